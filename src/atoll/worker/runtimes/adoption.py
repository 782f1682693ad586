"""Adopt: take over a sandbox another worker archived, from the shared object store.

The control plane asks for it when the sandbox's own worker is gone (removed after being lost):
the archive's manifest (worker.host.archive) says what the sandbox needs — the guest agent and
runsc its memory was made under (this worker must run the same: the runtime key), the layer stack
of its root file system as `{key, instance}` (fetched by worker.images.layerpack unless this worker
holds those very bytes; a layer this worker built itself under the same key is never used in
their place), its runtime settings, its volumes and drives. Volumes stay on the worker that made
them, so a sandbox with a volume is refused; a drive is adopted when it is served by the filer
(ATOLL_FILER_URL) this worker mounts too.

Adopting only records the sandbox here, archived (phase creating -> archived, step `adopted`),
with its network namespace and gateway attachment ready and the manifest kept locally: the next
call resumes it as any archived sandbox (download, verify, restore). The archive's objects become
this worker's once the record is, and then its claim: the manifest is written again naming this
installation as `holder` (archive.claim), so the worker it came from, should it come back with a
stale record, never removes them (worker.runtimes.archive_gc). Until then a failure leaves the
store untouched (the local record is deleted without its archive key). Called by
worker.service.node (`adopt`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
import typing

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.core.lifecycle import Step
from atoll.worker.host import archive, netns, objectstore
from atoll.worker.images import layerpack
from atoll.worker.images.layers import LayerStore
from atoll.worker.runtimes.runtime import RuntimeStore

log = logging.getLogger(__name__)


class Refused(errors.Conflict):
    code = "not_adoptable"


async def read_manifest(store: objectstore.ObjectStore, sid: str, tmp_root: str) -> archive.ArchiveManifest:
    os.makedirs(tmp_root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".adopt-{sid}-", dir=tmp_root)
    try:
        man = await archive.fetch_manifest(store, sid, tmp)
    except archive.ArchiveMissing as e:
        raise errors.SandboxNotFound(f"{e}; only an archived sandbox can move to another worker") from None
    except archive.ArchiveDamaged as e:
        raise Refused(f"sandbox {sid} cannot be adopted: {e}") from None
    except objectstore.StoreError as e:
        raise errors.Unavailable(f"the object store failed while adopting sandbox {sid}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if man.sandbox_id != sid:
        raise Refused(f"the archive manifest of sandbox {sid} names {man.sandbox_id}")
    return man


def check(
    man: archive.ArchiveManifest, runtime_key: str, mounts: typing.Sequence[api.MountSpec], filer: bool
) -> None:
    """Refused (409 not_adoptable, with the reason) when this worker cannot run the archive."""
    sid = man.sandbox_id
    if man.runtime_key != runtime_key:
        raise Refused(
            f"sandbox {sid} was archived under another guest agent or runsc ({man.runsc}) than this "
            "worker runs; it resumes only on a worker of that version"
        )
    if not man.layers:
        raise Refused(
            f"sandbox {sid} was archived without its template layers (its worker's archive tier was "
            "its own local directory, or they could not be published); only that worker can resume it"
        )
    if not man.runtime:
        raise Refused(f"the archive of sandbox {sid} does not carry its runtime settings (an older atoll)")
    for m in man.mounts:
        if m.get("kind") == "volume":
            raise Refused(
                f"sandbox {sid} mounts volume {m.get('name')!r}, which stays on the worker that holds "
                "it; it cannot move to another worker"
            )
        if m.get("kind") == "drive" and not filer:
            raise Refused(
                f"sandbox {sid} mounts drive {m.get('name')!r} and this worker has no filer "
                "(ATOLL_FILER_URL) to serve it from"
            )
    wanted = {(m.get("kind"), m.get("name")) for m in man.mounts}
    given = {(m.kind, m.name) for m in mounts}
    if wanted - given:
        raise Refused(f"sandbox {sid} mounts {sorted(wanted - given)}, which the adoption did not name")


async def adopt(
    sid: str,
    man: archive.ArchiveManifest,
    *,
    store: objectstore.ObjectStore,
    layers: LayerStore,
    runtimes: RuntimeStore,
    agent_dir: str,
    attach: typing.Callable[[typing.Any], typing.Awaitable[None]],
    undo: typing.Callable[[str], typing.Awaitable[None]],
) -> api.AdoptOutcome:
    """Record `man`'s sandbox here, archived (see the module doc). `attach(rt)` sets up its
    gateway; `undo(sid)` deletes a half-adopted runtime (its archive key is still empty then)."""
    t0 = time.perf_counter()
    paths = []
    fetched = 0
    for ref in man.layers:
        try:
            had = layerpack.local_path(layers, *layerpack.check_ref(ref)) is not None
            paths.append(await layerpack.fetch(store, layers, ref))
        except layerpack.LayerUnavailable as e:
            raise Refused(f"sandbox {sid} cannot be adopted: {e}") from None
        except objectstore.StoreError as e:
            raise errors.Unavailable(
                f"the object store failed while fetching sandbox {sid}'s layers: {e}"
            ) from None
        fetched += not had
    r = man.runtime
    rt = runtimes.new(
        sid,
        template=man.template,
        memory_mb=int(r["memory_mb"]),
        cpus=float(r["cpus"]),
        env=dict(r.get("env") or {}),
        disk_mb=int(r["disk_mb"]),
        user=r.get("user"),
        network=dict(r.get("network") or {}),
        trust_pem=str(r.get("trust_pem") or ""),
        build_id=man.build_id,
        lower=":".join(paths),
        workdir=r.get("workdir"),
        runtime_key=man.runtime_key,
        agent_dir=agent_dir,
        mounts=[dict(m) for m in man.mounts],
    )
    try:
        rt.generation = man.generation
        man = dataclasses.replace(man, store=store.name)  # found in this worker's store
        archive.write_local_manifest(runtimes.dir(sid), man)
        await netns.create(rt.name)
        await attach(rt)
        rt.archive_key = man.key
        runtimes.advance(rt, Step.ADOPTED)
        try:  # the archive is this worker's from now on (worker.runtimes.archive_gc)
            await archive.claim(store, runtimes.dir(sid), man, runtimes.install_id)
        except objectstore.StoreError as e:
            raise errors.Unavailable(f"the object store failed while adopting sandbox {sid}: {e}") from None
    except BaseException:
        rt.archive_key = ""
        with contextlib.suppress(Exception):
            runtimes.save(rt)
            await undo(sid)
        raise
    took = round((time.perf_counter() - t0) * 1000, 1)
    log.info(
        "sandbox.adopted from the store in %.0f ms (%d of %d layers fetched)",
        took,
        fetched,
        len(paths),
        extra={"sandbox_id": sid, "generation": rt.generation},
    )
    return api.AdoptOutcome(layers_fetched=fetched, duration_ms=took)

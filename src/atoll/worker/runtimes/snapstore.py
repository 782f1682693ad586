"""Named snapshots in the shared object store: a snapshot kept on one worker (worker.runtimes.forks)
is created from on any worker that reads the same store (S3, or ATOLL_ARCHIVE_DIR set).

In the store a snapshot is two objects under `snapshots/<snapshot id>/`:
    snapshot.tar.zst   its kept directory's `image/` (runsc's image, when the memory was kept) and
                       `upper/` (the writable layer copy), packed as the archive tier packs layers
                       (worker.images.layerpack.pack_tree: GNU tar with numeric owners, xattrs such
                       as the overlay's opaque marks and whiteout devices, zstd-compressed)
    manifest.json      SnapshotManifest: the object's size and sha256, the kept settings without
                       this host's paths, its template's layer stack `[{key, instance}]` (published
                       beside it, as an archive's), the runtime key its memory was made under —
                       written last: a snapshot is in the store only once its manifest is

`upload` (the seam's store_snapshot, which the control plane calls in the background once the
snapshot's record is written): publish its layers, pack, put, check the stored size, write the
manifest. `fetch` (a create from a snapshot this worker does not keep): read the manifest, refuse a
memory snapshot made under another guest agent or runsc (409 snapshot_unavailable), fetch its
layers as adoption does (worker.images.layerpack.fetch: this worker's own build of the same key is
never used in their place), download the object and check it against the manifest before anything
is unpacked, unpack into a staging directory beside the kept ones, write its `kept.json` naming
this worker's layer paths and guest agent, and rename it into place: from then on it is kept here
like any snapshot (the control plane's reconciliation removes it once no record names it). `remove`
deletes the manifest first, then the rest of the prefix; `stored` lists the snapshots whose
manifest is in the store, with the installation that uploaded each (the control plane's garbage
collection of its own workers' stored snapshots no record names).
Called by worker.service.node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field

from atoll.core import errors
from atoll.worker.host import objectstore
from atoll.worker.images import layerpack
from atoll.worker.images.layers import LayerStore
from atoll.worker.runtimes import forks

log = logging.getLogger(__name__)

FORMAT = 1
"""Raise it when the layout changes; a worker refuses snapshots of a format it lacks."""
ROOT = "snapshots/"
HOST_PATHS = ("lower", "agent_dir")
"""Kept settings that are paths on the worker that kept it: the fetching worker names its own."""


def prefix(snapshot_id: str) -> str:
    return f"{ROOT}{snapshot_id}/"


def object_key(snapshot_id: str) -> str:
    return f"{prefix(snapshot_id)}snapshot.tar.zst"


def manifest_key(snapshot_id: str) -> str:
    return f"{prefix(snapshot_id)}manifest.json"


@dataclass
class SnapshotManifest:
    snapshot_id: str
    key: str
    size: int
    """Bytes of the compressed object."""
    sha256: str
    memory: bool
    settings: dict
    """The kept settings (forks.Kept.settings) without HOST_PATHS."""
    layers: list[dict] = field(default_factory=list)
    """The root file system's layer stack, top first, as `{key, instance}` in the same store."""
    runtime_key: str = ""
    """What the memory image was made under (guest agent and runsc): a worker running another
    cannot restore it."""
    raw_bytes: int = 0
    holder: str = ""
    """The installation id of the worker that uploaded it."""
    stored_at: float = 0.0
    format: int = FORMAT

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str | bytes) -> SnapshotManifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(
                f"snapshot format {data.get('format')!r} is not {FORMAT} (made by another version)"
            )
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def unavailable(snapshot_id: str, why: str, store: objectstore.ObjectStore | None = None) -> errors.Conflict:
    """409 snapshot_unavailable; the store's name (a host path, an S3 endpoint) only in `detail`,
    which is logged and never sent to the caller."""
    return errors.Conflict(
        f"snapshot {snapshot_id} cannot be created from here: {why}",
        code="snapshot_unavailable",
        detail=f"object store {store.name}" if store is not None else None,
    )


async def upload(
    store: objectstore.ObjectStore, snapshot_id: str, kept: forks.Kept, *, holder: str, work: str
) -> SnapshotManifest:
    """Upload the kept snapshot (see the module doc); `work` is a scratch directory (made and
    removed here). StoreError when the store fails (nothing is named by a manifest then)."""
    refs = await asyncio.to_thread(layerpack.refs_of, kept.settings.get("lower", ""))
    if refs is None:
        raise unavailable(
            snapshot_id,
            "its root file system is not made of layers (an earlier atoll made its template); it stays "
            "on the worker that keeps it",
        )
    os.makedirs(work, mode=0o700, exist_ok=True)
    try:
        await layerpack.publish(store, refs, work)
        out = os.path.join(work, "snapshot.tar.zst")
        members = ("image", "upper") if kept.image is not None else ("upper",)
        sha, size, raw = await asyncio.to_thread(layerpack.pack_tree, kept.dir, out, members)
        man = SnapshotManifest(
            snapshot_id=snapshot_id,
            key=object_key(snapshot_id),
            size=size,
            sha256=sha,
            memory=kept.memory,
            settings={k: v for k, v in kept.settings.items() if k not in HOST_PATHS},
            layers=[{"key": r["key"], "instance": r["instance"]} for r in refs],
            runtime_key=str(kept.settings.get("runtime_key") or ""),
            raw_bytes=raw,
            holder=holder,
            stored_at=time.time(),
        )
        await objectstore.put_checked(store, man.key, out, size)
        meta = os.path.join(work, "manifest.json")
        with open(meta, "w") as f:
            f.write(man.dumps())
        await store.put_file(manifest_key(snapshot_id), meta)
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    return man


async def read_manifest(store: objectstore.ObjectStore, snapshot_id: str, tmp_root: str) -> SnapshotManifest:
    """The snapshot's manifest in the store: 409 snapshot_unavailable when it is missing or
    unreadable, StoreError when the store fails."""
    tmp = tempfile.mkdtemp(prefix=f".manifest-{snapshot_id}-", dir=tmp_root)  # no kept.json: swept at start
    path = os.path.join(tmp, "manifest.json")
    try:
        await store.get_file(manifest_key(snapshot_id), path, durable=False)
        with open(path) as f:
            man = SnapshotManifest.loads(f.read())
    except objectstore.ObjectNotFound:
        raise unavailable(
            snapshot_id, "it is neither kept on this worker nor in the object store the workers share", store
        ) from None
    except (ValueError, TypeError) as e:
        raise unavailable(
            snapshot_id, f"its manifest in the object store is unreadable: {e}", store
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if man.snapshot_id != snapshot_id or man.key != object_key(snapshot_id):
        raise unavailable(snapshot_id, "its manifest in the object store names another snapshot", store)
    return man


async def fetch(
    store: objectstore.ObjectStore,
    snapshot_id: str,
    dest: str,
    *,
    layers: LayerStore,
    runtime_key: str,
    agent_dir: str,
) -> forks.Kept:
    """Download the stored snapshot into `dest` (`<home>/snapshots/<id>`, absent) and keep it
    there (see the module doc). 409 snapshot_unavailable when it cannot be restored here (missing,
    damaged, made under another runtime key, its layers missing); StoreError when the store fails."""
    t0 = time.perf_counter()
    root = os.path.dirname(dest)
    os.makedirs(root, mode=0o700, exist_ok=True)
    man = await read_manifest(store, snapshot_id, root)
    if man.memory and man.runtime_key != runtime_key:
        raise unavailable(
            snapshot_id,
            "its memory was saved under another guest agent or runsc than this worker runs; it is "
            "created only on workers of that version",
        )
    paths = []
    try:
        for ref in man.layers:
            paths.append(await layerpack.fetch(store, layers, ref))
    except layerpack.LayerUnavailable as e:
        raise unavailable(snapshot_id, str(e).replace(store.name, "the object store"), store) from None
    t_layers = time.perf_counter()
    staging = tempfile.mkdtemp(prefix=f".fetch-{snapshot_id}-", dir=root)  # no kept.json: swept at start
    try:
        obj = os.path.join(staging, "snapshot.tar.zst")
        try:
            await store.get_file(man.key, obj, durable=False)
        except objectstore.ObjectNotFound:
            raise unavailable(
                snapshot_id, f"its object {man.key} is gone from the object store", store
            ) from None
        t_get = time.perf_counter()
        if not await asyncio.to_thread(layerpack.matches, obj, man.size, man.sha256):
            raise unavailable(
                snapshot_id,
                "its object in the object store does not match the size and sha256 of its manifest",
                store,
            )
        try:
            await asyncio.to_thread(layerpack.unpack_tree, obj, staging)
        except layerpack.LayerUnavailable as e:
            raise unavailable(snapshot_id, str(e)) from None
        os.unlink(obj)
        if not os.path.isdir(os.path.join(staging, "upper")) or (
            man.memory and not os.path.isdir(os.path.join(staging, "image"))
        ):
            raise unavailable(snapshot_id, "its object in the object store lacks its image or layer", store)
        settings = dict(man.settings) | {"lower": ":".join(paths), "agent_dir": agent_dir}
        forks.Kept(staging, settings, man.memory).save()
        os.rename(staging, dest)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, staging, True)
        raise
    t_end = time.perf_counter()
    log.info(
        "snapshot %s fetched from %s in %.0f ms (%d bytes; layers %.0f, download %.0f, check and unpack %.0f)",
        snapshot_id,
        store.name,
        (t_end - t0) * 1000,
        man.size,
        (t_layers - t0) * 1000,
        (t_get - t_layers) * 1000,
        (t_end - t_get) * 1000,
    )
    kept = forks.Kept.load(dest)
    assert kept is not None
    return kept


async def remove(store: objectstore.ObjectStore, snapshot_id: str) -> int:
    """Delete the stored snapshot: its manifest first (it is no longer in the store from then on),
    then the rest of its prefix (an upload cut short included). Returns how many objects went."""
    keys = await store.list(prefix(snapshot_id))
    keys.sort(key=lambda k: k != manifest_key(snapshot_id))
    for k in keys:
        await store.delete(k)
    return len(keys)


async def stored(
    store: objectstore.ObjectStore, tmp_root: str, seen: dict[str, tuple[float, str]]
) -> list[tuple[str, float, str]]:
    """(id, stored_at, holder) of the snapshots whose manifest is in the store. `seen` caches the
    manifests read before (they never change once written); an unreadable one is left out (never
    taken for garbage)."""
    ids = [
        k[len(ROOT) :].split("/", 1)[0]
        for k in await store.list(ROOT)
        if k.endswith("/manifest.json") and k.count("/") == 2
    ]
    for gone in set(seen) - set(ids):
        del seen[gone]
    for snapshot_id in ids:
        if snapshot_id not in seen:
            with contextlib.suppress(errors.Conflict):  # unreadable, or removed meanwhile
                man = await read_manifest(store, snapshot_id, tmp_root)
                seen[snapshot_id] = (man.stored_at, man.holder)
    return [(i, *seen[i]) for i in ids if i in seen]

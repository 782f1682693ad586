"""Fork and named snapshots: one checkpoint of a running sandbox, kept as an image and a copy of
its writable layer, from which new sandboxes boot with their own identity.

`keep` is the half both share: the parent is gated like a disk standby (idle egress connections
reset first; a sandbox the gate refuses is left running, untouched, and the call answers 409 with
the reason), checkpointed, and its writable layer copied once while it is stopped; its image is
hard-linked into the kept directory. The caller then restores the parent from its own image (it is
never restored twice: copies restore from hard links of the image). `boot_copy` is the other half:
a copy boots from the kept image in a bundle of its own — its own namespaces, a copy of the kept
writable layer over the same template layers, and its own identity (id, hostname, generation 0,
the caller's runtime settings, a fresh seed for the kernel's pool: gVisor serves getrandom from
the host per call, so nothing random is replayed from the image by the kernel; user-space state
such as a seeded Python `random` is duplicated — see docs/api.md). A kept state without an image
(a files-only snapshot) boots cold over its layer copy.

A fork is keep + N copies + drop (its kept directory is temporary, under the parent's); a named
snapshot is keep alone, its directory `<home>/snapshots/<snapshot id>/` kept with `kept.json`
(the parent's runtime settings) until deleted, and a create from it is `boot_copy`, later and any
number of times. Called by worker.node under the parent's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
import time
import typing

from atoll.core import errors, ids
from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase
from atoll.worker.host import hostcmd
from atoll.worker.runtimes.guest import Guest
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore
from atoll.worker.runtimes.sandboxes import Sandboxes
from atoll.worker.runtimes.tiers import Tiers

log = logging.getLogger(__name__)

MAX_COPIES = 50
KEPT_META = "kept.json"

_SETTINGS: tuple[str, ...] = (
    *("template", "memory_mb", "cpus", "env", "disk_mb", "user", "network", "trust_pem"),
    *("build_id", "lower", "workdir", "runtime_key", "agent_dir"),
)
"""The parent's runtime settings a copy takes (worker.runtimes.runtime.Runtime fields)."""


@dataclasses.dataclass(frozen=True)
class Kept:
    """A kept checkpoint: `dir` holds `upper/` (the writable layer copy), `image/` when the memory
    was kept, and `kept.json` (`settings`: the parent's runtime settings a copy takes)."""

    dir: str
    settings: dict
    memory: bool

    @property
    def image(self) -> str | None:
        return os.path.join(self.dir, "image") if self.memory else None

    @property
    def upper(self) -> str:
        return os.path.join(self.dir, "upper")

    def save(self) -> None:
        path = os.path.join(self.dir, KEPT_META)
        with open(path + ".tmp", "w") as f:
            json.dump({"settings": self.settings, "memory": self.memory}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, path: str) -> Kept | None:
        try:
            with open(os.path.join(path, KEPT_META)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        return cls(path, dict(data["settings"]), bool(data["memory"]))


def size_of(path: str) -> int:
    """Bytes of the regular files under `path` (hard links counted once). Blocking."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for fn in files:
            try:
                st = os.lstat(os.path.join(dirpath, fn))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


async def keep(
    parent: Runtime,
    dest: str,
    *,
    memory: bool,
    what: str,
    runtimes: RuntimeStore,
    sandboxes: Sandboxes,
    tiers: Tiers,
    guest: Guest,
    lower: str,
) -> Kept:
    """Gate and checkpoint the running `parent` and keep its state in `dest` (made here). The parent
    is left checkpointed: the caller restores it (`tiers.restore`). A checkpoint is taken even for a
    files-only keep: it is what flushes the sandbox's writes to its layer while it is stopped.
    `what` ("forked", "snapshotted") is for messages."""
    sid = parent.sandbox_id
    if parent.phase != Phase.RUNNING:
        raise errors.Conflict(
            f"sandbox {sid} is {parent.phase.value} on its worker; only a running sandbox is {what}",
            code="invalid_state",
        )
    busy = await sandboxes.edge.quiesce(sid)
    gate = await guest.gate(sid)
    if busy is None:  # the egress gateway cannot vouch for the sandbox's connections
        gate = type(gate)(
            False, [*gate.blockers, "the egress gateway is not answering or was just restarted"]
        )
    if not gate.ok:
        why = "; ".join(gate.blockers)
        if busy:
            why += f" ({busy} egress connection(s) in use)"
        verb = what.removesuffix("ted").removesuffix("ed")
        raise errors.Conflict(
            f"sandbox {sid} cannot be {what} now: its state cannot be saved ({why}); it keeps running "
            f"untouched — close those connections or stop that server, then {verb} again",
            code="checkpoint_refused",
        )
    await tiers.checkpoint(parent)  # on failure runsc stopped it: the parent is failed, with the cause
    os.makedirs(dest, mode=0o700)
    kept = Kept(dest, {k: getattr(parent, k) for k in _SETTINGS} | {"lower": lower}, memory)
    if not kept.settings["agent_dir"]:
        kept.settings["agent_dir"] = sandboxes.agent_dir_of(parent)  # a copy's agent is the parent's
    await hostcmd.run("cp", "-a", runtimes.path(sid, "upper", "upper") + "/.", kept.upper + "/")
    if kept.image is not None:
        snap = runtimes.path(sid, "snapshot")
        os.makedirs(kept.image)
        for name in os.listdir(snap):
            os.link(os.path.join(snap, name), os.path.join(kept.image, name))
    return kept


def new_copy(runtimes: RuntimeStore, nid: str, kept: Kept, **overrides: typing.Any) -> Runtime:
    """Record a copy of a kept state (phase creating): the parent's settings, with `overrides`
    (a create's env, cpus, network); a files-only copy boots under this worker's runtime key and agent."""
    settings = copy.deepcopy(kept.settings)
    if not kept.memory:
        settings["runtime_key"] = settings["agent_dir"] = ""
    settings.update(overrides)
    return runtimes.new(nid, **settings)


async def boot_copy(rt: Runtime, kept: Kept, *, sandboxes: Sandboxes) -> str:
    """Boot the recorded copy `rt` from `kept`: restored from hard links of its image (one set per
    copy, removed once it runs: restore reads the image eagerly), or cold over its layer."""
    links = None
    if kept.image is not None:
        links = os.path.join(kept.dir, f"copy-{rt.sandbox_id}")
        os.makedirs(links)
        for name in os.listdir(kept.image):
            os.link(os.path.join(kept.image, name), os.path.join(links, name))
    try:
        return await sandboxes.start(rt, rt.lower, links, kept.upper)
    finally:
        if links is not None:
            await asyncio.to_thread(shutil.rmtree, links, True)


async def fork(
    parent: Runtime,
    new_ids: typing.Sequence[str],
    *,
    runtimes: RuntimeStore,
    sandboxes: Sandboxes,
    tiers: Tiers,
    guest: Guest,
    lower: str,
    locks: typing.Callable[[str], asyncio.Lock],
) -> api.ForkOutcome:
    sid = parent.sandbox_id
    if not 1 <= len(new_ids) <= MAX_COPIES:
        raise errors.InvalidRequest(f"count={len(new_ids)} is outside 1-{MAX_COPIES}")
    for nid in new_ids:
        if not ids.is_sandbox_id(nid) or runtimes.find(nid) is not None:
            raise errors.InvalidRequest(f"fork: sandbox id {nid!r} is malformed or in use on this worker")
    t0 = time.perf_counter()
    work = runtimes.path(sid, f"fork-{int(time.time() * 1000)}")
    children: list[Runtime] = []
    kept: Kept | None = None
    restoring = False
    try:
        kept = await keep(
            parent,
            work,
            memory=True,
            what="forked",
            runtimes=runtimes,
            sandboxes=sandboxes,
            tiers=tiers,
            guest=guest,
            lower=lower,
        )
        t_ckpt = time.perf_counter()
        children = [new_copy(runtimes, nid, kept) for nid in new_ids]

        async def child(rt: Runtime) -> None:
            assert kept is not None
            async with locks(rt.sandbox_id):
                await boot_copy(rt, kept, sandboxes=sandboxes)

        restoring = True
        results = await asyncio.gather(
            tiers.restore(parent), *(child(rt) for rt in children), return_exceptions=True
        )
    except BaseException:
        if not restoring and parent.phase == Phase.CHECKPOINTED:
            with contextlib.suppress(errors.AtollError):  # checkpointed, never copied: it runs on
                await tiers.restore(parent)
        raise
    finally:
        if os.path.isdir(work):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(shutil.rmtree, work, True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if isinstance(results[0], BaseException):
        log.warning("fork: the parent did not restore: %s", results[0], extra={"sandbox_id": sid})
    if failures:
        raise (
            failures[0]
            if isinstance(failures[0], errors.AtollError)
            else errors.RuntimeFailure(f"fork of sandbox {sid} failed: {failures[0]!r}")
        )
    t_end = time.perf_counter()
    log.info(
        "forked into %d copies in %.0f ms (checkpoint %.0f ms)",
        len(children),
        (t_end - t0) * 1000,
        (t_ckpt - t0) * 1000,
        extra={"sandbox_id": sid},
    )
    return api.ForkOutcome(tuple(new_ids), round((t_ckpt - t0) * 1000, 1), round((t_end - t0) * 1000, 1))


async def snapshot(
    parent: Runtime,
    snapshot_id: str,
    dest: str,
    *,
    memory: bool,
    runtimes: RuntimeStore,
    sandboxes: Sandboxes,
    tiers: Tiers,
    guest: Guest,
    lower: str,
) -> api.SnapshotOutcome:
    """Keep the parent's state in `dest` (`<home>/snapshots/<id>`) and restore the parent. If the
    parent does not come back, nothing is kept (the error is the parent's, as a fork's)."""
    sid = parent.sandbox_id
    t0 = time.perf_counter()
    restoring = False
    try:
        kept = await keep(
            parent,
            dest,
            memory=memory,
            what="snapshotted",
            runtimes=runtimes,
            sandboxes=sandboxes,
            tiers=tiers,
            guest=guest,
            lower=lower,
        )
        t_ckpt = time.perf_counter()
        kept.save()
        restoring = True
        await tiers.restore(parent)
    except BaseException:
        if not restoring and parent.phase == Phase.CHECKPOINTED:  # its state could not be kept
            with contextlib.suppress(errors.AtollError):
                await tiers.restore(parent)
        if parent.phase == Phase.CHECKPOINTED:
            log.warning("snapshot: the parent did not restore", extra={"sandbox_id": sid})
        if os.path.isdir(dest):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(shutil.rmtree, dest, True)
        raise
    size = await asyncio.to_thread(size_of, dest)
    t_end = time.perf_counter()
    log.info(
        "snapshot %s kept (%s, %d bytes) in %.0f ms (checkpoint %.0f ms)",
        snapshot_id,
        "memory and files" if memory else "files only",
        size,
        (t_end - t0) * 1000,
        (t_ckpt - t0) * 1000,
        extra={"sandbox_id": sid},
    )
    return api.SnapshotOutcome(
        snapshot_id,
        size,
        parent.memory_mb if memory else 0,
        round((t_ckpt - t0) * 1000, 1),
        round((t_end - t0) * 1000, 1),
    )

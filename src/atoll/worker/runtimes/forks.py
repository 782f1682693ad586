"""Fork: one checkpoint of a running sandbox, restored as itself and as N new sandboxes.

The parent is gated like a disk standby (idle egress connections reset first; a sandbox the gate
refuses is left running, untouched, and the fork answers 409 with the reason), checkpointed, and
its writable layer copied once while it is stopped. Then the parent restores from its own image
(it is never restored twice: its copies restore from hard links of the image made before), and
each copy boots from that image in a bundle of its own: its own namespaces, a copy of the parent's
writable layer over the same template layers, and its own identity — id, hostname, generation 0,
the caller's runtime settings, a fresh seed for the kernel's pool (gVisor serves getrandom from the
host per call, so nothing random is replayed from the image by the kernel; user-space state such as
a seeded Python `random` is duplicated — see docs/api.md). Called by worker.node under the parent's
lock.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    if parent.phase != Phase.RUNNING:
        raise errors.Conflict(
            f"sandbox {sid} is {parent.phase.value} on its worker; only a running sandbox is forked",
            code="invalid_state",
        )
    t0 = time.perf_counter()
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
        raise errors.Conflict(
            f"sandbox {sid} cannot be forked now: its state cannot be saved ({why}); it keeps running "
            "untouched — close those connections or stop that server, then fork again",
            code="checkpoint_refused",
        )
    await tiers.checkpoint(parent)  # on failure runsc stopped it: the parent is failed, with the cause
    t_ckpt = time.perf_counter()
    snap = runtimes.path(sid, "snapshot")
    work = runtimes.path(sid, f"fork-{int(time.time() * 1000)}")
    children: list[Runtime] = []
    try:
        os.makedirs(work, mode=0o700)
        # one copy of the stopped parent's writable layer, and hard links of its image per copy
        await hostcmd.run(
            "cp", "-a", runtimes.path(sid, "upper", "upper") + "/.", os.path.join(work, "upper") + "/"
        )
        for nid in new_ids:
            img = os.path.join(work, f"image-{nid}")
            os.makedirs(img)
            for name in os.listdir(snap):
                os.link(os.path.join(snap, name), os.path.join(img, name))
            children.append(
                runtimes.new(
                    nid,
                    template=parent.template,
                    memory_mb=parent.memory_mb,
                    cpus=parent.cpus,
                    env=dict(parent.env),
                    disk_mb=parent.disk_mb,
                    user=parent.user,
                    network=dict(parent.network),
                    trust_pem=parent.trust_pem,
                    build_id=parent.build_id,
                    lower=lower,
                    workdir=parent.workdir,
                    runtime_key=parent.runtime_key,  # its memory is the parent's
                    agent_dir=sandboxes.agent_dir_of(parent),  # and so is its agent
                )
            )

        async def child(rt: Runtime) -> None:
            async with locks(rt.sandbox_id):
                await sandboxes.start(
                    rt, lower, os.path.join(work, f"image-{rt.sandbox_id}"), os.path.join(work, "upper")
                )

        results = await asyncio.gather(
            tiers.restore(parent), *(child(rt) for rt in children), return_exceptions=True
        )
    finally:
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

"""Which sandboxes' runtimes are alive, and what killed the ones that died.

Every running runtime's gVisor sentry is watched through a pidfd (`os.pidfd_open`, readable once
the process exits) registered with the event loop: a sentry that dies while its runtime should be
running (the host OOM killer, the host pids limit, a kill from outside) is noticed at once, without
polling. The runtime is marked failed with the cause read from its cgroups (`death_cause`), calls
waiting on it end (`exited(sid)` is set), and a `SandboxDied` event goes to the control plane.
A sentry that exits because the worker checkpointed, compacted or deleted the sandbox is expected
(its phase or generation says so) and ignored.
Called by worker.node (watch after boot/restore/reattach), worker.guest (calls wait on `exited`)
and worker.recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import typing

from atoll.core import errors
from atoll.core.lifecycle import Phase
from atoll.core.worker_api import SandboxDied, WorkerEvent
from atoll.worker.host import bundle, cgroups, runsc
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore

log = logging.getLogger(__name__)

# Phases in which the sentry must be running; an exit in any other phase is the worker's own doing.
_SHOULD_RUN = (Phase.CREATING, Phase.RUNNING, Phase.FROZEN)


class Liveness:
    def __init__(
        self,
        runtimes: RuntimeStore,
        install_id: str,
        runsc_root: str,
        emit: typing.Callable[[WorkerEvent], None],
    ):
        self.runtimes = runtimes
        self.install_id = install_id
        self.runsc_root = runsc_root
        self._emit = emit
        self._watched: dict[str, tuple[int, int]] = {}  # sid -> (generation, pidfd)
        self.on_failed: typing.Callable[[Runtime], None] | None = None
        self._exited: dict[str, asyncio.Event] = {}

    def watch(self, rt: Runtime) -> None:
        """Watch the current generation's sentry (read from runsc's state file if unknown)."""
        self.unwatch(rt.sandbox_id)
        self._exited[rt.sandbox_id] = asyncio.Event()
        if rt.sentry_pid is None:
            rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(rt.sentry_pid) if rt.sentry_pid else -1
        except (ProcessLookupError, OSError):
            fd = -1
        if fd < 0:  # already gone
            loop.call_soon(self._on_exit, rt.sandbox_id, rt.generation, -1)
            return
        self._watched[rt.sandbox_id] = (rt.generation, fd)
        loop.add_reader(fd, self._on_exit, rt.sandbox_id, rt.generation, fd)

    def unwatch(self, sid: str) -> None:
        entry = self._watched.pop(sid, None)
        if entry is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(entry[1])
            with contextlib.suppress(OSError):
                os.close(entry[1])

    def close(self) -> None:
        for sid in list(self._watched):
            self.unwatch(sid)

    def exited(self, sid: str) -> asyncio.Event:
        """Set once the sandbox's runtime died unexpectedly (calls waiting on it give up)."""
        return self._exited.setdefault(sid, asyncio.Event())

    def _on_exit(self, sid: str, generation: int, fd: int) -> None:
        entry = self._watched.get(sid)
        if entry is not None and entry == (generation, fd):
            self.unwatch(sid)
        rt = self.runtimes.find(sid)
        if rt is None or rt.generation != generation or rt.phase not in _SHOULD_RUN:
            return  # checkpointed, compacted, deleted: the worker stopped it
        self.died(sid)

    def alive(self, sid: str) -> bool:
        """Is the sandbox's sentry there? (A file read; safe on a frozen sandbox.) A checkpointed
        runtime has no sentry and counts as alive."""
        rt = self.runtimes.get(sid)
        if rt.phase in (Phase.CHECKPOINTING, Phase.CHECKPOINTED, Phase.RESTORING):
            return True
        if rt.phase == Phase.FAILED:
            return False
        if rt.sentry_pid is None:
            rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        return runsc.pid_alive(rt.sentry_pid)

    def died(self, sid: str) -> errors.SandboxDied:
        """Mark the sandbox failed with the cause of its death (once), wake the calls waiting on it,
        tell the control plane; returns the error a waiting call raises."""
        rt = self.runtimes.get(sid)
        if rt.phase != Phase.FAILED:
            self.failed(sid, self.death_cause(rt))
        self.exited(sid).set()
        return errors.SandboxDied(
            (rt.failure or "the sandbox's runtime stopped")
            + " (the sandbox is now failed; its files are kept until you delete it)"
        )

    def failed(self, sid: str, cause: str) -> None:
        """The sandbox cannot go on (its runtime died, a checkpoint killed it, its agent stopped
        answering): mark it failed with `cause`, wake waiting calls, tell the control plane."""
        rt = self.runtimes.find(sid)
        if rt is None or rt.phase in (Phase.FAILED, Phase.DELETING):
            return
        self.runtimes.fail(rt, cause)
        log.warning("sandbox.failed", extra={"sandbox_id": sid, "reason": cause})
        self.exited(sid).set()
        self._emit(SandboxDied(sid, cause))
        if self.on_failed is not None:  # its runtime is stopped; its files stay until the delete
            self.on_failed(rt)

    def limit_cause(self, rt: Runtime) -> str | None:
        """A dead runtime's cause when one of its limits killed it (its memory cgroup's OOM killer,
        its task limit), else None. Also asked by the reconciler, which may find the sentry gone
        before the watch does (a loaded machine): the cause is the limit either way."""
        sid, cg = rt.sandbox_id, rt.cgroup(self.install_id)
        if cgroups.oom_kills(cg):
            return (
                f"sandbox {sid} was stopped by the host's OOM killer: its programs used more than "
                f"memory_mb={rt.memory_mb} (plus {bundle.RUNTIME_OVERHEAD_MB + bundle.RESTORE_GROWTH_MB} MB "
                "for the runtime); create a new sandbox with a larger memory_mb"
            )
        hits, limit = cgroups.pids_limit_hits(cg)
        if hits:
            return (
                f"sandbox {sid} was stopped after its runtime reached the host's task limit "
                f"(pids.max={limit} host tasks, ~{bundle.HOST_TASKS_PER_GUEST_TASK} per guest process or "
                f"thread); programs inside are limited to {bundle.GUEST_PIDS_MAX} tasks, so something "
                "outran that limit; create a new sandbox and run fewer processes at once"
            )
        return None

    def death_cause(self, rt: Runtime) -> str:
        sid = rt.sandbox_id
        cause = self.limit_cause(rt)
        if cause is not None:
            return cause
        log.warning(
            "sandbox.runtime.died",
            extra={
                "sandbox_id": sid,
                "detail": f"runsc log: {runsc.tail(self.runtimes.path(sid, 'runsc.log'))}",
            },
        )
        return f"sandbox {sid} stopped unexpectedly (its gVisor sentry exited; the worker log has runsc's last lines)"

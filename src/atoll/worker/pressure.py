"""Host task pressure: shedding the host tasks this runsc's ptrace platform keeps behind.

Under the ptrace platform the sentry keeps a stub process with a thread per tracer thread for every
address space it ran, and reuses but never frees them: each burst of concurrent processes leaves
~5–15 host tasks per process behind, until the host pids limit kills the sandbox (measured: four
bursts of 200 sleeps, 34 -> 4,021 host tasks). A checkpoint and restore starts a fresh sentry
(3,366 -> 213) with the processes, memory and files kept. So, in every monitor pass, for each
running sandbox (share of its host pids limit in use):
  * past COMPACT_AT, an idle one (no call in flight, no step running) is checkpointed and restored
    in place when the gate allows (retried after COMPACT_RETRY_S otherwise) — its status stays
    `running`, calls arriving meanwhile wait for it;
  * past KILL_AT, its user processes are killed, busy or not, like an OOM kill (at most every
    RELIEF_EVERY_S), and the next call waits for a compaction first.
A runsc-specific mitigation, so it lives in the worker; the control plane never sees it.
Called by worker.node's monitor loop and before each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing

from atoll.core import errors
from atoll.core.lifecycle import Phase
from atoll.core.worker_api import RuntimeChanged, WorkerEvent
from atoll.worker import cgroups
from atoll.worker.guest import Guest
from atoll.worker.runtime import RuntimeStore
from atoll.worker.tiers import Tiers

log = logging.getLogger(__name__)

COMPACT_AT = 0.25  # one burst of 200 processes adds ~2,000 host tasks (a fifth of the limit)
KILL_AT = 0.6  # above what ~512 live processes hold (~45%); a fork bomb adds ~900 a second
COMPACT_RETRY_S = 30.0
RELIEF_EVERY_S = 2.0  # the host tasks a kill leaves stay until a compaction: do not kill again at once


class Pressure:
    def __init__(
        self,
        runtimes: RuntimeStore,
        guest: Guest,
        tiers: Tiers,
        install_id: str,
        *,
        idle: typing.Callable[[str], bool],
        lock: typing.Callable[[str], asyncio.Lock],
        emit: typing.Callable[[WorkerEvent], None] = lambda ev: None,
    ):
        self.runtimes = runtimes
        self.guest = guest
        self.tiers = tiers
        self.install_id = install_id
        self._idle = idle
        self._lock = lock
        self._emit = emit
        self._relief: dict[str, asyncio.Task] = {}
        self._relieved_at: dict[str, float] = {}
        self._compact_retry: dict[str, float] = {}
        self._compacting: dict[str, asyncio.Task] = {}
        self.compact_due: set[str] = set()

    def share(self, sid: str) -> float:
        """The share of its host pids limit a running sandbox's runtime uses (0 when unknown)."""
        rt = self.runtimes.find(sid)
        if rt is None or rt.phase != Phase.RUNNING:
            return 0.0
        usage = cgroups.pids_usage(rt.cgroup(self.install_id))
        return usage[0] / usage[1] if usage and usage[1] else 0.0

    def check(self, sid: str) -> None:
        """One monitor pass over one sandbox: start a relief or a compaction when due."""
        share = self.share(sid)
        if share <= 0:
            return
        now = time.monotonic()
        if (
            share >= KILL_AT
            and sid not in self._relief
            and now - self._relieved_at.get(sid, -RELIEF_EVERY_S) >= RELIEF_EVERY_S
        ):
            self._relieved_at[sid] = now
            relief = asyncio.ensure_future(self._relieve(sid, share))
            self._relief[sid] = relief
            relief.add_done_callback(lambda _t, sid=sid: self._relief.pop(sid, None))
        elif (
            share >= COMPACT_AT
            and sid not in self._relief
            and sid not in self._compacting
            and now >= self._compact_retry.get(sid, 0.0)
            and self._idle(sid)
        ):
            self._start_compaction(sid)

    async def before_call(self, sid: str) -> None:
        """A call to a sandbox whose user processes were just killed waits for a compaction: a
        second fork bomb right after the first would otherwise start where the first left off."""
        if sid in self.compact_due and self._idle(sid):
            self._start_compaction(sid)
        task = self._compacting.get(sid)
        if task is not None:
            await asyncio.shield(task)

    def _start_compaction(self, sid: str) -> None:
        self.compact_due.discard(sid)
        task = asyncio.ensure_future(self._compact(sid))
        self._compacting[sid] = task
        task.add_done_callback(lambda _t: self._compacting.pop(sid, None))

    async def _relieve(self, sid: str, share: float) -> None:
        log.warning(
            "sandbox.tasks.relief: killing the user processes",
            extra={"sandbox_id": sid, "reason": f"{share:.0%} of its host task limit in use"},
        )
        try:
            await self.guest.kill_all(sid)
        except errors.AtollError as e:
            log.warning("sandbox.tasks.relief.failed", extra={"sandbox_id": sid, "error": e.message})
        self.compact_due.add(sid)

    async def _compact(self, sid: str) -> None:
        """Checkpoint and restore an idle sandbox in place (see the module docstring)."""
        async with self._lock(sid):
            rt = self.runtimes.find(sid)
            if rt is None or rt.phase != Phase.RUNNING:
                return
            share = self.share(sid)
            gate = await self.guest.gate(sid)
            if not gate.ok:
                self._compact_retry[sid] = time.monotonic() + COMPACT_RETRY_S
                log.info(
                    "sandbox.compact.gated", extra={"sandbox_id": sid, "reason": "; ".join(gate.blockers)}
                )
                return
            log.info("sandbox.compact", extra={"sandbox_id": sid, "reason": f"{share:.0%} of its host tasks"})
            t0 = time.perf_counter()
            try:
                await self.tiers.checkpoint(rt)
                await self.tiers.restore(rt)
            except errors.AtollError as e:
                self._compact_retry[sid] = time.monotonic() + COMPACT_RETRY_S
                log.warning("sandbox.compact.failed", extra={"sandbox_id": sid, "error": e.message})
                if rt.phase == Phase.CHECKPOINTED:  # its restore failed: in disk standby, kept
                    self._emit(RuntimeChanged(sid, rt.phase, e.message))
                return
            log.info(
                "sandbox.compact.complete",
                extra={"sandbox_id": sid, "duration_ms": round((time.perf_counter() - t0) * 1000, 1)},
            )

    def forget(self, sid: str) -> None:
        for per_sandbox in (self._relieved_at, self._compact_retry):
            per_sandbox.pop(sid, None)
        self.compact_due.discard(sid)

    async def aclose(self) -> None:
        tasks = [*self._relief.values(), *self._compacting.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

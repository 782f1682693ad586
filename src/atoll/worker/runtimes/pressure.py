"""Host task pressure: shedding the host tasks this runsc's ptrace platform keeps behind.

Under the ptrace platform the sentry keeps a stub process with a thread per tracer thread for every
address space it ran, and reuses but never frees them: each burst of concurrent processes leaves
~5–15 host tasks per process behind, until the host pids limit kills the sandbox (measured: four
bursts of 200 sleeps, 34 -> 4,021 host tasks). A checkpoint and restore starts a fresh sentry
(3,366 -> 213) with the processes, memory and files kept. But a failed checkpoint kills the
sandbox, so a checkpoint is never the answer to a sandbox in trouble. In every monitor pass, for
each running sandbox (its share of its host pids limit, sampled):

  * past KILL_AT, busy or not and whatever step holds its lock, every user process is killed (the
    agent kills atoll-init, and gVisor its whole PID namespace at once: background and setsid'd
    processes too), again every RELIEF_EVERY_S while the share still grows. Killing the offending
    command tree by its pids was tried and measured too slow: under a fork bomb 353 kills took 6 s
    and 496 processes were left; one kill of the namespace stops the growth within ~1 s of reaching
    the agent;
  * past COMPACT_AT, a *settled* one — idle (no call in flight, no step), its host tasks not
    growing for SETTLE_S (a fork bomb left running by a command that returned is idle, not settled)
    and no relief for RELIEF_QUIET_S — is checkpointed and restored in place when the gate allows
    (retried after COMPACT_RETRY_S otherwise). Its status stays `running`, and calls arriving
    meanwhile wait for it. The gate can take long (a starved agent), so the conditions are checked
    again right before the checkpoint. Measured with a bash fork bomb (timeout_s 20) after a
    2,000-process flood: kills at 60-75%, a compaction 10 s later at ~75%, the sandbox kept (5 of
    5 runs; before, a compaction's gate held the sandbox's lock for 10 s on a starved agent, no
    kill could start, and the sandbox was lost in 2 of 2).

A runsc-specific mitigation, so it lives in the worker; the control plane never sees it (except a
compaction whose restore failed: the sandbox is then in disk standby, RuntimeChanged).
Called by worker.node's monitor loop and before each call; worker.tiers asks relieved_recently
before a disk pause.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import typing

from atoll.core import errors
from atoll.core.lifecycle import Phase
from atoll.core.worker_api import RuntimeChanged, WorkerEvent
from atoll.worker.host import cgroups
from atoll.worker.runtimes.guest import Guest
from atoll.worker.runtimes.runtime import RuntimeStore
from atoll.worker.runtimes.tiers import Tiers

log = logging.getLogger(__name__)

COMPACT_AT = 0.25  # one burst of 200 processes adds ~2,000 host tasks (a fifth of the limit)
KILL_AT = 0.6  # above what ~512 live processes hold (~45%); a fork bomb adds ~350-900 a second
COMPACT_RETRY_S = 30.0
RELIEF_EVERY_S = 2.0  # host tasks grow for a moment after a kill: judge the kill after this long
SETTLE_S = 1.5  # a compaction needs host tasks that did not grow for this long...
RELIEF_QUIET_S = 10.0  # ...and no relief for this long
GROWTH = 0.005  # growth below this share of the limit is noise (a thread or two)
_now = time.monotonic  # (tests replace it; asyncio's own clock stays the real one)


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
        self._relieved: dict[str, tuple[float, float]] = {}  # sid -> (when, share then) of the last kill
        self._samples: dict[str, collections.deque[tuple[float, float]]] = {}
        self._compact_retry: dict[str, float] = {}
        self._compacting: dict[str, asyncio.Task] = {}

    def share(self, sid: str) -> float:
        """The share of its host pids limit a running sandbox's runtime uses (0 when unknown)."""
        rt = self.runtimes.find(sid)
        if rt is None or rt.phase != Phase.RUNNING:
            return 0.0
        usage = cgroups.pids_usage(rt.cgroup(self.install_id))
        return usage[0] / usage[1] if usage and usage[1] else 0.0

    def _sample(self, sid: str, now: float, share: float) -> collections.deque[tuple[float, float]]:
        dq = self._samples.setdefault(sid, collections.deque(maxlen=64))
        while dq and now - dq[0][0] > SETTLE_S + 1:
            dq.popleft()
        dq.append((now, share))
        return dq

    def relieved_recently(self, sid: str) -> str | None:
        """Why no checkpoint may start now, if its processes were killed within RELIEF_QUIET_S (a
        checkpoint in that state killed the sandbox; Tiers.pause asks this too)."""
        relieved = self._relieved.get(sid)
        if relieved is not None and _now() - relieved[0] < RELIEF_QUIET_S:
            return "its processes were just killed near its host task limit; try again in a few seconds"
        return None

    def unsettled(self, sid: str) -> str | None:
        """Why a compaction would be unsafe now (None: it may be saved): its processes were just
        killed (relieved_recently), or its host tasks grew within SETTLE_S."""
        why = self.relieved_recently(sid)
        if why is not None:
            return why
        now = _now()
        dq = self._samples.get(sid)
        if not dq or now - dq[0][0] < SETTLE_S - 0.6:
            return "its host task count has not been watched long enough"
        share = self.share(sid)
        if share - min((s for t, s in dq if now - t <= SETTLE_S), default=share) > GROWTH:
            return "its host task count is growing (processes being created)"
        return None

    def check(self, sid: str) -> None:
        """One monitor pass over one running sandbox: start a relief or a compaction when due."""
        share = self.share(sid)
        if share <= 0:
            return
        now = _now()
        dq = self._sample(sid, now, share)
        if sid in self._relief:
            return
        last = self._relieved.get(sid)
        growing = share - min((s for t, s in dq if now - t <= SETTLE_S), default=share) > GROWTH
        # (a count that sits past KILL_AT, host tasks an earlier burst left, is no reason to kill)
        if share >= KILL_AT and growing and (last is None or now - last[0] >= RELIEF_EVERY_S):
            self._relieved[sid] = (now, share)
            relief = asyncio.ensure_future(self._relieve(sid, share))
            self._relief[sid] = relief
            relief.add_done_callback(lambda _t, sid=sid: self._relief.pop(sid, None))
            return
        if (
            share >= COMPACT_AT
            and sid not in self._compacting
            and now >= self._compact_retry.get(sid, 0.0)
            and len(dq) > 1
            and self._idle(sid)
            and self.unsettled(sid) is None
        ):
            self._start_compaction(sid)

    async def before_call(self, sid: str) -> None:
        """A call waits for a compaction in progress (the sandbox is being saved and restored)."""
        task = self._compacting.get(sid)
        if task is not None:
            await asyncio.shield(task)

    def _start_compaction(self, sid: str) -> None:
        task = asyncio.ensure_future(self._compact(sid))
        self._compacting[sid] = task
        task.add_done_callback(lambda _t: self._compacting.pop(sid, None))

    async def _relieve(self, sid: str, share: float) -> None:
        log.warning(
            "sandbox.tasks.relief: killing the user processes",
            extra={"sandbox_id": sid, "reason": f"{share:.0%} of its host task limit in use"},
        )
        t0 = time.perf_counter()
        try:
            await self.guest.kill_all(sid)
        except errors.AtollError as e:
            log.warning("sandbox.tasks.relief.failed", extra={"sandbox_id": sid, "error": e.message})
            return
        # how long the starved agent took to take the kill: the margin KILL_AT must leave
        log.info(
            "sandbox.tasks.relief.sent",
            extra={"sandbox_id": sid, "duration_ms": round((time.perf_counter() - t0) * 1000, 1)},
        )

    async def _compact(self, sid: str) -> None:
        """Checkpoint and restore a settled, idle sandbox in place (see the module docstring)."""
        async with self._lock(sid):
            rt = self.runtimes.find(sid)
            if rt is None or rt.phase != Phase.RUNNING:
                return
            share = self.share(sid)
            gate = await self.guest.gate(sid)
            # the gate may have taken a while (a busy agent): is it still safe to save? (No call
            # can have started meanwhile: calls wait for this lock.)
            why = "; ".join(gate.blockers) if not gate.ok else self.unsettled(sid)
            if why is not None:
                self._compact_retry[sid] = _now() + COMPACT_RETRY_S
                log.info("sandbox.compact.gated", extra={"sandbox_id": sid, "reason": why})
                return
            log.info("sandbox.compact", extra={"sandbox_id": sid, "reason": f"{share:.0%} of its host tasks"})
            t0 = time.perf_counter()
            try:
                await self.tiers.checkpoint(rt)
                await self.tiers.restore(rt)
            except errors.AtollError as e:
                self._compact_retry[sid] = _now() + COMPACT_RETRY_S
                log.warning("sandbox.compact.failed", extra={"sandbox_id": sid, "error": e.message})
                if rt.phase == Phase.CHECKPOINTED:  # its restore failed: in disk standby, kept
                    self._emit(RuntimeChanged(sid, rt.phase, e.message))
                return
            self._samples.pop(sid, None)
            log.info(
                "sandbox.compact.complete",
                extra={"sandbox_id": sid, "duration_ms": round((time.perf_counter() - t0) * 1000, 1)},
            )

    def forget(self, sid: str) -> None:
        for per_sandbox in (self._relieved, self._compact_retry, self._samples):
            per_sandbox.pop(sid, None)

    async def aclose(self) -> None:
        tasks = [*self._relief.values(), *self._compacting.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

"""The tier policy: when an idle sandbox goes to standby, and when it moves to disk and to the archive.

Every PASS_EVERY_S the policy looks at each live record whose worker is ready and that has no call in
flight and no lifecycle step running, and starts at most POLICY_CONCURRENCY steps at once (one
sandbox whose worker or agent is slow delays no other's standby):
  * running → memory after `idle_timeout_s` without exec, file or process calls (0 = never); the
    worker declines while the sandbox has open TCP connections on its interface (activity);
  * memory → disk after `disk_after_s` in the memory tier, on the wall clock from the persisted
    `standby_since` (so it survives restarts); a sandbox the checkpoint gate refuses stays in
    memory and is retried after max(60 s, disk_after_s).
  * disk → archive after `archive_after_s` in standby (memory and disk together, from
    `standby_since`; 0 = never); a sandbox whose archive upload failed (the store down) stays on
    disk with the reason and is retried after max(60 s, archive_after_s).
  * a lifetime's end (`expires_at`, controlplane.lifetime): to the disk tier or deleted, first.
The policy decides *when*; the worker owns *how* (core.worker_api.WorkerAPI.pause).
Called by atoll.up and controlplane.main (run as a task beside the API); it passes only while
this server holds the `leader` lease (controlplane.leases: one server of several runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import typing

from atoll.controlplane import db as dbm
from atoll.controlplane import lifetime
from atoll.controlplane.lifecycle import SandboxManager
from atoll.core import errors
from atoll.core.lifecycle import State, Tier

log = logging.getLogger(__name__)

PASS_EVERY_S = 0.5
POLICY_CONCURRENCY = 8
GATE_RETRY_MIN_S = 60.0


class TierPolicy:
    def __init__(self, manager: SandboxManager):
        self.manager = manager
        self._steps: dict[str, asyncio.Task] = {}
        self._limit = asyncio.Semaphore(POLICY_CONCURRENCY)
        self._gate_retry: dict[str, float] = {}  # monotonic time before which a gated sandbox stays

    async def run(self) -> None:
        """Passes while this server holds the `leader` lease (controlplane.leases)."""
        while True:
            try:
                if self.manager.leader.held:
                    self.pass_once()
            except Exception:
                log.exception("tier policy pass failed")
            await asyncio.sleep(PASS_EVERY_S)

    def pass_once(self) -> None:
        m = self.manager
        now, wall = time.monotonic(), dbm.utcnow()
        ready = {h.id for h in m.workers.ready()} | {
            h.id for h in m.workers.handles.values() if h.state == "draining"
        }
        live = set()
        for rec in m.live():
            sid = rec.id
            live.add(sid)
            if sid not in self._steps and lifetime.expired(rec, wall):
                expiry = self._expiry(rec, ready, now)
                if expiry is not None:
                    self._start(sid, expiry)
                    continue
            if sid in self._steps or rec.worker_id not in ready or m.busy(sid) or rec.pooled:
                continue  # a pool's sandboxes stay frozen in memory until claimed
            step: typing.Awaitable | None = None
            if rec.state == State.RUNNING and rec.idle_timeout_s > 0:
                if m.idle_for(sid, now) >= rec.idle_timeout_s:
                    step = self._pause(sid, Tier.MEMORY, only_if_idle=True)
            elif (
                rec.state == State.STANDBY
                and rec.standby_tier == Tier.MEMORY
                and rec.disk_after_s > 0
                and rec.standby_since is not None
                and now >= self._gate_retry.get(sid, 0.0)
            ):
                since = (
                    rec.standby_since
                    if rec.standby_since.tzinfo
                    else rec.standby_since.replace(tzinfo=dt.UTC)
                )
                if (wall - since).total_seconds() >= rec.disk_after_s:
                    step = self._pause(sid, Tier.DISK)
            elif (
                rec.state == State.STANDBY
                and rec.standby_tier == Tier.DISK
                and (rec.archive_after_s or 0) > 0
                and rec.standby_since is not None
                and now >= self._gate_retry.get(sid, 0.0)
            ):
                since = (
                    rec.standby_since
                    if rec.standby_since.tzinfo
                    else rec.standby_since.replace(tzinfo=dt.UTC)
                )
                if (wall - since).total_seconds() >= rec.archive_after_s:
                    step = self._pause(sid, Tier.ARCHIVE)
            if step is not None:
                self._start(sid, step)
        for sid in [s for s in self._gate_retry if s not in live]:
            self._gate_retry.pop(sid, None)

    def _start(self, sid: str, step: typing.Awaitable) -> None:
        task = asyncio.ensure_future(self._slot(step))
        self._steps[sid] = task
        task.add_done_callback(lambda _t, sid=sid: self._steps.pop(sid, None))

    def _expiry(self, rec: dbm.SandboxRecord, ready: set[str], now: float) -> typing.Awaitable | None:
        """The step that ends an expired lifetime (controlplane.lifetime), None for none now."""
        if rec.on_timeout == "delete":
            return self._expire_delete(rec.id)
        if rec.state == State.STANDBY and rec.standby_tier in (Tier.DISK, Tier.ARCHIVE):
            lifetime.clear(self.manager.ledger, rec)  # already where a "pause" expiry puts it (or colder)
            return None
        if (
            rec.state in (State.RUNNING, State.STANDBY)
            and rec.worker_id in ready
            and not self.manager.busy(rec.id)
            and now >= self._gate_retry.get(rec.id, 0.0)
        ):
            # E2B's timeout pauses with process streams open (they end): its sandboxes ask so
            return self._expire_pause(rec.id, end_streams=bool(rec.compat))
        return None

    async def _expire_delete(self, sid: str) -> None:
        log.info("sandbox.lifetime.expired: deleting", extra={"sandbox_id": sid})
        with contextlib.suppress(errors.NotFound):
            await self.manager.delete(sid)

    async def _expire_pause(self, sid: str, *, end_streams: bool = False) -> None:
        log.info("sandbox.lifetime.expired: to the disk tier", extra={"sandbox_id": sid})
        with contextlib.suppress(errors.AtollError):
            rec = await self.manager.pause(sid, Tier.DISK, end_streams=end_streams)
            if rec.standby_tier == Tier.DISK:
                lifetime.clear(self.manager.ledger, rec)
            else:  # gated: it stays in memory with its lifetime, retried later
                self._gate_retry[sid] = time.monotonic() + max(GATE_RETRY_MIN_S, rec.disk_after_s)

    async def _slot(self, step: typing.Awaitable) -> None:
        async with self._limit:
            if not self.manager.leader.held:  # lost the lease while it waited: another server decides
                if asyncio.iscoroutine(step):
                    step.close()
                return
            try:
                await step
            except Exception:
                log.exception("tier policy step failed")

    async def _pause(self, sid: str, tier: Tier, *, only_if_idle: bool = False) -> None:
        with contextlib.suppress(errors.AtollError):
            rec = await self.manager.pause(sid, tier, only_if_idle=only_if_idle)
            if tier == Tier.DISK and rec.standby_tier == Tier.MEMORY:  # gated: try again later
                self._gate_retry[sid] = time.monotonic() + max(GATE_RETRY_MIN_S, rec.disk_after_s)
            if tier == Tier.ARCHIVE and rec.standby_tier == Tier.DISK:  # the store failed: later
                self._gate_retry[sid] = time.monotonic() + max(GATE_RETRY_MIN_S, rec.archive_after_s)

    async def aclose(self) -> None:
        for t in list(self._steps.values()):
            t.cancel()

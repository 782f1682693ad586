"""Workers lost for good: what becomes of their sandboxes after ATOLL_WORKER_GONE_S.

A worker without heartbeats for ATOLL_WORKER_LOST_S is `lost` (controlplane.workers): calls to its
sandboxes answer 503 worker_unavailable and `GET /v1/sandboxes/{id}` shows `worker_state: "lost"`;
it may come back, and nothing about them changes meanwhile. Once it has been lost for
ATOLL_WORKER_GONE_S (0: never) as this server sees it (`WorkerHandle.lost_since`: a server restart
starts the count again), `GoneWorkers` settles each sandbox it holds, under the sandbox's lock:

- archive tier: another worker adopts it from the shared object store by reference (as
  `DELETE /v1/workers/{id}` does): it stays in standby there and resumes on its next call;
- running, memory or disk tier with `on_worker_lost: "restore"`: another worker adopts its last
  archive (the one its resumes kept in the store, worker verb `resume(keep_archive)`); one that
  was running is resumed there at once, one in standby stays in the archive tier there. Its state
  is the archive's: whatever happened after that archive was made is lost. Without an archive in
  the store it fails like the others;
- anything else (and a creating one): failed, the reason naming the worker and since when; a warm
  pool's unclaimed member is dropped (the keepers refill elsewhere).

A worker this server took to be alive on another server sharing the records (`HELD_ELSEWHERE`,
not counted) is counted from when no server has written a heartbeat of it for ATOLL_WORKER_LOST_S
plus the interval at which they write them (`notice_silent_elsewhere`, on every server each pass):
the server it had joined lost it too, and the leader, which settles, may be another server.

No other worker with room now, or the store unreachable (503): the sandbox stays as it is and is
tried again on the next pass. A server stopped after another worker adopted a sandbox and before
the record names it leaves the record's `moving_to` naming that worker: its reconciliation
finishes the move (controlplane.lifecycle `_finish_move`: recorded there in the archive tier, a
running one resumed), never deletes the copy that holds the archive now. A worker that returns (controlplane.lifecycle `worker_joined`)
deletes its copies of sandboxes that moved (their record names another worker) or that were
failed here (`failed_as_gone`), never the archive objects their new worker adopted (the manifest
names that worker as `holder`, and a worker only removes what names itself).
Started and stopped by controlplane.lifecycle.SandboxManager; the pass runs in the server's loop, on the
server holding the `leader` lease only (controlplane.leases).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import typing

from atoll.controlplane import db as dbm
from atoll.controlplane.workers import HEARTBEAT_WRITE_S, HELD_ELSEWHERE
from atoll.core import errors
from atoll.core.lifecycle import State, Tier, Verb

if typing.TYPE_CHECKING:
    from atoll.controlplane.manager_view import Manager
    from atoll.controlplane.workers import WorkerHandle

log = logging.getLogger(__name__)

CONCURRENCY = 4
"""Sandboxes settled at once (a restore is an adoption and a resume on another worker)."""
GONE = "worker gone: "
"""How the failure reason of a sandbox failed here begins (its returning worker drops its copy)."""


def restored_reason(cause: str) -> str:
    """The standby reason of an `on_worker_lost: "restore"` sandbox adopted by another worker."""
    return (
        f"restored from its last archive on another worker ({cause}); what changed after that "
        "archive was made is lost"
    )


def failed_as_gone(rec: dbm.SandboxRecord) -> bool:
    return rec.state == State.FAILED and (rec.failure_reason or "").startswith(GONE)


class GoneWorkers:
    def __init__(self, manager: Manager, gone_after_s: float, every_s: float = 1.0):
        self.m = manager
        self.gone_after_s = gone_after_s
        """ATOLL_WORKER_GONE_S (0: never)."""
        self.every_s = every_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                self.notice_silent_elsewhere()
            except Exception:  # the database may be away: the next pass reads it again
                log.debug("reading the heartbeats other servers wrote failed", exc_info=True)
            if self.gone_after_s <= 0 or not self.m.leader.held:  # another server settles them
                continue
            try:
                await self.sweep()
            except Exception:  # the next pass tries again
                log.exception("settling the sandboxes of lost workers failed")

    def notice_silent_elsewhere(self) -> int:
        """Start counting ATOLL_WORKER_GONE_S for the workers this server took to be held by
        another one (`HELD_ELSEWHERE`, no `lost_since`) whose heartbeats no server has written for
        ATOLL_WORKER_LOST_S plus the interval at which servers write them: the server that held it
        lost it too, and may not be the one that settles (only the leader does). How many."""
        reg = self.m.workers
        waiting = [
            h
            for h in reg.handles.values()
            if not h.local
            and h.state == "lost"
            and h.lost_since is None
            and (h.reason or "").startswith(HELD_ELSEWHERE)
        ]
        if not reg.shared or not waiting or time.monotonic() - reg.db.trouble_at < reg.lost_after_s:
            return 0
        records = {rec.id: rec for rec in reg.db.workers()}
        now, started = reg.db.now(), 0  # the clock heartbeats are written on
        for h in waiting:
            rec = records.get(h.id)
            at = rec.last_heartbeat_at if rec is not None else None
            if at is None or h.state != "lost" or h.lost_since is not None:
                continue
            silent_s = (now - (at if at.tzinfo else at.replace(tzinfo=dt.UTC))).total_seconds()
            if silent_s < reg.lost_after_s + HEARTBEAT_WRITE_S:
                continue
            h.reason = f"no server has heard from it since {at.isoformat(timespec='seconds')}"
            h.lost_since = time.time()
            log.warning("worker.lost", extra={"worker": h.name, "reason": h.reason})
            started += 1
        return started

    async def sweep(self) -> int:
        """Settle the sandboxes of every worker lost for ATOLL_WORKER_GONE_S; how many changed."""
        now = time.time()
        changed = 0
        reg = self.m.workers
        if time.monotonic() - reg.db.trouble_at < reg.lost_after_s:
            return 0  # the records database failed lately: heartbeats could not get through
        for h in list(self.m.workers.handles.values()):
            if h.local or h.state != "lost" or h.lost_since is None:
                continue
            if now - h.lost_since < self.gone_after_s:
                continue
            if reg.shared and reg.held_elsewhere(reg.db.get_worker(h.id)):
                # alive, through another server sharing the records: nothing to settle
                h.reason, h.lost_since = HELD_ELSEWHERE, None
                continue
            cause = (
                f"its worker {h.name!r} has been lost since {_iso(h.lost_since)} "
                f"({h.reason or 'no heartbeat'}) for over ATOLL_WORKER_GONE_S ({self.gone_after_s:g} s)"
            )
            changed += await self.settle(h, cause, final=False)
        return changed

    async def settle(self, h: WorkerHandle, cause: str, *, final: bool) -> int:
        """Settle every live sandbox `h` holds (see the module doc); `cause` says why, in the
        failure reasons. `final` (the worker was removed): what cannot move now fails instead of
        waiting for the next pass. How many changed."""
        limit = asyncio.Semaphore(CONCURRENCY)

        async def one(sid: str) -> bool:
            async with limit:
                try:
                    return await self._settle(sid, h, cause, final)
                except Exception:  # one sandbox's trouble must not stop the others
                    log.exception("settling a sandbox of a lost worker failed", extra={"sandbox_id": sid})
                    return False

        recs = [r for r in self.m.ledger.live() if r.worker_id == h.id]
        done = await asyncio.gather(
            *(one(r.id) for r in recs if r.state not in (State.FAILED, State.DELETED))
        )
        return sum(done)

    async def _settle(self, sid: str, h: WorkerHandle, cause: str, final: bool) -> bool:
        m = self.m
        async with m.ledger.lock(sid):
            try:
                rec = m.get(sid)
            except errors.AtollError:
                return False
            if rec.worker_id != h.id or rec.state in (State.FAILED, State.DELETED) or h.state != "lost":
                return False  # moved, ended, or its worker came back meanwhile
            if rec.pooled:
                log.info("sandbox.gone: an unclaimed pool member dropped", extra={"sandbox_id": sid})
                m.ledger.persist(rec, Verb.DELETE, deleted_at=dbm.utcnow(), failure_reason=f"{GONE}{cause}")
                return True
            archived = rec.state == State.STANDBY and rec.standby_tier == Tier.ARCHIVE
            restore = rec.on_worker_lost == "restore" and rec.state in (State.RUNNING, State.STANDBY)
            if not (archived or restore):
                m.ledger.fail(rec, f"{GONE}{cause}; it was not in the archive tier{_HINT}")
                return True
            try:
                await m.adopt_elsewhere(rec, h.name, avoid=h.id)
            except errors.Unavailable as e:  # no room now, the store down: the next pass tries again
                log.info("sandbox.gone: not moved yet: %s", e.message, extra={"sandbox_id": sid})
                if final:
                    m.ledger.fail(rec, f"{GONE}{cause}, and no other worker could take it now: {e.message}")
                return final
            except errors.SandboxNotFound as e:
                m.ledger.fail(
                    rec, f"{GONE}{cause}, and the object store holds no archive of it ({e.message}){_HINT}"
                )
                return True
            except errors.AtollError as e:
                m.ledger.fail(rec, f"{GONE}{cause}, and no other worker could take it: {e.message}{_HINT}")
                return True
            if archived:
                log.info("sandbox.gone: moved by reference to another worker", extra={"sandbox_id": sid})
                return True
            was_running = rec.state == State.RUNNING
            m.ledger.persist(
                rec,
                Verb.ARCHIVE,
                standby_since=dbm.utcnow(),
                standby_reason=restored_reason(cause),
            )
            log.warning(
                "sandbox.gone: restored from its last archive on another worker (was %s)",
                "running" if was_running else "in standby",
                extra={"sandbox_id": sid, "from": h.name},
            )
            if was_running:
                try:
                    await m.resume_locked(rec)
                except errors.AtollError as e:  # it resumes on its next call, or says why not
                    log.warning(
                        "sandbox.gone: restored, not resumed yet: %s", e.message, extra={"sandbox_id": sid}
                    )
            return True


_HINT = '; delete it and create a new one (`on_worker_lost: "restore"` brings one back from its last archive)'


def _iso(t: float | None) -> str:
    return "?" if t is None else dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")

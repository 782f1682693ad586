"""Standby tiers of one sandbox, and how this runsc gets there and back: the worker's *how* of pause
and resume.

memory: freeze the sandbox's freezer cgroup directly (0.3–3 ms; `runsc pause` costs ~30 ms of CLI),
        thaw to resume (the agent's health request is written on a kept-alive connection first).
disk:   thaw if frozen, ask the checkpoint gate (a failed checkpoint kills the sandbox, so what this
        runsc cannot save is refused first), reset the agent's connections and ask the gate once
        more on the last one (POST /gate/final: the resets processed, nothing new since; no other
        connection is opened until runsc is done), `runsc checkpoint` into the snapshot store's staging
        directory, commit; a gated sandbox is frozen again and stays in the memory tier with the
        reason. Resume = readdress eth0, next generation, `runsc restore` (checksum verified
        meanwhile), agent health, CPU quota, identity. A resume that fails at any step throws the
        half-restored runtime away and leaves the sandbox checkpointed, image and files kept
        (ResumeFailed: the control plane decides whether to try again).
archive: a checkpointed sandbox (checkpointed first, through the same gate, when it runs or is
        frozen) goes to the object store (worker.runtimes.archiving); the store failing leaves it in
        the disk tier with the reason. Resume = download, verify, unpack, then the disk restore.
`pause` answers a `PauseOutcome` (tier reached and why); nothing here decides *when* (the control
plane's policy does). Called by worker.node, worker.pressure and worker.builder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import typing

from atoll.core import errors
from atoll.core.lifecycle import Phase, Step, Tier
from atoll.core.worker_api import PauseOutcome, ResumeOutcome
from atoll.worker.host import cgroups, netns, runsc
from atoll.worker.host.snapshots import Snapshot, SnapshotStore
from atoll.worker.runtimes.archiving import Archiver
from atoll.worker.runtimes.guest import Gate, Guest
from atoll.worker.runtimes.liveness import Liveness
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore
from atoll.worker.runtimes.sandboxes import Sandboxes

log = logging.getLogger(__name__)

THAW_READY_TIMEOUT_S = 10.0
RESTORE_READY_TIMEOUT_S = 30.0


class CheckpointRefused(errors.Conflict):
    """The gate asked right before runsc would save (Tiers.checkpoint) found what this runsc cannot
    save: nothing was checkpointed and the sandbox runs on, thawed."""

    code = "checkpoint_refused"

    def __init__(self, sid: str, blockers: list[str]):
        self.blockers = blockers
        super().__init__(
            f"sandbox {sid} cannot be checkpointed now: its state cannot be saved "
            f"({'; '.join(blockers)}); it keeps running untouched — close those connections or stop "
            "that server, then try again"
        )


class Tiers:
    def __init__(
        self,
        runtimes: RuntimeStore,
        guest: Guest,
        liveness: Liveness,
        sandboxes: Sandboxes,
        snapshots: SnapshotStore,
        spawn: typing.Callable[[typing.Awaitable], None],
        archiver: Archiver | None = None,
        home: str | None = None,
    ):
        self.home = home
        """The worker's ATOLL_HOME: runsc's log of a failed checkpoint is kept in its `logs/`
        (None: not kept, as in unit tests)."""
        self.archiver = archiver
        """The archive tier (None: pausing to it is refused)."""
        self.runtimes = runtimes
        self.guest = guest
        self.liveness = liveness
        self.sandboxes = sandboxes
        self.snapshots = snapshots
        self.install_id = sandboxes.install_id
        self.runsc_root = sandboxes.runsc_root
        self._spawn = spawn
        self._addressed: dict[str, int] = {}  # sandbox -> generation whose eth0 is addressed again
        self._net_locks: dict[str, asyncio.Lock] = {}  # sandbox -> held while eth0 is re-addressed
        self.unsafe_to_save: typing.Callable[[str], str | None] = lambda sid: None
        """Why no checkpoint may start now beyond the gate (worker.pressure: processes just killed)."""

    def _cg(self, rt: Runtime) -> str:
        return rt.cgroup(self.install_id)

    # ---- memory tier ----------------------------------------------------------------------------
    def freeze(self, rt: Runtime) -> None:
        """Freeze (raises FreezeTimeout, the sandbox thawed and running, when it cannot)."""
        cgroups.freeze(self._cg(rt))
        self.runtimes.advance(rt, Step.FREEZE, durable=False)

    def thaw(self, rt: Runtime) -> None:
        cgroups.thaw(self._cg(rt))
        self.runtimes.advance(rt, Step.THAW, soon=True)  # a reattach reads the freezer anyway

    async def thaw_and_ping(self, rt: Runtime) -> None:
        """Thaw a memory-tier sandbox and wait for its agent's answer. The health request is
        written on a kept-alive connection before the thaw: it waits in the frozen sentry's socket
        and is served as soon as its threads run again."""
        sid = rt.sandbox_id
        ping = asyncio.ensure_future(self.guest.channel(sid).request("GET", "/health", timeout=2.0))
        await asyncio.sleep(0)  # lets the request go out on an idle connection, if there is one
        try:
            self.thaw(rt)
        except BaseException:
            ping.cancel()
            raise
        try:
            r = await ping
            if r.status_code == 200:
                return
        except Exception:  # noqa: BLE001 - any failure: wait for the agent the slow way
            pass
        await self.guest.wait_ready(sid, THAW_READY_TIMEOUT_S, self.runtimes.path(sid, "runsc.log"))

    # ---- pause ----------------------------------------------------------------------------------
    async def pause(self, rt: Runtime, tier: Tier, *, only_if_idle: bool = False) -> PauseOutcome:
        if rt.phase == Phase.ARCHIVED:
            return PauseOutcome(Tier.ARCHIVE)  # the coldest: the control plane checks the order
        if tier == Tier.ARCHIVE and self.archiver is None:
            raise errors.Conflict("this worker has no archive tier configured", code="invalid_state")
        if rt.phase == Phase.CHECKPOINTED:
            if tier == Tier.ARCHIVE:
                return await self._archive(rt)
            return PauseOutcome(Tier.DISK)  # colder than anything asked: the control plane checks order
        if rt.phase not in (Phase.RUNNING, Phase.FROZEN):
            raise errors.Conflict(
                f"sandbox {rt.sandbox_id} is {rt.phase.value} on its worker and cannot be paused now",
                code="invalid_state",
            )
        if tier == Tier.MEMORY:
            if rt.phase == Phase.FROZEN:
                return PauseOutcome(Tier.MEMORY)
            if only_if_idle:
                # bytes moving through the gateway are activity; an idle open connection is not
                busy = await self.sandboxes.edge.busy_now(rt.sandbox_id)
                if busy:
                    return PauseOutcome(None, f"{busy} network connection(s) in use count as activity")
            return self._freeze_outcome(rt, Tier.MEMORY, None)
        was_frozen = rt.phase == Phase.FROZEN
        if was_frozen:
            self.thaw(rt)
        busy = await self.sandboxes.edge.quiesce(rt.sandbox_id)  # idle connections: reset
        gate = await self.guest.gate(rt.sandbox_id)
        if busy is None:  # the egress gateway cannot vouch for the sandbox's connections
            gate = Gate(False, [*gate.blockers, "the egress gateway is not answering or was just restarted"])
        unsafe = self.unsafe_to_save(rt.sandbox_id)
        if unsafe is not None:
            gate = Gate(False, [*gate.blockers, unsafe])
        if not gate.ok:
            why = "kept in the memory tier: " + "; ".join(gate.blockers)
            if busy:
                why += f" ({busy} egress connection(s) in use)"
            log.info("sandbox.pause_disk.gated", extra={"sandbox_id": rt.sandbox_id, "reason": why})
            return self._freeze_outcome(rt, Tier.MEMORY, why)
        try:
            await self.checkpoint(rt)
        except CheckpointRefused as e:
            why = "kept in the memory tier: " + "; ".join(e.blockers)
            log.info("sandbox.pause_disk.gated", extra={"sandbox_id": rt.sandbox_id, "reason": why})
            return self._freeze_outcome(rt, Tier.MEMORY, why)
        if tier == Tier.ARCHIVE:
            return await self._archive(rt)
        return PauseOutcome(Tier.DISK)

    async def _archive(self, rt: Runtime) -> PauseOutcome:
        assert self.archiver is not None
        why = await self.archiver.archive(rt)
        return PauseOutcome(Tier.DISK, why) if why else PauseOutcome(Tier.ARCHIVE)

    def _freeze_outcome(self, rt: Runtime, tier: Tier, reason: str | None) -> PauseOutcome:
        try:
            self.freeze(rt)
        except errors.FreezeTimeout as e:
            return PauseOutcome(None, e.message, busy=True)
        return PauseOutcome(tier, reason)

    # ---- disk tier ------------------------------------------------------------------------------
    async def checkpoint(self, rt: Runtime) -> None:
        """Checkpoint a running, gated sandbox to disk and release its memory. On failure the
        sandbox is dead (this runsc kills it): the runtime is failed with the cause."""
        sid = rt.sandbox_id
        # Saving is the runtime's work, not the sandbox's: do not throttle it to the sandbox's cpus.
        # Lifted before the resets below, so that a sandbox that used up its quota does not leave
        # the RSTs unprocessed by its network stack until the next period (an endpoint still
        # connected when the sentry saves fails the checkpoint, and that kills the sandbox).
        cgroups.set_cpu_limit(self._cg(rt), None)
        # The calls cut here answer before the checkpoint's outcome is known: say both outcomes.
        ended = errors.Conflict(
            f"sandbox {sid} was being checkpointed (saved for a standby, a fork or a compaction) "
            "while this call was in flight: its answer is lost. Call again: if the checkpoint "
            "completed, what this call did in the sandbox is kept (and a sandbox in standby is "
            "resumed); if it failed, runsc stopped the sandbox and it is now failed (the answer "
            "says why)"
        )
        await self.guest.close(sid, ended)
        try:
            # Asked again right before runsc saves, with none of our connections left open: what
            # came up since the caller's gate (a user's connection, our reset not yet processed)
            # refuses the checkpoint here instead of killing the sandbox.
            gate = await self.guest.final_gate(sid, ended)
            if not gate.ok:
                self.sandboxes.limit_cpu(rt)
                raise CheckpointRefused(sid, gate.blockers)
            tmp = self.snapshots.staging(sid, rt.generation)
            self.runtimes.advance(rt, Step.BEGIN_CHECKPOINT)
            t0 = time.perf_counter()
            proc = await runsc.start_checkpoint(
                self.runsc_root, rt.cid, tmp, self.runtimes.path(sid, "runsc.log")
            )
            await proc.wait()
            await self.finish_checkpoint(rt, tmp)
        finally:
            self.guest.unseal(sid)
        log.info("checkpoint took %.0f ms", (time.perf_counter() - t0) * 1000, extra={"sandbox_id": sid})

    async def finish_checkpoint(self, rt: Runtime, tmp: str) -> None:
        """Commit the image `runsc checkpoint` wrote into `tmp` (or fail the runtime if it did not
        complete); the old container is discarded in the background."""
        sid = rt.sandbox_id
        old_cid, old_cg = rt.cid, self._cg(rt)
        if not self.snapshots.staged_complete(tmp):
            self.snapshots.drop_staging(tmp)
            message = self.checkpoint_failure(rt, "failed and runsc stopped it")
            self.liveness.failed(sid, message)
            self._spawn(self.sandboxes.discard_container(old_cid, old_cg))
            # The sandbox is gone, not the host: 409 sandbox_failed (as any sandbox that dies
            # under a call), not a 5xx; a retry cannot help, a new sandbox can.
            raise errors.SandboxDied(message)
        await self.snapshots.commit(sid, rt.generation, tmp)
        self.liveness.unwatch(sid)
        self.runtimes.advance(rt, Step.COMMIT_CHECKPOINT)
        self._spawn(self._discard_after_checkpoint(rt, old_cid, old_cg))

    def checkpoint_failure(self, rt: Runtime, what: str) -> str:
        """A checkpoint of `rt` that did not complete (this runsc stops the sandbox then): keep
        runsc's log under `$ATOLL_HOME/logs/` (the sandbox's own goes with its delete) and log its
        end. Returns what the runtime fails with: the failure in runsc's own words."""
        sid = rt.sandbox_id
        log_path = self.runtimes.path(sid, "runsc.log")
        kept = None
        if self.home is not None:
            name = f"{sid}-checkpoint-{rt.generation}.log"
            kept = runsc.keep_log(log_path, os.path.join(self.home, "logs"), name)
        message = (
            f"checkpoint of sandbox {sid} {what} (runsc: {runsc.cause(log_path, self.home)}); "
            "its memory is lost and its files are kept until you delete it — create a new sandbox"
        )
        log.error(
            "sandbox.checkpoint.failed: runsc log: %s",
            runsc.tail(log_path),
            extra={"sandbox_id": sid, "generation": rt.generation, "kept_log": kept or "(not kept)"},
        )
        return message

    def _net_lock(self, sid: str) -> asyncio.Lock:
        return self._net_locks.setdefault(sid, asyncio.Lock())

    def forget(self, sid: str) -> None:
        self._addressed.pop(sid, None)
        self._net_locks.pop(sid, None)

    async def restore(self, rt: Runtime) -> None:
        """Restore a checkpointed sandbox. If any step fails, the half-restored runtime is thrown
        away and the sandbox is checkpointed again, its image and writable layer untouched:
        ResumeFailed (another try may work). A snapshot that is gone is a RuntimeFailure."""
        sid = rt.sandbox_id
        t0 = time.perf_counter()
        snap = self.snapshots.committed(sid)
        if snap is None:
            raise errors.RuntimeFailure(f"sandbox {sid} has no committed snapshot to restore")
        try:
            snap = self.snapshots.checked(sid)
            # eth0 gets its address back before runsc takes the interface over (and the address
            # off again). Nothing may add it once runsc has: an address on eth0 makes the host
            # kernel answer the agent's port with RSTs, so the agent "refuses" every connection.
            # The re-address after a checkpoint (_discard_after_checkpoint) and this one are
            # serialized, and the generation moves on under the same lock: a re-address that
            # waited for it sees the new generation and does nothing.
            async with self._net_lock(sid):
                if self._addressed.pop(sid, None) != rt.generation:  # else done after the checkpoint
                    await netns.readdress(rt.name)
                rt.generation += 1
            rt.sentry_pid = None
            self.liveness.exited(sid).clear()
            self.sandboxes.write_bundle(rt)
            self.runtimes.advance(rt, Step.BEGIN_RESTORE)  # written once, with the new generation
            t_prep = time.perf_counter()
            await self._restore_runtime(rt, snap)
            t_runsc = time.perf_counter()
            # The restored agent still has the generation (and CPU count) of its image; its first
            # answer to POST /identity is also the sign that it runs again.
            await self.guest.identify_when_ready(
                sid,
                rt.generation,
                rt.cpus,
                RESTORE_READY_TIMEOUT_S,
                self.runtimes.path(sid, "runsc.log"),
                alive=lambda: runsc.pid_alive(rt.sentry_pid),
            )
        except BaseException as e:
            await asyncio.shield(self._undo_restore(rt))
            if isinstance(e, errors.AtollError):
                raise errors.ResumeFailed(
                    f"restoring sandbox {sid} failed: {e.message}",
                    detail=e.detail,
                ) from None
            raise
        # not fsync'd: after a crash the file says `restoring` and the reattach finishes the restore
        self.runtimes.advance(rt, Step.RESTORED, durable=False)
        self.liveness.watch(rt)
        self.sandboxes.limit_cpu(rt)
        t_end = time.perf_counter()
        log.info(
            "restore took %.0f ms (prepare %.0f, runsc and checksum %.0f, agent %.0f)",
            (t_end - t0) * 1000,
            (t_prep - t0) * 1000,
            (t_runsc - t_prep) * 1000,
            (t_end - t_runsc) * 1000,
            extra={"sandbox_id": sid},
        )
        # The image is stale once the sandbox runs on; the next standby writes a fresh one.
        self._spawn(self.snapshots.discard(sid))

    async def _restore_runtime(self, rt: Runtime, snap: Snapshot) -> None:
        """`runsc restore` with the checksum verified meanwhile (both read the same image; two
        cores): a mismatch throws the restored sandbox away before it serves any call."""
        verify = asyncio.ensure_future(self.snapshots.verify(snap))
        try:
            await runsc.restore(
                self.runsc_root,
                self.runtimes.path(rt.sandbox_id, "bundle"),
                rt.cid,
                snap.dir,
                self.runtimes.path(rt.sandbox_id, "runsc.log"),
            )
            rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
            await verify
        finally:
            if not verify.done():
                verify.cancel()

    async def _undo_restore(self, rt: Runtime) -> None:
        """A restore failed (or was cut short): stop whatever runsc started for it — its sentry and
        gofer must be gone before another restore takes eth0 — and go back to checkpointed."""
        sid = rt.sandbox_id
        log.warning("sandbox.restore.undone", extra={"sandbox_id": sid, "generation": rt.generation})
        await self.guest.close(sid)
        if rt.phase == Phase.RESTORING:
            try:
                await self.sandboxes.discard_container(rt.cid, self._cg(rt))
            except errors.AtollError as e:  # the next restore uses a new container id anyway
                log.warning("the failed restore's container stays: %s", e.message, extra={"sandbox_id": sid})
            rt.sentry_pid = None
            self.runtimes.advance(rt, Step.RESTORE_FAILED)

    async def _discard_after_checkpoint(self, rt: Runtime, old_cid: str, old_cg: str) -> None:
        """Delete the checkpointed container, then give eth0 its address back already (runsc took
        it): the next restore does not wait for `ip` (~5 ms)."""
        generation = rt.generation
        await self.sandboxes.discard_container(old_cid, old_cg)
        async with self._net_lock(rt.sandbox_id):  # see restore: never once a restore has begun
            if rt.phase != Phase.CHECKPOINTED or rt.generation != generation:
                return
            try:
                await netns.readdress(rt.name)
            except errors.AtollError as e:
                log.info("readdress after a checkpoint failed (the restore does it): %s", e.message)
                return
            self._addressed[rt.sandbox_id] = generation

    async def set_identity(self, rt: Runtime) -> None:
        """The restored agent still has the generation (and CPU count) of its image."""
        try:
            await self.guest.identify(rt.sandbox_id, rt.generation, hostname=None, env=None, cpus=rt.cpus)
        except errors.AtollError as e:
            log.warning(
                "could not set the identity after a restore: %s",
                e.message,
                extra={"sandbox_id": rt.sandbox_id},
            )

    # ---- resume ---------------------------------------------------------------------------------
    async def resume(self, rt: Runtime, keep_archive: bool = False) -> ResumeOutcome:
        t0 = time.perf_counter()
        if rt.phase == Phase.FROZEN:
            await self.thaw_and_ping(rt)
            tier = Tier.MEMORY
        elif rt.phase == Phase.CHECKPOINTED:
            await self.restore(rt)
            tier = Tier.DISK
        elif rt.phase == Phase.ARCHIVED:
            if self.archiver is None:
                raise errors.RuntimeFailure(
                    f"sandbox {rt.sandbox_id} is archived and this worker has no archive tier"
                )
            await self.archiver.unarchive(rt, keep_archive)
            await self.restore(rt)
            await self.archiver.drop_stale(rt)  # only now: until it runs, the archive is its copy
            tier = Tier.ARCHIVE
        elif rt.phase == Phase.RUNNING:
            return ResumeOutcome(Tier.MEMORY, 0.0)  # nothing to do (e.g. a resume shared with another)
        else:
            raise errors.Conflict(
                f"sandbox {rt.sandbox_id} is {rt.phase.value} on its worker and cannot be resumed",
                code="invalid_state",
            )
        return ResumeOutcome(tier, round((time.perf_counter() - t0) * 1000, 3))

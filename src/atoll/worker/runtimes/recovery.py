"""Records and reality on this host: reattach at start-up, reconcile periodically, report inventory.

`reattach` (start-up, per runtime record) finds where each sandbox really is after the worker was
stopped or killed, and moves its phase there through the phase table:

| phase on disk   | what is checked                                   | becomes                          |
|-----------------|---------------------------------------------------|----------------------------------|
| creating        | —                                                 | failed (the create was cut short) |
| checkpointing   | wait for an orphaned `runsc checkpoint`, `done`   | checkpointed (commit) / running / failed |
| checkpointed    | committed snapshot                                | checkpointed / failed            |
| restoring       | wait for an orphaned `runsc restore`, runsc state | running (agent, quota, identity) / checkpointed / failed |
| running, frozen | freezer cgroup (never `runsc state` on a frozen sentry), runsc state | frozen / running / failed |
| archiving       | — (the disk copy is whole until the commit)       | checkpointed (layers mounted again) |
| archived        | local leftovers of a download                     | archived (leftovers dropped)     |
| deleting        | —                                                 | deleted now                      |

In every other phase the staging files of an archive transfer cut short and a stale local archive
manifest are removed (worker.runtimes.archive_gc.drop_local_leftovers).

`reconcile` (start-up and every RECONCILE_EVERY_S) scans the host once (worker.sweep.scan): objects
no live runtime record owns are removed (logged), and a runtime whose objects vanished (no sentry,
no root filesystem mount, no network namespace, no snapshot) becomes failed with the cause.
Runtimes with a step in progress are left alone. Called by worker.node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import typing

from atoll.core import errors
from atoll.core.lifecycle import Phase, Step
from atoll.core.worker_api import ReconcileReport
from atoll.worker.host import cgroups, runsc, sweep
from atoll.worker.host.snapshots import SnapshotStore
from atoll.worker.runtimes import archive_gc
from atoll.worker.runtimes.guest import Guest
from atoll.worker.runtimes.liveness import Liveness
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore
from atoll.worker.runtimes.sandboxes import Sandboxes
from atoll.worker.runtimes.tiers import Tiers

log = logging.getLogger(__name__)

RECONCILE_EVERY_S = 30.0
ORPHAN_WAIT_S = 120.0
# what a pass finds missing when the sentry died; a limit that killed it is then the cause
SENTRY_GONE = "its gVisor sentry is not running"


def _runsc_command_running(verb: str, needle: str) -> bool:
    """Is a `runsc <verb> …` command line naming `needle` still running (the command, or the shell
    wrapper around it)? The sandbox's own daemons (runsc-sandbox, runsc-gofer) name the container
    too, but they are the sandbox, not a command that is still at work: they do not count."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) in (b"runsc-sandbox", b"runsc-gofer"):
            continue
        line = b" ".join(argv)
        if b"runsc" in line and f" {verb} ".encode() in line and needle.encode() in line:
            return True
    return False


class Recovery:
    def __init__(
        self,
        runtimes: RuntimeStore,
        host: sweep.Installation,
        guest: Guest,
        liveness: Liveness,
        sandboxes: Sandboxes,
        tiers: Tiers,
        snapshots: SnapshotStore,
        busy: typing.Callable[[str], bool],
    ):
        self.runtimes = runtimes
        self.host = host
        self.guest = guest
        self.liveness = liveness
        self.sandboxes = sandboxes
        self.tiers = tiers
        self.snapshots = snapshots
        self._busy = busy
        self.install_id = host.install_id
        self.runsc_root = host.runsc_root

    # ---- reattach -------------------------------------------------------------------------------
    async def reattach(self, rt: Runtime) -> None:
        """Bring `rt`'s phase in line with the host after a restart (see the module table)."""
        sid, before = rt.sandbox_id, rt.phase
        try:
            note = await self._reattach(rt)
        except (errors.AtollError, OSError, TimeoutError) as e:
            note = None
            self.runtimes.fail(rt, f"could not reattach to sandbox {sid} after the worker restarted: {e}")
        if rt.phase in (Phase.RUNNING, Phase.FROZEN):
            self.liveness.watch(rt)
        for path in archive_gc.drop_local_leftovers(rt, self.runtimes.dir(sid)):
            log.info("removed %s (an archive transfer cut short)", path, extra={"sandbox_id": sid})
        log.info(
            "sandbox.reattach.complete",
            extra={"sandbox_id": sid, "before": before.value, "phase": rt.phase.value, "note": note},
        )

    async def _reattach(self, rt: Runtime) -> str | None:
        sid = rt.sandbox_id
        if rt.phase == Phase.FAILED:
            return None
        if rt.phase == Phase.CREATING:
            self.runtimes.fail(rt, f"the worker stopped while sandbox {sid} was being created")
            return "the create was cut short"
        if rt.phase in (Phase.ARCHIVING, Phase.ARCHIVED):
            if self.tiers.archiver is None:
                if rt.phase == Phase.ARCHIVING:
                    raise errors.RuntimeFailure(
                        "an archive was cut short and no archive tier is configured now"
                    )
                return "archived; no archive tier is configured now (set ATOLL_S3_* or ATOLL_ARCHIVE_DIR as before)"
            return await self.tiers.archiver.reattach(rt)
        if rt.phase == Phase.CHECKPOINTING:
            tmp = self.snapshots.staging_path(sid, rt.generation)
            await self._wait_orphan("checkpoint", f"--image-path={tmp}")
            if self.snapshots.staged_complete(tmp):
                await self.tiers.finish_checkpoint(rt, tmp)
                return "committed a checkpoint the previous worker process had finished"
            st = await runsc.state(self.runsc_root, rt.cid)
            if st and st.get("status") in ("running", "paused"):
                self.snapshots.drop_staging(tmp)
                self.runtimes.advance(rt, Step.ABORT_CHECKPOINT)
                with contextlib.suppress(errors.AtollError):
                    self.sandboxes.limit_cpu(rt)  # lifted for the checkpoint
                return "an interrupted checkpoint left the sandbox running"
            self.runtimes.fail(
                rt,
                self.tiers.checkpoint_failure(
                    rt, "was cut short by a worker stop and runsc did not finish it"
                ),
            )
            return "runsc log: " + runsc.tail(self.runtimes.path(sid, "runsc.log"))
        if rt.phase == Phase.CHECKPOINTED:
            st = await runsc.state(self.runsc_root, rt.cid)
            if st and st.get("status") in ("running", "paused"):  # a restore of an older version
                self.runtimes.advance(rt, Step.BEGIN_RESTORE)
                return await self._finish_restore(rt)
            if self.snapshots.committed(sid) is not None:
                return None
            self.runtimes.fail(rt, f"the committed snapshot of sandbox {sid} is missing from disk")
            return None
        if rt.phase == Phase.RESTORING:
            await self._wait_orphan("restore", rt.cid)
            st = await runsc.state(self.runsc_root, rt.cid)
            if st and st.get("status") in ("running", "paused"):
                return await self._finish_restore(rt)
            with contextlib.suppress(errors.AtollError):
                await self.sandboxes.discard_container(rt.cid, rt.cgroup(self.install_id))
            if self.snapshots.committed(sid) is not None:
                self.runtimes.advance(rt, Step.RESTORE_FAILED)
                return "a restore cut short by the restart did not complete; the snapshot is kept"
            self.runtimes.fail(
                rt, f"the worker stopped while restoring sandbox {sid} and its snapshot is gone"
            )
            return None
        # running or frozen
        cg = rt.cgroup(self.install_id)
        if cgroups.freezer_state(cg) == "FREEZING":
            # stopped in the middle of a freeze: finish nothing half-way, let it run again
            with contextlib.suppress(errors.AtollError):
                cgroups.thaw(cg)
        if cgroups.freezer_state(cg) == "FROZEN" and cgroups.has_tasks(cg):
            # `runsc state` would hang asking a frozen sentry: the cgroup is the truth here.
            if rt.phase == Phase.RUNNING:
                self.runtimes.advance(rt, Step.FREEZE, durable=False)
            rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
            return None
        st = await runsc.state(self.runsc_root, rt.cid)
        if not st or st.get("status") not in ("running", "paused"):
            self.runtimes.fail(
                rt,
                f"runsc reports the sandbox as {st.get('status') if st else 'gone'} after a restart: "
                + self.liveness.death_cause(rt),
            )
            return None
        if rt.phase == Phase.FROZEN:
            self.runtimes.advance(rt, Step.THAW, durable=False)
        rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        self.runtimes.save(rt)
        with contextlib.suppress(errors.AtollError):
            self.sandboxes.limit_cpu(rt)  # idempotent; covers a restart between a start and its quota
        return None

    async def _finish_restore(self, rt: Runtime) -> str:
        """A restore the previous worker process started has completed in runsc: finish our part."""
        rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        self.runtimes.advance(rt, Step.RESTORED)
        self.liveness.watch(rt)
        await self.guest.wait_ready(rt.sandbox_id, 30, self.runtimes.path(rt.sandbox_id, "runsc.log"))
        with contextlib.suppress(errors.AtollError):
            self.sandboxes.limit_cpu(rt)
        await self.tiers.set_identity(rt)
        await self.snapshots.discard(rt.sandbox_id)
        return "a restore interrupted by the restart had completed"

    async def _wait_orphan(self, verb: str, needle: str, timeout: float = ORPHAN_WAIT_S) -> None:
        """Wait while a `runsc <verb>` started by a previous worker process is still running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and await asyncio.to_thread(_runsc_command_running, verb, needle):
            await asyncio.sleep(0.1)

    # ---- reconcile ------------------------------------------------------------------------------
    def _live(self) -> set[str]:
        return {rt.sandbox_id for rt in self.runtimes.cached() if rt.phase != Phase.DELETING}

    async def reconcile(self, *, parents: bool = False) -> ReconcileReport:
        """One pass: remove host objects no live runtime owns; fail runtimes whose objects vanished."""
        t0, c0 = time.perf_counter(), time.thread_time()
        found = sweep.scan(self.host)
        live = self._live()
        busy = {sid for sid in found.owner_ids(self.host) | live if self._busy(sid)}
        removed = await sweep.remove(
            self.host, found, lambda sid: sid not in live and sid not in busy, parents=parents
        )
        failed = []
        for rt in self.runtimes.cached():
            if rt.sandbox_id in busy:
                continue
            missing = self._vanished(rt, found)
            if missing is None and rt.phase == Phase.FROZEN and _kill_pending(rt.sentry_pid):
                # A frozen (cgroup v1) process cannot die: a SIGKILL waits for the thaw. Thaw it
                # so it ends now, not at the next resume, and say so.
                with contextlib.suppress(errors.AtollError):
                    cgroups.thaw(rt.cgroup(self.install_id))
                missing = "its gVisor sentry was killed (SIGKILL) while in memory-tier standby"
            if missing:
                failed.append(rt.sandbox_id)
                self.liveness.failed(rt.sandbox_id, self._vanished_cause(rt, missing))
            removed += self._stale_images(rt)
        report = ReconcileReport(
            runtimes=len(live),
            removed=tuple(removed),
            failed=tuple(failed),
            wall_ms=round((time.perf_counter() - t0) * 1000, 2),
            cpu_ms=round((time.thread_time() - c0) * 1000, 2),
        )
        if removed or failed:
            log.info("reconcile: removed %d object(s), failed %d sandbox(es)", len(removed), len(failed))
        return report

    def _vanished_cause(self, rt: Runtime, missing: str) -> str:
        """The failure of a runtime the pass found incomplete: a limit that killed its sentry when
        that is what is missing (the pass can see the sentry gone before the watch does), else
        what vanished."""
        cause = self.liveness.limit_cause(rt) if missing == SENTRY_GONE else None
        return cause or (
            f"the runtime of sandbox {rt.sandbox_id} vanished from its worker's host ({missing}); "
            "its files may be gone — delete it and create a new one"
        )

    def _vanished(self, rt: Runtime, found: sweep.HostObjects) -> str | None:
        """What a runtime needs on the host and does not have (None when all is there)."""
        if rt.phase in (Phase.FAILED, Phase.DELETING, Phase.CREATING, Phase.ARCHIVING, Phase.ARCHIVED):
            return None  # nothing of an archived sandbox is mounted; an archiving one is busy
        has = found.of(self.host, rt.sandbox_id)
        if not any(m.endswith("/rootfs") for m in has.get("mounts", ())):
            return "its root filesystem is not mounted"
        if rt.phase == Phase.CHECKPOINTED:
            return None if self.snapshots.committed(rt.sandbox_id) else "its snapshot is gone"
        if rt.phase in (Phase.RUNNING, Phase.FROZEN):
            if not has.get("sentry") and not self.liveness.alive(rt.sandbox_id):
                return SENTRY_GONE
            if len(has.get("netns", ())) < 2:
                return "its network namespaces are gone"
        return None

    def _stale_images(self, rt: Runtime) -> list[str]:
        """Checkpoint images a runtime no longer needs (a staging directory outside a checkpoint,
        a committed snapshot of a sandbox that runs again)."""
        out = []
        try:  # one listing per sandbox (a pass looks at every runtime)
            names = os.listdir(self.runtimes.dir(rt.sandbox_id))
        except FileNotFoundError:
            return out
        for name in names:
            stale = (name.startswith("snapshot.tmp-") and rt.phase != Phase.CHECKPOINTING) or (
                name == "snapshot" and rt.phase in (Phase.RUNNING, Phase.FROZEN)
            )
            if stale:
                path = self.runtimes.path(rt.sandbox_id, name)
                shutil.rmtree(path, ignore_errors=True)
                out.append(f"image {path}")
        for what in out:
            log.info("reconcile removed %s", what, extra={"sandbox_id": rt.sandbox_id})
        return out


def _kill_pending(pid: int | None) -> bool:
    """Whether a SIGKILL waits on `pid` (pending for the thread or the process)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (1 << 8):
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return False

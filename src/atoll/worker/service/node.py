"""One worker: `Node` implements the seam (core.worker_api.WorkerAPI) over this host's gVisor sandboxes.

It wires the worker's parts and owns what spans them: one lock per sandbox (its steps — create,
pause, resume, delete, a compaction — run one at a time, and a call waits for a step in progress),
the count of calls in flight (a sandbox with calls is not paused or compacted), the events to the
control plane, the monitor loop (host task pressure every MONITOR_EVERY_S, usage every
`usage_every_s` (ATOLL_USAGE_EVERY_S, default USAGE_EVERY_S) — cgroup counters, and the bytes of standby images and stores from
worker.runtimes.retained —, reconciliation every `reconcile_s`, template status changes) and the garbage loop
(archive removals the store owes every GC_EVERY_S; orphaned archive objects and unused template
layers at start and hourly).

    templates, layers ─▶ builder ─▶ sandboxes, tiers ─▶ guest, liveness, runtime, snapshots
    recovery (reattach, reconcile) and pressure sit beside them; node is the only caller of all.

Used in-process by `atoll up` and behind worker.httpapi by `atoll worker`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import re
import resource
import shutil
import socket
import time
import typing
from collections.abc import AsyncIterator, Sequence

from atoll._version import __version__
from atoll.core import errors, ids, netpolicy
from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase, Tier
from atoll.guest.agent import ptyframes
from atoll.shared import stream_ends
from atoll.worker.host import agent_pack, bundle, cgroups, objectstore, storage, stores, sweep, trust
from atoll.worker.host.snapshots import LocalSnapshotStore
from atoll.worker.images import layer_gc, layers, templates
from atoll.worker.images.builder import Builder
from atoll.worker.runtimes import adoption, archive_gc, budget, forks, snapstore
from atoll.worker.runtimes.archiving import Archiver
from atoll.worker.runtimes.edge import Edge
from atoll.worker.runtimes.guest import Guest
from atoll.worker.runtimes.liveness import Liveness
from atoll.worker.runtimes.pressure import Pressure
from atoll.worker.runtimes.recovery import Recovery
from atoll.worker.runtimes.retained import Retained
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore
from atoll.worker.runtimes.sandbox_metrics import figures as metric_figures
from atoll.worker.runtimes.sandboxes import Sandboxes
from atoll.worker.runtimes.tiers import Tiers
from atoll.worker.service.settings import WorkerSettings
from atoll.worker.service.store_verbs import StoreVerbs

log = logging.getLogger(__name__)

MONITOR_EVERY_S = 0.5
USAGE_EVERY_S = 5.0
# A running sandbox whose processes used more than ACTIVITY_CPU_SHARE of one CPU over the last
# ACTIVITY_WINDOW_S is busy (a build, a test run): the idle policy's pause declines it, and a
# SandboxActivity event (at most every ACTIVITY_EVENT_EVERY_S) tells the control plane. An idle dev
# server or REPL stays far below (a sleeping sandbox uses ~0.02% of a core here). Samples come from
# the sandbox cgroup's cpuacct, read in every monitor pass.
ACTIVITY_CPU_SHARE = 0.1
ACTIVITY_WINDOW_S = 2.0
ACTIVITY_EVENT_EVERY_S = 2.0
AGENT_VERSION_PREFIX = "v-"  # <agent_root>/v-<digest>: one version's agent files
REATTACH_TIMEOUT_S = 180.0
EVENT_QUEUE = 1000
END_STREAMS_WAIT_S = 3.0
"""How long `pause(end_streams=True)` waits for the calls in flight to finish once it ended the
sandbox's output follows and watches (a file transfer, say); after that the pause is busy."""
GC_EVERY_S = 60.0
"""Pending archive removals are retried this often; the full garbage pass runs hourly
(worker.images.layer_gc.LAYER_GC_EVERY_S) and at start."""


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_spec(spec: api.SandboxSpec) -> None:
    """What a worker makes must be makeable; the control plane checks the same before it asks, so
    this guards the worker protocol itself."""
    problems = []
    if not ids.is_sandbox_id(spec.sandbox_id):
        problems.append(f"malformed sandbox id {spec.sandbox_id!r}")
    if not 64 <= spec.memory_mb <= 65536:
        problems.append(f"memory_mb={spec.memory_mb} is outside 64-65536")
    if not 0.01 <= spec.cpus <= 64:
        problems.append(f"cpus={spec.cpus} is outside 0.01-64")
    if spec.disk_mb and not 64 <= spec.disk_mb <= 1024 * 1024:
        problems.append(f"disk_mb={spec.disk_mb} is outside 64-1048576")
    for k, v in spec.env.items():
        if not _ENV_NAME.fullmatch(k) or "\x00" in v:
            problems.append(f"environment variable {k!r} has an invalid name or a NUL in its value")
    if spec.user is not None and not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", spec.user):
        problems.append(f"user {spec.user!r} is not a user name")
    if problems:
        raise errors.InvalidRequest("sandbox spec refused: " + "; ".join(problems))
    netpolicy.from_wire(spec.network)  # a 400 naming the bad entry


def _share(samples: typing.Sequence[tuple[float, float]]) -> float | None:
    """CPU seconds per second between the first and the last (time, CPU seconds) sample."""
    if len(samples) < 2 or samples[-1][0] - samples[0][0] < 0.25:
        return None
    return (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])


def installation_id(home: str) -> str:
    """This installation's id, kept in `<home>/installation-id` so names survive a moved home."""
    path = os.path.join(home, "installation-id")
    try:
        with open(path) as f:
            value = f.read().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    value = ids.installation_id(os.path.realpath(home))
    storage.private_dir(home)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(value + "\n")
    return value


def _raise_nofile() -> None:
    """The egress gateway holds two descriptors per relayed connection (up to 256 per sandbox):
    this process may use as many as its hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _raise_pid_max() -> None:
    """Each gVisor sandbox holds ~40 host threads; the default pid_max of 32768 caps a host at ~800."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            cur = int(f.read())
        if cur < 4194304:
            with open("/proc/sys/kernel/pid_max", "w") as f:
                f.write("4194304")
            log.info("raised kernel.pid_max from %d to 4194304 (gVisor sandboxes use ~40 threads each)", cur)
    except OSError as e:
        log.warning("could not raise kernel.pid_max: %s", e)


class HomeInUse(errors.Conflict):
    """Another worker process holds this ATOLL_HOME."""


class EventHub:
    """Fan-out of the worker's events: each `subscribe()` gets its own bounded queue (the oldest
    event is dropped when a subscriber falls behind: events are hints, inventory is the truth).
    A new subscriber first gets `prime()`'s events (the current template statuses), so that no
    change between its last look and its subscription goes unseen."""

    def __init__(self, prime: typing.Callable[[], typing.Iterable[api.WorkerEvent]] = tuple) -> None:
        self._queues: set[asyncio.Queue] = set()
        self._prime = prime

    def emit(self, ev: api.WorkerEvent) -> None:
        for q in self._queues:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(ev)

    async def subscribe(self) -> AsyncIterator[api.WorkerEvent]:
        q: asyncio.Queue = asyncio.Queue(EVENT_QUEUE)
        for ev in self._prime():
            q.put_nowait(ev)
        self._queues.add(q)
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                yield ev
        finally:
            self._queues.discard(q)

    def close(self) -> None:
        for q in self._queues:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)


class Node(StoreVerbs):
    def __init__(self, settings: WorkerSettings):
        self.s = settings
        self.install_id = installation_id(settings.home)
        self.host = sweep.Installation(os.path.realpath(settings.home), self.install_id)
        self.agent_root = os.path.join(settings.home, "agent")
        self.agent_dir = self.agent_root  # this version's own directory under it, once built (start)
        self.sandbox_ca_pem = ""
        """ATOLL_SANDBOX_CA_FILE's certificates (only those), added to every sandbox made here."""
        if settings.sandbox_ca_file:
            with open(settings.sandbox_ca_file, encoding="ascii", errors="replace") as f:
                self.sandbox_ca_pem = trust.certificates(f.read(8 * 1024 * 1024))
        self.installation_ca = ""
        """The installation's root CA as the control plane last gave it (`set_authority`, first
        at every adoption; every create's spec carries the same in `trust_pem`). With
        `sandbox_ca_pem`, what a sandbox made now trusts: a frozen pool member that trusts
        anything else was made before one of them changed, and is not handed out."""
        self.layers = layers.LayerStore(settings.templates)
        """The one layer cache: built-in templates' root file systems and user templates' steps."""
        self.templates = templates.TemplateStore(
            settings.templates, settings.debian_mirror, self.layers, settings.code_interpreter
        )
        self.runtimes = RuntimeStore(settings.home, self.install_id)
        self.hub = EventHub(
            lambda: [
                *(api.TemplateChanged(t) for t in self.template_infos()),
                *(api.BuildChanged(b) for b in self.builder.infos()),
            ]
        )
        self.liveness = Liveness(self.runtimes, self.install_id, self.host.runsc_root, self.hub.emit)
        self.guest = Guest(self.runtimes, self.host.runsc_root, self.liveness)
        self.snapshots = LocalSnapshotStore(self.runtimes.root)
        self.tunnel_port = 0
        """Set by worker.main once its tunnel listens (worker.tunnel)."""
        self.url: str | None = None
        self.token: str | None = None
        """In `atoll up` (atoll.up.SeamListener): the URL and token of its loopback seam listener,
        which only the server's grant route uses; the server's own calls stay in-process."""
        self.edge = Edge(
            settings.hosts_files,
            settings.egress_source,
            settings.upstream_ca_file,
            log_format=settings.log_format,
            log_level=settings.log_level,
        )
        self.stores = stores.Stores(self.host.home, settings.filer_url)
        self.sandboxes = Sandboxes(
            self.runtimes, self.guest, self.liveness, self.host, self.agent_root, self.edge, self.stores
        )
        self.liveness.on_failed = lambda rt: self._spawn(self.sandboxes.stop_container(rt))
        self.store = objectstore.from_settings(settings.home, settings.archive_dir, settings.s3)
        """The archive tier's object store (S3 when ATOLL_S3_* are set, else a local directory)."""
        self.shared_store = bool(settings.s3 or settings.archive_dir)
        """Whether `store` is one other workers read too: archives publish their layers, builds
        and named snapshots are uploaded there (worker.runtimes.snapstore)."""
        self.archiver = Archiver(
            self.runtimes,
            self.store,
            os.path.join(settings.home, archive_gc.JOURNAL),
            share_layers=self.shared_store,
        )
        self.archiver.store_info = self.stores.info  # the volumes' state, pinned in each manifest
        self.retained = Retained(self.runtimes, self.stores)
        """Bytes of standby images and stores, for the usage report."""
        self._usage_told = False
        self.archive_gc = archive_gc.ArchiveCollector(self.runtimes, self.archiver, self._lock)
        self.budget = (
            budget.DiskBudget(
                int(settings.disk_budget_gb * 2**30),
                self.runtimes,
                self.snapshots,
                self.archiver,
                self._lock,
                self.hub.emit,
            )
            if settings.disk_budget_gb
            else None
        )
        self.tiers = Tiers(
            self.runtimes,
            self.guest,
            self.liveness,
            self.sandboxes,
            self.snapshots,
            self._spawn,
            archiver=self.archiver,
            home=settings.home,
        )
        self.builder = Builder(
            settings.home,
            self.layers,
            self._builtin_rootfs,
            self.runtimes,
            self.sandboxes,
            self.tiers,
            self.guest,
            self._delete_runtime,
            self._spawn,
            lambda info: self.hub.emit(api.BuildChanged(info)),
            build_network={"allow_out": list(settings.build_allow_out)},
            build_env=settings.build_env(),
            apt_sources=settings.apt_sources,
            step_timeout_s=settings.build_step_timeout_s,
            build_timeout_s=settings.build_timeout_s,
        )
        self.builder.image_cache = settings.test_image_cache
        if settings.s3 or settings.archive_dir:  # a store other workers read: builds travel through it
            self.builder.store, self.builder.holder = self.store, self.install_id
        self.pressure = Pressure(
            self.runtimes,
            self.guest,
            self.tiers,
            self.install_id,
            idle=self._idle,
            lock=self._lock,
            emit=self.hub.emit,
        )
        self.tiers.unsafe_to_save = self.pressure.relieved_recently
        self.recovery = Recovery(
            self.runtimes,
            self.host,
            self.guest,
            self.liveness,
            self.sandboxes,
            self.tiers,
            self.snapshots,
            busy=self._busy,
        )
        self._locks: dict[str, asyncio.Lock] = {}
        self._inflight: dict[str, int] = {}
        self._snapshot_users: dict[str, int] = {}
        """Creates copying from each kept snapshot right now (several at once; a delete refuses)."""
        self._stored_seen: dict[str, tuple[float, str]] = {}
        """The stored snapshots' manifests read so far: (stored_at, holder) by id (`stored_snapshots`)."""
        self._stream_ends = stream_ends.StreamEnds()
        """The output follows and watches open per sandbox, which `pause(end_streams=True)` ends."""
        self._bg: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._preparing: dict[str, str] = {}  # template -> what is being prepared
        self._template_seen: dict[str, api.TemplateInfo] = {}
        self.last_reconcile: api.ReconcileReport | None = None
        self._home_lock: int | None = None
        self._cpu: dict[str, collections.deque] = {}  # "<sandbox>-<generation>" -> (time, CPU s)
        self._activity_told: dict[str, float] = {}
        self._served_at: dict[str, float] = {}
        """When (monotonic) the last call into each sandbox ended: a call that did not come
        through the control plane (the edge's, with a grant) is activity only this worker sees."""

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    def _busy(self, sid: str) -> bool:
        lock = self._locks.get(sid)
        return bool(lock and lock.locked()) or sid in self.builder.temporary

    def _building(self, sid: str) -> bool:
        return sid in self.builder.temporary

    def _idle(self, sid: str) -> bool:
        return not self._inflight.get(sid) and not self._busy(sid)

    def _spawn(self, coro: typing.Awaitable) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ---- start and stop -------------------------------------------------------------------------
    def claim_home(self) -> None:
        """Take this home for this worker process: an exclusive lock on `<home>/worker.lock`, held
        until the process exits. A second worker on the same home would sweep the first one's
        sandboxes away as objects nobody owns, so it is refused (`HomeInUse`)."""
        if self._home_lock is not None:
            return
        storage.private_dir(self.s.home)
        path = os.path.join(self.s.home, "worker.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = os.pread(fd, 32, 0).decode().strip()
            os.close(fd)
            raise HomeInUse(
                f"another atoll worker (pid {holder or 'unknown'}) is using ATOLL_HOME={self.s.home}; "
                "every worker needs a home of its own (--home): stop that one, or give this one another"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._home_lock = fd

    async def start(self) -> None:
        """Prepare the host (private modes, nosuid/nodev mounts, the packed agent, pid_max), reattach
        every recorded runtime, reconcile the host with the records, start the monitor loop and
        the preparation of the `base` template. Sandboxes are never stopped by this."""
        self.claim_home()
        for d in (self.runtimes.root, self.host.runsc_root):
            storage.private_dir(d)
        os.makedirs(self.agent_root, exist_ok=True)  # bind-mounted into sandboxes: keeps 0755
        storage.secure_home(self.s.home)
        storage.private_dir(self.templates.dir)
        for mp in await storage.harden_mounts(self.s.home):
            log.warning("added nosuid,nodev to %s (mounted by an earlier version without them)", mp)
        # Each version's files in a directory of their own: a sandbox keeps mounting the files
        # of the agent in its memory (an old agent restarts its atoll-init from them).
        self.agent_dir = os.path.join(self.agent_root, AGENT_VERSION_PREFIX + agent_pack.digest()[:16])
        os.makedirs(self.agent_dir, mode=0o755, exist_ok=True)
        os.chmod(self.agent_dir, 0o755)
        agent_pack.build(self.agent_dir, dir_in_sandbox=bundle.AGENT_DIR_IN_SANDBOX)
        self.sandboxes.agent_dir = self.agent_dir
        if self.s.build_ca_file:  # the CA bundle of build steps (public certificates only)
            shutil.copyfile(self.s.build_ca_file, os.path.join(self.agent_dir, self.s.BUILD_CA_NAME))
            os.chmod(os.path.join(self.agent_dir, self.s.BUILD_CA_NAME), 0o644)
        for stale in ("agent.py", "agent.pyz"):  # what much earlier versions ran
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.agent_root, stale))
        _raise_pid_max()
        _raise_nofile()
        await self.stores.thaw_all()  # a worker killed during a clone left its source frozen
        for what in await self.stores.mount_all():
            log.info("mounted %s", what)
        await self.edge.start()  # the egress gateway's process: sandboxes are attached to it below
        doomed = []
        for rt in self.runtimes.all():
            if rt.temporary or rt.phase == Phase.DELETING:
                doomed.append(rt.sandbox_id)
                continue
            async with self._lock(rt.sandbox_id):
                try:
                    await asyncio.wait_for(self.recovery.reattach(rt), REATTACH_TIMEOUT_S)
                except TimeoutError:
                    self.runtimes.fail(
                        rt,
                        f"reattaching to sandbox {rt.sandbox_id} took longer than {REATTACH_TIMEOUT_S:.0f}s",
                    )
        for sid in doomed:  # deletes a previous process did not finish, template-image leftovers
            await self._delete_runtime(sid)
        for rt in self.runtimes.cached():  # the sockets the previous worker held died with it
            if rt.phase not in (Phase.FAILED, Phase.DELETING) and not rt.temporary:
                try:
                    await self.edge.attach(rt)
                except OSError as e:
                    log.warning(
                        "egress gateway not attached after restart: %s",
                        e,
                        extra={"sandbox_id": rt.sandbox_id},
                    )
        self._sweep_agent_dirs()
        self._sweep_snapshot_debris()
        self.last_reconcile = await self.recovery.reconcile(parents=True)
        self._loops.append(asyncio.ensure_future(self._monitor()))
        self._loops.append(asyncio.ensure_future(self._prepare_templates()))
        self.builder.publish_pending()  # builds made before the store was shared, or cut short
        self._loops.append(asyncio.ensure_future(self._collect_garbage()))
        if self.budget is not None:
            self._loops.append(asyncio.ensure_future(self._keep_budget()))

    def _sweep_agent_dirs(self) -> None:
        """Remove the agent files of versions no recorded runtime runs any more (after the
        reattach: the records left are the sandboxes this worker keeps) and no kept memory
        snapshot names (a sandbox made from it runs its parent's agent)."""
        used = {self.sandboxes.agent_dir_of(rt) for rt in self.runtimes.all()}
        used |= {
            k.settings["agent_dir"]
            for k in self._kept_snapshots()
            if k.memory and k.settings.get("agent_dir")
        }
        for name in os.listdir(self.agent_root):
            path = os.path.join(self.agent_root, name)
            if name.startswith(AGENT_VERSION_PREFIX) and path != self.agent_dir and path not in used:
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed the agent files of an earlier version: %s", path)
        if self.agent_root not in used:  # files of versions before the per-version directories
            legacy = (agent_pack.COMPILED, agent_pack.SOURCE, agent_pack.INIT, agent_pack.INIT + ".key")
            for name in (*legacy, self.s.BUILD_CA_NAME):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.agent_root, name))

    async def _prepare_templates(self) -> None:
        await self._prepare_template("base")
        if templates.CODE_INTERPRETER_NAME in self.templates.recipes:
            # its layer only, after base's (a create boots it cold; a snapshot of a booted kernel
            # would be taken by the E2B edge's first call, not here)
            name = templates.CODE_INTERPRETER_NAME
            self._preparing[name] = "building the template layer"
            self._emit_templates()
            try:
                await self.templates.ensure(name)
            except errors.AtollError as e:
                log.warning("template %s could not be prepared: %s", name, e.message)
            finally:
                self._preparing.pop(name, None)
                self._emit_templates()

    async def _prepare_template(self, name: str) -> None:
        self._preparing[name] = "building the template layer"
        try:
            await self.templates.ensure(name)
            if self.s.template_snapshots:
                self._preparing[name] = "making the template image"
                self._emit_templates()
            await self.builder.prepare_builtin(name, self.s.default_memory_mb, self.s.template_snapshots)
        except errors.AtollError as e:
            log.warning("template %s could not be prepared: %s", name, e.message)
        finally:
            self._preparing.pop(name, None)
            self._emit_templates()

    async def aclose(self) -> None:
        """Stop talking to sandboxes (they keep running). Waits briefly for background clean-ups;
        builds and snapshots still being made are abandoned (their sandboxes are deleted)."""
        for t in self._loops:
            t.cancel()
        await self.builder.aclose()
        for t in self._loops:
            with contextlib.suppress(BaseException):
                await t
        self.retained.aclose()
        await self.pressure.aclose()
        await self.guest.aclose()
        await self.edge.aclose()
        self.liveness.close()
        self.hub.close()
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=10)
        cgroups.remove_empty_parents(self.install_id)  # where no sandbox is left

    async def _keep_budget(self) -> None:
        """ATOLL_DISK_BUDGET_GB: a pass every BUDGET_EVERY_S (worker.runtimes.budget)."""
        assert self.budget is not None
        while True:
            await asyncio.sleep(budget.BUDGET_EVERY_S)
            try:
                await self.budget.enforce()
            except Exception:
                log.exception("disk budget pass failed")

    # ---- garbage --------------------------------------------------------------------------------
    async def _collect_garbage(self) -> None:
        """A pass now (start) and every GC_EVERY_S; the full one every LAYER_GC_EVERY_S."""
        last_full: float | None = None
        while True:
            now = time.monotonic()
            full = last_full is None or now - last_full >= layer_gc.LAYER_GC_EVERY_S
            try:
                await self.collect_garbage(full=full)
            except Exception:
                log.exception("garbage collection pass failed")
            if full:
                last_full = now
            await asyncio.sleep(GC_EVERY_S)

    async def collect_garbage(self, *, full: bool = True) -> None:
        """Retry the archive removals the store refused (worker.runtimes.archive_gc); with `full`,
        also remove archive objects uploads cut short and layers nothing uses any more
        (worker.images.layer_gc)."""
        owed = await self.archive_gc.retry()
        if owed:
            log.info("%d archive removal(s) still wait for the object store %s", owed, self.store.name)
        if not full:
            return
        gone = await self.archive_gc.sweep()
        if gone:
            log.info("archive garbage collection removed %d object(s): %s", len(gone), ", ".join(gone))
        await self.collect_layers()

    async def collect_layers(self) -> list[layer_gc.Removed]:
        """One pass of the layer cache's garbage collection (never while a template build runs:
        its stack so far is in no record yet)."""
        if self.builder.building():
            return []
        referenced = self.builder.layer_paths() | self.snapshot_lowers()
        for rt in self.runtimes.all():
            referenced.update(p for p in rt.lower.split(":") if p)
        removed = await layer_gc.collect(
            self.layers,
            referenced,
            {self.templates.key(r) for r in templates.RECIPES.values()},
            ttl_s=self.s.layer_cache_ttl_s,
            cap_bytes=int((self.s.layer_cache_gb or 0) * 2**30),
        )
        if removed:
            log.info(
                "layer cache: removed %d layer(s), %d bytes",
                len(removed),
                sum(r.size_bytes for r in removed),
            )
        return removed

    # ---- monitor --------------------------------------------------------------------------------
    async def _monitor(self) -> None:
        last_usage = last_reconcile = time.monotonic()
        while True:
            await asyncio.sleep(MONITOR_EVERY_S)
            try:
                for rt in self.runtimes.cached():
                    # busy or not: a relief must not wait for a step that holds the sandbox's lock
                    # (a compaction's gate once waited 10 s on an agent starved by a fork bomb)
                    if rt.phase == Phase.RUNNING and not rt.temporary and not self._building(rt.sandbox_id):
                        self.pressure.check(rt.sandbox_id)
                self._emit_templates()
                now = time.monotonic()
                self._sample_cpu(now)
                if now - last_usage >= self.s.usage_every_s:
                    last_usage = now
                    await self._emit_usage()
                if now - last_reconcile >= self.s.reconcile_s:
                    last_reconcile = now
                    self.last_reconcile = await self.recovery.reconcile()
            except Exception:
                log.exception("worker monitor pass failed")

    def _sample_cpu(self, now: float) -> None:
        """Record each running sandbox's CPU time; tell the control plane about busy ones."""
        samples: dict[str, collections.deque] = {}
        for rt in self.runtimes.cached():
            if rt.phase != Phase.RUNNING or rt.temporary:
                continue
            cpu = cgroups.cpu_seconds(rt.cgroup(self.install_id))
            if cpu is None:
                continue
            key = f"{rt.sandbox_id}-{rt.generation}"  # a restore starts a new cgroup at 0
            dq = self._cpu.get(key) or collections.deque(maxlen=int(ACTIVITY_WINDOW_S / MONITOR_EVERY_S) + 1)
            dq.append((now, cpu))
            samples[key] = dq
            share = _share(dq)
            told = self._activity_told.get(rt.sandbox_id, 0.0)
            if now - told < ACTIVITY_EVENT_EVERY_S:
                continue
            if share is not None and share > ACTIVITY_CPU_SHARE:
                self._activity_told[rt.sandbox_id] = now
                self.hub.emit(api.SandboxActivity(rt.sandbox_id, f"its processes use {share:.0%} of a CPU"))
            elif now - self.edge.last_io(rt.sandbox_id) < ACTIVITY_WINDOW_S:
                self._activity_told[rt.sandbox_id] = now
                self.hub.emit(api.SandboxActivity(rt.sandbox_id, "its network connections carry traffic"))
            elif (
                self._inflight.get(rt.sandbox_id)
                or now - self._served_at.get(rt.sandbox_id, -1e9) < ACTIVITY_WINDOW_S
            ):
                # calls through the edge (a grant) never pass the control plane's own accounting
                self._activity_told[rt.sandbox_id] = now
                self.hub.emit(
                    api.SandboxActivity(rt.sandbox_id, "a call into it is in progress or just ended")
                )
            elif self.edge.busy(rt.sandbox_id):
                self._activity_told[rt.sandbox_id] = now
                self.hub.emit(api.SandboxActivity(rt.sandbox_id, "a request of its is waiting for an answer"))
        self._cpu = samples

    def cpu_share(self, sid: str) -> float | None:
        """The share of one CPU the sandbox's processes used over about the last ACTIVITY_WINDOW_S
        (a fresh reading against the oldest sample); None without a sample yet."""
        rt = self.runtimes.find(sid)
        if rt is None:
            return None
        dq = self._cpu.get(f"{sid}-{rt.generation}")
        cpu = cgroups.cpu_seconds(rt.cgroup(self.install_id))
        if not dq or cpu is None:
            return None
        return _share([dq[0], (time.monotonic(), cpu)])

    async def _emit_usage(self) -> None:
        items = []
        for rt in self.runtimes.cached():
            if rt.phase == Phase.RUNNING and not rt.temporary:
                u = cgroups.usage(rt.cgroup(self.install_id))
                if u is not None:
                    n = self.edge.stats(rt.sandbox_id)
                    items.append(
                        api.Usage(
                            rt.sandbox_id,
                            round(u[0], 3),
                            u[1],
                            u[2],
                            n.allowed,
                            n.refused,
                            n.dns_refused,
                            generation=rt.generation,
                            egress_bytes=n.bytes_out,
                            ingress_bytes=n.bytes_in,
                        )
                    )
        snapshots = await self.retained.snapshots(self.runtimes.cached())
        used = await self.retained.stores_now()
        if items or snapshots or used or self._usage_told:  # an emptied report is told once
            self.hub.emit(api.UsageReport(tuple(items), snapshots, used))
        self._usage_told = bool(items or snapshots or used)

    def _emit_templates(self) -> None:
        for t in self.template_infos():
            if self._template_seen.get(t.name) != t:
                self._template_seen[t.name] = t
                self.hub.emit(api.TemplateChanged(t))

    def template_infos(self) -> tuple[api.TemplateInfo, ...]:
        out = []
        for t in self.templates.status():
            status, progress = t["status"], t["progress"]
            if t["name"] in self._preparing and status == "ready":
                status, progress = "building", self._preparing[t["name"]]
            out.append(
                api.TemplateInfo(
                    name=t["name"],
                    status=status,
                    hash=t["hash"],
                    progress=progress or "",
                    error=t["error"],
                    description=t["description"],
                    packages=tuple(t["packages"]),
                    built_at=t["built_at"],
                    size_bytes=t["size_bytes"],
                )
            )
        return tuple(out)

    # ---- the seam: lifecycle --------------------------------------------------------------------
    async def info(self) -> api.WorkerInfo:
        disk = shutil.disk_usage(self.s.home)
        return api.WorkerInfo(
            name=self.s.name,
            version=__version__,
            protocol=api.PROTOCOL_VERSION,
            installation=self.install_id,
            capacity=api.Capacity(
                memory_mb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20,
                cpus=float(os.cpu_count() or 1),
                disk_mb=disk.total // 2**20,
                slots=self.s.slots,
            ),
            templates=self.template_infos(),
            builds=self.builder.infos(),
            default_disk_mb=self.s.default_disk_mb,
            tunnel_port=self.tunnel_port,
            shared_store=self.shared_store,
        )

    async def _builtin_rootfs(self, name: str) -> tuple[str, str]:
        """A built-in template's layer, the bottom of its build and of user templates FROM it:
        (content key, path)."""
        return self.templates.key(self.templates.recipe(name)), await self.templates.ensure(name)

    async def create(self, spec: api.SandboxSpec) -> api.CreateOutcome:
        sid = spec.sandbox_id
        _check_spec(spec)
        if spec.snapshot_id:
            return await self._create_from_snapshot(spec)
        if spec.build_id:
            build = await self.builder.ensure(spec.build_id)  # fetched from the store if not here
        else:
            self.templates.recipe(spec.template)  # 404 template_not_found before any work
            build = await self.builder.builtin(spec.template, self.s.default_memory_mb)
        t0 = time.perf_counter()
        async with self._lock(sid):
            if self.runtimes.find(sid) is not None:
                raise errors.Conflict(f"sandbox {sid} already exists on this worker", code="invalid_state")
            lower = build.lower
            for m in spec.mounts:  # 404 before any work
                if (
                    m.kind == "drive"
                    and m.size_mb
                    and self.stores.filer
                    and not self.stores.exists(m.kind, m.name)
                ):
                    # a filer-backed drive made on another worker: mounted here too
                    with contextlib.suppress(errors.Conflict):
                        await self.stores.create(m.kind, m.name, m.size_mb, attach=True)
                self.stores.fs(m.kind, m.name)
            # a template image restores with the mount layout it was saved with: with volumes or
            # drives the sandbox boots cold (measured, docs/benchmarks.md "Volumes")
            use_image = self.s.template_snapshots and not spec.mounts
            found = self.builder.image(build, spec.memory_mb) if use_image else None
            env = {**build.env, **spec.env}
            trust_pem = trust.combine(spec.trust_pem, self.sandbox_ca_pem)
            if trust_pem:
                for k, v in trust.ENV.items():
                    env.setdefault(k, v)
            rt = self.runtimes.new(
                sid,
                template=spec.template,
                memory_mb=spec.memory_mb,
                cpus=spec.cpus,
                env=env,
                disk_mb=spec.disk_mb or self.s.default_disk_mb,
                user=spec.user,
                network=netpolicy.from_wire(spec.network).to_wire(),
                trust_pem=trust_pem,
                build_id=spec.build_id,
                lower=lower,
                workdir=build.workdir,
                runtime_key=found.runtime_key if found else "",
                mounts=[
                    {"kind": m.kind, "name": m.name, "path": m.path, "read_only": m.read_only}
                    for m in spec.mounts
                ],
            )
            if not spec.user:
                rt.user = build.user
            self.edge.set_secrets(sid, spec.secrets)
            try:
                how = await self.sandboxes.start(
                    rt, lower, found.dir if found else None, found.seed_upper if found else None
                )
                if how == "cold boot":
                    await self.builder.prepare_boot(sid, build)
                if build.start and (how == "cold boot" or (found and found.start_mode == "after_restore")):
                    await self.builder.start_command(sid, build)  # its snapshot does not hold it running
            except BaseException:
                self.edge.set_secrets(sid, ())
                raise
        return api.CreateOutcome(how, round((time.perf_counter() - t0) * 1000, 1))

    # ---- the seam: user templates ---------------------------------------------------------------
    async def build_template(self, build: api.TemplateBuild) -> api.BuildInfo:
        return await self.builder.start(build)

    def build_log(self, build_id: str) -> typing.AsyncContextManager[AsyncIterator[bytes]]:
        return self.builder.log_stream(build_id)

    async def delete_build(self, build_id: str) -> None:
        for rt in self.runtimes.cached():
            if rt.build_id == build_id and rt.phase != Phase.DELETING:
                raise errors.Conflict(
                    f"build {build_id} is in use by sandbox {rt.sandbox_id} on this worker",
                    code="template_in_use",
                )
        await self.builder.delete(build_id)

    # ---- the seam: pools and fork ---------------------------------------------------------------
    async def claim(self, sandbox_id: str, env: dict[str, str], cpus: float) -> api.ResumeOutcome:
        bad = [k for k, v in env.items() if not _ENV_NAME.fullmatch(k) or "\x00" in v]
        if bad or not 0.01 <= cpus <= 64:
            raise errors.InvalidRequest(f"claim refused: bad environment names {bad[:5]} or cpus={cpus}")
        async with self._lock(sandbox_id):
            rt = self.runtimes.get(sandbox_id)
            if rt.phase == Phase.FAILED:
                raise errors.SandboxDied(rt.failure or f"sandbox {sandbox_id} has failed")
            why = self._outdated(rt, self._made_now())
            if why:
                raise errors.Conflict(
                    f"pooled sandbox {sandbox_id} was made {why}; it is not handed out (the pool "
                    "replaces it)",
                    code="invalid_state",
                )
            outcome = await self.tiers.resume(rt)
            rt.env = {**rt.env, **env}
            rt.cpus = cpus
            self.runtimes.save(rt, durable=False)
            await self.guest.identify(
                sandbox_id, rt.generation, hostname=None, env=env, cpus=cpus, workdir=rt.workdir
            )
            self.sandboxes.limit_cpu(rt)
            return outcome

    def _copyable(self, sandbox_id: str, parent: Runtime, verb: str, why_not_mounts: str) -> None:
        """Before a fork or a snapshot (`verb`), under the sandbox's lock: refused while it mounts
        volumes or drives (`why_not_mounts` says why) or has calls in progress."""
        if parent.mounts:
            raise errors.Conflict(
                f"sandbox {sandbox_id} mounts volumes or drives ("
                + ", ".join(f"{m['kind']} {m['name']}" for m in parent.mounts)
                + "): "
                + why_not_mounts,
                code="invalid_state",
            )
        if self._inflight.get(sandbox_id):
            raise errors.SandboxBusy(
                f"sandbox {sandbox_id} has {self._inflight[sandbox_id]} call(s) in progress; {verb} it "
                "when they have finished"
            )

    async def fork(self, sandbox_id: str, new_ids: Sequence[str]) -> api.ForkOutcome:
        async with self._lock(sandbox_id):
            parent = self.runtimes.get(sandbox_id)
            if parent.phase == Phase.FAILED:
                raise errors.SandboxDied(parent.failure or f"sandbox {sandbox_id} has failed")
            self._copyable(
                sandbox_id,
                parent,
                "fork",
                "it cannot be forked (a volume has one holder); clone the volume and create a sandbox "
                "with the copy instead",
            )
            lower = parent.lower or await self.templates.ensure(parent.template)
            try:
                return await forks.fork(
                    parent,
                    new_ids,
                    runtimes=self.runtimes,
                    sandboxes=self.sandboxes,
                    tiers=self.tiers,
                    guest=self.guest,
                    lower=lower,
                    locks=self._lock,
                )
            except BaseException:
                for nid in new_ids:  # no half fork: the copies that started go again
                    if self.runtimes.find(nid) is not None and ids.is_sandbox_id(nid):
                        self._spawn(self._delete_runtime(nid))
                raise

    # ---- the seam: named snapshots (worker.runtimes.forks) -------------------------------------
    def _snapshot_dir(self, snapshot_id: str) -> str:
        if not ids.is_snapshot_id(snapshot_id):
            raise errors.InvalidRequest(f"malformed snapshot id {snapshot_id!r} (snp- and 16 hex digits)")
        return os.path.join(self.s.home, "snapshots", snapshot_id)

    def _kept(self, snapshot_id: str) -> forks.Kept:
        kept = forks.Kept.load(self._snapshot_dir(snapshot_id))
        if kept is None:
            raise errors.NotFound(
                f"snapshot {snapshot_id} is not on worker {self.s.name}", code="snapshot_not_found"
            )
        return kept

    def _kept_snapshots(self) -> list[forks.Kept]:
        root = os.path.join(self.s.home, "snapshots")
        kept = (
            forks.Kept.load(os.path.join(root, n)) for n in (os.listdir(root) if os.path.isdir(root) else ())
        )
        return [k for k in kept if k is not None]

    def snapshot_lowers(self) -> set[str]:
        """The layers the kept snapshots stack (the layer cache's garbage collection keeps them)."""
        return {p for k in self._kept_snapshots() for p in k.settings.get("lower", "").split(":") if p}

    def _sweep_snapshot_debris(self) -> None:
        """At start: what a worker stopped mid-way left under `snapshots/` — a snapshot whose
        `kept.json` was never written (its `snapshot` call did not answer) and a create's image
        links (`copy-<id>`)."""
        root = os.path.join(self.s.home, "snapshots")
        for name in os.listdir(root) if os.path.isdir(root) else ():
            path = os.path.join(root, name)
            if forks.Kept.load(path) is None:
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed an unfinished snapshot: %s", path)
                continue
            for sub in os.listdir(path):
                if sub.startswith("copy-"):
                    shutil.rmtree(os.path.join(path, sub), ignore_errors=True)

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, memory: bool = True, end_streams: bool = False
    ) -> api.SnapshotOutcome:
        dest = self._snapshot_dir(snapshot_id)
        async with self._lock(sandbox_id):
            parent = self.runtimes.get(sandbox_id)
            if parent.phase == Phase.FAILED:
                raise errors.SandboxDied(parent.failure or f"sandbox {sandbox_id} has failed")
            if end_streams and self._inflight.get(sandbox_id):
                await self._end_streams(sandbox_id)  # no new call starts meanwhile: it waits for this lock
            self._copyable(
                sandbox_id,
                parent,
                "snapshot",
                "it cannot be snapshotted (their contents are not part of the sandbox); "
                "snapshot a sandbox without them",
            )
            if os.path.exists(dest):
                raise errors.Conflict(f"snapshot {snapshot_id} exists on this worker", code="snapshot_exists")
            os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
            lower = parent.lower or await self.templates.ensure(parent.template)
            return await forks.snapshot(
                parent,
                snapshot_id,
                dest,
                memory=memory,
                runtimes=self.runtimes,
                sandboxes=self.sandboxes,
                tiers=self.tiers,
                guest=self.guest,
                lower=lower,
            )

    async def delete_snapshot(self, snapshot_id: str) -> None:
        dest = self._snapshot_dir(snapshot_id)
        async with self._lock(snapshot_id):  # no create starts copying from it meanwhile
            if self._snapshot_users.get(snapshot_id):
                raise errors.Conflict(
                    f"snapshot {snapshot_id} is being copied into {self._snapshot_users[snapshot_id]} new "
                    "sandbox(es) right now; delete it when they have started",
                    code="invalid_state",
                )
            if os.path.isdir(dest):
                # made unreadable first, so that a half-removed snapshot is never taken for one
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dest, forks.KEPT_META))
                await asyncio.to_thread(shutil.rmtree, dest, True)
            if self.shared_store:
                try:
                    n = await snapstore.remove(self.store, snapshot_id)
                except objectstore.StoreError as e:
                    raise errors.Unavailable(
                        f"the object store failed while deleting snapshot {snapshot_id}'s stored copy; "
                        "delete it again",
                        detail=str(e),
                    ) from None
                if n:
                    log.info("snapshot %s removed from %s (%d objects)", snapshot_id, self.store.name, n)

    async def store_snapshot(self, snapshot_id: str) -> api.StoredSnapshot:
        """Upload a kept snapshot to the shared store (worker.runtimes.snapstore). Not under the
        snapshot's lock: creates from it go on meanwhile; a delete meanwhile removes the kept
        directory, and what the upload then put in the store is removed here."""
        dest = self._snapshot_dir(snapshot_id)
        if not self.shared_store:
            raise errors.Conflict(
                f"worker {self.s.name} has no object store other workers read (ATOLL_S3_* or "
                "ATOLL_ARCHIVE_DIR): its snapshots stay on it",
                code="snapshot_unavailable",
            )
        kept = self._kept(snapshot_id)
        t0 = time.perf_counter()
        work = os.path.join(os.path.dirname(dest), f".upload-{snapshot_id}-{os.getpid()}-{int(t0 * 1000)}")
        try:
            man = await snapstore.upload(self.store, snapshot_id, kept, holder=self.install_id, work=work)
        except objectstore.StoreError as e:
            raise errors.Unavailable(
                f"the object store failed while storing snapshot {snapshot_id}", detail=str(e)
            ) from None
        except OSError as e:  # deleted while it was packed
            if forks.Kept.load(dest) is not None:
                raise
            raise errors.NotFound(
                f"snapshot {snapshot_id} was deleted while it was uploaded", code="snapshot_not_found"
            ) from e
        if forks.Kept.load(dest) is None:  # deleted meanwhile: nothing of it stays in the store
            with contextlib.suppress(objectstore.StoreError):
                await snapstore.remove(self.store, snapshot_id)
            raise errors.NotFound(
                f"snapshot {snapshot_id} was deleted while it was uploaded", code="snapshot_not_found"
            )
        took = round((time.perf_counter() - t0) * 1000, 1)
        log.info(
            "snapshot %s stored in %s: %d bytes (%d before compression) in %.0f ms",
            snapshot_id,
            self.store.name,
            man.size,
            man.raw_bytes,
            took,
        )
        return api.StoredSnapshot(snapshot_id, man.size, took)

    async def stored_snapshots(self) -> list[api.KeptSnapshot]:
        if not self.shared_store:
            return []
        root = os.path.join(self.s.home, "snapshots")
        os.makedirs(root, mode=0o700, exist_ok=True)
        try:
            found = await snapstore.stored(self.store, root, self._stored_seen)
            return [api.KeptSnapshot(i, at, holder) for i, at, holder in found]
        except objectstore.StoreError as e:
            raise errors.Unavailable(f"the object store failed while listing snapshots: {e}") from None

    async def _fetch_snapshot(self, snapshot_id: str) -> forks.Kept:
        """A snapshot this worker does not keep, from the shared store (under its lock)."""
        if not self.shared_store:
            return self._kept(snapshot_id)  # 404 snapshot_not_found: only its worker has it
        try:
            return await snapstore.fetch(
                self.store,
                snapshot_id,
                self._snapshot_dir(snapshot_id),
                layers=self.layers,
                runtime_key=self.sandboxes.runtime_key(),
                agent_dir=self.sandboxes.agent_dir,
            )
        except objectstore.StoreError as e:
            raise errors.Unavailable(
                f"the object store failed while fetching snapshot {snapshot_id}; try again", detail=str(e)
            ) from None

    async def _create_from_snapshot(self, spec: api.SandboxSpec) -> api.CreateOutcome:
        """A create from a named snapshot: a copy of it, as a fork's (worker.runtimes.forks).
        Several creates copy from one snapshot at once."""
        if spec.mounts:
            raise errors.InvalidRequest(
                "a sandbox made from a snapshot mounts no volumes or drives (the snapshot was saved without them)"
            )
        t0 = time.perf_counter()
        async with self._lock(spec.snapshot_id):  # a delete waits for this, and refuses while it is used
            kept = forks.Kept.load(self._snapshot_dir(spec.snapshot_id))
            if kept is None:  # kept on another worker: downloaded from the shared store, once
                kept = await self._fetch_snapshot(spec.snapshot_id)
            self._snapshot_users[spec.snapshot_id] = self._snapshot_users.get(spec.snapshot_id, 0) + 1
        try:
            return await self._copy_snapshot(spec, kept, t0)
        finally:
            left = self._snapshot_users.pop(spec.snapshot_id, 1) - 1
            if left:
                self._snapshot_users[spec.snapshot_id] = left

    async def _copy_snapshot(self, spec: api.SandboxSpec, kept: forks.Kept, t0: float) -> api.CreateOutcome:
        """A create from the kept snapshot `kept` (its users counted: `_create_from_snapshot`)."""
        sid = spec.sandbox_id
        st = kept.settings
        if kept.memory and spec.memory_mb != st["memory_mb"]:
            raise errors.InvalidRequest(
                f"snapshot {spec.snapshot_id} holds the memory of a {st['memory_mb']} MB sandbox: a "
                f"sandbox made from it has memory_mb={st['memory_mb']} (asked {spec.memory_mb}); a "
                "files-only snapshot (memory: false) takes any size"
            )
        build = None
        if kept.memory:
            missing = [p for p in st["lower"].split(":") if p and not os.path.isdir(p)]
            if missing or (st["agent_dir"] and not os.path.isdir(st["agent_dir"])):
                raise errors.Conflict(
                    f"snapshot {spec.snapshot_id} cannot be restored on this worker any more: the "
                    "template layers or guest agent it was made with are gone",
                    code="snapshot_unavailable",
                )
        else:
            if st["build_id"]:
                build = await self.builder.ensure(st["build_id"])
            else:
                build = await self.builder.builtin(st["template"], self.s.default_memory_mb)
        async with self._lock(sid):
            if self.runtimes.find(sid) is not None:
                raise errors.Conflict(f"sandbox {sid} already exists on this worker", code="invalid_state")
            overrides: dict[str, typing.Any] = {
                "memory_mb": spec.memory_mb,
                "cpus": spec.cpus,
                "env": {**st["env"], **spec.env},
                "disk_mb": max(spec.disk_mb, st["disk_mb"]),
                "network": netpolicy.from_wire(spec.network).to_wire(),
            }
            if build is not None and not all(os.path.isdir(p) for p in st["lower"].split(":") if p):
                overrides["lower"] = build.lower  # its template's layer was rebuilt since
            rt = forks.new_copy(self.runtimes, sid, kept, **overrides)
            self.edge.set_secrets(sid, spec.secrets)
            try:
                how = await forks.boot_copy(rt, kept, sandboxes=self.sandboxes)
                if how == "cold boot" and build is not None:
                    await self.builder.prepare_boot(sid, build)
                    if build.start:
                        await self.builder.start_command(sid, build)
            except BaseException:
                self.edge.set_secrets(sid, ())
                raise
        how = "snapshot" if how == "template image" else "snapshot files, cold boot"
        return api.CreateOutcome(how, round((time.perf_counter() - t0) * 1000, 1))

    async def pause(
        self, sandbox_id: str, tier: Tier, *, only_if_idle: bool = False, end_streams: bool = False
    ) -> api.PauseOutcome:
        async with self._lock(sandbox_id):
            rt = self.runtimes.get(sandbox_id)
            if rt.phase == Phase.FAILED:
                raise errors.SandboxDied(rt.failure or f"sandbox {sandbox_id} has failed")
            if end_streams and self._inflight.get(sandbox_id):
                # no new call starts meanwhile: _serving waits for this lock
                await self._end_streams(sandbox_id)
            if self._inflight.get(sandbox_id):
                return api.PauseOutcome(
                    None,
                    f"sandbox {sandbox_id} has {self._inflight[sandbox_id]} call(s) in progress",
                    busy=True,
                )
            if only_if_idle and rt.phase == Phase.RUNNING:
                share = self.cpu_share(sandbox_id)
                if share is not None and share > ACTIVITY_CPU_SHARE:
                    return api.PauseOutcome(None, f"its processes use {share:.0%} of a CPU (activity)")
            return await self.tiers.pause(rt, tier, only_if_idle=only_if_idle)

    async def _end_streams(self, sandbox_id: str) -> None:
        """End the sandbox's output follows and watches and wait (up to END_STREAMS_WAIT_S) for
        the calls in flight to finish; what is still in flight then makes the pause busy."""
        self._stream_ends.end(sandbox_id)
        deadline = time.monotonic() + END_STREAMS_WAIT_S
        while self._inflight.get(sandbox_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            self._stream_ends.end(sandbox_id)  # one that opened while we waited (it was queued)

    async def resume(self, sandbox_id: str, keep_archive: bool = False) -> api.ResumeOutcome:
        async with self._lock(sandbox_id):
            rt = self.runtimes.get(sandbox_id)
            if rt.phase == Phase.FAILED:
                raise errors.SandboxDied(rt.failure or f"sandbox {sandbox_id} has failed")
            return await self.tiers.resume(rt, keep_archive)

    async def adopt(self, sandbox_id: str, mounts: typing.Sequence[api.MountSpec]) -> api.AdoptOutcome:
        """Take over a sandbox another worker archived into the shared store (worker.runtimes.adoption)."""
        if not ids.is_sandbox_id(sandbox_id):
            raise errors.InvalidRequest(f"malformed sandbox id {sandbox_id!r}")

        async def undo(sid: str) -> None:
            await self.sandboxes.delete(sid)
            self.edge.forget(sid)

        async with self._lock(sandbox_id):
            if self.runtimes.find(sandbox_id) is not None:
                raise errors.Conflict(
                    f"sandbox {sandbox_id} already exists on this worker", code="invalid_state"
                )
            man = await adoption.read_manifest(self.store, sandbox_id, self.runtimes.root)
            adoption.check(man, self.sandboxes.runtime_key(), mounts, self.stores.filer is not None)
            for m in mounts:
                if m.kind == "drive" and m.size_mb and not self.stores.exists(m.kind, m.name):
                    with contextlib.suppress(errors.Conflict):
                        await self.stores.create(m.kind, m.name, m.size_mb, attach=True)
                self.stores.fs(m.kind, m.name)
            return await adoption.adopt(
                sandbox_id,
                man,
                store=self.store,
                layers=self.layers,
                runtimes=self.runtimes,
                agent_dir=self.sandboxes.agent_dir,
                attach=self.edge.attach,
                undo=undo,
            )

    async def set_network(self, sandbox_id: str, network: dict) -> dict:
        """Replace a sandbox's egress policy; applies to new connections and DNS questions at once,
        in any phase (the gateway sits outside the sandbox). Returns it as stored."""
        policy = netpolicy.from_wire(network)
        async with self._lock(sandbox_id):
            rt = self.runtimes.get(sandbox_id)
            if rt.phase in (Phase.FAILED, Phase.DELETING):
                raise errors.Conflict(
                    f"sandbox {sandbox_id} is {rt.phase.value}; its network cannot change",
                    code="invalid_state",
                )
            rt.network = policy.to_wire()
            self.runtimes.save(rt)
            self.edge.set_policy(rt, policy)
        return rt.network

    async def set_secrets(self, sandbox_id: str, secrets: typing.Sequence[api.SecretBinding]) -> None:
        """Replace the sandbox's secret bindings (kept in memory only: the control plane gives
        them again when it adopts this worker)."""
        rt = self.runtimes.get(sandbox_id)
        if rt.phase in (Phase.FAILED, Phase.DELETING):
            raise errors.Conflict(f"sandbox {sandbox_id} is {rt.phase.value}", code="invalid_state")
        self.edge.set_secrets(sandbox_id, tuple(secrets))

    async def set_authority(self, authority: api.Authority) -> None:
        self.installation_ca = authority.root_pem
        self.edge.set_authority(authority)

    async def open_port(self, sandbox_id: str, port: int) -> api.PortStream:
        """A connection into the sandbox's port, from its host-side namespace. The sandbox must be
        running (the control plane resumes it first)."""
        rt = self._port_runtime(sandbox_id, port)
        return await self.edge.open_port(rt, port)

    def _port_runtime(self, sandbox_id: str, port: int):
        if not 1 <= port <= 65535:
            raise errors.InvalidRequest(f"port {port} is not a TCP port (1-65535)")
        if port == bundle.AGENT_PORT:  # the agent runs commands for the worker: never opened for others
            raise errors.PermissionDenied(f"port {port} is the guest agent's; it is not opened to previews")
        rt = self.runtimes.get(sandbox_id)
        if rt.phase != Phase.RUNNING:
            raise errors.Conflict(
                f"sandbox {sandbox_id} is {rt.phase.value}, not running; resume it first",
                code="invalid_state",
            )
        return rt

    async def relay_port(self, sandbox_id: str, port: int, client: socket.socket, greeting: bytes) -> None:
        """The port tunnel's connection `client` (already authenticated) relayed into the
        sandbox's port by the gateway process, `greeting` first; the same checks as open_port.
        Raises what open_port raises; the caller closes its `client`."""
        rt = self._port_runtime(sandbox_id, port)
        await self.edge.relay_port(rt, port, client, greeting)

    async def delete(self, sandbox_id: str) -> None:
        if not ids.is_sandbox_id(sandbox_id):
            raise errors.InvalidRequest(f"malformed sandbox id {sandbox_id!r}")
        await self._delete_runtime(sandbox_id)

    async def _delete_runtime(self, sid: str) -> None:
        async with self._lock(sid):
            rt = self.runtimes.find(sid)
            archive_key = rt.archive_key if rt is not None else ""
            await self.sandboxes.delete(sid)
            await self.archiver.remove(sid, archive_key)
            self.edge.forget(sid)
            self.pressure.forget(sid)
            self.tiers.forget(sid)
            self._inflight.pop(sid, None)
            self._served_at.pop(sid, None)
        if not self._lock(sid).locked():
            self._locks.pop(sid, None)

    def _made_now(self) -> tuple[str, str]:
        """What a sandbox made now holds that may change under a worker: the runtime key of its
        memory, and the certificates it trusts besides its template's (see `create`)."""
        return self.sandboxes.runtime_key(), trust.combine(self.installation_ca, self.sandbox_ca_pem)

    def _outdated(self, rt: Runtime, made_now: tuple[str, str]) -> str | None:
        """Why `rt` is not what a create would make now, or None. Its memory holds the guest agent
        it was made with (which may not speak this worker's protocol), and its files and
        environment the CA certificates it was given, and its root file system the layer of its
        template: a frozen pool member keeps them across a restart of its worker with another agent,
        runsc, ATOLL_SANDBOX_CA_FILE, installation CA or built-in layer (after an upgrade)."""
        runtime_key, trust_pem = made_now
        if rt.runtime_key != runtime_key:
            return "under another guest agent or runsc than this worker runs now"
        if not rt.build_id:  # a built-in template's: its layer changes with atoll (recipe, shim, profile)
            current = self.builder.known_builtin(rt.template)
            if current is not None and rt.lower != current.lower:
                return f"from an older layer of the built-in template {rt.template!r} than this worker's"
        if rt.trust_pem != trust_pem:
            return (
                "trusting other CA certificates than a sandbox made now (ATOLL_SANDBOX_CA_FILE or "
                "the installation's CA changed since)"
            )
        return None

    async def inventory(self) -> api.Inventory:
        reports = []
        made_now = self._made_now()
        for rt in self.runtimes.cached():
            if rt.temporary or rt.phase == Phase.DELETING:
                continue
            reports.append(
                api.RuntimeReport(
                    rt.sandbox_id,
                    rt.phase,
                    rt.generation,
                    rt.failure,
                    busy=self._busy(rt.sandbox_id),
                    stale_runtime=self._outdated(rt, made_now) is not None,
                )
            )
        kept = []
        for k in self._kept_snapshots():
            with contextlib.suppress(OSError):  # deleted meanwhile
                kept.append(
                    api.KeptSnapshot(
                        os.path.basename(k.dir), os.stat(os.path.join(k.dir, forks.KEPT_META)).st_mtime
                    )
                )
        return api.Inventory(self.s.name, tuple(reports), tuple(kept))

    async def reconcile(self) -> api.ReconcileReport:
        """One reconciliation pass now (the monitor loop runs one every `reconcile_s`)."""
        self.last_reconcile = await self.recovery.reconcile()
        return self.last_reconcile

    # ---- the seam: calls into a running sandbox ---------------------------------------------------
    @contextlib.asynccontextmanager
    async def _serving(self, sid: str) -> AsyncIterator[None]:
        """A call into a running sandbox: waits for a step in progress (a compaction, say), then
        counts as in flight so that no pause or compaction starts under it."""
        await self.pressure.before_call(sid)
        async with self._lock(sid):
            rt = self.runtimes.get(sid)
            if rt.phase != Phase.RUNNING:
                if rt.phase == Phase.FAILED:
                    raise errors.SandboxDied(rt.failure or f"sandbox {sid} has failed")
                raise errors.Conflict(
                    f"sandbox {sid} is {rt.phase.value} on its worker; resume it first", code="invalid_state"
                )
            self._inflight[sid] = self._inflight.get(sid, 0) + 1
        try:
            yield
        finally:
            self._inflight[sid] = self._inflight.get(sid, 1) - 1
            self._served_at[sid] = time.monotonic()

    async def exec(self, sandbox_id: str, spec: api.ExecSpec) -> api.ExecResult:
        async with self._serving(sandbox_id):
            return await self.guest.exec(sandbox_id, spec)

    @contextlib.asynccontextmanager
    async def exec_stream(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[AsyncIterator[api.ExecEvent]]:
        async with self._serving(sandbox_id), self.guest.exec_stream(sandbox_id, spec) as events:
            yield events

    async def start_process(self, sandbox_id: str, spec: api.ExecSpec) -> api.ProcessStarted:
        async with self._serving(sandbox_id):
            return await self.guest.start_process(sandbox_id, spec)

    @contextlib.asynccontextmanager
    async def run_process(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[tuple[api.ProcessStarted, AsyncIterator[api.ProcessEvent]]]:
        async with self._serving(sandbox_id), self.guest.run_process(sandbox_id, spec) as (started, events):
            endable = self._stream_ends.process_output(sandbox_id, 0, events)
            try:
                yield started, endable
            finally:
                with contextlib.suppress(RuntimeError):  # still being read elsewhere: it ends with it
                    await endable.aclose()

    async def list_processes(self, sandbox_id: str) -> Sequence[api.ProcessInfo]:
        async with self._serving(sandbox_id):
            return await self.guest.list_processes(sandbox_id)

    async def kill_process(self, sandbox_id: str, pid: int) -> None:
        async with self._serving(sandbox_id):
            await self.guest.kill_process(sandbox_id, pid)

    async def metrics(self, sandbox_id: str) -> api.SandboxMetrics:
        rt = self.runtimes.get(sandbox_id)
        if rt.phase == Phase.DELETING:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is being deleted")
        processes = None
        if rt.phase == Phase.RUNNING:  # only the agent can count them; a standby one is not woken
            with contextlib.suppress(errors.Conflict):
                async with self._serving(sandbox_id):
                    processes = await self.guest.process_count(sandbox_id)
        rt = self.runtimes.get(sandbox_id)
        return metric_figures(
            sandbox_id,
            rt.phase,
            rt.cgroup(self.install_id),
            cpu_share=self.cpu_share(sandbox_id),
            memory_limit_mb=rt.memory_mb,
            disk_limit_mb=rt.disk_mb,
            upper_mount=self.runtimes.path(sandbox_id, "upper"),
            processes=processes,
        )

    # process handles (issue 9)
    async def get_process(self, sandbox_id: str, pid: int) -> api.ProcessInfo:
        async with self._serving(sandbox_id):
            return await self.guest.get_process(sandbox_id, pid)

    @contextlib.asynccontextmanager
    async def process_output(
        self, sandbox_id: str, pid: int, offset: int, follow: bool
    ) -> AsyncIterator[AsyncIterator[api.ProcessEvent]]:
        async with (
            self._serving(sandbox_id),
            self.guest.process_output(sandbox_id, pid, offset, follow) as events,
        ):
            if not follow:
                yield events
                return
            endable = self._stream_ends.process_output(sandbox_id, offset, events)
            try:
                yield endable
            finally:
                with contextlib.suppress(RuntimeError):  # still being read elsewhere: it ends with it
                    await endable.aclose()  # a follower that left mid-way: unregistered at once

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool) -> int:
        async with self._serving(sandbox_id):
            return await self.guest.send_stdin(sandbox_id, pid, data, eof)

    async def signal_process(self, sandbox_id: str, pid: int, signal: str) -> None:
        async with self._serving(sandbox_id):
            await self.guest.signal_process(sandbox_id, pid, signal)

    async def wait_process(self, sandbox_id: str, pid: int, timeout_s: float | None) -> api.ProcessInfo:
        async with self._serving(sandbox_id):
            return await self.guest.wait_process(sandbox_id, pid, timeout_s)

    @contextlib.asynccontextmanager
    async def read_file(self, sandbox_id: str, path: api.FilePath) -> AsyncIterator[api.FileDownload]:
        async with self._serving(sandbox_id), self.guest.read_file(sandbox_id, path) as download:
            yield download

    async def write_file(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> None:
        async with self._serving(sandbox_id):
            await self.guest.write_file(sandbox_id, path, chunks, size)

    async def list_files(self, sandbox_id: str, path: api.FilePath) -> Sequence[api.FileEntry]:
        async with self._serving(sandbox_id):
            return await self.guest.list_files(sandbox_id, path)

    async def delete_file(self, sandbox_id: str, path: api.FilePath) -> None:
        async with self._serving(sandbox_id):
            await self.guest.delete_file(sandbox_id, path)

    # ---- files, issue 9 ---------------------------------------------------------------------------
    async def stat_file(self, sandbox_id: str, path: api.FilePath) -> api.FileStat:
        async with self._serving(sandbox_id):
            return await self.guest.stat_file(sandbox_id, path)

    async def make_dir(self, sandbox_id: str, path: api.FilePath) -> bool:
        async with self._serving(sandbox_id):
            return await self.guest.make_dir(sandbox_id, path)

    async def move_file(self, sandbox_id: str, src: api.FilePath, dst: api.FilePath) -> api.FileStat:
        async with self._serving(sandbox_id):
            return await self.guest.move_file(sandbox_id, src, dst)

    async def chmod_file(self, sandbox_id: str, path: api.FilePath, mode: int) -> api.FileStat:
        async with self._serving(sandbox_id):
            return await self.guest.chmod_file(sandbox_id, path, mode)

    @contextlib.asynccontextmanager
    async def watch_files(
        self, sandbox_id: str, path: api.FilePath, recursive: bool
    ) -> AsyncIterator[AsyncIterator[api.FileEvent]]:
        async with self._serving(sandbox_id), self.guest.watch_files(sandbox_id, path, recursive) as events:
            endable = self._stream_ends.watch(sandbox_id, path, events)
            try:
                yield endable
            finally:
                with contextlib.suppress(RuntimeError):
                    await endable.aclose()

    async def write_tar(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        async with self._serving(sandbox_id):
            return await self.guest.write_tar(sandbox_id, path, chunks, size)

    @contextlib.asynccontextmanager
    async def read_tar(self, sandbox_id: str, path: api.FilePath) -> AsyncIterator[api.FileDownload]:
        async with self._serving(sandbox_id), self.guest.read_tar(sandbox_id, path) as download:
            yield download

    # ---- terminals (ptys): the guest agent keeps the sessions ----------------------------------
    async def open_pty(self, sandbox_id: str, spec: api.PtySpec) -> api.PtyStarted:
        async with self._serving(sandbox_id):
            return await self.guest.open_pty(sandbox_id, spec)

    async def list_ptys(self, sandbox_id: str) -> Sequence[api.PtyInfo]:
        async with self._serving(sandbox_id):
            return await self.guest.list_ptys(sandbox_id)

    async def kill_pty(self, sandbox_id: str, pty_id: str) -> None:
        _check_pty_id(sandbox_id, pty_id)
        async with self._serving(sandbox_id):
            await self.guest.kill_pty(sandbox_id, pty_id)

    async def attach_pty(self, sandbox_id: str, pty_id: str) -> api.PortStream:
        """Only the opening counts as a call in flight: an attached terminal never blocks a pause
        (a disk checkpoint resets its socket; the session lives on in the sandbox)."""
        _check_pty_id(sandbox_id, pty_id)
        async with self._serving(sandbox_id):
            return await self.guest.attach_pty(sandbox_id, pty_id)

    def events(self) -> AsyncIterator[api.WorkerEvent]:
        return self.hub.subscribe()


def _check_pty_id(sandbox_id: str, pty_id: str) -> None:
    if not ptyframes.is_pty_id(pty_id):
        raise errors.PtyNotFound(
            f"no terminal {pty_id!r} in sandbox {sandbox_id} (ids look like pty_0123456789ab)"
        )


async def purge_installation(home: str) -> list[str]:
    """Remove every sandbox of the installation at `home` from this host, without a control plane
    or worker running: a sweep with no live sandbox, also of the installation's parent cgroups.
    For test fixtures and `atoll.testing`. Returns what it removed."""
    home = os.path.realpath(home)
    inst = sweep.Installation(home, installation_id(home))
    removed = await sweep.sweep(inst, live=())
    for mp in storage.mounts_under(inst.stores):  # volumes and drives: unmounted, their files kept
        await storage.unmount(mp)
        stores.stop_weed(os.path.dirname(mp))  # a filer-backed drive's `weed mount`
        removed.append(f"mount {mp}")
    return removed

"""`FakeWorker`: the seam (core.worker_api.WorkerAPI) in memory, for tests of the control plane —
atoll's own and yours.

It keeps each sandbox as Python state (a phase, files, processes), follows the same phase table
as a real worker (core.lifecycle.PHASE_TRANSITIONS), answers pauses with the same outcomes (gate
blockers keep a sandbox in memory, a freeze that cannot finish leaves it running and busy), and
emits the same events. Knobs provoke what a real host does: `delay[verb]`, `fail` (verbs that
raise a RuntimeFailure; a failed "checkpoint" kills the sandbox and raises SandboxDied, a failed "restore" leaves the sandbox checkpointed and raises
ResumeFailed, as a real worker does), `gate_blockers`, `open_connections[sid]`, `freeze_stuck`,
`gate_stalled` (a pause that never answers), `kill(sid)` (the runtime dies), `vanish(sid)` (it is
gone without a word), `exec_handler` (what a command "prints"; a background process starts with it as its stdout), `write_process`
/ `end_process` (a background process prints, exits), `runtime_key` (change it to play a
worker restarted with another guest agent or runsc: the sandboxes made before are `stale_runtime`
in the inventory, and `claim` refuses them), `sandbox_ca` (the certificates a real worker's
ATOLL_SANDBOX_CA_FILE adds; a sandbox made trusting other ones than a new sandbox would — this and
the root `set_authority` gave — is `stale_runtime` too). The archive store (`store`, shared by the fakes
given the same dict) names each archive's holder as a real one does: `delete` by its holder
removes it. Every call is recorded in `calls`.

    manager = SandboxManager(db, metrics)           # controlplane.lifecycle
    await manager.start()
    await manager.workers.attach_local(FakeWorker())

Commands do not run: `exec` answers `exec_handler(spec)` (by default exit 0, no output). Terminals
are real host ptys running a line-echo program (`testing.fake_pty`), killed by `delete`/`aclose`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import itertools
import socket
import time
import typing
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from atoll.core import errors, netpolicy, signals
from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase, Step, Tier, advance
from atoll.shared import stream_ends
from atoll.shared.portstream import SocketPort
from atoll.testing import fake_files
from atoll.testing.fake_pty import FakePtys


def _pieces(
    start: int, end: int, stderr: list[tuple[int, int]]
) -> list[tuple[typing.Literal["stdout", "stderr"], int, int]]:
    """[start, end) cut into (stream, start, end) runs: the `stderr` ranges, stdout around them."""
    out: list[tuple[typing.Literal["stdout", "stderr"], int, int]] = []
    at = start
    for a, b in sorted(stderr):
        if b <= at or a >= end:
            continue
        if a > at:
            out.append(("stdout", at, a))
        out.append(("stderr", max(a, at), min(b, end)))
        at = min(b, end)
    if at < end:
        out.append(("stdout", at, end))
    return out


@dataclass
class FakeRuntime:
    spec: api.SandboxSpec
    phase: Phase = Phase.CREATING
    generation: int = 0
    failure: str | None = None
    files: dict[bytes, bytes] = field(default_factory=dict)
    processes: dict[int, api.ProcessInfo] = field(default_factory=dict)
    output: dict[int, bytes] = field(default_factory=dict)
    """A background process's stdout: what exec_handler answered for it, then what its stdin got
    (a fake process echoes its input), until it is signalled (then it exits 128+N)."""
    stdin: dict[int, bytearray] = field(default_factory=dict)
    stderr: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Byte ranges [start, end) of `output` a process wrote to stderr (`write_process`)."""
    runtime_key: str = ""
    """The worker's `runtime_key` when it was made (a fork's: its parent's)."""
    trust: tuple[str, str] = ("", "")
    """The certificates it was made trusting: its spec's `trust_pem` and the worker's
    `sandbox_ca` then (a fork's: its parent's)."""
    holder: str = ""
    """Of an archive in the store: the worker that holds it (the one that archived it, then the
    last one that adopted it, as a real archive's manifest names its holder); only the holder's
    `delete` removes it."""


def _entries(files: dict[bytes, bytes], path: api.FilePath) -> list[api.FileEntry]:
    """The entries of directory `path` among `files` (path -> content), as a listing shows them."""
    import base64

    prefix = _key(path).rstrip(b"/") + b"/"
    out = []
    for p, data in sorted(files.items()):
        if p.startswith(prefix) and b"/" not in p[len(prefix) :]:
            name = p[len(prefix) :]
            out.append(
                api.FileEntry(
                    name.decode(errors="replace"),
                    p.decode(errors="replace"),
                    base64.b64encode(name).decode(),
                    base64.b64encode(p).decode(),
                    "file",
                    len(data),
                    0o644,
                    0.0,
                )
            )
    return out


def _key(path: api.FilePath) -> bytes:
    return path if isinstance(path, bytes) else path.encode("utf-8", "surrogateescape")


class FakeWorker(fake_files.FakeFileOps):
    def __init__(
        self,
        name: str = "fake",
        *,
        installation: str = "fake00",
        memory_mb: int = 65536,
        cpus: float = 16,
        templates: Sequence[str] = ("base",),
        store: dict[str, FakeRuntime] | None = None,
        published: dict[str, api.BuildInfo] | None = None,
        slots: int = 0,
        snapshot_store: dict[str, FakeRuntime] | None = None,
    ):
        self.name = name
        self.store: dict[str, FakeRuntime] = {} if store is None else store
        """The archive tier's object store: fakes given the same dict share it (adopt)."""
        self.published = published
        """Builds in a shared object store (build id -> its info), as a real worker with S3 or
        ATOLL_ARCHIVE_DIR publishes them: fakes given the same dict publish ready builds there and
        fetch from it a build they lack (None: builds stay on this fake)."""
        self.snapshot_store = snapshot_store
        """Named snapshots in a shared object store (snapshot id -> the kept copy), as a real
        worker with S3 or ATOLL_ARCHIVE_DIR uploads them (`store_snapshot`): fakes given the same
        dict create from a snapshot another one kept (None: no shared store)."""
        self._fetching: dict[str, asyncio.Lock] = {}
        self.installation = installation
        self.capacity = api.Capacity(memory_mb=memory_mb, cpus=cpus, disk_mb=1 << 20, slots=slots)
        self.template_names = list(templates)
        self.runtimes: dict[str, FakeRuntime] = {}
        self.calls: list[tuple[str, str]] = []
        self.delay: dict[str, float] = {}
        self.fail: set[str] = set()
        self.gate_blockers: list[str] = []
        self.snapshots: dict[str, FakeRuntime] = {}
        self.snapshot_times: dict[str, float] = {}
        """When each was kept (Unix seconds): the inventory reports it."""
        """Named snapshots kept here (`snapshot`): a copy of the sandbox as it was, `spec.memory_mb`
        0 for a files-only one."""
        self.open_connections: dict[str, int] = {}
        self.ports: dict[tuple[str, int], tuple[str, int]] = {}
        """(sandbox, port) -> a loopback address open_port connects to (a test's server)."""
        self.secrets: dict[str, tuple[api.SecretBinding, ...]] = {}
        self.authority: api.Authority | None = None
        self.freeze_stuck = False
        self.gate_stalled: set[str] = set()
        self.exec_handler: typing.Callable[[api.ExecSpec], api.ExecResult] = lambda spec: api.ExecResult(
            exit_code=0, stdout="", stderr="", duration_ms=1, timed_out=False
        )
        self._pids = itertools.count(100)
        self._timers: set[asyncio.Future] = set()
        self._queues: set[asyncio.Queue] = set()
        self.ptys = FakePtys()
        self.stream_ends = stream_ends.StreamEnds()
        """Output follows and watches open, which a pause with end_streams ends (as a worker's)."""
        """Terminals: real host ptys running a line-echo program (see testing.fake_pty)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self.closed = False
        self.builds: dict[str, api.BuildInfo] = {}
        self.stores: dict[tuple[str, str], dict] = {}
        """Volumes and drives: (kind, name) -> {size_mb, files: path -> bytes}."""
        self.build_fails: str | None = None
        """A build asked for while this is set fails with it as its error."""
        self.runtime_key = "1"
        """What a real worker's guest agent and runsc are (worker.host.snapshots.RuntimeKey)."""
        self.sandbox_ca = ""
        """What a real worker's ATOLL_SANDBOX_CA_FILE adds to every sandbox's trust store."""

    # ---- test knobs -----------------------------------------------------------------------------
    def emit(self, ev: api.WorkerEvent) -> None:
        for q in self._queues:
            q.put_nowait(ev)

    def kill(self, sid: str, cause: str | None = None) -> None:
        """The sandbox's runtime dies (as under the host OOM killer); the control plane is told."""
        rt = self.runtimes[sid]
        rt.failure = cause or f"fake death of {sid}"
        rt.phase = advance(rt.phase, Step.FAIL)
        self.emit(api.SandboxDied(sid, rt.failure))

    def vanish(self, sid: str) -> None:
        """The runtime disappears without an event (only reconciliation notices)."""
        self.runtimes.pop(sid, None)

    def phase(self, sid: str) -> Phase | None:
        rt = self.runtimes.get(sid)
        return rt.phase if rt else None

    async def _step(self, verb: str, sid: str) -> None:
        self.calls.append((verb, sid))
        await asyncio.sleep(self.delay.get(verb, 0))
        if verb in self.fail:
            raise errors.RuntimeFailure(
                f"fake {verb} failure", detail=f"runsc log: /var/lib/atoll/sandboxes/{sid}/runsc.log said no"
            )

    async def _boot(self, rt: FakeRuntime) -> None:
        """A create's boot: the runtime registered, then booted, or FAILED with the `create` step's
        error."""
        self.runtimes[rt.spec.sandbox_id] = rt
        try:
            await self._step("create", rt.spec.sandbox_id)
        except errors.AtollError as e:
            rt.phase, rt.failure = Phase.FAILED, e.message
            raise
        self._advance(rt, Step.BOOTED)

    async def _end_streams(self, sid: str) -> None:
        """End the sandbox's open streams, if any, and wait (up to a second) for them to close."""
        if self.stream_ends.end(sid):
            for _ in range(100):  # let them deliver their last event and close
                await asyncio.sleep(0.01)
                if not self.stream_ends.count(sid):
                    break

    def _get(self, sid: str) -> FakeRuntime:
        rt = self.runtimes.get(sid)
        if rt is None:
            raise errors.SandboxNotFound(f"sandbox {sid} has no runtime on worker {self.name}")
        return rt

    def _running(self, sid: str) -> FakeRuntime:
        rt = self._get(sid)
        if rt.phase == Phase.FAILED:
            raise errors.SandboxDied(rt.failure or f"sandbox {sid} has failed")
        if rt.phase != Phase.RUNNING:
            raise errors.Conflict(
                f"fake: sandbox {sid} is {rt.phase.value}; resume it first", code="invalid_state"
            )
        return rt

    def _advance(self, rt: FakeRuntime, step: Step) -> None:
        rt.phase = advance(rt.phase, step)

    # ---- the seam: lifecycle --------------------------------------------------------------------
    async def info(self) -> api.WorkerInfo:
        return api.WorkerInfo(
            name=self.name,
            version="fake",
            protocol=api.PROTOCOL_VERSION,
            installation=self.installation,
            capacity=self.capacity,
            templates=tuple(
                api.TemplateInfo(t, "ready", description=f"fake {t}") for t in self.template_names
            ),
            builds=tuple(self.builds.values()),
            shared_store=self.snapshot_store is not None,
        )

    async def _ensure_build(self, build_id: str) -> None:
        """As the real worker (worker.images.builder.ensure): a build this fake lacks is fetched
        from `published` by id, once however many creates ask at the same time."""
        if build_id in self.builds or self.published is None:
            return
        async with self._fetching.setdefault(build_id, asyncio.Lock()):
            if build_id in self.builds:
                return
            held = self.published.get(build_id)
            if held is None:
                raise errors.BuildUnavailable(
                    f"fake: template build {build_id} is neither on worker {self.name} nor in the store"
                )
            self.calls.append(("fetch_build", build_id))
            await asyncio.sleep(self.delay.get("fetch_build", 0))
            self.builds[build_id] = held
            self.emit(api.BuildChanged(held))

    async def create(self, spec: api.SandboxSpec) -> api.CreateOutcome:
        if spec.snapshot_id:
            return await self._create_from_snapshot(spec)
        if spec.build_id:
            await self._ensure_build(spec.build_id)
            b = self.builds.get(spec.build_id)
            if b is None or b.status != "ready":
                raise errors.TemplateNotFound(f"fake: build {spec.build_id} is not ready here")
        elif spec.template not in self.template_names:
            raise errors.TemplateNotFound(f"template {spec.template!r} does not exist")
        if spec.sandbox_id in self.runtimes:
            raise errors.Conflict(f"sandbox {spec.sandbox_id} already exists", code="invalid_state")
        rt = FakeRuntime(spec, runtime_key=self.runtime_key, trust=(spec.trust_pem, self.sandbox_ca))
        await self._boot(rt)
        return api.CreateOutcome("fake", 0.0)

    async def pause(
        self, sandbox_id: str, tier: Tier, *, only_if_idle: bool = False, end_streams: bool = False
    ) -> api.PauseOutcome:
        self.calls.append(("pause", sandbox_id))
        if end_streams:
            await self._end_streams(sandbox_id)
        if sandbox_id in self.gate_stalled:
            await asyncio.sleep(3600)
        rt = self._get(sandbox_id)
        if rt.phase == Phase.ARCHIVED:
            return api.PauseOutcome(Tier.ARCHIVE)
        if rt.phase == Phase.CHECKPOINTED:
            return await self._archive(rt) if tier == Tier.ARCHIVE else api.PauseOutcome(Tier.DISK)
        if rt.phase not in (Phase.RUNNING, Phase.FROZEN):
            raise errors.Conflict(f"fake: sandbox {sandbox_id} is {rt.phase.value}", code="invalid_state")
        if tier == Tier.MEMORY:
            if rt.phase == Phase.FROZEN:
                return api.PauseOutcome(Tier.MEMORY)
            if only_if_idle and self.open_connections.get(sandbox_id):
                return api.PauseOutcome(None, f"{self.open_connections[sandbox_id]} open TCP connection(s)")
            return await self._freeze(rt, Tier.MEMORY, None)
        if rt.phase == Phase.FROZEN:
            await self._step("thaw", sandbox_id)
            self._advance(rt, Step.THAW)
        self.calls.append(("gate", sandbox_id))
        if self.gate_blockers:
            return await self._freeze(
                rt, Tier.MEMORY, "kept in the memory tier: " + "; ".join(self.gate_blockers)
            )
        self._advance(rt, Step.BEGIN_CHECKPOINT)
        self.ptys.detach_all(sandbox_id)  # as the real worker: attach sockets reset before a checkpoint
        try:
            await self._step("checkpoint", sandbox_id)
        except errors.AtollError as e:  # as this runsc: a failed checkpoint kills the sandbox
            rt.failure = e.message
            self._advance(rt, Step.FAIL)
            raise errors.SandboxDied(e.message, detail=e.detail) from None  # 409, as the real worker
        self._advance(rt, Step.COMMIT_CHECKPOINT)
        if tier == Tier.ARCHIVE:
            return await self._archive(rt)
        return api.PauseOutcome(Tier.DISK)

    async def _archive(self, rt: FakeRuntime) -> api.PauseOutcome:
        """As the real worker: a store that fails (`fail` holds "archive") leaves it on disk."""
        self._advance(rt, Step.BEGIN_ARCHIVE)
        try:
            await self._step("archive", rt.spec.sandbox_id)
        except errors.AtollError as e:
            self._advance(rt, Step.ABORT_ARCHIVE)
            return api.PauseOutcome(Tier.DISK, f"kept in the disk tier: {e.message}")
        self._advance(rt, Step.COMMIT_ARCHIVE)
        rt.holder = self.name
        self.store[rt.spec.sandbox_id] = rt
        return api.PauseOutcome(Tier.ARCHIVE)

    async def adopt(self, sandbox_id: str, mounts: Sequence[api.MountSpec]) -> api.AdoptOutcome:
        """As the real worker: only an archive in the (shared) store can be adopted, never one
        with a volume; the record arrives archived."""
        await self._step("adopt", sandbox_id)
        if sandbox_id in self.runtimes:
            raise errors.Conflict(f"fake: sandbox {sandbox_id} already exists on this worker")
        held = self.store.get(sandbox_id)
        if held is None or held.phase != Phase.ARCHIVED:
            raise errors.SandboxNotFound(f"fake: sandbox {sandbox_id} has no archive in the store")
        if any(m.kind == "volume" for m in held.spec.mounts):
            raise errors.Conflict(f"fake: sandbox {sandbox_id} mounts a volume", code="not_adoptable")
        rt = FakeRuntime(
            spec=held.spec,
            phase=Phase.ARCHIVED,
            generation=held.generation,
            files=dict(held.files),
            runtime_key=held.runtime_key,
            trust=held.trust,
        )
        held.holder = self.name  # as the real worker's archive.claim: this worker's from now on
        self.runtimes[sandbox_id] = rt
        return api.AdoptOutcome(layers_fetched=0, duration_ms=0.0)

    async def _freeze(self, rt: FakeRuntime, tier: Tier, reason: str | None) -> api.PauseOutcome:
        await self._step("freeze", rt.spec.sandbox_id)
        if self.freeze_stuck:  # as the real worker: thawed again, still running
            return api.PauseOutcome(
                None, f"fake: sandbox {rt.spec.sandbox_id} stayed FREEZING; retry", busy=True
            )
        self._advance(rt, Step.FREEZE)
        return api.PauseOutcome(tier, reason)

    async def resume(self, sandbox_id: str, keep_archive: bool = False) -> api.ResumeOutcome:
        rt = self._get(sandbox_id)
        t0 = time.perf_counter()
        if rt.phase == Phase.FROZEN:
            await self._step("thaw", sandbox_id)
            self._advance(rt, Step.THAW)
            tier = Tier.MEMORY
        elif rt.phase in (Phase.CHECKPOINTED, Phase.ARCHIVED):
            if rt.phase == Phase.ARCHIVED:
                await self._step("unarchive", sandbox_id)
                if keep_archive:  # as the real worker: the archive stays in the store as it was
                    self.store[sandbox_id] = dataclasses.replace(rt, files=dict(rt.files), holder=self.name)
                    self.calls.append(("keep_archive", sandbox_id))
                self._advance(rt, Step.UNARCHIVED)
            self._advance(rt, Step.BEGIN_RESTORE)
            try:
                await self._step("restore", sandbox_id)
            except errors.AtollError as e:  # as on a real worker: undone, back in disk standby
                self._advance(rt, Step.RESTORE_FAILED)
                raise errors.ResumeFailed(
                    f"restoring sandbox {sandbox_id} failed: {e.message}",
                    detail=e.detail,
                ) from None
            rt.generation += 1
            self._advance(rt, Step.RESTORED)
            tier = Tier.DISK
        elif rt.phase == Phase.RUNNING:
            return api.ResumeOutcome(Tier.MEMORY, 0.0)
        else:
            raise errors.Conflict(f"fake: sandbox {sandbox_id} is {rt.phase.value}", code="invalid_state")
        return api.ResumeOutcome(tier, (time.perf_counter() - t0) * 1000)

    async def delete(self, sandbox_id: str) -> None:
        await self._step("delete", sandbox_id)
        held = self.store.get(sandbox_id)
        if self.runtimes.pop(sandbox_id, None) is not None and held is not None and held.holder == self.name:
            del self.store[sandbox_id]  # as the real worker: the holder's delete removes its archive
        self.ptys.close_all(sandbox_id)

    async def set_network(self, sandbox_id: str, network: dict[str, list[str]]) -> dict[str, list[str]]:
        rt = self._get(sandbox_id)
        policy = netpolicy.from_wire(network).to_wire()
        rt.spec = dataclasses.replace(rt.spec, network=policy)
        return policy

    async def set_secrets(self, sandbox_id: str, secrets: Sequence[api.SecretBinding]) -> None:
        self._get(sandbox_id)
        self.secrets[sandbox_id] = tuple(secrets)

    async def set_authority(self, authority: api.Authority) -> None:
        self.authority = authority

    # ---- the seam: templates, pools, fork -------------------------------------------------------
    async def build_template(self, build: api.TemplateBuild) -> api.BuildInfo:
        """A build "runs" for one loop turn: ready (or failed with `build_fails`), with an event."""
        self.calls.append(("build", build.build_id))
        if build.parent_build:
            await self._ensure_build(build.parent_build)
        info = api.BuildInfo(build.build_id, str(build.spec.get("name", "")), "building")
        self.builds[build.build_id] = info

        async def finish() -> None:
            await asyncio.sleep(self.delay.get("build", 0))
            done = dataclasses.replace(
                info,
                status="failed" if self.build_fails else "ready",
                error=self.build_fails,
                progress="" if self.build_fails else "ready",
                built_at=time.time(),
            )
            self.builds[build.build_id] = done
            self.emit(api.BuildChanged(done))
            if self.published is not None and done.status == "ready":
                await asyncio.sleep(self.delay.get("publish", 0))
                done = dataclasses.replace(done, in_store=True)
                self.published[build.build_id] = done
                self.builds[build.build_id] = done
                self.emit(api.BuildChanged(done))

        asyncio.ensure_future(finish())
        return info

    @contextlib.asynccontextmanager
    async def build_log(self, build_id: str) -> AsyncIterator[AsyncIterator[bytes]]:
        if build_id not in self.builds:
            raise errors.NotFound(f"fake: no build {build_id}", code="template_not_found")

        async def lines() -> AsyncIterator[bytes]:
            yield f"fake build {build_id}\n".encode()

        yield lines()

    async def delete_build(self, build_id: str) -> None:
        self.calls.append(("delete_build", build_id))
        self.builds.pop(build_id, None)
        if self.published is not None:
            self.published.pop(build_id, None)

    async def claim(self, sandbox_id: str, env: dict[str, str], cpus: float) -> api.ResumeOutcome:
        if self._stale(self._get(sandbox_id)):
            self.calls.append(("claim refused", sandbox_id))
            raise errors.Conflict(
                f"fake: pooled sandbox {sandbox_id} was made under another runtime or trusting other "
                "certificates",
                code="invalid_state",
            )
        outcome = await self.resume(sandbox_id)
        rt = self._get(sandbox_id)
        rt.spec = dataclasses.replace(rt.spec, env={**rt.spec.env, **env}, cpus=cpus)
        self.calls.append(("claim", sandbox_id))
        return outcome

    async def fork(self, sandbox_id: str, new_ids: Sequence[str]) -> api.ForkOutcome:
        parent = self._running(sandbox_id)
        await self._step("fork", sandbox_id)
        if self.gate_blockers:
            raise errors.Conflict(
                f"sandbox {sandbox_id} cannot be forked now: " + "; ".join(self.gate_blockers),
                code="checkpoint_refused",
            )
        for nid in new_ids:
            child = FakeRuntime(
                dataclasses.replace(parent.spec, sandbox_id=nid),
                files=dict(parent.files),
                runtime_key=parent.runtime_key,
                trust=parent.trust,
            )
            child.phase = Phase.RUNNING
            self.runtimes[nid] = child
        return api.ForkOutcome(tuple(new_ids), 0.0, 0.0)

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, memory: bool = True, end_streams: bool = False
    ) -> api.SnapshotOutcome:
        self.calls.append(("snapshot", sandbox_id))
        if end_streams:
            await self._end_streams(sandbox_id)
        parent = self._running(sandbox_id)
        await self._step("snapshot", sandbox_id)
        if parent.spec.mounts:
            raise errors.Conflict(
                f"fake: sandbox {sandbox_id} mounts volumes or drives: it cannot be snapshotted",
                code="invalid_state",
            )
        if self.gate_blockers:
            raise errors.Conflict(
                f"sandbox {sandbox_id} cannot be snapshotted now: " + "; ".join(self.gate_blockers),
                code="checkpoint_refused",
            )
        if snapshot_id in self.snapshots:
            raise errors.Conflict(f"fake: snapshot {snapshot_id} exists", code="snapshot_exists")
        kept = FakeRuntime(
            dataclasses.replace(parent.spec, memory_mb=parent.spec.memory_mb if memory else 0),
            files=dict(parent.files),
            runtime_key=parent.runtime_key,
            trust=parent.trust,
        )
        self.snapshots[snapshot_id] = kept
        self.snapshot_times[snapshot_id] = time.time()
        size = sum(len(v) for v in kept.files.values()) + (parent.spec.memory_mb << 20 if memory else 0)
        return api.SnapshotOutcome(snapshot_id, size, kept.spec.memory_mb, 0.0, 0.0)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        self.calls.append(("delete_snapshot", snapshot_id))
        await asyncio.sleep(self.delay.get("delete_snapshot", 0))
        self.snapshots.pop(snapshot_id, None)
        self.snapshot_times.pop(snapshot_id, None)
        if self.snapshot_store is not None:
            self.snapshot_store.pop(snapshot_id, None)

    async def store_snapshot(self, snapshot_id: str) -> api.StoredSnapshot:
        await self._step("store_snapshot", snapshot_id)
        if self.snapshot_store is None:
            raise errors.Conflict(
                f"fake: worker {self.name} has no shared store", code="snapshot_unavailable"
            )
        kept = self.snapshots.get(snapshot_id)
        if kept is None:
            raise errors.NotFound(
                f"fake: snapshot {snapshot_id} is not on worker {self.name}", code="snapshot_not_found"
            )
        self.snapshot_store[snapshot_id] = dataclasses.replace(kept, holder=self.installation)
        return api.StoredSnapshot(snapshot_id, sum(len(v) for v in kept.files.values()), 0.0)

    async def stored_snapshots(self) -> list[api.KeptSnapshot]:
        return [
            api.KeptSnapshot(i, 0.0, kept.holder) for i, kept in sorted((self.snapshot_store or {}).items())
        ]

    async def _create_from_snapshot(self, spec: api.SandboxSpec) -> api.CreateOutcome:
        kept = self.snapshots.get(spec.snapshot_id)
        if kept is None and self.snapshot_store is not None and self.delay.get("fetch_snapshot"):
            await asyncio.sleep(self.delay["fetch_snapshot"])  # the download, as a real worker's
            kept = self.snapshots.get(spec.snapshot_id)
        if kept is None and self.snapshot_store is not None and spec.snapshot_id in self.snapshot_store:
            kept = self.snapshot_store[spec.snapshot_id]  # fetched, as a worker does: kept here from now on
            if kept.spec.memory_mb and kept.runtime_key != self.runtime_key:
                raise errors.Conflict(
                    f"fake: snapshot {spec.snapshot_id} was made under another runtime key",
                    code="snapshot_unavailable",
                )
            self.calls.append(("fetch_snapshot", spec.snapshot_id))
            self.snapshots[spec.snapshot_id] = kept
            self.snapshot_times[spec.snapshot_id] = time.time()
        if kept is None:
            raise errors.NotFound(
                f"fake: snapshot {spec.snapshot_id} is not on worker {self.name}", code="snapshot_not_found"
            )
        if kept.spec.memory_mb and spec.memory_mb != kept.spec.memory_mb:
            raise errors.InvalidRequest(
                f"snapshot {spec.snapshot_id} holds the memory of a {kept.spec.memory_mb} MB sandbox "
                f"(asked {spec.memory_mb})"
            )
        if spec.sandbox_id in self.runtimes:
            raise errors.Conflict(f"sandbox {spec.sandbox_id} already exists", code="invalid_state")
        own = dataclasses.replace(
            kept.spec,
            sandbox_id=spec.sandbox_id,
            memory_mb=spec.memory_mb,
            cpus=spec.cpus,
            env={**kept.spec.env, **spec.env},
            network=spec.network,
            secrets=spec.secrets,
            snapshot_id=spec.snapshot_id,
        )
        rt = FakeRuntime(
            own,
            files=dict(kept.files),
            runtime_key=kept.runtime_key if kept.spec.memory_mb else self.runtime_key,
            trust=kept.trust,
        )
        await self._boot(rt)
        return api.CreateOutcome("snapshot" if kept.spec.memory_mb else "snapshot files, cold boot", 0.0)

    async def open_port(self, sandbox_id: str, port: int) -> api.PortStream:
        self.calls.append(("open_port", sandbox_id))
        rt = self._get(sandbox_id)
        if rt.phase != Phase.RUNNING:
            raise errors.Conflict(f"fake: sandbox {sandbox_id} is {rt.phase.value}", code="invalid_state")
        address = self.ports.get((sandbox_id, port))
        if address is None:
            raise ConnectionRefusedError(f"fake: nothing listens on port {port} of {sandbox_id}")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return SocketPort(sock)

    def _stale(self, rt: FakeRuntime) -> bool:
        """Not what a create makes now: another runtime key, or other trusted certificates."""
        root = self.authority.root_pem if self.authority is not None else ""
        return rt.runtime_key != self.runtime_key or rt.trust != (root, self.sandbox_ca)

    async def inventory(self) -> api.Inventory:
        return api.Inventory(
            self.name,
            tuple(
                api.RuntimeReport(sid, rt.phase, rt.generation, rt.failure, stale_runtime=self._stale(rt))
                for sid, rt in self.runtimes.items()
            ),
            tuple(api.KeptSnapshot(i, self.snapshot_times.get(i, 0.0)) for i in self.snapshots),
        )

    async def reconcile(self) -> api.ReconcileReport:
        self.calls.append(("reconcile", ""))
        return api.ReconcileReport(len(self.runtimes), (), (), 0.0, 0.0)

    def write_process(self, sid: str, pid: int, data: bytes, stream: str = "stdout") -> None:
        """Make a running background process print `data` (on stdout or stderr)."""
        rt = self._get(sid)
        start = len(rt.output.get(pid, b""))
        rt.output[pid] = rt.output.get(pid, b"") + data
        if stream == "stderr":
            rt.stderr.setdefault(pid, []).append((start, start + len(data)))

    def end_process(self, sid: str, pid: int, exit_code: int | None, *, timed_out: bool = False) -> None:
        """Make a running background process exit with `exit_code`."""
        rt = self._get(sid)
        info = rt.processes[pid]
        if info.running:
            rt.processes[pid] = dataclasses.replace(
                info, running=False, exit_code=exit_code, stdin_open=False, timed_out=timed_out
            )

    # ---- the seam: calls --------------------------------------------------------------------------
    async def exec(self, sandbox_id: str, spec: api.ExecSpec) -> api.ExecResult:
        self._running(sandbox_id)
        await self._step("exec", sandbox_id)
        self._running(sandbox_id)  # it may have died meanwhile
        return self.exec_handler(spec)

    @contextlib.asynccontextmanager
    async def exec_stream(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[AsyncIterator[api.ExecEvent]]:
        result = await self.exec(sandbox_id, spec)

        async def events() -> AsyncIterator[api.ExecEvent]:
            if result.stdout:
                yield api.ExecOutput("stdout", result.stdout)
            if result.stderr:
                yield api.ExecOutput("stderr", result.stderr)
            yield api.ExecExit(result.exit_code, result.timed_out, result.duration_ms)

        yield events()

    async def start_process(self, sandbox_id: str, spec: api.ExecSpec) -> api.ProcessStarted:
        rt = self._running(sandbox_id)
        await self._step("start_process", sandbox_id)
        pid = next(self._pids)
        rt.processes[pid] = api.ProcessInfo(
            pid, spec.cmd, True, None, True, time.time(), f"/tmp/.atoll/proc-{pid}.log"
        )
        rt.output[pid] = self.exec_handler(spec).stdout.encode()
        rt.stdin[pid] = bytearray()
        if spec.stdin is not None:
            rt.stdin[pid] += spec.stdin.encode()
            rt.output[pid] += spec.stdin.encode()
            rt.processes[pid] = dataclasses.replace(rt.processes[pid], stdin_open=False)
        else:
            rt.processes[pid] = dataclasses.replace(rt.processes[pid], stdin_open=True)
        if spec.timeout_s is not None:  # killed at its timeout, as a real worker does
            timeout_s = spec.timeout_s

            async def expire() -> None:
                await asyncio.sleep(timeout_s)
                with contextlib.suppress(KeyError):
                    self.end_process(sandbox_id, pid, 137, timed_out=True)

            timer = asyncio.ensure_future(expire())
            self._timers.add(timer)
            timer.add_done_callback(self._timers.discard)
        return api.ProcessStarted(pid, f"/tmp/.atoll/proc-{pid}.log")

    @contextlib.asynccontextmanager
    async def run_process(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[tuple[api.ProcessStarted, AsyncIterator[api.ProcessEvent]]]:
        """start_process, then its output followed from 0 (as one call, like a real worker)."""
        started = await self.start_process(sandbox_id, spec)
        async with self.process_output(sandbox_id, started.pid, 0, True) as events:
            yield started, events

    # process handles: fake processes run until signalled; they echo their stdin to stdout
    def _process(self, sandbox_id: str, pid: int) -> tuple[FakeRuntime, api.ProcessInfo]:
        rt = self._running(sandbox_id)
        info = rt.processes.get(pid)
        if info is None:
            raise errors.ProcessNotFound(f"no process with pid {pid} was started in sandbox {sandbox_id}")
        return rt, info

    async def get_process(self, sandbox_id: str, pid: int) -> api.ProcessInfo:
        rt, info = self._process(sandbox_id, pid)
        return dataclasses.replace(info, output_bytes=len(rt.output.get(pid, b"")))

    @contextlib.asynccontextmanager
    async def process_output(
        self, sandbox_id: str, pid: int, offset: int, follow: bool
    ) -> AsyncIterator[AsyncIterator[api.ProcessEvent]]:
        """Its output from `offset` (stderr pieces apart, as `write_process` wrote them), then its
        exit; `follow` polls for more until it exits."""
        rt, info = self._process(sandbox_id, pid)
        if offset > len(rt.output.get(pid, b"")):
            raise errors.InvalidRequest(
                f"offset {offset} is past the end of the output ({len(rt.output.get(pid, b''))} bytes)"
            )

        async def events() -> AsyncIterator[api.ProcessEvent]:
            at = offset
            while True:
                info = rt.processes.get(pid)
                data = rt.output.get(pid, b"")
                for stream, start, end in _pieces(at, len(data), rt.stderr.get(pid, [])):
                    raw = data[start:end]
                    text = raw.decode(errors="replace")
                    exact = None if text.encode() == raw else base64.b64encode(raw).decode()
                    yield api.ProcessOutput(stream, text, end, b64=exact)
                at = len(data)
                if info is None:
                    return  # killed and forgotten (kill_process)
                if not info.running:
                    yield api.ProcessExit(info.exit_code, info.timed_out, 0, at, signal=info.signal)
                    return
                if not follow:
                    return
                await asyncio.sleep(0.01)

        yield self.stream_ends.process_output(sandbox_id, offset, events()) if follow else events()

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool) -> int:
        rt, info = self._process(sandbox_id, pid)
        if not info.running:
            raise errors.Conflict(
                f"process {pid} has exited; its stdin takes no more input", code="process_exited"
            )
        if not info.stdin_open:
            raise errors.Conflict(f"the stdin of process {pid} is closed", code="stdin_closed")
        rt.stdin[pid] += data
        rt.output[pid] = rt.output.get(pid, b"") + data
        if eof:
            rt.processes[pid] = dataclasses.replace(info, stdin_open=False)
        return len(data)

    async def signal_process(self, sandbox_id: str, pid: int, signal: str) -> None:
        rt, info = self._process(sandbox_id, pid)
        if info.running and signal not in ("CONT", "CHLD", "WINCH", "URG"):
            rt.processes[pid] = dataclasses.replace(
                info,
                running=False,
                exit_code=128 + signals.LINUX_SIGNALS[signal],
                stdin_open=False,
                signal=signals.LINUX_SIGNALS[signal],
            )

    async def wait_process(self, sandbox_id: str, pid: int, timeout_s: float | None) -> api.ProcessInfo:
        rt, info = self._process(sandbox_id, pid)
        if info.running:
            raise errors.Conflict(
                f"process {pid} is still running after timeout_s={timeout_s}", code="process_running"
            )
        return info

    async def list_processes(self, sandbox_id: str) -> Sequence[api.ProcessInfo]:
        return list(self._running(sandbox_id).processes.values())

    async def kill_process(self, sandbox_id: str, pid: int) -> None:
        rt = self._running(sandbox_id)
        if rt.processes.pop(pid, None) is None:
            raise errors.ProcessNotFound(f"no process with pid {pid} was started in sandbox {sandbox_id}")

    async def metrics(self, sandbox_id: str) -> api.SandboxMetrics:
        """Figures made up from its state: 1% CPU and 32 MB while running (32 MB frozen in memory,
        0 checkpointed), disk = its files' bytes, processes = its running background ones."""
        rt = self._get(sandbox_id)
        if rt.phase == Phase.DELETING:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is being deleted")
        running = rt.phase == Phase.RUNNING
        return api.SandboxMetrics(
            sandbox_id=sandbox_id,
            phase=rt.phase,
            cpu_percent=1.0 if running else 0.0,
            memory_used_mb=32.0 if rt.phase in (Phase.RUNNING, Phase.FROZEN) else 0.0,
            memory_limit_mb=rt.spec.memory_mb,
            disk_used_mb=round(sum(len(v) for v in rt.files.values()) / 1048576, 1),
            disk_limit_mb=rt.spec.disk_mb or 4096,
            processes=sum(1 for p in rt.processes.values() if p.running) if running else None,
        )

    @contextlib.asynccontextmanager
    async def read_file(self, sandbox_id: str, path: api.FilePath) -> AsyncIterator[api.FileDownload]:
        rt = self._running(sandbox_id)
        data = rt.files.get(_key(path))
        if data is None:
            raise errors.FileNotFound(f"file {path!r} does not exist")

        async def chunks() -> AsyncIterator[bytes]:
            yield data

        yield api.FileDownload(len(data), chunks())

    async def write_file(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> None:
        rt = self._running(sandbox_id)
        await self._step("write_file", sandbox_id)
        rt.files[_key(path)] = b"".join([c async for c in chunks])
        self._files_changed(sandbox_id, path, "create")

    async def list_files(self, sandbox_id: str, path: api.FilePath) -> Sequence[api.FileEntry]:
        """Its files and, as a real listing shows them, its subdirectories (made with make_dir,
        or holding files)."""
        import base64

        rt = self._running(sandbox_id)
        out = _entries(rt.files, path)
        prefix = _key(path).rstrip(b"/") + b"/"
        subdirs = {
            p[len(prefix) :].split(b"/", 1)[0]
            for p in [*rt.files, *self._dirs(sandbox_id)]
            if p.startswith(prefix)
            and len(p) > len(prefix)
            and (p in self._dirs(sandbox_id) or b"/" in p[len(prefix) :])
        }
        for name in sorted(subdirs):
            full = prefix + name
            out.append(
                api.FileEntry(
                    name.decode(errors="replace"),
                    full.decode(errors="replace"),
                    base64.b64encode(name).decode(),
                    base64.b64encode(full).decode(),
                    "dir",
                    4096,
                    self._modes(sandbox_id).get(full, 0o755),
                    0.0,
                )
            )
        return sorted(out, key=lambda e: e.name)

    async def delete_file(self, sandbox_id: str, path: api.FilePath) -> None:
        rt = self._running(sandbox_id)
        if rt.files.pop(_key(path), None) is None:
            raise errors.FileNotFound(f"file {path!r} does not exist")
        self._files_changed(sandbox_id, path, "delete")

    # ---- volumes and drives: each a dict of path -> bytes ------------------------------------------
    def _store(self, kind: str, name: str) -> dict:
        st = self.stores.get((kind, name))
        if st is None:
            raise errors.NotFound(f"no {kind} named {name!r}", code=f"{kind}_not_found")
        return st

    def _store_info(self, kind: str, name: str) -> api.StoreInfo:
        st = self._store(kind, name)
        used = sum(len(v) for v in st["files"].values())
        return api.StoreInfo(kind, name, st["size_mb"], round(used / 1048576, 1))

    async def create_store(self, kind: str, name: str, size_mb: int) -> api.StoreInfo:
        self.calls.append(("create_store", f"{kind}/{name}"))
        if (kind, name) in self.stores:
            raise errors.Conflict(f"a {kind} named {name!r} exists", code=f"{kind}_exists")
        self.stores[(kind, name)] = {"size_mb": size_mb, "files": {}}
        return self._store_info(kind, name)

    async def get_store(self, kind: str, name: str) -> api.StoreInfo:
        return self._store_info(kind, name)

    async def delete_store(self, kind: str, name: str) -> None:
        self._store(kind, name)
        del self.stores[(kind, name)]

    async def clone_store(self, kind: str, name: str, new_name: str) -> api.StoreInfo:
        st = self._store(kind, name)
        if (kind, new_name) in self.stores:
            raise errors.Conflict(f"a {kind} named {new_name!r} exists", code=f"{kind}_exists")
        self.stores[(kind, new_name)] = {"size_mb": st["size_mb"], "files": dict(st["files"])}
        return self._store_info(kind, new_name)

    # a fake store: "files" path -> bytes, "dirs" the directories made by mkdir (parents of files
    # are directories too), "attrs" path -> (mode, uid, gid) set by mkdir / attrs
    def _store_dirs(self, st: dict) -> set[bytes]:
        made = st.setdefault("dirs", set())
        dirs = {b"/"} | made
        for p in list(st["files"]) + list(made):
            while p := p.rsplit(b"/", 1)[0]:
                dirs.add(p)
        return dirs

    def _store_entry(self, st: dict, k: bytes) -> api.StoreEntry:
        import base64

        files = st["files"]
        if k not in files and k not in self._store_dirs(st):
            raise errors.FileNotFound(f"fake: {k.decode(errors='replace')!r} does not exist")
        is_dir = k not in files
        mode, uid, gid = st.setdefault("attrs", {}).get(k, (0o755 if is_dir else 0o644, 0, 0))
        n = k.rsplit(b"/", 1)[-1]
        return api.StoreEntry(
            n.decode(errors="replace"),
            k.decode(errors="replace"),
            base64.b64encode(n).decode(),
            base64.b64encode(k).decode(),
            "dir" if is_dir else "file",
            0 if is_dir else len(files[k]),
            mode,
            uid,
            gid,
            0.0,
            0.0,
            0.0,
        )

    async def list_store_files(
        self, kind: str, name: str, path: api.FilePath, depth: int
    ) -> Sequence[api.StoreEntry]:
        st = self._store(kind, name)
        base = _key(path).rstrip(b"/") or b"/"
        if base not in self._store_dirs(st):
            raise errors.FileNotFound(f"fake: directory {path!r} does not exist")
        prefix = b"" if base == b"/" else base
        out = []

        def walk(d: bytes, left: int) -> None:
            kids = sorted(
                {
                    p[len(d) + 1 :].split(b"/", 1)[0]
                    for p in list(st["files"]) + list(self._store_dirs(st))
                    if p.startswith(d + b"/") and len(p) > len(d) + 1
                }
            )
            for kid in kids:
                e = self._store_entry(st, d + b"/" + kid)
                out.append(e)
                if left > 1 and e.type == "dir":
                    walk(d + b"/" + kid, left - 1)

        walk(prefix, depth)
        return out

    async def stat_store_file(self, kind: str, name: str, path: api.FilePath) -> api.StoreEntry:
        return self._store_entry(self._store(kind, name), _key(path).rstrip(b"/") or b"/")

    async def make_store_dir(
        self,
        kind: str,
        name: str,
        path: api.FilePath,
        parents: bool,
        mode: int | None,
        uid: int | None,
        gid: int | None,
    ) -> api.StoreEntry:
        st = self._store(kind, name)
        k = _key(path).rstrip(b"/")
        if k in st["files"]:
            raise errors.Conflict(f"fake: {path!r} exists and is not a directory", code="invalid_state")
        parent = k.rsplit(b"/", 1)[0] or b"/"
        if not parents and parent not in self._store_dirs(st):
            raise errors.FileNotFound(f"fake: making directory: {parent!r} does not exist")
        st.setdefault("dirs", set()).add(k)
        return await self.set_store_file_attrs(kind, name, path, mode, uid, gid)

    async def set_store_file_attrs(
        self, kind: str, name: str, path: api.FilePath, mode: int | None, uid: int | None, gid: int | None
    ) -> api.StoreEntry:
        st = self._store(kind, name)
        k = _key(path).rstrip(b"/")
        e = self._store_entry(st, k)
        st.setdefault("attrs", {})[k] = (
            e.mode if mode is None else mode,
            e.uid if uid is None else uid,
            e.gid if gid is None else gid,
        )
        return self._store_entry(st, k)

    async def delete_store_file(self, kind: str, name: str, path: api.FilePath) -> None:
        st = self._store(kind, name)
        k = _key(path).rstrip(b"/")
        if st["files"].pop(k, None) is not None:
            return
        if k not in self._store_dirs(st):
            raise errors.FileNotFound(f"file {path!r} does not exist")
        for p in [p for p in st["files"] if p.startswith(k + b"/")]:
            del st["files"][p]
        st["dirs"] = {d for d in st.get("dirs", set()) if d != k and not d.startswith(k + b"/")}

    @contextlib.asynccontextmanager
    async def read_store_file(
        self, kind: str, name: str, path: api.FilePath
    ) -> AsyncIterator[api.FileDownload]:
        data = self._store(kind, name)["files"].get(_key(path))
        if data is None:
            raise errors.FileNotFound(f"file {path!r} does not exist")

        async def chunks() -> AsyncIterator[bytes]:
            yield data

        yield api.FileDownload(len(data), chunks())

    async def write_store_file(
        self, kind: str, name: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.FileStat:
        import base64

        st = self._store(kind, name)
        data = b"".join([c async for c in chunks])
        if sum(len(v) for v in st["files"].values()) + len(data) > st["size_mb"] * 1048576:
            raise errors.InsufficientStorage(f"{kind} {name!r} is full", code="store_full")
        k = _key(path)
        st["files"][k] = data
        n = k.rsplit(b"/", 1)[-1]
        return api.FileStat(
            n.decode(errors="replace"),
            k.decode(errors="replace"),
            base64.b64encode(n).decode(),
            base64.b64encode(k).decode(),
            "file",
            len(data),
            0o644,
            0.0,
        )

    @contextlib.asynccontextmanager
    async def read_store_tar(self, kind: str, name: str) -> AsyncIterator[api.FileDownload]:
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p, data in sorted(self._store(kind, name)["files"].items()):
                info = tarfile.TarInfo(p.decode(errors="replace").lstrip("/"))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        async def chunks() -> AsyncIterator[bytes]:
            yield buf.getvalue()

        yield api.FileDownload(None, chunks())

    async def write_store_tar(
        self, kind: str, name: str, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        import io
        import tarfile

        files = self._store(kind, name)["files"]
        raw = b"".join([c async for c in chunks])
        await self._step("write_store_tar", f"{kind}/{name}")
        read: dict[bytes, bytes] = {}  # the whole tar first: one it cannot read changes nothing
        try:
            with tarfile.open(fileobj=io.BytesIO(raw), mode="r:*") as tar:
                for m in tar:
                    if m.isfile():
                        f = tar.extractfile(m)
                        read[b"/" + m.name.encode()] = f.read() if f else b""
        except (tarfile.TarError, EOFError, OSError) as e:  # as worker.host.treetar answers
            raise errors.InvalidRequest(
                f"the body is not a tar archive: {e}; send a tar (optionally gzip) stream; nothing was written"
            ) from None
        files.update(read)
        return api.TarWritten("/", len(read), 0, 0, sum(map(len, read.values())))

    async def open_pty(self, sandbox_id: str, spec: api.PtySpec) -> api.PtyStarted:
        self._running(sandbox_id)
        await self._step("open_pty", sandbox_id)
        return self.ptys.open(sandbox_id, spec)

    async def list_ptys(self, sandbox_id: str) -> Sequence[api.PtyInfo]:
        self._running(sandbox_id)
        return [s.info() for s in self.ptys.sessions.get(sandbox_id, {}).values()]

    async def kill_pty(self, sandbox_id: str, pty_id: str) -> None:
        self._running(sandbox_id)
        self.ptys.kill(sandbox_id, pty_id)

    async def attach_pty(self, sandbox_id: str, pty_id: str) -> api.PortStream:
        self._running(sandbox_id)
        await self._step("attach_pty", sandbox_id)
        return self.ptys.get(sandbox_id, pty_id).attach()

    async def events(self) -> AsyncIterator[api.WorkerEvent]:
        q: asyncio.Queue = asyncio.Queue()
        self._queues.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._queues.discard(q)

    async def aclose(self) -> None:
        self.closed = True
        self.ptys.close_all()
        for timer in self._timers:
            timer.cancel()

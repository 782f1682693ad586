"""The seam between the control plane and a worker: the typed interface and its plain data types.

The control plane holds one `WorkerAPI` per worker: the worker itself in `atoll up`
(`worker.node.Node`), an HTTP client of a separate `atoll worker` process
(`controlplane.remote_worker.RemoteWorker`), or `atoll.testing.FakeWorker` in tests. Verbs are
coarse, one per intent; the worker owns every runtime-specific step of them (thaw before a
checkpoint, the checkpoint gate, re-freezing a gated sandbox, host task pressure, liveness) and
answers with an outcome that says what it reached and why. Nothing crosses the seam but these
types: no callbacks, no shared objects. Exec, processes and files are defined here, in atoll's
own terms; the guest agent's protocol stays behind the worker.

The worker reports what happens on its own as `events()`: a sandbox died, it is busy (its
processes use CPU), its runtime changed phase on the worker's initiative, a template's status
changed, resource usage. Events are hints
delivered at most once; `inventory()` is the truth the control plane reconciles against.

`PROTOCOL_VERSION` is the version of this interface on the wire (core.wire): both sides send it
and refuse a peer that speaks another.
"""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from atoll.core.lifecycle import Phase, Tier

# The seam's exec request: one definition, shared with the guest agent (which imports nothing of atoll).
from atoll.guest.agent.execspec import ExecSpec as ExecSpec

PROTOCOL_VERSION = 15
"""15: run_process (start a background process and follow its output in one call: E2B's
envd `Start`); 14: named snapshots in the shared object store (store_snapshot, stored_snapshots,
WorkerInfo.shared_store; a create's snapshot_id may name one this worker fetches; delete_snapshot
removes the stored copy too); 13: named snapshots (snapshot, delete_snapshot, SandboxSpec.snapshot_id); 12: a worker registering again sends `proof` (core.wire.registration_proof) that it holds the
token of the registration it replaces; 11: pause(end_streams) ends the sandbox's output follows and watches first (ProcessEnded, a
watch's `ended` event) and a process killed by a signal says which (ProcessInfo.signal,
ProcessExit.signal); 10: store entries with owner and times (StoreEntry: list_store_files with `depth`,
stat_store_file, make_store_dir, set_store_file_attrs); 9: builds in the object store (BuildInfo.in_store; a create or a build may name a build the
worker lacks, which it fetches by id); 8: adopt (an archived sandbox moves to another worker through the store); 7: volumes and drives (issue 19: SandboxSpec.mounts, the store verbs); 6: SecretBinding.allow_http (a secret goes over plain HTTP only when it says so), and the
tunnel's connections into a sandbox's port relayed by the worker's gateway process; 5: interactive work (issue 9: terminals, process handles, stdin, files stat/watch/tar, metrics); 4: user templates (build_template, build_log, delete_build, BuildInfo, SandboxSpec.build_id),
pools (claim) and fork; 3: secrets (SandboxSpec.secrets, set_secrets), the installation CA (SandboxSpec.trust_pem,
set_authority) and connections into a sandbox's port (open_port); 2: SandboxSpec.network and the
set_network verb; 1: the first split (issue 6)."""

FilePath = str | bytes
"""A path inside the sandbox: text, or its exact bytes for names that are not UTF-8."""


# ---- describing and placing sandboxes --------------------------------------------------------


@dataclass(frozen=True)
class SecretBinding:
    """One secret a sandbox may use: its placeholder (what the sandbox sees), the value the
    egress gateway puts in its place in requests to `hosts` (names, or `*.suffix`). The value is
    never logged (not in repr) and never written to the worker's disk."""

    placeholder: str
    value: str = field(repr=False)
    hosts: tuple[str, ...] = ()
    allow_http: bool = False
    """Whether the value may go over plain HTTP (in clear text); else only over HTTPS."""


@dataclass(frozen=True)
class Authority:
    """The installation's CA as a worker uses it: the root sandboxes trust, and the intermediate
    (certificate and key) its egress gateway signs intercepted HTTPS with. Kept in memory only."""

    root_pem: str
    cert_pem: str
    key_pem: str = field(repr=False)


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a worker needs to make a sandbox. Later issues add network policy, volumes,
    drives and secret placeholders here."""

    sandbox_id: str
    template: str
    memory_mb: int
    cpus: float
    disk_mb: int
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    network: dict[str, list[str]] = field(default_factory=dict)
    """Egress policy, `{"allow_out": [...], "deny_out": [...]}` (core.netpolicy); empty = deny all."""
    secrets: tuple[SecretBinding, ...] = ()
    """Placeholders the gateway replaces (their variables are already in `env`)."""
    trust_pem: str = ""
    """The installation's root CA: installed in the sandbox's own trust store (never the template)."""
    build_id: str = ""
    """The user template's build it starts from (its snapshot); "" for a built-in template."""
    mounts: tuple[MountSpec, ...] = ()
    """Volumes and drives (on this worker) bind-mounted into it; a sandbox with any boots cold."""
    snapshot_id: str = ""
    """A snapshot on this worker (`snapshot`), or one in the shared object store (`store_snapshot`)
    which this worker then downloads and checks first, it starts from, as a fork's copy does: its files,
    and with a memory snapshot its memory and processes (then `memory_mb` must be the snapshot's).
    Its template, build, user and workdir are the snapshot's; `env` is added to the snapshot's."""


@dataclass(frozen=True)
class MountSpec:
    """A volume or drive a sandbox mounts (core.mounts checked it): `kind` "volume" | "drive", the
    store's `name`, the absolute `path` inside the sandbox."""

    kind: str
    name: str
    path: str
    read_only: bool = False
    size_mb: int = 0
    """A filer-backed drive's size (its quota): a worker that has not mounted it yet mounts it."""


@dataclass(frozen=True)
class StoreInfo:
    """A volume or drive on a worker: its size limit and what is used of it, in MB. `backend`:
    "local" (an ext4 image on this worker) or "filer" (a drive served by ATOLL_FILER_URL, which
    every worker configured with the same filer mounts)."""

    kind: str
    name: str
    size_mb: int
    used_mb: float
    backend: str = "local"


@dataclass(frozen=True)
class TemplateBuild:
    """One build of a user template: its spec (core.templatespec wire form) and, for a template
    built FROM another, the build whose layers and settings it starts from."""

    build_id: str
    spec: dict
    parent_build: str = ""
    memory_mb: int = 512
    """The memory size of the snapshot made at the end (other sizes are made when first used)."""


@dataclass(frozen=True)
class BuildInfo:
    """A user template's build on a worker."""

    build_id: str
    template: str
    status: str  # building | ready | failed
    progress: str = ""
    error: str | None = None
    start_mode: str = ""
    """"snapshot": the start command runs in the snapshot; "after_restore": it could not be saved
    (start_reason says why) and is started after each restore; "": no start command."""
    start_reason: str = ""
    steps: int = 0
    cached_steps: int = 0
    started_at: float | None = None
    built_at: float | None = None
    size_bytes: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start: str | None = None
    in_store: bool = False
    """Published in the object store: a worker that lacks it fetches it by id (worker.images.buildpack)."""


@dataclass(frozen=True)
class Capacity:
    memory_mb: int
    cpus: float
    disk_mb: int
    slots: int = 0
    """The most sandboxes holding its resources (creating, running, memory tier) it takes
    (`atoll worker --slots`, ATOLL_WORKER_SLOTS); 0: no limit. Sent at registration."""


@dataclass(frozen=True)
class TemplateInfo:
    """A template a worker can start, with its build status on that worker."""

    name: str
    status: str  # missing | building | ready | failed
    hash: str = ""
    progress: str = ""
    error: str | None = None
    description: str = ""
    packages: tuple[str, ...] = ()
    built_at: float | None = None
    size_bytes: int | None = None


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    version: str
    protocol: int
    installation: str
    """The worker's installation id (derived from its ATOLL_HOME): the same name with another
    installation is another machine, not a restart."""
    capacity: Capacity
    templates: tuple[TemplateInfo, ...] = ()
    default_disk_mb: int = 4096
    builds: tuple[BuildInfo, ...] = ()
    """User template builds it holds (ready, building, or failed)."""
    tunnel_port: int = 0
    """The port of its tunnel listener (worker.tunnel; same host as its API): the ingress
    router's way into its sandboxes. 0: none (an in-process worker is called directly)."""
    shared_store: bool = False
    """Its object store is one other workers read too (S3, or ATOLL_ARCHIVE_DIR set): it uploads
    named snapshots there (`store_snapshot`) and creates from stored snapshots it does not keep."""


# ---- lifecycle outcomes ----------------------------------------------------------------------


@dataclass(frozen=True)
class CreateOutcome:
    how: str  # "template image" | "cold boot"
    duration_ms: float


@dataclass(frozen=True)
class PauseOutcome:
    """Where a pause left the sandbox: `tier` reached, None when it is (still or again) running.
    `reason` says why it is not in the tier asked for (the checkpoint gate's blockers, open
    connections); `busy` that the sandbox could not be paused now and a retry may succeed."""

    tier: Tier | None
    reason: str | None = None
    busy: bool = False


@dataclass(frozen=True)
class ResumeOutcome:
    tier: Tier  # the tier it came back from
    duration_ms: float


@dataclass(frozen=True)
class AdoptOutcome:
    """Another worker's archived sandbox, now recorded here (archived): how many of its template
    layers had to be fetched from the store, and what it took."""

    layers_fetched: int
    duration_ms: float


@dataclass(frozen=True)
class ForkOutcome:
    """A fork: the copies made (their ids, in order) and what it cost; the parent runs on."""

    sandbox_ids: tuple[str, ...]
    checkpoint_ms: float
    duration_ms: float


@dataclass(frozen=True)
class SnapshotOutcome:
    """A snapshot kept on the worker: its size on disk (memory image + writable layer copy), the
    memory size a create from it must use (0: files only, any size), what it cost."""

    snapshot_id: str
    bytes: int
    memory_mb: int
    checkpoint_ms: float
    duration_ms: float


@dataclass(frozen=True)
class StoredSnapshot:
    """A named snapshot uploaded to the shared object store (`store_snapshot`): the bytes of the
    stored object (compressed) and what the upload cost."""

    snapshot_id: str
    bytes: int
    duration_ms: float


@dataclass(frozen=True)
class RuntimeReport:
    """One runtime a worker holds, as its inventory reports it."""

    sandbox_id: str
    phase: Phase
    generation: int
    failure: str | None = None
    busy: bool = False
    """A step (create, pause, resume, delete, compaction) is running on it right now: its phase is
    about to change, so reconciliation leaves it alone this time."""
    stale_runtime: bool = False
    """It is not what a create would make now: its memory was made under a guest agent or runsc
    the worker no longer starts sandboxes with (it was made before they changed, or by a version
    that did not record what it was made under), so it may not speak the worker's current
    protocol; or it trusts other CA certificates than a new sandbox gets (the worker's
    ATOLL_SANDBOX_CA_FILE or the installation's root, `set_authority`, changed since). A pool
    member so marked is never handed out; the pool keeper replaces it. (Added within protocol 6:
    a peer that does not send it sends False, and a worker refuses to claim such a sandbox
    whatever its control plane knows.)"""


@dataclass(frozen=True)
class KeptSnapshot:
    """A named snapshot a worker keeps (`snapshot`), with when it was kept (Unix seconds); or one in
    the shared object store (`stored_snapshots`), with when it was stored and `holder`, the
    installation id of the worker that uploaded it (the control plane removes only its own
    workers' snapshots: a store may be shared beyond one installation)."""

    snapshot_id: str
    kept_at: float
    holder: str = ""


@dataclass(frozen=True)
class Inventory:
    worker: str
    runtimes: tuple[RuntimeReport, ...]
    snapshots: tuple[KeptSnapshot, ...] = ()
    """The named snapshots it keeps: the control plane deletes those no record names (a snapshot
    call whose answer was lost, a delete while the worker was away)."""


@dataclass(frozen=True)
class ReconcileReport:
    """What one reconciliation pass of a worker's host did, and what it cost the worker."""

    runtimes: int
    removed: tuple[str, ...]
    failed: tuple[str, ...]
    wall_ms: float
    cpu_ms: float


# ---- exec, processes, files ------------------------------------------------------------------


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    stdout: str
    stderr: str
    duration_ms: int
    timed_out: bool
    stdout_truncated_bytes: int = 0
    stderr_truncated_bytes: int = 0


@dataclass(frozen=True)
class ExecOutput:
    """A piece of a streamed command's output."""

    stream: Literal["stdout", "stderr"]
    text: str
    kind: Literal["output"] = "output"


@dataclass(frozen=True)
class ExecExit:
    """The end of a streamed command."""

    exit_code: int | None
    timed_out: bool
    duration_ms: int
    kind: Literal["exit"] = "exit"


ExecEvent = ExecOutput | ExecExit


@dataclass(frozen=True)
class ProcessStarted:
    pid: int
    log_path: str | None = None


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    cmd: str | list[str] | None
    running: bool
    exit_code: int | None
    background: bool
    started_at: float
    log_path: str | None = None
    stdin_open: bool = False
    timed_out: bool = False
    output_bytes: int = 0
    """Offset after the newest byte of its output (stdout and stderr counted together)."""
    signal: int | None = None
    """The signal that ended it (its exit_code is then 128 + signal), whoever sent it; None when
    it exited by itself (or is running). An `exit 137` is exit_code 137 and signal None."""


@dataclass(frozen=True)
class ProcessOutput:
    """A piece of a background process's output; `offset` is the byte offset after it (resume
    reading there)."""

    stream: Literal["stdout", "stderr"]
    text: str
    offset: int
    kind: Literal["output"] = "output"
    b64: str | None = None
    """The piece's exact bytes, base64, when `text` does not carry them (output that is not UTF-8:
    `text` has U+FFFD there); None when `text` is exact."""


@dataclass(frozen=True)
class ProcessDropped:
    """Output before `offset` is no longer kept (the per-process buffer holds the newest bytes):
    `dropped` bytes were skipped from the offset asked for."""

    dropped: int
    offset: int
    kind: Literal["dropped"] = "dropped"


@dataclass(frozen=True)
class ProcessExit:
    """The end of a background process's output: it exited, and everything it wrote was read."""

    exit_code: int | None
    timed_out: bool
    duration_ms: int
    offset: int
    kind: Literal["exit"] = "exit"
    signal: int | None = None
    """As ProcessInfo.signal: the signal that ended it, None when it exited by itself."""


@dataclass(frozen=True)
class ProcessEnded:
    """The end of a follow that is not the process's end: the sandbox was paused with
    `end_streams` (`reason` "paused"). The process runs on after a resume; read again from
    `offset` (where this follow stopped)."""

    reason: str
    offset: int
    kind: Literal["ended"] = "ended"


ProcessEvent = ProcessOutput | ProcessDropped | ProcessExit | ProcessEnded


def process_line(ev: ProcessEvent) -> dict[str, typing.Any]:
    """One event as a line of the public output stream (`GET …/processes/{pid}/output`, served by
    the API and by the edge alike)."""
    if isinstance(ev, ProcessOutput):
        return {ev.stream: ev.text, "offset": ev.offset}
    if isinstance(ev, ProcessDropped):
        return {"dropped": ev.dropped, "offset": ev.offset}
    if isinstance(ev, ProcessEnded):
        return {"ended": ev.reason, "offset": ev.offset}
    line: dict[str, typing.Any] = {"exit_code": ev.exit_code, "timed_out": ev.timed_out}
    if ev.signal is not None:
        line["signal"] = ev.signal
    return {**line, "duration_ms": ev.duration_ms, "offset": ev.offset}


MAX_STDIN_BYTES = 16 << 20
"""The most one send_stdin call carries (the public stdin route's body limit)."""


@dataclass(frozen=True)
class FileEntry:
    name: str
    path: str
    name_b64: str
    path_b64: str
    type: str  # file | dir | symlink | other
    size: int
    mode: int
    mtime: float


@dataclass(frozen=True)
class FileStat:
    """One path's lstat (issue 9): `target` is a symlink's target, else None."""

    name: str
    path: str
    name_b64: str
    path_b64: str
    type: str  # file | dir | symlink | other
    size: int
    mode: int
    mtime: float
    target: str | None = None


@dataclass(frozen=True)
class StoreEntry:
    """One path of a drive's or volume's tree with its owner and times (lstat; a symlink is
    reported as itself, with its `target`). What the store file verbs answer; times are unix s."""

    name: str
    path: str
    name_b64: str
    path_b64: str
    type: str  # file | dir | symlink | other
    size: int
    mode: int
    uid: int
    gid: int
    atime: float
    mtime: float
    ctime: float
    target: str | None = None


MAX_LIST_DEPTH = 16
"""The deepest a store listing goes (`depth`)."""
MAX_LIST_ENTRIES = 100_000
"""The most entries one store listing answers (a bigger tree: list its parts)."""


@dataclass(frozen=True)
class FileEvent:
    """A change seen by a watch: `type` is ready (the watch is in place; first) | create | modify |
    delete | rename (`from_path` is the old path) | chmod | overflow (events were lost; last) |
    ended (the sandbox was paused with `end_streams`; last, `path` is the watched directory)."""

    type: str
    path: str
    is_dir: bool = False
    from_path: str | None = None


@dataclass(frozen=True)
class TarWritten:
    """What an unpacked tar wrote under `path`."""

    path: str
    files: int
    dirs: int
    links: int
    bytes: int


@dataclass
class FileDownload:
    """An open file: its size when known, and its content, read chunk by chunk (never whole)."""

    size: int | None
    chunks: AsyncIterator[bytes]


@dataclass(frozen=True)
class SandboxMetrics:
    """Resource figures of one sandbox now (cgroups, its writable layer, its guest agent). A
    sandbox in standby is not woken for them: cpu_percent is 0, memory is what its frozen cgroup
    holds (0 in the disk tier), processes is None (only the agent can count them)."""

    sandbox_id: str
    phase: Phase
    cpu_percent: float
    """Share of one CPU its processes used over about the last 2 s, in percent."""
    memory_used_mb: float
    """Host memory its cgroup charges (programs plus gVisor's own use)."""
    memory_limit_mb: int
    """Memory its programs may use (the create's memory_mb)."""
    disk_used_mb: float
    """Space used in its writable layer's filesystem."""
    disk_limit_mb: int
    """Size of that filesystem (the create's disk_mb)."""
    processes: int | None
    """Processes inside the sandbox (None: not counted, it is in standby)."""


@dataclass(frozen=True)
class PtySpec:
    """A terminal to open: its size (1..guest.agent.ptyframes.MAX_COLS/MAX_ROWS), `term` (TERM, default
    xterm-256color), `cmd` (default: the user's login shell, as a login shell; a string runs
    with that shell's -c; a list is the argv), and cwd/env/user as for exec."""

    cols: int
    rows: int
    term: str | None = None
    cmd: str | list[str] | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    user: str | None = None


@dataclass(frozen=True)
class PtyStarted:
    pty_id: str
    pid: int


@dataclass(frozen=True)
class PtyInfo:
    """A terminal session: running, or finished (kept a while so a late attach gets the code)."""

    pty_id: str
    pid: int
    cmd: str | list[str] | None
    cols: int
    rows: int
    term: str
    running: bool
    exit_code: int | None
    created_at: float
    attached: int = 0


# ---- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SandboxDied:
    sandbox_id: str
    cause: str
    kind: Literal["died"] = "died"


@dataclass(frozen=True)
class SandboxActivity:
    """The sandbox is busy in a way only its worker sees (its processes use CPU): the control
    plane counts it as activity, so the idle policy leaves it running."""

    sandbox_id: str
    reason: str
    kind: Literal["activity"] = "activity"


@dataclass(frozen=True)
class RuntimeChanged:
    """The worker moved a runtime on its own (e.g. it compacted it, or a reconciliation pass
    found it in another phase)."""

    sandbox_id: str
    phase: Phase
    reason: str = ""
    kind: Literal["changed"] = "changed"


@dataclass(frozen=True)
class TemplateChanged:
    template: TemplateInfo
    kind: Literal["template"] = "template"


@dataclass(frozen=True)
class BuildChanged:
    build: BuildInfo
    kind: Literal["build"] = "build"


@dataclass(frozen=True)
class Usage:
    """Resource use of one running sandbox since its runtime started (cgroup counters)."""

    sandbox_id: str
    cpu_seconds: float
    memory_bytes: int
    host_tasks: int
    egress_allowed: int = 0
    """Connections its egress gateway let through since the worker attached it."""
    egress_refused: int = 0
    """Connections the gateway refused (policy, never-reachable, limits, failed upstreams)."""
    dns_refused: int = 0
    """DNS questions the gateway answered REFUSED (names no policy entry could allow)."""
    generation: int = 0
    """The runtime generation the CPU time belongs to: a restore starts a new one whose cgroup
    counts from 0 (controlplane.metering counts a new generation from 0)."""
    egress_bytes: int = 0
    """TCP bytes the sandbox sent through its gateway (egress and answers to previews) since
    the worker started (a restarted worker counts from 0 again)."""
    ingress_bytes: int = 0
    """TCP bytes that reached the sandbox through its gateway, since the worker started."""


@dataclass(frozen=True)
class SnapshotUsage:
    """Bytes a sandbox's standby image really takes, measured by the worker that holds it: in the
    disk tier the allocated blocks of its checkpoint and its upper (writable) layer image, in the
    archive tier the size of its object in the store (from the archive's manifest). The memory
    tier holds no image (its memory is metered as standby memory) and is not reported."""

    sandbox_id: str
    tier: Tier
    bytes: int


@dataclass(frozen=True)
class StoreUsage:
    """Bytes used in a volume or drive (its worker name, core.mounts.worker_name): statvfs of the
    mounted filesystem — (blocks − free blocks) × fragment size, what `df` shows as used — for an
    ext4 image as for a filer drive's FUSE mount."""

    kind: str
    name: str
    used_bytes: int


@dataclass(frozen=True)
class UsageReport:
    """What a worker measured, every few seconds: its running sandboxes (`items`), its standby
    images (`snapshots`) and its stores (`stores`). A worker of an earlier version sends only
    `items`: the other two default to empty (controlplane.metering then meters standby images
    and stores at their size bounds)."""

    items: tuple[Usage, ...]
    snapshots: tuple[SnapshotUsage, ...] = ()
    stores: tuple[StoreUsage, ...] = ()
    kind: Literal["usage"] = "usage"


WorkerEvent = SandboxDied | SandboxActivity | RuntimeChanged | TemplateChanged | BuildChanged | UsageReport


# ---- the interface ---------------------------------------------------------------------------


@typing.runtime_checkable
class PortStream(Protocol):
    """A connection into a sandbox's port, opened by its worker; its sandbox side is ended with an
    RST (a FIN would leave an endpoint the next checkpoint cannot save)."""

    async def read(self, n: int) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...

    def detach(self) -> typing.Any:
        """The connected socket itself (socket.socket) for another process to serve — the
        ingress router's — or None when this stream cannot give it up; before any read or write."""
        ...


class WorkerAPI(Protocol):
    """What the control plane may ask of a worker. Errors are `core.errors.AtollError`s:
    `SandboxNotFound` (the worker has no such runtime), `SandboxDied` (it died under the call),
    `Unavailable` (the worker cannot be reached; nothing is known about the sandbox's state)."""

    async def info(self) -> WorkerInfo: ...

    async def create(self, spec: SandboxSpec) -> CreateOutcome: ...

    async def pause(
        self, sandbox_id: str, tier: Tier, *, only_if_idle: bool = False, end_streams: bool = False
    ) -> PauseOutcome:
        """Freeze (memory) or checkpoint (disk). `only_if_idle`: the idle policy asks; a sandbox
        with open connections on its external interface stays running (outcome tier None).
        Calls in flight make it `busy`, unless `end_streams`: then the sandbox's process output
        follows end with ProcessEnded and its watches with an `ended` event first (E2B's pause
        ends them and the processes run on after a resume); other calls still make it busy."""
        ...

    async def resume(self, sandbox_id: str, keep_archive: bool = False) -> ResumeOutcome:
        """Run it again from the tier it is in. `keep_archive`: one coming back from the archive
        tier leaves its archive in the store (else it is removed, being stale), so that the
        control plane can restore it on another worker from there if this one is lost."""
        ...

    async def adopt(self, sandbox_id: str, mounts: Sequence[MountSpec]) -> AdoptOutcome:
        """Take over a sandbox another worker archived into the shared store (its worker is gone):
        recorded here archived, resumed by the next call. `mounts`: its volumes and drives (only
        filer-backed drives can follow). 409 not_adoptable with the reason when this worker cannot
        run it (another guest agent or runsc, layers not published, a volume); 404 when the store
        holds no archive of it."""
        ...

    async def delete(self, sandbox_id: str) -> None: ...

    async def set_network(self, sandbox_id: str, network: dict[str, list[str]]) -> dict[str, list[str]]:
        """Replace the sandbox's egress policy (core.netpolicy wire form), live, in any phase;
        returns it as stored (normalized)."""
        ...

    async def set_secrets(self, sandbox_id: str, secrets: Sequence[SecretBinding]) -> None:
        """Replace the sandbox's secret bindings (a secret replaced or deleted), live."""
        ...

    async def set_authority(self, authority: Authority) -> None:
        """The CA the worker's egress gateway signs intercepted HTTPS with, and the root its
        sandboxes trust (given first at every adoption, before `inventory`: the root is what the
        worker compares its pooled sandboxes' trust with)."""
        ...

    async def open_port(self, sandbox_id: str, port: int) -> PortStream:
        """A TCP connection into the running sandbox's `port` (the ingress router's way in). It
        counts as the sandbox's activity while bytes move; a disk checkpoint resets it when idle.
        Raises ConnectionRefusedError (nothing listens there) or an AtollError."""
        ...

    async def build_template(self, build: TemplateBuild) -> BuildInfo:
        """Start building a user template (in the background); BuildChanged events follow."""
        ...

    def build_log(self, build_id: str) -> typing.AsyncContextManager[AsyncIterator[bytes]]:
        """The build's log from its start; the iterator ends when the build does."""
        ...

    async def delete_build(self, build_id: str) -> None:
        """Forget a build and remove its snapshots (layers stay cached by content)."""
        ...

    async def claim(self, sandbox_id: str, env: dict[str, str], cpus: float) -> ResumeOutcome:
        """Wake a pooled sandbox for its new owner: thaw it and give it the caller's environment
        and CPU count (its id, hostname and generation are already its own). A sandbox that is not
        what a create would make now (see RuntimeReport.stale_runtime) is refused, 409
        invalid_state, before any thaw."""
        ...

    async def fork(self, sandbox_id: str, new_ids: Sequence[str]) -> ForkOutcome:
        """Checkpoint the running sandbox once and restore it as itself and as each of `new_ids`
        (their runtimes take the parent's spec, with their own identity). A sandbox the checkpoint
        gate refuses raises SandboxBusy/Conflict with the reason and is left untouched."""
        ...

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, memory: bool = True, end_streams: bool = False
    ) -> SnapshotOutcome:
        """Keep the running sandbox's state as snapshot `snapshot_id` on this worker: checkpointed
        and restored as a fork's parent is; its image (with `memory`) and a copy of its writable
        layer are kept under the worker's `snapshots/<id>/`. Refused as fork is: volumes or drives
        mounted or the checkpoint gate's blockers (Conflict), calls in flight (SandboxBusy) —
        unless `end_streams`, which ends output follows and watches first, as pause's does (E2B's
        create_snapshot pauses the sandbox; its processes run on)."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a kept snapshot (nothing if it is not here), and its copy in the shared object
        store if there is one (503 when the store fails: retry)."""
        ...

    async def store_snapshot(self, snapshot_id: str) -> StoredSnapshot:
        """Upload a snapshot this worker keeps to the shared object store (its template layers
        too), so that any worker with that store creates from it. 404 snapshot_not_found when it
        is not kept here; 409 snapshot_unavailable when this worker has no shared store; 503 when
        the store fails (retry)."""
        ...

    async def stored_snapshots(self) -> list[KeptSnapshot]:
        """The named snapshots whole in the shared object store (any worker's; [] without one): the
        control plane removes those of its workers that no record names and marks the rest stored."""
        ...

    async def inventory(self) -> Inventory: ...

    async def reconcile(self) -> ReconcileReport:
        """Reconcile the host with the worker's records now (it also does so periodically)."""
        ...

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> ExecResult: ...

    def exec_stream(
        self, sandbox_id: str, spec: ExecSpec
    ) -> typing.AsyncContextManager[AsyncIterator[ExecEvent]]:
        """Run a command and stream its output; the iterator raises an AtollError if the stream
        breaks. Leaving the context early kills the command."""
        ...

    async def start_process(self, sandbox_id: str, spec: ExecSpec) -> ProcessStarted: ...

    def run_process(
        self, sandbox_id: str, spec: ExecSpec
    ) -> typing.AsyncContextManager[tuple[ProcessStarted, AsyncIterator[ProcessEvent]]]:
        """Start a background process and follow its output from offset 0, in one call: entered
        once it started (a spec that cannot start is refused as by `start_process`), it gives the
        process and its events as `process_output(…, 0, follow=True)` gives them (a pause with
        `end_streams` ends them with ProcessEnded). Leaving early leaves the process running."""
        ...

    async def list_processes(self, sandbox_id: str) -> Sequence[ProcessInfo]: ...

    async def kill_process(self, sandbox_id: str, pid: int) -> None: ...

    async def metrics(self, sandbox_id: str) -> SandboxMetrics:
        """Its resource figures now, in any phase but deleting (a standby sandbox is not woken)."""
        ...

    # process handles (issue 9): one process, its output from an offset, stdin, signals, wait
    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo: ...

    def process_output(
        self, sandbox_id: str, pid: int, offset: int, follow: bool
    ) -> typing.AsyncContextManager[AsyncIterator[ProcessEvent]]:
        """A background process's output from `offset` (its lines, then its exit once it ended);
        `follow` waits for more until it exits. Leaving early leaves the process running."""
        ...

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool) -> int:
        """Write `data` to a background process's stdin (then close it if `eof`); bytes written."""
        ...

    async def signal_process(self, sandbox_id: str, pid: int, signal: str) -> None:
        """Send `signal` (a name such as "TERM", core.signals) to the process's group."""
        ...

    async def wait_process(self, sandbox_id: str, pid: int, timeout_s: float | None) -> ProcessInfo:
        """Its record once it exited; ProcessRunning (409) if still running after `timeout_s`."""
        ...

    def read_file(self, sandbox_id: str, path: FilePath) -> typing.AsyncContextManager[FileDownload]: ...

    async def write_file(
        self, sandbox_id: str, path: FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> None: ...

    async def list_files(self, sandbox_id: str, path: FilePath) -> Sequence[FileEntry]: ...

    async def delete_file(self, sandbox_id: str, path: FilePath) -> None: ...

    # files, issue 9: stat/mkdir/move/chmod, watch, tar
    async def stat_file(self, sandbox_id: str, path: FilePath) -> FileStat:
        """lstat of `path`; FileNotFound when it does not exist."""
        ...

    async def make_dir(self, sandbox_id: str, path: FilePath) -> bool:
        """mkdir -p; True when it created the directory, False when it was one already."""
        ...

    async def move_file(self, sandbox_id: str, src: FilePath, dst: FilePath) -> FileStat:
        """Rename `src` to `dst` (parents of `dst` created); the stat of `dst`."""
        ...

    async def chmod_file(self, sandbox_id: str, path: FilePath, mode: int) -> FileStat: ...

    def watch_files(
        self, sandbox_id: str, path: FilePath, recursive: bool
    ) -> typing.AsyncContextManager[AsyncIterator[FileEvent]]:
        """Watch a directory: entering raises FileNotFound (and other errors) before any event;
        the first event is `ready`. Leaving the context ends the watch inside the sandbox."""
        ...

    async def write_tar(
        self, sandbox_id: str, path: FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> TarWritten:
        """Unpack a tar (plain, gzip, bzip2, xz) into directory `path`, created; a tar with any
        member pointing outside is refused whole (InvalidRequest) with nothing written."""
        ...

    def read_tar(self, sandbox_id: str, path: FilePath) -> typing.AsyncContextManager[FileDownload]:
        """The directory's contents as a tar stream (size None)."""
        ...

    # volumes and drives (issue 19): ext4 images on the worker, mounted into sandboxes at create
    async def create_store(self, kind: str, name: str, size_mb: int) -> StoreInfo: ...

    async def get_store(self, kind: str, name: str) -> StoreInfo: ...

    async def delete_store(self, kind: str, name: str) -> None:
        """Remove it and its data (the control plane refuses while a sandbox mounts it)."""
        ...

    async def clone_store(self, kind: str, name: str, new_name: str) -> StoreInfo:
        """A point-in-time copy (the filesystem frozen while the image is copied)."""
        ...

    async def list_store_files(
        self, kind: str, name: str, path: FilePath, depth: int
    ) -> Sequence[StoreEntry]:
        """The entries under directory `path`, `depth` levels down (1: its own entries), parents
        before what is in them; links are listed, never followed."""
        ...

    async def stat_store_file(self, kind: str, name: str, path: FilePath) -> StoreEntry: ...

    async def make_store_dir(
        self,
        kind: str,
        name: str,
        path: FilePath,
        parents: bool,
        mode: int | None,
        uid: int | None,
        gid: int | None,
    ) -> StoreEntry:
        """Make directory `path` (its parents too when `parents`; an existing directory is kept),
        then set the given mode and owner on it."""
        ...

    async def set_store_file_attrs(
        self, kind: str, name: str, path: FilePath, mode: int | None, uid: int | None, gid: int | None
    ) -> StoreEntry:
        """Set the mode (permission bits) and owner of `path` (a link itself, never its target)."""
        ...

    async def delete_store_file(self, kind: str, name: str, path: FilePath) -> None: ...

    def read_store_file(
        self, kind: str, name: str, path: FilePath
    ) -> typing.AsyncContextManager[FileDownload]: ...

    async def write_store_file(
        self, kind: str, name: str, path: FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> FileStat:
        """Write a file (parents made), atomically: readers see the old file or the whole new one."""
        ...

    def read_store_tar(self, kind: str, name: str) -> typing.AsyncContextManager[FileDownload]:
        """The whole tree as a tar stream, members relative to its root (flushed first)."""
        ...

    async def write_store_tar(
        self, kind: str, name: str, chunks: AsyncIterator[bytes], size: int | None
    ) -> TarWritten:
        """Unpack a tar into the tree's root (members with absolute names, `..` or links leading
        out are refused)."""
        ...

    async def open_pty(self, sandbox_id: str, spec: PtySpec) -> PtyStarted:
        """Start a terminal session in the running sandbox; it lives until its command ends or
        `kill_pty`, attached or not."""
        ...

    async def list_ptys(self, sandbox_id: str) -> Sequence[PtyInfo]: ...

    async def kill_pty(self, sandbox_id: str, pty_id: str) -> None:
        """Kill the session's process tree and forget it (NotFound `pty_not_found` if unknown)."""
        ...

    async def attach_pty(self, sandbox_id: str, pty_id: str) -> PortStream:
        """The session's byte stream in guest.agent.ptyframes frames: the scrollback, then live output, an
        EXIT frame at the end; DATA and RESIZE frames in. Closing detaches (the session lives on);
        a disk checkpoint resets it."""
        ...

    def events(self) -> AsyncIterator[WorkerEvent]:
        """The worker's events, from now on, until the worker goes away or `aclose()`."""
        ...

    async def aclose(self) -> None: ...

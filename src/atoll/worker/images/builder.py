"""User template builds on this worker: the steps of a spec (core.templatespec) as cached layers,
then one boot of the result, its start command run until ready, and a checkpoint of it — the
snapshot every create of the template restores.

A build runs in the background (`start`); its state is `<home>/builds/<build_id>/build.json` and
its log `<home>/builds/<build_id>/log`, streamed while it grows (`log_stream`). Steps:

1. The bottom: the `base` template's layer, the parent build's layers (FROM another template: its
   env, workdir and user carry over, its start command only together with its ready check), or
   an OCI archive unpacked (worker.layers).
2. Each step, in order, by content hash: a cached layer is reused; otherwise a `files` step is
   written on the host, and an `apt`, `pip` or `run` step runs in a build sandbox (gVisor, like
   every sandbox) whose egress allows only the package indexes (`ATOLL_BUILD_ALLOW_OUT`); its
   writable layer becomes the step's layer.
3. The snapshot: a sandbox of the stack boots with the template's env; the workdir is made; the
   start command runs as the template's user; the build waits for the ready check (a command
   exiting 0, or a port listening inside — read from /proc/net/tcp inside, never a connection from
   the host, which would leave state this runsc cannot save) or, without one, for the first TCP
   listener (at most START_GRACE_S). The checkpoint gate is asked first: a start command it
   refuses (an epoll-based server) is stopped, the sandbox is saved without it, and the start
   command runs after each restore instead (`start_mode` "after_restore", with the reason).
   The checkpoint and the sandbox's writable layer (files the boot wrote, which open files need)
   are kept under the build: `images/<runtime key>/<memory>m/` and `.../<memory>m.upper/`.

A snapshot's memory holds what the worker put there besides the template: the guest agent, the
runsc sentry, the bundle's process (worker.host.snapshots.RuntimeKey). So every build's snapshots
are kept under the runtime key they were made under, and only the current key's are restored: after
the agent or runsc changed, a create finds none, boots cold from the build's layers (which are still
valid) and the snapshot is made again in the background; `prepare_builtin` removes the images of
other keys of every build at start-up (`sweep_images`).

Built-in templates (`base`) are builds too (`builtin`): zero steps over their mmdebstrap root file
system (worker.images.templates), no start command, id `<name>-<digest>` where the digest covers
the layer (a new layer makes a new build; `prepare_builtin` removes the old ones at start-up).
Their snapshots are made, keyed, cached and restored exactly like a user build's. A create restores
the snapshot of its memory size; the first create of a size without one boots cold and makes it in
the background, for at most MAX_IMAGE_SIZES sizes per build (further sizes boot cold; a size whose
snapshot failed is not retried until the worker restarts).

Time limits (worker settings): a step that runs in a build sandbox may take `step_timeout_s`
(ATOLL_BUILD_STEP_TIMEOUT_S), the whole build `build_timeout_s` (ATOLL_BUILD_TIMEOUT_S); past
either the build fails naming the step (or what it was doing), and the build sandbox is deleted on
the way out like on any failure.

Builds are immutable once ready; a new build of the same template is another build id, and the
sandboxes of the old one keep running from its layers.

With an object store the other workers read (`store`, set by worker.node), a ready build is
published there (`publish`: its layers and `builds/<id>.json`, worker.images.buildpack; `in_store`
then), and a create or a build FROM a build this worker lacks fetches it by id (`ensure`: once per
build however many ask; its very layers, sha256-checked, never built again here) and keeps it as a
ready build of its own (`fetched`). Its snapshots are made here, from those layers. Called by
worker.node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import time
import typing
from dataclasses import dataclass, field

from atoll.core import errors, ids, templatespec
from atoll.core import worker_api as api
from atoll.worker.host import bundle, objectstore, storage
from atoll.worker.images import buildpack, image_cache, layers
from atoll.worker.runtimes.guest import Guest
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore
from atoll.worker.runtimes.sandboxes import Sandboxes
from atoll.worker.runtimes.tiers import Tiers

log = logging.getLogger(__name__)

BUILD_MEMORY_MB = 2048
BUILD_DISK_MB = 16384
IMAGE_DISK_MB = 1024
"""The disk of the temporary sandbox a snapshot is made from (a create's own disk is its own)."""
START_GRACE_S = 10.0
"""A start command without a ready check that never listens on a TCP port is saved this long after
it started."""
STEP_TIMEOUT_S = 1800.0
BUILD_TIMEOUT_S = 3600.0
LOG_LIMIT = 8 * 2**20
MAX_IMAGE_SIZES = 8
TOOLS_ENV = {"PATH": templatespec.DEFAULT_PATH}
"""The env of atoll's own commands in a build or template sandbox (mkdir of a workdir, `id` of a
user, the listen probe): they find their programs on the default PATH, whatever PATH the template
sets for its own commands (`PATH=/nonexistent` is the template's business, not theirs)."""

# Reads /proc/net/tcp{,6} inside the sandbox: exit 0 when something listens on the port (argv[1];
# "any": on any port but the guest agent's). No connection is made.
_LISTEN_PROBE = r"""
import sys
want = sys.argv[1]
ports = set()
for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        lines = open(name).read().splitlines()[1:]
    except OSError:
        continue
    for ln in lines:
        f = ln.split()
        if len(f) > 3 and f[3] == "0A":
            ports.add(int(f[1].rsplit(":", 1)[1], 16))
ports.discard(49999)
sys.exit(0 if (ports if want == "any" else int(want) in ports) else 1)
"""


@dataclass
class Build:
    build_id: str
    template: str
    status: str = "building"
    progress: str = ""
    error: str | None = None
    start_mode: str = ""
    start_reason: str = ""
    steps: int = 0
    cached_steps: int = 0
    started_at: float = field(default_factory=time.time)
    built_at: float | None = None
    size_bytes: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start: str | None = None
    ready: dict | None = None
    layers: list[str] = field(default_factory=list)
    """Host paths of its layers, top first (the overlay lowerdir order)."""
    top_key: str = ""
    memory_mb: int = 512
    in_store: bool = False
    """Published in the object store (worker.images.buildpack): other workers can fetch it."""
    fetched: bool = False
    """Fetched from the store, not built here."""

    def info(self) -> api.BuildInfo:
        return api.BuildInfo(
            build_id=self.build_id,
            template=self.template,
            status=self.status,
            progress=self.progress,
            error=self.error,
            start_mode=self.start_mode,
            start_reason=self.start_reason,
            steps=self.steps,
            cached_steps=self.cached_steps,
            started_at=self.started_at,
            built_at=self.built_at,
            size_bytes=self.size_bytes,
            env=dict(self.env),
            workdir=self.workdir,
            user=self.user,
            start=self.start,
            in_store=self.in_store,
        )

    @property
    def lower(self) -> str:
        return layers.stack(self.layers)


class BuildFailed(errors.InvalidRequest):
    """A build step failed (its command's output is in the build log)."""


class Image(typing.NamedTuple):
    """A build's snapshot at one memory size, as a create restores it."""

    dir: str
    """The checkpoint (runsc's --image-path)."""
    seed_upper: str | None
    """The writable layer it was saved with, or None when the boot wrote nothing a create needs."""
    start_mode: str
    """The size's own: "snapshot", "after_restore" (its start command runs after each restore) or ""."""
    runtime_key: str
    """What its memory was made under (worker.host.snapshots.RuntimeKey): the restored sandbox's."""


class Builder:
    def __init__(
        self,
        home: str,
        layer_store: layers.LayerStore,
        builtin_rootfs: typing.Callable[[str], typing.Awaitable[tuple[str, str]]],
        runtimes: RuntimeStore,
        sandboxes: Sandboxes,
        tiers: Tiers,
        guest: Guest,
        delete: typing.Callable[[str], typing.Awaitable[typing.Any]],
        spawn: typing.Callable[[typing.Awaitable], None],
        emit: typing.Callable[[api.BuildInfo], None],
        build_network: dict,
        build_env: dict[str, str],
        apt_sources: str | None = None,
        step_timeout_s: float = STEP_TIMEOUT_S,
        build_timeout_s: float = BUILD_TIMEOUT_S,
    ):
        self.root = os.path.join(home, "builds")
        storage.private_dir(self.root)
        self.layers = layer_store
        self._builtin_rootfs = builtin_rootfs
        """A built-in template's layer: (content key, path), built first if needed."""
        self.runtimes = runtimes
        self.sandboxes = sandboxes
        self.tiers = tiers
        self.guest = guest
        self._delete = delete
        self._spawn = spawn
        """Tracks a background task the worker waits for when it stops (a temporary's deletion)."""
        self._emit = emit
        self.build_network = build_network
        self.build_env = build_env
        self.apt_sources = apt_sources
        """ATOLL_APT_SOURCES: the sources list of apt steps (written into the build sandbox's /tmp)."""
        self.step_timeout_s = step_timeout_s
        self.build_timeout_s = build_timeout_s
        self._builds: dict[str, Build] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._grew: dict[str, asyncio.Event] = {}
        self._image_locks: dict[str, asyncio.Lock] = {}
        self._image_tasks: dict[str, asyncio.Task] = {}
        self._image_failed: set[str] = set()
        self._seeds: dict[str, str | None] = {}
        self._builtins: dict[str, Build] = {}
        self.store: objectstore.ObjectStore | None = None
        """The object store builds are published to and fetched from: set by worker.node when it can
        be shared with other workers (S3, ATOLL_ARCHIVE_DIR); None keeps builds on this worker."""
        self.holder = ""
        """This worker's installation id (named in the manifests it publishes)."""
        self._fetch_locks: dict[str, asyncio.Lock] = {}
        self._publishing: set[asyncio.Task] = set()
        self.temporary: set[str] = set()
        """Ids of the build's and the snapshots' temporary sandboxes (busy: never paused or reported)."""
        self.image_cache: str | None = None
        """ATOLL_TEST_IMAGE_CACHE (set by worker.node): built-in templates' start-up images shared
        by this host's installations (worker.images.image_cache; test suites only)."""
        self._load()

    # ---- records --------------------------------------------------------------------------------
    def _dir(self, bid: str, *parts: str) -> str:
        return os.path.join(self.root, bid, *parts)

    def _load(self) -> None:
        for bid in os.listdir(self.root):
            try:
                with open(self._dir(bid, "build.json")) as f:
                    b = Build(**json.load(f))
            except (OSError, ValueError, TypeError):
                continue
            if b.status == "building":  # the process that ran it is gone
                b.status, b.error = "failed", "the worker restarted during the build; build again"
                self._save(b)
            self._builds[bid] = b

    def _save(self, b: Build) -> None:
        path = self._dir(b.build_id, "build.json")
        with open(path + ".tmp", "w") as f:
            json.dump(b.__dict__, f)
        os.replace(path + ".tmp", path)
        self._emit(b.info())

    def infos(self) -> tuple[api.BuildInfo, ...]:
        return tuple(b.info() for b in self._builds.values())

    def get(self, bid: str) -> Build:
        b = self._builds.get(bid)
        if b is None or b.status != "ready":
            state = "unknown on this worker" if b is None else b.status
            raise errors.TemplateNotFound(f"template build {bid} is {state}; build the template again")
        gone = [p for p in b.layers if not os.path.isdir(p)]
        if gone:  # removed from a layer cache shared with another installation (worker.images.layer_gc)
            raise errors.TemplateNotFound(
                f"template build {bid} lost {len(gone)} of its layers from the layer cache ({gone[0]}): "
                "they went unused longer than ATOLL_LAYER_CACHE_TTL_S on every installation sharing "
                "the template directory; build the template again"
            )
        return b

    # ---- the object store (worker.images.buildpack) --------------------------------------------
    async def publish(self, b: Build) -> bool:
        """Put the ready build `b` in the store (its layers, then its manifest); `in_store` follows
        (BuildChanged tells the control plane). A failure is logged: the build still serves here."""
        assert self.store is not None
        t0 = time.monotonic()
        man = buildpack.BuildManifest(
            build_id=b.build_id,
            template=b.template,
            layers=[],
            top_key=b.top_key,
            env=dict(b.env),
            workdir=b.workdir,
            user=b.user,
            start=b.start,
            ready=b.ready,
            start_mode=b.start_mode,
            start_reason=b.start_reason,
            steps=b.steps,
            cached_steps=b.cached_steps,
            size_bytes=b.size_bytes,
            memory_mb=b.memory_mb,
            built_at=b.built_at,
            holder=self.holder,
        )
        try:
            await buildpack.publish(self.store, man, b.lower, self._dir(b.build_id))
        except (objectstore.StoreError, buildpack.BuildDamaged, OSError, KeyError) as e:
            log.warning(
                "template %s: build %s not published to %s (%s); only this worker can create from it",
                b.template,
                b.build_id,
                self.store.name,
                e,
            )
            self._log(b, f"NOTE not published to the object store: {e}")
            return False
        if self._builds.get(b.build_id) is not b:  # deleted meanwhile
            await buildpack.forget(self.store, b.build_id)
            return False
        b.in_store = True
        self._log(b, f"PUBLISHED to {self.store.name} in {time.monotonic() - t0:.1f}s")
        log.info(
            "template %s: build %s published to %s in %.0f ms",
            b.template,
            b.build_id,
            self.store.name,
            (time.monotonic() - t0) * 1000,
        )
        self._save(b)
        return True

    async def ensure(self, bid: str) -> Build:
        """The ready build `bid`: this worker's, or fetched from the store by its id when this
        worker never had it (its very layers, sha256-checked, cached like a local build's; never
        built again). One fetch per build at a time: concurrent creates wait for the first."""
        if bid in self._builds or self.store is None or not ids.is_build_id(bid):
            return self.get(bid)
        async with self._fetch_locks.setdefault(bid, asyncio.Lock()):
            if bid in self._builds:
                return self.get(bid)
            return await self._fetch(bid)

    async def _fetch(self, bid: str) -> Build:
        assert self.store is not None
        t0 = time.monotonic()
        storage.private_dir(self._dir(bid))
        try:
            man = await buildpack.fetch_manifest(self.store, bid, self._dir(bid))
            paths = await buildpack.fetch_layers(self.store, self.layers, man)
        except buildpack.BuildMissing:
            shutil.rmtree(self._dir(bid), ignore_errors=True)
            raise errors.BuildUnavailable(
                f"template build {bid} is neither on this worker nor in the object store "
                f"({self.store.name}); build the template again"
            ) from None
        except buildpack.BuildDamaged as e:
            shutil.rmtree(self._dir(bid), ignore_errors=True)
            raise errors.BuildUnavailable(
                f"template build {bid} in the object store cannot be used: {e}; build the template again"
            ) from None
        except objectstore.StoreError as e:
            shutil.rmtree(self._dir(bid), ignore_errors=True)
            raise errors.Unavailable(
                f"template build {bid} could not be fetched from the object store {self.store.name}: {e}; "
                "try again",
                code="worker_unavailable",
            ) from None
        b = Build(
            build_id=bid,
            template=man.template,
            status="ready",
            progress="ready",
            start_mode=man.start_mode,
            start_reason=man.start_reason,
            steps=man.steps,
            cached_steps=man.cached_steps,
            built_at=man.built_at,
            size_bytes=man.size_bytes,
            env=dict(man.env),
            workdir=man.workdir,
            user=man.user,
            start=man.start,
            ready=man.ready,
            layers=paths,
            top_key=man.top_key,
            memory_mb=man.memory_mb,
            in_store=True,
            fetched=True,
        )
        self._builds[bid] = b
        self._log(b, f"FETCHED build {bid} of {b.template} from {self.store.name} ({len(paths)} layer(s))")
        self._save(b)
        log.info(
            "template %s: build %s fetched from %s in %.0f ms",
            b.template,
            bid,
            self.store.name,
            (time.monotonic() - t0) * 1000,
        )
        return b

    def layer_paths(self) -> set[str]:
        """Host paths of the layers this installation's builds stack (built-in ones included): the
        layer cache's garbage collection keeps them."""
        return {p for b in (*self._builds.values(), *self._builtins.values()) for p in b.layers}

    def building(self) -> bool:
        """Whether a build runs now (its stack so far is in no record yet)."""
        return bool(self._tasks)

    # ---- the log --------------------------------------------------------------------------------
    def _log(self, b: Build, line: str) -> None:
        path = self._dir(b.build_id, "log")
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        if size < LOG_LIMIT:
            with open(path, "a", encoding="utf-8", errors="replace") as f:
                f.write(line.rstrip("\n")[:8192] + "\n")
        ev = self._grew.get(b.build_id)
        if ev is not None:
            ev.set()

    @contextlib.asynccontextmanager
    async def log_stream(self, bid: str) -> typing.AsyncIterator[typing.AsyncIterator[bytes]]:
        if bid not in self._builds:
            raise errors.NotFound(f"no build {bid} on this worker", code="template_not_found")

        async def chunks() -> typing.AsyncIterator[bytes]:
            offset = 0
            path = self._dir(bid, "log")
            while True:
                ev = self._grew.setdefault(bid, asyncio.Event())
                ev.clear()
                with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(1 << 20)
                    if data:
                        offset += len(data)
                        yield data
                        continue
                if self._builds[bid].status != "building":
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ev.wait(), 1.0)

        yield chunks()

    # ---- start ----------------------------------------------------------------------------------
    async def start(self, tb: api.TemplateBuild) -> api.BuildInfo:
        if not ids.is_build_id(tb.build_id):
            raise errors.InvalidRequest(f"malformed build id {tb.build_id!r}")
        if tb.build_id in self._builds:
            return self._builds[tb.build_id].info()
        spec = templatespec.from_wire(tb.spec)
        parent = None
        if spec.from_kind == "template":
            parent = await self.ensure(tb.parent_build)
        storage.private_dir(self._dir(tb.build_id))
        b = Build(build_id=tb.build_id, template=spec.name, memory_mb=tb.memory_mb, steps=len(spec.steps))
        self._builds[b.build_id] = b
        self._save(b)
        self._tasks[b.build_id] = asyncio.ensure_future(self._run(b, spec, parent))
        return b.info()

    async def _run(self, b: Build, spec: templatespec.TemplateSpec, parent: Build | None) -> None:
        t0 = time.monotonic()
        limit = asyncio.timeout(self.build_timeout_s)
        try:
            try:
                async with limit:
                    await self._build(b, spec, parent)
            except TimeoutError:
                if not limit.expired():
                    raise
                raise BuildFailed(
                    f"the build did not finish within {self.build_timeout_s:g}s "
                    f"(ATOLL_BUILD_TIMEOUT_S) and was stopped during {b.progress or 'its start'}; "
                    "make its steps or ready check finish sooner, or raise the limit"
                ) from None
        except asyncio.CancelledError:
            b.status, b.error = "failed", "the build was cancelled (the worker stopped)"
            self._log(b, f"ERROR {b.error}")
            self._save(b)
            raise
        except Exception as e:  # noqa: BLE001 - every failure ends the build with its reason
            message = getattr(e, "message", None) or repr(e)
            if not isinstance(e, errors.AtollError):
                log.exception("template build %s failed", b.build_id)
            elif e.detail:  # the internal cause: the worker's log only, never the build's
                log.warning("template build %s failed: %s", b.build_id, message, extra={"detail": e.detail})
            b.status, b.error = "failed", message
            self._log(b, f"ERROR {message}")
        else:
            b.status, b.built_at, b.progress = "ready", time.time(), "ready"
            self._log(b, f"DONE build {b.build_id} of {b.template} ready in {time.monotonic() - t0:.1f}s")
        finally:
            self._tasks.pop(b.build_id, None)
        self._save(b)
        if b.status == "ready" and self.store is not None:
            self._publish_later(b)

    def _publish_later(self, b: Build) -> None:
        task = asyncio.ensure_future(self.publish(b))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    def publish_pending(self) -> int:
        """Start-up: publish, in the background, the ready builds of this worker not in the store
        (made before the store was shared, or their publication cut short). Returns how many."""
        if self.store is None:
            return 0
        pending = [
            b for b in self._builds.values() if b.status == "ready" and not b.in_store and not b.fetched
        ]
        for b in pending:
            self._publish_later(b)
        return len(pending)

    async def _build(self, b: Build, spec: templatespec.TemplateSpec, parent: Build | None) -> None:
        say = lambda line: self._log(b, line)  # noqa: E731
        say(f"build {b.build_id} of template {spec.name}: FROM {spec.from_}, {len(spec.steps)} step(s)")
        env: dict[str, str] = {}
        workdir, user, start, ready = None, None, None, None
        if spec.from_kind == "base":
            base_key, bottom = await self._builtin_rootfs("base")
            stack = [bottom]
        elif spec.from_kind == "template":
            assert parent is not None
            base_key, stack = parent.top_key, list(reversed(parent.layers))
            env, workdir, user = dict(parent.env), parent.workdir, parent.user
            start, ready = parent.start, parent.ready
        else:
            base_key, bottom, config = await self.layers.bottom_from_archive(spec.oci_path or "", say)
            stack = [bottom]
            env = dict(config.env)
            workdir, user = config.workdir or None, config.user or None
            argv = [*config.entrypoint, *config.cmd]
            start = shlex.join(argv) if argv else None
        if spec.start is not None:
            start, ready = spec.start, spec.ready.__dict__ if spec.ready else None
        elif spec.ready is not None:
            ready = spec.ready.__dict__
        env.update(dict(spec.env))
        if workdir and workdir != "/":  # steps that name no workdir run in the parent's (Docker's way)
            spec = dataclasses.replace(
                spec,
                steps=tuple(
                    dataclasses.replace(s, workdir=workdir) if s.workdir == "/" else s for s in spec.steps
                ),
            )
        workdir = spec.workdir or workdir
        user = spec.user or user
        if layers.find_file(list(reversed(stack)), bundle.AGENT_PYTHON[1:]) is None:
            raise BuildFailed(
                f"FROM {spec.from_}: the image has no /usr/bin/python3, which atoll's guest agent "
                "runs on; start from an image with python3 (3.8 or newer) installed"
            )
        keys = templatespec.step_keys(spec, base_key)
        for i, (step, key) in enumerate(zip(spec.steps, keys, strict=True), 1):
            b.progress = f"step {i}/{len(spec.steps)}: {step.describe()}"
            self._save(b)
            if await self.layers.use(key):
                b.cached_steps += 1
                say(f"CACHED [{i}/{len(spec.steps)}] {step.describe()}")
            else:
                say(f"STEP [{i}/{len(spec.steps)}] {step.describe()}")
                async with self.layers.making(key) as fs:
                    if fs is None:
                        b.cached_steps += 1
                    else:
                        limit = asyncio.timeout(self.step_timeout_s)
                        try:
                            async with limit:
                                await self._run_step(b, step, stack, {**env, **dict(step.env)}, fs)
                        except TimeoutError:
                            if not limit.expired():
                                raise
                            raise BuildFailed(
                                f"step {i}/{len(spec.steps)} ({step.describe()}) did not finish within "
                                f"{self.step_timeout_s:g}s (ATOLL_BUILD_STEP_TIMEOUT_S); it was stopped "
                                "and its build sandbox deleted. Make the step finish sooner, or raise "
                                "the limit"
                            ) from None
                        self.layers.commit(key, fs, step.describe())
            stack.append(self.layers.path(key))
            layers.stack(stack)  # refuse a stack the mount cannot take, before the snapshot
            if layers.find_file(list(reversed(stack)), bundle.AGENT_PYTHON[1:]) is None:
                raise BuildFailed(
                    f"step {i} ({step.describe()}) removed /usr/bin/python3, which atoll's guest agent "
                    "runs on; keep python3 (3.8 or newer) in the template"
                )
        b.layers = list(reversed(stack))
        b.top_key = keys[-1] if keys else base_key
        b.env, b.workdir, b.user, b.start, b.ready = env, workdir, user, start, ready
        b.progress = "booting the template and making its snapshot"
        self._save(b)
        await self._snapshot(b, b.memory_mb, say)
        b.size_bytes = sum(_layer_size(p) for p in b.layers[:-1] if "/layers/" in p)

    # ---- build steps ----------------------------------------------------------------------------
    def _step_command(self, step: templatespec.Step) -> tuple[str, str | None]:
        """The shell command of an apt, pip or run step, and the user it runs as (None: root)."""
        if step.kind == "apt":
            pkgs = " ".join(shlex.quote(p) for p in step.packages)
            # ATOLL_APT_SOURCES (worker setting): a sources list in /tmp (memory, never in the layer)
            sources = 'APT_OPTS=""; '
            if self.apt_sources:
                sources = (
                    f"printf '%s\\n' {shlex.quote(self.apt_sources)} > /tmp/atoll-sources.list; "
                    'APT_OPTS="-o Dir::Etc::SourceList=/tmp/atoll-sources.list -o Dir::Etc::SourceParts=-"; '
                )
            return (
                "set -e; export DEBIAN_FRONTEND=noninteractive; "
                f"{sources}apt-get $APT_OPTS update; "
                f"apt-get $APT_OPTS install -y --no-install-recommends {pkgs}; apt-get clean; "
                "rm -rf /var/lib/apt/lists/*",
                None,
            )
        if step.kind == "pip":
            pkgs = " ".join(shlex.quote(p) for p in step.packages)
            # options as variables: a pip too old for one ignores it instead of failing
            return (
                "set -e; export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore "
                "PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1; "
                f"python3 -m pip install {pkgs}",
                None,
            )
        return step.command, None if step.user in ("", "root") else step.user

    async def _run_step(
        self, b: Build, step: templatespec.Step, stack: list[str], env: dict[str, str], fs: str
    ) -> None:
        if step.kind == "files":
            moved = await self.layers.files_layer(fs, step.files, list(reversed(stack)))
            for path, real in moved:  # Docker's way: /bin/x over /bin -> usr/bin is /usr/bin/x
                self._log(b, f"  {path} is {real} (through the template's symbolic links)")
            self._log(b, f"  wrote {len(step.files)} file(s)")
            return
        cmd, user = self._step_command(step)
        async with self._temporary(
            b,
            layers.stack(list(reversed(stack))),
            memory_mb=BUILD_MEMORY_MB,
            cpus=float(os.cpu_count() or 1),
            env={**env, **self.build_env},
            disk_mb=BUILD_DISK_MB,
            network=self.build_network,
        ) as rt:
            sid = rt.sandbox_id
            if user is not None:
                user = await self._check_user(sid, user)
            if step.workdir != "/":  # made by root, as Docker's WORKDIR does
                await self.guest.exec(
                    sid,
                    api.ExecSpec(cmd=["mkdir", "-p", step.workdir], env=TOOLS_ENV, max_output_bytes=4096),
                )
            spec = api.ExecSpec(
                cmd=["/bin/sh", "-c", cmd],
                max_output_bytes=1 << 16,
                user=user,
                cwd=step.workdir,
                # a backstop: the step's own limit (asyncio, in _build) ends it first, by name
                timeout_s=self.step_timeout_s + 60,
            )
            exit_code, tail = await self._stream(b, sid, spec)
            if exit_code != 0:
                raise BuildFailed(
                    f"step {step.describe()!r} failed with exit code {exit_code}: "
                    + " | ".join(tail[-5:])[-1500:]
                )
            await self.sandboxes.stop_container(rt)
            await self.layers.from_upper(fs, self.runtimes.path(sid, "upper", "upper"))

    async def _stream(self, b: Build, sid: str, spec: api.ExecSpec) -> tuple[int | None, list[str]]:
        tail: list[str] = []
        exit_code: int | None = None
        partial = {"stdout": "", "stderr": ""}
        async with self.guest.exec_stream(sid, spec) as events:
            async for ev in events:
                if isinstance(ev, api.ExecOutput):
                    text = partial[ev.stream] + ev.text
                    *lines, partial[ev.stream] = text.split("\n")
                    for ln in lines:
                        ln = ln.rstrip("\r").rsplit("\r", 1)[-1]  # a progress bar: its last state
                        self._log(b, "  " + ln)
                        tail = (tail + [ln])[-20:]
                else:
                    exit_code = 124 if ev.timed_out else ev.exit_code
        for rest in partial.values():
            if rest:
                self._log(b, "  " + rest)
                tail.append(rest)
        return exit_code, tail

    async def _check_user(self, sid: str, user: str) -> str:
        """The user's name (a numeric uid — `USER 1000` — is looked up: commands run as names)."""
        r = await self.guest.exec(
            sid, api.ExecSpec(cmd=["id", "-nu", user], env=TOOLS_ENV, max_output_bytes=4096)
        )
        name = r.stdout.strip()
        if r.exit_code != 0 or not name:
            raise BuildFailed(
                f"user {user!r} does not exist in the template; add it first (a run step "
                f"`useradd -m {user}` in the spec, or RUN useradd before USER in a Dockerfile)"
            )
        if user.isdigit() and name.isdigit():
            raise BuildFailed(f"uid {user} has no name in the template's /etc/passwd; add one with useradd")
        return name

    @contextlib.asynccontextmanager
    async def _temporary(self, b: Build, lower: str, **spec: typing.Any) -> typing.AsyncIterator[Runtime]:
        """A temporary sandbox of the build (a step's, or the one its snapshot is made from),
        booted cold from `lower`; recorded first (a crash leaves nothing unowned) and deleted on
        the way out, even when cancelled half-way."""
        sid = ids.new_sandbox_id()
        self.temporary.add(sid)
        try:
            rt = self.runtimes.new(sid, template=f"build:{b.build_id}", temporary=True, **spec)
            await self.sandboxes.start(rt, lower, None)
            yield rt
        finally:
            # shielded and tracked: a cancel (the worker stopping) may land here, while the
            # deletion runs; the worker waits for tracked tasks before it exits
            deletion = asyncio.ensure_future(self._delete(sid))
            self._spawn(deletion)
            try:
                with contextlib.suppress(Exception):
                    await asyncio.shield(deletion)
            finally:
                self.temporary.discard(sid)

    # ---- built-in templates ---------------------------------------------------------------------
    async def builtin(self, name: str, memory_mb: int = 512) -> Build:
        """The built-in template `name` as a ready build of zero steps over its layer (built
        first if needed). `memory_mb`: the size its start-up snapshot is made at."""
        key, rootfs = await self._builtin_rootfs(name)
        bid = f"{name}-{self._digest(key)}"
        b = self._builtins.get(name)
        if b is None or b.build_id != bid:
            storage.private_dir(self._dir(bid))
            b = Build(
                build_id=bid,
                template=name,
                status="ready",
                progress="ready",
                layers=[rootfs],
                top_key=key,
                memory_mb=memory_mb,
            )
            self._builtins[name] = b
        return b

    def known_builtin(self, name: str) -> Build | None:
        """The built-in template's build as this worker last made or found it (None before)."""
        return self._builtins.get(name)

    @staticmethod
    def _digest(layer_key: str) -> str:
        """A built-in template's build is its layer: what its snapshots hold besides (the agent,
        runsc) keys the images inside the build, as for every build."""
        return hashlib.blake2b(layer_key.encode(), digest_size=8).hexdigest()

    async def prepare_builtin(self, name: str, memory_mb: int, snapshot: bool = True) -> None:
        """Start-up: the built-in template's layer and (`snapshot`) its snapshot at `memory_mb`;
        the builds of it that other versions left, the `template-images/` directory of the
        versions before built-in templates were builds, and every build's images of another
        runtime key (`sweep_images`) are removed."""
        b = await self.builtin(name, memory_mb)
        ours = re.compile(rf"{re.escape(name)}-[0-9a-f]{{16}}")
        for d in os.listdir(self.root):
            if ours.fullmatch(d) and d != b.build_id:
                log.info("template %s: removing the snapshots of an older version (%s)", name, d)
                await asyncio.to_thread(shutil.rmtree, self._dir(d), True)
        legacy = os.path.join(os.path.dirname(self.root), "template-images")
        if os.path.isdir(legacy):
            await asyncio.to_thread(shutil.rmtree, legacy, True)
        await self.sweep_images()
        if snapshot:
            if self.image_cache and await self._adopt_shared(b, memory_mb):
                return
            await self._snapshot_later(b, memory_mb)
            if self.image_cache:
                await self._publish_shared(b, memory_mb)

    async def _adopt_shared(self, b: Build, memory_mb: int) -> bool:
        """The start-up image from the test image cache (worker.images.image_cache), if it has one."""
        assert self.image_cache is not None
        key = self.sandboxes.runtime_key()
        dest = self._image_dir(b, memory_mb, key)
        async with self._image_locks.setdefault(dest, asyncio.Lock()):
            if os.path.exists(os.path.join(dest, "manifest.json")):
                return True
            return await asyncio.to_thread(
                image_cache.adopt, self.image_cache, b.build_id, key, memory_mb, dest
            )

    async def _publish_shared(self, b: Build, memory_mb: int) -> None:
        assert self.image_cache is not None
        key = self.sandboxes.runtime_key()
        dest = self._image_dir(b, memory_mb, key)
        if os.path.exists(os.path.join(dest, "manifest.json")):
            await asyncio.to_thread(image_cache.publish, self.image_cache, b.build_id, key, memory_mb, dest)

    # ---- the snapshot ---------------------------------------------------------------------------
    def _image_dir(self, b: Build, memory_mb: int, runtime_key: str) -> str:
        return self._dir(b.build_id, "images", runtime_key, f"{memory_mb}m")

    async def sweep_images(self) -> list[str]:
        """Remove every build's images made under another runtime key than this worker's (and those
        of the layout before images were keyed, `images/<memory>m`): no create restores them again.
        Returns what was removed."""
        current = self.sandboxes.runtime_key()
        removed = []
        for bid in os.listdir(self.root):
            images = self._dir(bid, "images")
            try:
                names = os.listdir(images)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                if name == current:
                    continue
                path = os.path.join(images, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    await asyncio.to_thread(shutil.rmtree, path, True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                removed.append(path)
        if removed:
            log.info(
                "removed %d template image(s) made under another guest agent or runsc (runtime key now %s)",
                len(removed),
                current,
            )
        return removed

    def image(self, b: Build, memory_mb: int) -> Image | None:
        """The build's snapshot at this memory size made under this worker's runtime key, or None:
        that create boots cold, and a snapshot of the size is made in the background."""
        runtime_key = self.sandboxes.runtime_key()
        d = self._image_dir(b, memory_mb, runtime_key)
        if os.path.exists(os.path.join(d, "manifest.json")):
            try:
                with open(d + ".mode") as f:
                    mode = f.read().strip()
            except OSError:
                mode = b.start_mode
            if d not in self._seeds:
                self._seeds[d] = d + ".upper" if _needed(d + ".upper", b.layers) else None
            return Image(d, self._seeds[d], mode, runtime_key)
        try:
            sizes = sum(1 for n in os.listdir(os.path.dirname(d)) if n.endswith("m"))
        except FileNotFoundError:
            sizes = 0
        if (
            d not in self._image_tasks
            and d not in self._image_failed
            and sizes + len(self._image_tasks) < MAX_IMAGE_SIZES
        ):
            task = asyncio.ensure_future(self._snapshot_later(b, memory_mb))
            self._image_tasks[d] = task
            task.add_done_callback(lambda _t: self._image_tasks.pop(d, None))
        return None

    async def _snapshot_later(self, b: Build, memory_mb: int) -> None:
        d = self._image_dir(b, memory_mb, self.sandboxes.runtime_key())
        try:
            await self._snapshot(b, memory_mb, lambda line: log.info("build %s: %s", b.build_id, line))
        except Exception as e:  # noqa: BLE001 - that size keeps booting cold; say why
            self._image_failed.add(d)
            log.warning(
                "template %s: no template image of %d MB (build %s: %s); its sandboxes of that size "
                "boot cold",
                b.template,
                memory_mb,
                b.build_id,
                getattr(e, "message", None) or e,
            )

    async def _snapshot(self, b: Build, memory_mb: int, say: typing.Callable[[str], None]) -> None:
        runtime_key = self.sandboxes.runtime_key()
        dest = self._image_dir(b, memory_mb, runtime_key)
        async with self._image_locks.setdefault(dest, asyncio.Lock()):
            if os.path.exists(os.path.join(dest, "manifest.json")):
                return
            t0 = time.monotonic()
            async with self._temporary(
                b, b.lower, memory_mb=memory_mb, cpus=1, env=dict(b.env), disk_mb=IMAGE_DISK_MB, user=b.user
            ) as rt:
                sid = rt.sandbox_id
                if rt.runtime_key != runtime_key:  # runsc was replaced under this worker just now
                    raise BuildFailed(
                        "the runsc binary or the guest agent changed while the snapshot was being "
                        "made; try again"
                    )
                await self.prepare_boot(sid, b)
                mode, reason = "", ""
                if b.start:
                    say(f"START {b.start}")
                    started = await self.start_command(sid, b)
                    await self._wait_ready(b, sid, started, say)
                    gate = await self.guest.gate(sid)
                    mode = "snapshot"
                    if not gate.ok:
                        mode, reason = "after_restore", "; ".join(gate.blockers)
                        say(
                            f"the start command cannot be saved in the snapshot ({reason}); it is "
                            "stopped and will run after each restore instead"
                        )
                        await self.guest.kill_all(sid)
                        await asyncio.sleep(0.3)
                elif b.ready:
                    await self._wait_ready(b, sid, None, say)
                gate = await self.guest.gate(sid)
                if not gate.ok:
                    raise BuildFailed("the booted template cannot be saved: " + "; ".join(gate.blockers))
                await self.tiers.checkpoint(rt)
                staged = self.runtimes.path(sid, "snapshot")
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.rmtree(dest + ".upper", ignore_errors=True)
                os.makedirs(dest + ".upper")
                await self.layers.from_upper(dest + ".upper", self.runtimes.path(sid, "upper", "upper"))
                with open(dest + ".mode", "w") as f:
                    f.write(mode)
                os.replace(staged, dest)
                if memory_mb == b.memory_mb:
                    b.start_mode, b.start_reason = mode, reason
                say(f"snapshot of {memory_mb} MB made in {time.monotonic() - t0:.1f}s")
                log.info(
                    "template %s: image made in %.0f ms (%s)",
                    b.template,
                    (time.monotonic() - t0) * 1000,
                    dest,
                )

    async def prepare_boot(self, sid: str, b: Build) -> None:
        """What a fresh boot of the build needs before its start command: the workdir."""
        if b.workdir and b.workdir != "/":
            r = await self.guest.exec(
                sid, api.ExecSpec(cmd=["mkdir", "-p", b.workdir], env=TOOLS_ENV, max_output_bytes=4096)
            )
            if r.exit_code != 0:
                raise BuildFailed(f"workdir {b.workdir!r} cannot be made: {r.stderr.strip()[:300]}")
        if b.user:
            b.user = await self._check_user(sid, b.user)

    async def start_command(self, sid: str, b: Build) -> api.ProcessStarted:
        assert b.start
        return await self.guest.start_process(
            sid,
            # `start` and `ready.cmd` keep sh -c (a Dockerfile CMD's shell form), whatever the sandbox's shell
            api.ExecSpec(
                cmd=b.start, cwd=b.workdir or "/", user=b.user, max_output_bytes=1 << 16, shell="sh"
            ),
        )

    async def _wait_ready(
        self, b: Build, sid: str, started: api.ProcessStarted | None, say: typing.Callable[[str], None]
    ) -> None:
        ready = b.ready or {}
        timeout = float(ready.get("timeout_s") or 120.0)
        if ready.get("cmd"):
            probe = api.ExecSpec(
                cmd=ready["cmd"], cwd=b.workdir or "/", max_output_bytes=4096, timeout_s=30, shell="sh"
            )
            what = f"ready check {ready['cmd']!r}"
        else:
            port = ready.get("port")
            probe = api.ExecSpec(
                cmd=[bundle.AGENT_PYTHON, "-I", "-c", _LISTEN_PROBE, str(port) if port else "any"],
                env=TOOLS_ENV,
                max_output_bytes=4096,
            )
            what = f"port {port} listening" if port else "the start command listening on a TCP port"
            if not port:
                timeout = START_GRACE_S
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            r = await self.guest.exec(sid, probe)
            if r.exit_code == 0:
                say(f"READY ({what})")
                return
            if started is not None:
                procs = {p.pid: p for p in await self.guest.list_processes(sid)}
                p = procs.get(started.pid)
                if p is not None and not p.running:
                    raise BuildFailed(
                        f"the start command exited with code {p.exit_code} before it was ready: "
                        + await self._output_tail(sid, started)
                    )
            if time.monotonic() >= deadline:
                if ready:
                    raise BuildFailed(
                        f"the template never became ready: {what} did not pass within {timeout:.0f}s"
                        + (
                            f"; start command output: {await self._output_tail(sid, started)}"
                            if started
                            else ""
                        )
                    )
                say(
                    f"the start command did not listen on a TCP port within {START_GRACE_S:.0f}s; saving it as it is"
                )
                return
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    async def _output_tail(self, sid: str, started: api.ProcessStarted | None) -> str:
        if started is None or not started.log_path:
            return "(no output)"
        try:
            async with self.guest.read_file(sid, started.log_path) as dl:
                data = b"".join([c async for c in dl.chunks])
        except errors.AtollError:
            return "(its output could not be read)"
        return data.decode(errors="replace")[-1500:].strip() or "(no output)"

    # ---- delete ---------------------------------------------------------------------------------
    async def delete(self, bid: str) -> None:
        task = self._tasks.get(bid)
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self._builds.pop(bid, None)
        await asyncio.to_thread(shutil.rmtree, self._dir(bid), True)
        if self.store is not None and ids.is_build_id(bid):
            try:  # the template is going: no worker fetches the build again
                await buildpack.forget(self.store, bid)
            except objectstore.StoreError as e:
                log.warning("build %s: its manifest stays in %s (%s)", bid, self.store.name, e)

    async def aclose(self) -> None:
        tasks = [*self._tasks.values(), *self._image_tasks.values(), *self._publishing]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=15)


def _needed(upper: str, layers_top_first: list[str]) -> bool:
    """Whether a snapshot's writable layer holds anything a create must start with: a file, or a
    directory the template's layers do not have (an empty copy is a process spawn saved per create)."""
    for dirpath, dirs, files in os.walk(upper):
        if files:
            return True
        for d in dirs:
            path = os.path.join(dirpath, d)
            if (
                os.path.islink(path)
                or layers.find_file(layers_top_first, os.path.relpath(path, upper)) is None
            ):
                return True
            with contextlib.suppress(OSError):
                if os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y":
                    return True  # it hides what the layers below hold there
    return False


def _layer_size(fs: str) -> int:
    try:
        with open(os.path.join(os.path.dirname(fs), "layer.json")) as f:
            return int(json.load(f).get("size_bytes") or 0)
    except (OSError, ValueError):
        return 0

"""The worker façade: create, freeze/thaw, checkpoint/restore, reattach and delete gVisor sandboxes,
and proxy exec/file calls to each sandbox's guest agent.

Runtime facts per sandbox live on disk in `$ATOLL_HOME/sandboxes/<id>/runtime.json` (written before
each step is acknowledged) so that a restarted worker can reattach: a running or frozen sandbox keeps
running under runsc (it is in its own session), a checkpointed one is restored on demand.

Snapshots: `runsc checkpoint` writes into `snapshot.tmp-<gen>/`; when its `done` marker exists the
worker checksums the image, writes `manifest.json` and renames the directory to `snapshot/`, only then
dropping the previous one. The control plane (controlplane.lifecycle) decides *when*; this module
knows *how*. Called by the control plane (in-process in `atoll up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import typing
from dataclasses import asdict, dataclass

from atoll.core import errors, ids
from atoll.worker import agent_channel, agent_pack, bundle, cgroups, netns, runsc, storage, sweep, templates

log = logging.getLogger(__name__)

# Template images are kept for at most this many memory sizes per template (the default size's is
# made at start-up; others on first use, in the background); sandboxes of further sizes boot cold.
MAX_IMAGE_SIZES = 8
# Health checks of the guest agent while a call waits on it (see Worker._watch).
PROBE_AFTER_S = 5.0
PROBE_EVERY_S = 3.0
PROBE_TIMEOUT_S = 4.0
PROBE_FAILURES = 3


@dataclass
class WorkerSettings:
    """Settings of one worker process."""

    home: str
    """Root of this installation's state; sandboxes live under `<home>/sandboxes`."""
    template_dir: str | None = None
    """Template layer cache (default `<home>/templates`)."""
    debian_mirror: str = "http://deb.debian.org/debian"
    """Mirror mmdebstrap builds template layers from."""
    default_disk_mb: int = 4096
    """Disk quota of a sandbox's writable layer when the caller gives none."""
    template_snapshots: bool = True
    """Create sandboxes by restoring a checkpoint of a booted template sandbox (else boot cold)."""


@dataclass
class Runtime:
    """What the worker knows about one sandbox on this host (persisted as runtime.json)."""

    sandbox_id: str
    name: str
    template: str
    memory_mb: int
    cpus: float
    env: dict[str, str]
    disk_mb: int
    generation: int = 0
    phase: str = "creating"  # creating | running | frozen | checkpointing | checkpointed | failed | deleting
    failure: str | None = None
    sentry_pid: int | None = None

    @property
    def cid(self) -> str:
        return f"{self.name}-{self.generation}"

    def cgroup(self, install_id: str) -> str:
        return f"/atoll-{install_id}/{self.sandbox_id}-{self.generation}"


@dataclass
class Observed:
    """Result of reattaching: where the sandbox really is after a worker restart."""

    phase: str  # running | frozen | checkpointed | failed | missing
    reason: str | None = None


@dataclass
class GateResult:
    ok: bool
    blockers: list[str]
    external_connections: int = 0


class Worker:
    def __init__(self, settings: WorkerSettings):
        self.s = settings
        self.install_id = _installation_id(settings.home)
        self.host = sweep.Installation(os.path.realpath(settings.home), self.install_id)
        self.sbx_root = os.path.join(settings.home, "sandboxes")
        self.runsc_root = os.path.join(settings.home, "runsc")
        self.agent_dir = os.path.join(settings.home, "agent")
        self.templates = templates.TemplateStore(
            settings.template_dir or os.path.join(settings.home, "templates"), settings.debian_mirror
        )
        self._runtimes: dict[str, Runtime] = {}
        self._channels: dict[str, agent_channel.AgentChannel] = {}
        self._bg: set[asyncio.Task] = set()
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._template_failed: set[str] = set()
        self._template_keys: dict[str, str] = {}
        self._image_builds: dict[str, asyncio.Task] = {}

    # ---- paths and persistence -------------------------------------------------------------
    def _dir(self, sid: str) -> str:
        return os.path.join(self.sbx_root, sid)

    def _p(self, sid: str, *parts: str) -> str:
        return os.path.join(self._dir(sid), *parts)

    def _save(self, rt: Runtime, durable: bool = True) -> None:
        """Write runtime.json (0600: it holds the sandbox's env) atomically; `durable=False` skips
        the fsync for facts that a restart re-reads from the host anyway (frozen vs running is the
        freezer cgroup's state)."""
        path = self._p(rt.sandbox_id, "runtime.json")
        tmp = path + ".tmp"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(asdict(rt), f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def _load(self, sid: str) -> Runtime | None:
        try:
            with open(self._p(sid, "runtime.json")) as f:
                return Runtime(**json.load(f))
        except FileNotFoundError:
            return None

    def runtime(self, sid: str) -> Runtime:
        rt = self._runtimes.get(sid) or self._load(sid)
        if rt is None:
            raise errors.SandboxNotFound(f"sandbox {sid} has no runtime on this worker")
        self._runtimes[sid] = rt
        return rt

    def channel(self, sid: str) -> agent_channel.AgentChannel:
        ch = self._channels.get(sid)
        if ch is None:
            rt = self.runtime(sid)
            ch = agent_channel.AgentChannel(rt.name, netns.SANDBOX_IP, bundle.AGENT_PORT)
            self._channels[sid] = ch
        return ch

    # ---- start-up ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Prepare the host: private modes on the home (fixing what earlier versions left), nosuid,
        nodev on mounts that lack them, the packed agent, pid_max. Sandboxes are left alone."""
        for d in (self.sbx_root, self.runsc_root):
            storage.private_dir(d)
        os.makedirs(self.agent_dir, exist_ok=True)  # bind-mounted into sandboxes: keeps 0755
        storage.secure_home(self.s.home)
        storage.private_dir(self.templates.dir)
        for mp in await storage.harden_mounts(self.s.home):
            log.warning("added nosuid,nodev to %s (mounted by an earlier version without them)", mp)
        # The agent is packed here into one file (not bind-mounted from site-packages): agent.pyc,
        # every module's bytecode in one file, for templates whose python3 has this interpreter's
        # version (nothing compiles in the sandbox, ~20 ms at every boot in gVisor), else a zipapp
        # of the sources. See agent_pack.
        agent_pack.build(self.agent_dir, dir_in_sandbox=bundle.AGENT_DIR_IN_SANDBOX)
        for stale in ("agent.py", "agent.pyz"):  # what earlier versions ran
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.agent_dir, stale))
        _raise_pid_max()

    async def sweep(self, live: typing.Collection[str]) -> list[str]:
        """Remove this installation's runtime objects that no sandbox in `live` owns (start-up)."""
        return await sweep.sweep(self.host, live)

    def remove_empty_cgroups(self) -> list[str]:
        """Remove the installation's parent cgroups where no sandbox is left (at stop)."""
        return cgroups.remove_empty_parents(self.install_id)

    # ---- create --------------------------------------------------------------------------------
    async def create(
        self,
        sid: str,
        *,
        template: str,
        env: dict[str, str],
        memory_mb: int,
        cpus: float,
        disk_mb: int | None,
        from_image: bool = True,
    ) -> Runtime:
        lower = await self.templates.ensure(template)
        rt = Runtime(
            sandbox_id=sid,
            name=ids.runtime_name(self.install_id, sid),
            template=template,
            memory_mb=memory_mb,
            cpus=cpus,
            env=env,
            disk_mb=disk_mb or self.s.default_disk_mb,
        )
        storage.private_dir(self._dir(sid))
        self._runtimes[sid] = rt
        self._save(rt)
        use_image = from_image and self.s.template_snapshots
        image = await self._template_image(template, memory_mb) if use_image else None
        t0 = time.perf_counter()
        marks: dict[str, float] = {}
        try:
            # Storage and network are independent: set them up concurrently.
            await asyncio.gather(self._prepare_rootfs(rt, lower), netns.create(rt.name))
            marks["prepare"] = time.perf_counter()
            self._write_bundle(rt, lower)
            how = "cold boot"
            if image is not None:
                try:
                    await self._start_from_image(rt, image)
                    marks["runsc"] = time.perf_counter()
                    rt.phase = "running"
                    rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
                    self._save(rt)
                    await self.wait_agent(sid, timeout=30)
                    await self._identify(
                        sid, rt.generation, hostname=_hostname(sid), env=rt.env, cpus=rt.cpus
                    )
                    how = "template image"
                except errors.AtollError as e:
                    log.warning(
                        "starting from the template image failed; booting cold: %s",
                        e,
                        extra={"sandbox_id": sid},
                    )
                    ch = self._channels.pop(sid, None)
                    if ch is not None:
                        await ch.aclose()
                    await runsc.delete(self.runsc_root, rt.cid)
                    cgroups.remove(rt.cgroup(self.install_id))
                    rt.generation += 1
                    rt.sentry_pid = None
                    await netns.readdress(rt.name)
                    self._write_bundle(rt, lower)
                    image = None
            if image is None:
                await runsc.run(self.runsc_root, self._p(sid, "bundle"), rt.cid, self._p(sid, "runsc.log"))
                marks["runsc"] = time.perf_counter()
                rt.phase = "running"
                rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
                self._save(rt)
                await self.wait_agent(sid, timeout=30)
            marks["agent"] = time.perf_counter()
            self._limit_cpu(rt)
        except BaseException as e:
            rt.phase, rt.failure = "failed", str(e)
            self._save(rt)
            log.warning("sandbox create failed", extra={"sandbox_id": sid, "error": str(e)})
            raise
        log.info(
            "sandbox runtime started in %.0f ms by %s (rootfs+netns %.0f, runsc %.0f, agent %.0f)",
            (time.perf_counter() - t0) * 1000,
            how,
            (marks["prepare"] - t0) * 1000,
            (marks["runsc"] - marks["prepare"]) * 1000,
            (marks["agent"] - marks["runsc"]) * 1000,
            extra={"sandbox_id": sid},
        )
        return rt

    # ---- template images ---------------------------------------------------------------------
    def _template_key(self, template: str, memory_mb: int) -> str:
        """Name of the image for `template` at `memory_mb`: the hash of what an image depends on is
        computed once per template and process (the agent's zipapps are rewritten only at start-up).
        The size is part of the key because the sentry keeps the memory size it booted with:
        `MemTotal` inside a restored sandbox is that of the image's sandbox."""
        return f"{template}-{memory_mb}m-{self._template_digest(template)}"

    def _template_digest(self, template: str) -> str:
        digest = self._template_keys.get(template)
        if digest is None:
            digest = self._template_keys[template] = self._compute_template_key(template)
        return digest

    def _compute_template_key(self, template: str) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(self.templates.recipe(template).content_hash().encode())
        for name in (agent_pack.COMPILED, agent_pack.SOURCE):  # whichever the template runs
            with open(os.path.join(self.agent_dir, name), "rb") as f:
                h.update(f.read())
        st = os.stat(shutil.which(runsc.RUNSC) or runsc.RUNSC)
        # images before the agent bound SANDBOX_IP:AGENT_PORT (not the wildcard) are not reused
        h.update(f"{st.st_size}-{st.st_mtime_ns}-{bundle.AGENT_PORT}-{netns.SANDBOX_IP}-bound".encode())
        return h.hexdigest()

    async def _template_image(self, template: str, memory_mb: int, wait: bool = False) -> str | None:
        """A checkpoint of a freshly booted sandbox of `template` with `memory_mb` (agent ready),
        made once per template, size, agent and runsc version. Creating a sandbox restores it
        instead of booting the sentry and starting Python (~200 ms less). None when there is none
        (yet): that create boots cold. The image of the default size is made at start-up
        (`prepare_template`, `wait=True`); one of another size is made in the background the first
        time a sandbox of that size is created, up to MAX_IMAGE_SIZES sizes per template."""
        key = self._template_key(template, memory_mb)
        dest = os.path.join(self.s.home, "template-images", key)
        if os.path.exists(os.path.join(dest, "manifest.json")):
            return dest
        if key in self._template_failed:
            return None
        if not wait:
            self._build_image_later(template, memory_mb, key, dest)
            return None
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if os.path.exists(os.path.join(dest, "manifest.json")):
                return dest
            try:
                await self._make_template_image(template, memory_mb, dest)
            except Exception as e:  # noqa: BLE001 - any failure means: boot cold, and say why
                self._template_failed.add(key)
                log.warning("template %s: no template image (%s); sandboxes boot cold", template, e)
                return None
        return dest

    def _build_image_later(self, template: str, memory_mb: int, key: str, dest: str) -> None:
        if key in self._image_builds:
            return
        if len(self._image_dirs(template)) + len(self._image_builds) >= MAX_IMAGE_SIZES:
            return  # enough sizes kept: other sizes boot cold

        async def build() -> None:
            try:
                await self._template_image(template, memory_mb, wait=True)
            finally:
                self._image_builds.pop(key, None)

        self._image_builds[key] = asyncio.ensure_future(build())

    def _image_dirs(self, template: str, current: bool = True) -> list[str]:
        """This template's image directories: those of the current key (agent, runsc, layer), or
        with current=False the stale ones other versions left."""
        digest = self._template_digest(template)
        root = os.path.join(self.s.home, "template-images")
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return []
        # <template>-<hex16> (before images were kept per size) or <template>-<N>m-<hex16>
        ours = re.compile(rf"{re.escape(template)}-(?:\d+m-)?([0-9a-f]{{16}})")
        out = []
        for d in names:
            m = ours.fullmatch(d)
            if m and (m.group(1) == digest and "m-" in d) == current:
                out.append(os.path.join(root, d))
        return out

    async def prepare_template(self, template: str, memory_mb: int) -> None:
        """Build the template layer and its image for the default size ahead of the first create
        (called at start-up); remove images of this template that older versions made."""
        await self.templates.ensure(template)
        for stale in self._image_dirs(template, current=False):
            log.info("template %s: removing a stale template image %s", template, stale)
            await asyncio.to_thread(shutil.rmtree, stale, True)
        if self.s.template_snapshots:
            await self._template_image(template, memory_mb, wait=True)

    async def _make_template_image(self, template: str, memory_mb: int, dest: str) -> None:
        t0 = time.perf_counter()
        sid = ids.new_sandbox_id()
        try:  # the temporary sandbox is deleted even when this is cancelled half-way (shutdown)
            await self.create(
                sid, template=template, env={}, memory_mb=memory_mb, cpus=1, disk_mb=64, from_image=False
            )
            gate = await self.gate(sid)
            if not gate.ok:
                raise errors.RuntimeFailure("; ".join(gate.blockers))
            await self.checkpoint(sid)
            storage.private_dir(os.path.dirname(dest))
            tmp = dest + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            os.replace(self._p(sid, "snapshot"), tmp)
            os.replace(tmp, dest)
        finally:
            # shielded and tracked in _bg: a cancel (shutdown) must not stop the deletion half-way;
            # aclose() waits for _bg
            deletion = asyncio.ensure_future(self.delete(sid))
            self._bg.add(deletion)
            deletion.add_done_callback(self._bg.discard)
            await asyncio.shield(deletion)
        log.info("template %s: image made in %.0f ms (%s)", template, (time.perf_counter() - t0) * 1000, dest)

    async def _start_from_image(self, rt: Runtime, image: str) -> None:
        await runsc.restore(
            self.runsc_root,
            self._p(rt.sandbox_id, "bundle"),
            rt.cid,
            image,
            self._p(rt.sandbox_id, "runsc.log"),
        )

    async def _identify(
        self, sid: str, generation: int, *, hostname: str, env: dict[str, str], cpus: float
    ) -> None:
        """Give a sandbox restored from a shared image its own identity: id, generation, hostname,
        env, and the CPU count its programs see (the image's was that of the sandbox it was made from)."""
        r = await self.agent_request(
            sid,
            "POST",
            "/identity",
            json={
                "sandbox_id": sid,
                "generation": generation,
                "hostname": hostname,
                "env": env,
                "cpus": cpus,
            },
        )
        if r.json().get("hostname") != hostname:
            raise errors.RuntimeFailure(f"sandbox {sid} kept the template's hostname after restore")

    async def _prepare_rootfs(self, rt: Runtime, lower: str) -> None:
        sid = rt.sandbox_id
        await storage.create_upper(self._p(sid, "upper.img"), self._p(sid, "upper"), rt.disk_mb)
        await storage.mount_rootfs(lower, self._p(sid, "upper"), self._p(sid, "rootfs"))
        _write_identity_files(self._p(sid, "rootfs"), _hostname(sid))

    def _write_bundle(self, rt: Runtime, lower: str | None = None) -> None:
        """Write config.json. The CPU quota is left out: runsc would apply it while the sentry boots or
        restores (runtime work, 50-300 ms slower on one core); `_limit_cpu` sets it right after."""
        bundle.write(
            self._p(rt.sandbox_id, "bundle"),
            bundle.BundleSpec(
                sandbox_id=rt.sandbox_id,
                hostname=_hostname(rt.sandbox_id),
                rootfs=self._p(rt.sandbox_id, "rootfs"),
                agent_dir=self.agent_dir,
                netns_path=netns.path(rt.name),
                cgroup_path=rt.cgroup(self.install_id),
                memory_mb=rt.memory_mb,
                cpus=None,
                env=rt.env,
                generation=rt.generation,
                agent_entry=self._agent_entry(lower),
                visible_cpus=rt.cpus,
                agent_host=netns.SANDBOX_IP,
            ),
        )

    def _agent_entry(self, lower: str | None) -> str:
        if lower is None:  # restore: the process already runs; the entry is not used
            return agent_pack.SOURCE
        py = os.path.realpath(os.path.join(lower, "usr/bin/python3"))
        ours = f"python{sys.version_info.major}.{sys.version_info.minor}"
        has_pyc = os.path.exists(os.path.join(self.agent_dir, agent_pack.COMPILED))
        return agent_pack.COMPILED if has_pyc and os.path.basename(py) == ours else agent_pack.SOURCE

    def _limit_cpu(self, rt: Runtime) -> None:
        cgroups.set_cpu_limit(rt.cgroup(self.install_id), rt.cpus)

    async def wait_agent(self, sid: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        delay = 0.002
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                r = await self.channel(sid).request("GET", "/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except (agent_channel.ChannelError, OSError) as e:
                last = e
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.005)
        raise errors.RuntimeFailure(
            f"the guest agent of sandbox {sid} did not answer within {timeout}s",
            detail=f"last error: {last!r}; runsc log: {runsc.tail(self._p(sid, 'runsc.log'))}",
        )

    # ---- memory tier -------------------------------------------------------------------------
    async def freeze(self, sid: str) -> None:
        rt = self.runtime(sid)
        cgroups.freeze(rt.cgroup(self.install_id))
        rt.phase = "frozen"  # not written: after a restart the freezer cgroup itself says so

    async def thaw(self, sid: str) -> None:
        rt = self.runtime(sid)
        cgroups.thaw(rt.cgroup(self.install_id))
        rt.phase = "running"

    async def thaw_and_ping(
        self, sid: str, timeout: float, while_waiting: typing.Callable[[], None] | None = None
    ) -> dict:
        """Thaw a memory-tier sandbox and return its agent's health answer.

        The health request is written on a kept-alive connection before the thaw (it waits in the
        frozen sentry's socket and is served as soon as its threads run again); `while_waiting`
        (the caller's bookkeeping, e.g. the database write) runs after the thaw, while the sandbox
        wakes up and answers, instead of after the answer.
        """
        rt = self.runtime(sid)
        ping = asyncio.ensure_future(self.channel(sid).request("GET", "/health", timeout=min(2.0, timeout)))
        await asyncio.sleep(0)  # lets the request go out on an idle connection, if there is one
        try:
            cgroups.thaw(rt.cgroup(self.install_id))
            rt.phase = "running"
            if while_waiting is not None:
                while_waiting()
        except BaseException:
            ping.cancel()
            raise
        try:
            r = await ping
            if r.status_code == 200:
                return r.json()
        except (agent_channel.ChannelError, OSError):
            pass
        return await self.wait_agent(sid, timeout=timeout)

    # ---- disk tier -----------------------------------------------------------------------------
    async def gate(self, sid: str) -> GateResult:
        """Ask the guest agent what this runsc could not save. The sandbox must be thawed."""
        rt = self.runtime(sid)
        if cgroups.freezer_state(rt.cgroup(self.install_id)) != "THAWED":
            return GateResult(False, ["the sandbox's cgroup is frozen; thaw before checkpointing"])
        try:
            r = await self.channel(sid).request("GET", "/gate", timeout=10)
            data = r.json()
        except (agent_channel.ChannelError, ValueError) as e:
            return GateResult(False, [f"the checkpoint gate could not be evaluated: {e!r}"])
        blockers = list(data.get("blockers", []))
        return GateResult(not blockers, blockers, int(data.get("external_connections", 0)))

    async def checkpoint(self, sid: str) -> None:
        """Checkpoint a running (thawed, gated) sandbox to disk and release its memory.

        On failure the sandbox is dead (this runsc kills it); the runtime is marked failed with the
        cause and the upper dir is kept.
        """
        rt = self.runtime(sid)
        ch = self._channels.pop(sid, None)
        if ch is not None:
            await ch.aclose()
        # Let the agent's threads see the RSTs and close their sockets before the sentry saves.
        await asyncio.sleep(0.02)
        tmp = self._p(sid, f"snapshot.tmp-{rt.generation}")
        shutil.rmtree(tmp, ignore_errors=True)
        rt.phase = "checkpointing"
        self._save(rt)
        # Saving is the runtime's work, not the sandbox's: do not throttle it to the sandbox's cpus.
        cgroups.set_cpu_limit(rt.cgroup(self.install_id), None)
        t0 = time.perf_counter()
        proc = await runsc.start_checkpoint(self.runsc_root, rt.cid, tmp, self._p(sid, "runsc.log"))
        await proc.wait()
        await self._finish_checkpoint(rt, tmp)
        log.info("checkpoint took %.0f ms", (time.perf_counter() - t0) * 1000, extra={"sandbox_id": sid})

    async def _finish_checkpoint(self, rt: Runtime, tmp: str) -> None:
        sid = rt.sandbox_id
        if not os.path.exists(os.path.join(tmp, "done")):
            cause = runsc.tail(self._p(sid, "runsc.log"))
            rt.phase, rt.failure = "failed", f"runsc checkpoint failed: {cause}"
            self._save(rt)
            shutil.rmtree(tmp, ignore_errors=True)
            self._spawn(self._discard_container(rt.cid, rt.cgroup(self.install_id)))
            raise errors.RuntimeFailure(
                f"checkpoint of sandbox {sid} failed and runsc stopped it (runsc's error is in the server log)",
                detail=f"runsc log: {cause}",
            )
        img = os.path.join(tmp, "checkpoint.img")
        digest, size = await asyncio.to_thread(_checksum, img)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(
                {
                    "sandbox_id": sid,
                    "generation": rt.generation,
                    "image": "checkpoint.img",
                    "size": size,
                    "blake2b": digest,
                    "runsc": "0.0~20221219.0",
                    "created_at": time.time(),
                },
                f,
            )
            f.flush()
            os.fsync(f.fileno())  # the commit below must never expose a manifest that is not on disk
        final = self._p(sid, "snapshot")
        old = self._p(sid, "snapshot.old")
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        old_cid, old_cg = rt.cid, rt.cgroup(self.install_id)
        rt.phase = "checkpointed"
        self._save(rt)
        self._spawn(self._discard_container(old_cid, old_cg))

    async def _discard_container(self, cid: str, cg: str) -> None:
        await runsc.delete(self.runsc_root, cid)
        cgroups.remove(cg)

    async def restore(self, sid: str) -> None:
        rt = self.runtime(sid)
        snap = self._p(sid, "snapshot")
        try:
            with open(os.path.join(snap, "manifest.json")) as f:
                man = json.load(f)
        except FileNotFoundError:
            raise errors.RuntimeFailure(f"sandbox {sid} has no committed snapshot to restore") from None
        img = os.path.join(snap, man["image"])
        if os.path.getsize(img) != man["size"]:
            raise errors.RuntimeFailure(
                f"snapshot of {sid} is damaged: its image has {os.path.getsize(img)} bytes, "
                f"the manifest says {man['size']}",
                detail=img,
            )
        await netns.readdress(rt.name)
        rt.generation += 1
        self._write_bundle(rt)
        self._save(rt)
        t0 = time.perf_counter()
        # The checksum is verified while runsc restores (both read the same image; two cores), and a
        # mismatch throws the restored sandbox away before it serves any call.
        verify = asyncio.ensure_future(asyncio.to_thread(_checksum, img))
        try:
            await runsc.restore(
                self.runsc_root, self._p(sid, "bundle"), rt.cid, snap, self._p(sid, "runsc.log")
            )
            t_runsc = time.perf_counter()
            digest, _size = await verify
            if digest != man["blake2b"]:
                await runsc.delete(self.runsc_root, rt.cid)
                raise errors.RuntimeFailure(
                    f"snapshot of {sid} is damaged: checksum {digest} differs from the committed {man['blake2b']}"
                )
        except errors.AtollError as e:
            if not verify.done():
                verify.cancel()
            rt.phase, rt.failure = "failed", str(e)
            self._save(rt)
            raise
        rt.phase = "running"
        rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        self._save(rt)
        t_verified = time.perf_counter()
        await self.wait_agent(sid, timeout=30)
        self._limit_cpu(rt)
        await self._set_identity(sid, rt.generation, rt.cpus)
        t_end = time.perf_counter()
        log.info(
            "restore took %.0f ms (runsc %.0f, checksum wait %.0f, agent %.0f)",
            (t_end - t0) * 1000,
            (t_runsc - t0) * 1000,
            (t_verified - t_runsc) * 1000,
            (t_end - t_verified) * 1000,
            extra={"sandbox_id": sid},
        )
        # The image is stale once the sandbox runs on; the next standby writes a fresh one.
        self._spawn(asyncio.to_thread(shutil.rmtree, snap, True))

    async def _set_identity(self, sid: str, generation: int, cpus: float) -> None:
        with contextlib.suppress(agent_channel.ChannelError):
            await self.channel(sid).request(
                "POST",
                "/identity",
                json={"sandbox_id": sid, "generation": generation, "hostname": None, "cpus": cpus},
            )

    # ---- reattach after a worker restart --------------------------------------------------------
    async def reattach(self, sid: str) -> Observed:
        rt = self._load(sid)
        if rt is None:
            return Observed("missing", "the worker has no runtime record for it")
        self._runtimes[sid] = rt
        if rt.phase == "failed":
            return Observed("failed", rt.failure)
        if rt.phase == "checkpointing":
            tmp = self._p(sid, f"snapshot.tmp-{rt.generation}")
            await self._wait_orphan_checkpoint(rt)
            if os.path.exists(os.path.join(tmp, "done")):
                await self._finish_checkpoint(rt, tmp)
                return Observed("checkpointed")
            st = await runsc.state(self.runsc_root, rt.cid)
            if st and st.get("status") in ("running", "paused"):
                shutil.rmtree(tmp, ignore_errors=True)
                rt.phase = "running"
                self._save(rt)
                with contextlib.suppress(errors.AtollError):
                    self._limit_cpu(rt)  # lifted for the checkpoint
                return Observed("running", "an interrupted checkpoint left the sandbox running")
            rt.phase = "failed"
            rt.failure = "the worker stopped during a checkpoint and runsc did not finish it: " + runsc.tail(
                self._p(sid, "runsc.log")
            )
            self._save(rt)
            return Observed("failed", rt.failure)
        if rt.phase == "checkpointed":
            st = await runsc.state(self.runsc_root, rt.cid)
            if st and st.get("status") in ("running", "paused"):
                # The worker stopped in the middle of a restore that runsc completed.
                rt.phase = "running"
                rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
                self._save(rt)
                with contextlib.suppress(errors.AtollError):
                    self._limit_cpu(rt)
                return Observed("running", "a restore interrupted by a restart had completed")
            if os.path.exists(self._p(sid, "snapshot", "manifest.json")):
                return Observed("checkpointed")
            rt.phase, rt.failure = "failed", "its committed snapshot is missing from disk"
            self._save(rt)
            return Observed("failed", rt.failure)
        cg = rt.cgroup(self.install_id)
        if cgroups.freezer_state(cg) == "FREEZING":
            # stopped in the middle of a freeze: finish nothing half-way, let it run again
            with contextlib.suppress(errors.AtollError):
                cgroups.thaw(cg)
        if cgroups.freezer_state(cg) == "FROZEN" and cgroups.has_tasks(cg):
            # `runsc state` would hang asking a frozen sentry: the cgroup is the truth here.
            rt.phase = "frozen"
            self._save(rt)
            return Observed("frozen")
        st = await runsc.state(self.runsc_root, rt.cid)
        if not st or st.get("status") not in ("running", "paused"):
            rt.phase = "failed"
            rt.failure = (
                f"runsc reports the sandbox as {st.get('status') if st else 'gone'} after a restart: "
                + (self.death_cause(sid))
            )
            self._save(rt)
            return Observed("failed", rt.failure)
        rt.phase = "running"
        rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        self._save(rt)
        with contextlib.suppress(errors.AtollError):
            self._limit_cpu(rt)  # idempotent; covers a restart between a start and its quota
        return Observed(rt.phase)

    async def _wait_orphan_checkpoint(self, rt: Runtime, timeout: float = 120) -> None:
        """Wait while a `runsc checkpoint` started by a previous worker process is still running."""
        needle = f"--image-path={self._p(rt.sandbox_id, f'snapshot.tmp-{rt.generation}')}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _process_running_with(needle):
            await asyncio.sleep(0.1)

    # ---- delete --------------------------------------------------------------------------------
    async def delete(self, sid: str) -> None:
        """Stop the sandbox and remove everything it had on this host (runsc state, images, upper).

        `runsc delete` runs in its own session (a stop signal to atoll cannot cut it short); then
        whatever it left — a sentry or gofer still running, state of other generations, a cgroup,
        a namespace, a mount — is found by name and removed (worker.sweep), down to the directory.
        If this is interrupted, the runtime says `deleting` and the next start-up's sweep finishes.
        """
        rt = self._runtimes.pop(sid, None) or self._load(sid)
        ch = self._channels.pop(sid, None)
        if ch is not None:
            await ch.aclose()
        if rt is not None:
            rt.phase = "deleting"
            with contextlib.suppress(OSError):
                self._save(rt)
            cg = rt.cgroup(self.install_id)
            if cgroups.freezer_state(cg) in ("FROZEN", "FREEZING"):  # frozen processes cannot die
                with contextlib.suppress(errors.AtollError):
                    cgroups.thaw(cg)
            await runsc.delete(self.runsc_root, rt.cid)
        for what in await sweep.remove_sandbox(self.host, sid):
            if what.startswith("runsc process"):
                log.warning("runsc delete left %s running; killed it", what, extra={"sandbox_id": sid})

    # ---- host task pressure ----------------------------------------------------------------------
    def task_pressure(self, sid: str) -> float:
        """The share of its host pids limit a running sandbox's runtime uses (0 when unknown).

        Under the ptrace platform the sentry keeps a stub process with a thread per tracer thread
        for every address space it ran, and reuses but never frees them: each burst of concurrent
        processes leaves ~5 host tasks per process behind (measured: 200 concurrent sleeps, four
        times, 34 -> 4,021 host tasks, then the 4,096 limit of the time killed the sandbox). A
        checkpoint and restore starts a fresh sentry (3,366 -> 213)."""
        rt = self.runtime(sid)
        if rt.phase != "running":
            return 0.0
        usage = cgroups.pids_usage(rt.cgroup(self.install_id))
        return usage[0] / usage[1] if usage and usage[1] else 0.0

    async def kill_user_processes(self, sid: str) -> None:
        """Kill every process of the sandbox's user namespace (its init is restarted): the pids
        counterpart of an OOM kill, so that a fork bomb ends its processes, not the sandbox."""
        log.warning("sandbox.tasks.relief: killing the user processes", extra={"sandbox_id": sid})
        await self.agent_request(sid, "POST", "/processes/kill-all", timeout=10)

    # ---- liveness ------------------------------------------------------------------------------
    def alive(self, sid: str) -> bool:
        """Is the sandbox's sentry still there? (A file read; safe on a frozen sandbox.)"""
        rt = self.runtime(sid)
        if rt.phase in ("checkpointed", "checkpointing"):
            return True
        if rt.sentry_pid is None:
            rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        return runsc.pid_alive(rt.sentry_pid)

    def death_cause(self, sid: str) -> str:
        rt = self.runtime(sid)
        if cgroups.oom_kills(rt.cgroup(self.install_id)):
            return (
                f"sandbox {sid} was stopped by the host's OOM killer: its programs used more than "
                f"memory_mb={rt.memory_mb} (plus {bundle.RUNTIME_OVERHEAD_MB + bundle.RESTORE_GROWTH_MB} MB for "
                "the runtime); create a new sandbox with a larger memory_mb"
            )
        hits, limit = cgroups.pids_limit_hits(rt.cgroup(self.install_id))
        if hits:
            return (
                f"sandbox {sid} was stopped after its runtime reached the host's task limit "
                f"(pids.max={limit} host tasks, ~{bundle.HOST_TASKS_PER_GUEST_TASK} per guest process or "
                f"thread); programs inside are limited to {bundle.GUEST_PIDS_MAX} tasks, so something "
                "outran that limit; create a new sandbox and run fewer processes at once"
            )
        log.warning(
            "sandbox.runtime.died",
            extra={"sandbox_id": sid, "detail": f"runsc log: {runsc.tail(self._p(sid, 'runsc.log'))}"},
        )
        return f"sandbox {sid} stopped unexpectedly (its gVisor sentry exited; the server log has runsc's last lines)"

    def _died(self, sid: str) -> errors.SandboxDied:
        rt = self.runtime(sid)
        rt.phase, rt.failure = "failed", self.death_cause(sid)
        with contextlib.suppress(OSError):
            self._save(rt)
        return errors.SandboxDied(
            rt.failure + " (the sandbox is now failed; its files are kept until you delete it)"
        )

    async def _watch(self, sid: str, aw: typing.Awaitable) -> typing.Any:
        """Await `aw` (an agent call), but give up as soon as the sandbox's sentry dies (its netstack
        then never answers), or when its guest agent stops answering health checks.

        A call may rightly take long (an exec without timeout_s, a large file): while it runs past
        PROBE_AFTER_S, the agent's /health is asked on another connection every PROBE_EVERY_S. A
        probe that fails once gets the agent a SIGCONT (`runsc kill`: the one way something inside
        can have stopped it); PROBE_FAILURES failures in a row end the call and mark the sandbox
        failed (AgentUnresponsive), so no call hangs forever on a sandbox that cannot answer."""
        task = asyncio.ensure_future(aw)
        probe: asyncio.Future | None = None
        failures = 0
        next_probe = time.monotonic() + PROBE_AFTER_S
        try:
            while True:
                waiting = {task} if probe is None else {task, probe}
                await asyncio.wait(waiting, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                if not self.alive(sid):
                    raise self._died(sid)
                if probe is not None and probe.done():
                    failures = 0 if probe.result() else failures + 1
                    probe = None
                    next_probe = time.monotonic() + PROBE_EVERY_S
                    if failures >= PROBE_FAILURES:
                        raise self._unresponsive(sid, failures)
                    if failures:
                        self._continue_agent(sid)
                if probe is None and time.monotonic() >= next_probe:
                    probe = asyncio.ensure_future(self._agent_answers(sid))
        finally:
            for t in (task, probe):
                if t is not None and not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t

    async def _agent_answers(self, sid: str) -> bool:
        try:
            r = await self.channel(sid).request("GET", "/health", timeout=PROBE_TIMEOUT_S)
            return r.status_code == 200
        except (agent_channel.ChannelError, OSError):
            return False

    def _continue_agent(self, sid: str) -> None:
        """SIGCONT to the agent, in the background (`runsc kill` would hang on a hung sentry)."""
        rt = self.runtime(sid)
        log.warning("sandbox.agent.unresponsive: sending SIGCONT", extra={"sandbox_id": sid})
        self._spawn(runsc.signal(self.runsc_root, rt.cid, "CONT"))

    def _unresponsive(self, sid: str, failures: int) -> errors.SandboxDied:
        rt = self.runtime(sid)
        rt.phase = "failed"
        rt.failure = (
            f"the guest agent of sandbox {sid} stopped answering: {failures} health checks in a row "
            f"failed within {PROBE_TIMEOUT_S:.0f}s each (a SIGCONT did not help) while a call was waiting; "
            "the sandbox is marked failed — its files are kept until you delete it"
        )
        with contextlib.suppress(OSError):
            self._save(rt)
        log.warning("sandbox.agent.unresponsive", extra={"sandbox_id": sid, "reason": rt.failure})
        return errors.SandboxDied(rt.failure)

    async def _watched_body(self, sid: str, body: typing.AsyncIterator[bytes]) -> typing.AsyncIterator[bytes]:
        """Relay a streamed answer chunk by chunk, each wait under `_watch`: a sentry that dies
        mid-stream (its netstack never answers again) ends the stream with SandboxDied within ~1 s
        instead of leaving it open until the caller gives up."""
        end = object()

        async def step() -> typing.Any:
            try:
                return await anext(body)
            except StopAsyncIteration:
                return end

        try:
            while (chunk := await self._watch(sid, step())) is not end:
                yield chunk
        except agent_channel.ChannelError:
            if not self.alive(sid):
                raise self._died(sid) from None
            raise
        finally:
            with contextlib.suppress(Exception):
                await body.aclose()  # type: ignore[attr-defined]

    # ---- guest agent proxy -----------------------------------------------------------------------
    def _unreachable(self, sid: str, e: agent_channel.ChannelError) -> errors.AtollError:
        """What a failed agent call means: the sandbox died (SandboxDied), its answer was too large
        to hold, or the agent did not answer."""
        if not self.alive(sid):
            return self._died(sid)
        if isinstance(e, agent_channel.AnswerTooLarge):
            return errors.PayloadTooLarge(
                f"the answer from sandbox {sid} is larger than {agent_channel.MAX_ANSWER_BYTES >> 20} MiB, "
                "the most atoll holds for a listing; list a smaller directory (or read a file instead)",
                code="answer_too_large",
            )
        return errors.RuntimeFailure(f"the guest agent of sandbox {sid} did not answer", detail=repr(e))

    async def agent_request(
        self, sid: str, method: str, url: str, **kw: typing.Any
    ) -> agent_channel.Response:
        try:
            r = await self._watch(sid, self.channel(sid).request(method, url, **kw))
        except agent_channel.ChannelError as e:
            raise self._unreachable(sid, e) from None
        if r.status_code >= 400:
            raise _agent_error(r)
        return r

    @contextlib.asynccontextmanager
    async def agent_stream(self, sid: str, method: str, url: str, **kw: typing.Any):
        try:
            cm = self.channel(sid).stream(method, url, **kw)
            r = await self._watch(sid, cm.__aenter__())
            try:
                if r.status_code >= 400:
                    await r.aread()
                    raise _agent_error(r)
                r.wrap_body(lambda body: self._watched_body(sid, body))
                yield r
            finally:
                await cm.__aexit__(None, None, None)
        except agent_channel.ChannelError as e:
            raise self._unreachable(sid, e) from None

    def _spawn(self, coro: typing.Awaitable) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def aclose(self) -> None:
        """Stop talking to sandboxes (they keep running). Waits briefly for background clean-ups;
        template images still being made are abandoned (their sandboxes are deleted)."""
        builds = list(self._image_builds.values())
        for t in builds:
            t.cancel()
        if builds:
            await asyncio.wait(builds, timeout=10)
        for ch in list(self._channels.values()):
            await ch.aclose()
        self._channels.clear()
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=5)


def _installation_id(home: str) -> str:
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


def _agent_error(r: agent_channel.Response) -> errors.AtollError:
    try:
        err = r.json()["error"]
        code, message = err.get("code", "runtime_error"), err.get("message", r.text)
    except (ValueError, KeyError, TypeError):
        code, message = "runtime_error", f"guest agent answered {r.status_code}: {r.text[:300]}"
    by_status = {
        400: errors.InvalidRequest,
        403: errors.PermissionDenied,
        404: errors.NotFound,
        409: errors.Conflict,
        413: errors.PayloadTooLarge,
        507: errors.InsufficientStorage,
    }
    cls = by_status.get(r.status_code, errors.RuntimeFailure)
    return cls(message, code=code)


def _checksum(path: str) -> tuple[str, int]:
    h = hashlib.blake2b(digest_size=20)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(4 * 1024 * 1024):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _hostname(sid: str) -> str:
    return sid


def _write_identity_files(rootfs: str, hostname: str) -> None:
    """Name resolution that never leaves the sandbox: the hostname resolves from /etc/hosts."""
    with open(os.path.join(rootfs, "etc/hosts"), "w") as f:
        f.write(f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n127.0.1.1\t{hostname}\n")
    with open(os.path.join(rootfs, "etc/hostname"), "w") as f:
        f.write(hostname + "\n")


def _process_running_with(needle: str) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    return True
        except OSError:
            continue
    return False


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


async def purge_installation(home: str) -> list[str]:
    """Remove every sandbox of the installation at `home` from this host, without a control plane.

    For test fixtures and `atoll.testing`: a sweep with no live sandbox (see worker.sweep), which
    also removes the installation's parent cgroups. Returns what it removed.
    """
    home = os.path.realpath(home)
    return await sweep.sweep(sweep.Installation(home, _installation_id(home)), live=())

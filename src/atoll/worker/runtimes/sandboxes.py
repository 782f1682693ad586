"""Making and removing one sandbox's runtime on this host: rootfs, network namespaces, the OCI bundle,
`runsc run` (cold boot) or `runsc restore` of a template image, the CPU quota, and delete.

`start` boots a recorded runtime (phase creating): it sets up the upper layer + overlay rootfs and
the namespace pair concurrently, writes the bundle, and either restores the template image it is
given (then tells the agent its own identity) or boots cold; a failed image restore falls back to a
cold boot in a new generation. A cold boot records this worker's runtime key (`runtime_key`,
worker.host.snapshots.RuntimeKey) in the runtime; a restore keeps the one its caller recorded (the
image's). `delete` runs `runsc delete` in its own session and then removes by
name whatever it left (worker.sweep). Called by worker.node and worker.builder; the tiers
module uses `write_bundle`, `limit_cpu` and `discard_container`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import sys
import time

from atoll.core import errors, mounts
from atoll.core.lifecycle import Phase, Step
from atoll.worker.host import (
    agent_pack,
    bundle,
    cgroups,
    hostcmd,
    netns,
    runsc,
    snapshots,
    storage,
    sweep,
    trust,
)
from atoll.worker.host.stores import Stores
from atoll.worker.images import layers
from atoll.worker.runtimes.edge import Edge
from atoll.worker.runtimes.guest import Guest
from atoll.worker.runtimes.liveness import Liveness
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore

log = logging.getLogger(__name__)

AGENT_READY_TIMEOUT_S = 30.0


def hostname(sid: str) -> str:
    return sid


def _write_identity_files(rootfs: str, name: str) -> None:
    """The hostname resolves from /etc/hosts; every other name from the egress gateway's resolver
    (the only DNS server a sandbox reaches: nftables send questions to any server there)."""
    etc = os.open(os.path.join(rootfs, "etc"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for fname, text in (
            ("hosts", f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n127.0.1.1\t{name}\n"),
            ("resolv.conf", f"nameserver {netns.HOST_IP}\noptions timeout:2 attempts:2\n"),
            ("hostname", name + "\n"),
        ):
            # never through a symlink the template may hold (it would point into the host)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fname, dir_fd=etc)
            fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=etc)
            with os.fdopen(fd, "w") as f:
                f.write(text)
    finally:
        os.close(etc)


def _resolve_in_root(rootfs: str, path: str) -> str:
    """`path` as the sandbox's kernel resolves it: symbolic links in its root file system followed
    within that root (an absolute target starts again at the root; at most 40 links)."""
    todo = [p for p in path.split("/") if p and p != "."]
    done: list[str] = []
    links = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        try:
            st = os.lstat(os.path.join(rootfs, *done, part))
        except (FileNotFoundError, NotADirectoryError):
            done.append(part)
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > 40:
                raise errors.InvalidPath(f"mount path {path!r} goes through more than 40 symbolic links")
            target = os.readlink(os.path.join(rootfs, *done, part))
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p and p != "."] + todo
            continue
        done.append(part)
    return "/" + "/".join(done)


def _check_mount_point(rootfs: str, m: dict) -> None:
    """A volume or drive is mounted on a directory, by the path the sandbox sees: the path with the
    template's symbolic links followed (`/var/run` is `/run` in Debian) must pass the same rules
    (core.mounts: never on /run/atoll, /proc, ...) and, if it exists, be a directory."""
    try:
        real = _resolve_in_root(rootfs, m["path"])
    except OSError as e:  # a name too long, a loop the kernel refuses, …
        raise errors.InvalidPath(f"mount path {m['path'][:200]!r} cannot be resolved: {e.strerror}") from None
    if real != m["path"]:
        try:
            mounts.check_path(m["kind"], m["name"], real)
        except errors.InvalidPath as e:
            raise errors.InvalidPath(
                f"{m['path']} is {real} in the sandbox's template (symbolic links): {e.message}"
            ) from None
    try:
        st = os.lstat(os.path.join(rootfs, real.lstrip("/")))
    except (FileNotFoundError, NotADirectoryError):
        return  # made by runsc
    if not stat.S_ISDIR(st.st_mode):
        raise errors.InvalidPath(
            f"{m['kind']} {m['name']!r} cannot be mounted at {m['path']}: {real} is a file in the "
            "sandbox's template, not a directory; choose a directory path"
        )


class Sandboxes:
    def __init__(
        self,
        runtimes: RuntimeStore,
        guest: Guest,
        liveness: Liveness,
        host: sweep.Installation,
        agent_root: str,
        edge: Edge,
        stores: Stores | None = None,
    ):
        self.runtimes = runtimes
        self.guest = guest
        self.liveness = liveness
        self.host = host
        self.install_id = host.install_id
        self.runsc_root = host.runsc_root
        self.agent_root = agent_root
        """`$ATOLL_HOME/agent`: the agent's files of each version in a directory of their own (see
        `agent_dir`); the files of versions before those directories lie in it directly."""
        self.agent_dir = agent_root
        """This worker's agent files (`<agent_root>/v-<digest>`, set by Node.start once built):
        every sandbox it starts mounts them, and keeps mounting them after an upgrade."""
        self.edge = edge
        self.stores = stores
        self.runtime_key = snapshots.RuntimeKey()
        """This worker's runtime key now: what a cold boot's memory holds."""

    def _p(self, rt: Runtime, *parts: str) -> str:
        return self.runtimes.path(rt.sandbox_id, *parts)

    def agent_dir_of(self, rt: Runtime) -> str:
        """The agent files `rt` runs: those of its version (a record of an earlier version, which
        named none, has the files in `agent_root` itself)."""
        return rt.agent_dir or self.agent_root

    # ---- start ----------------------------------------------------------------------------------
    async def start(self, rt: Runtime, lower: str, image: str | None, seed_upper: str | None = None) -> str:
        """Boot `rt` (phase creating) from the template layer(s) `lower` (an overlay lowerdir
        stack): restore `image` if given, else boot cold. `seed_upper` is the writable layer the
        image was saved with (a user template's boot wrote files its processes hold open), or the
        files a cold boot starts with (a files-only snapshot): the sandbox's own starts as a copy of it; `rt.runtime_key` says what the image was made under
        (a cold boot sets it to this worker's). Returns how ("template image" or "cold boot"); on
        failure the runtime is failed and the error raised."""
        if not rt.agent_dir:  # a new sandbox runs this worker's agent (a fork's names its parent's)
            rt.agent_dir = self.agent_dir
            self.runtimes.save(rt)
        sid = rt.sandbox_id
        t0 = time.perf_counter()
        marks: dict[str, float] = {}
        how = "cold boot"
        try:
            await asyncio.gather(
                self._prepare_rootfs(rt, lower, seed_upper),
                netns.create(rt.name),
            )
            await self.edge.attach(rt)
            marks["prepare"] = time.perf_counter()
            self.write_bundle(rt, lower)
            if image is not None:
                try:
                    await runsc.restore(
                        self.runsc_root, self._p(rt, "bundle"), rt.cid, image, self._p(rt, "runsc.log")
                    )
                    marks["runsc"] = time.perf_counter()
                    self._booted(rt)
                    await self.guest.wait_ready(sid, AGENT_READY_TIMEOUT_S, self._p(rt, "runsc.log"))
                    # A sandbox restored from a shared image gets its own identity: id, generation,
                    # hostname, env, and the CPU count its programs see.
                    name = await self.guest.identify(
                        sid,
                        rt.generation,
                        hostname=hostname(sid),
                        env=rt.env,
                        cpus=rt.cpus,
                        workdir=rt.workdir,
                    )
                    if name != hostname(sid):
                        raise errors.RuntimeFailure(
                            f"sandbox {sid} kept the template's hostname after restore"
                        )
                    how = "template image"
                except errors.AtollError as e:
                    log.warning(
                        "starting from the template image failed; booting cold: %s",
                        e,
                        extra={"sandbox_id": sid},
                    )
                    await self._reset_for_cold_boot(rt, lower)
                    image = None
            if image is None:
                rt.runtime_key = self.runtime_key()
                await runsc.run(self.runsc_root, self._p(rt, "bundle"), rt.cid, self._p(rt, "runsc.log"))
                marks["runsc"] = time.perf_counter()
                self._booted(rt)
                await self.guest.wait_ready(sid, AGENT_READY_TIMEOUT_S, self._p(rt, "runsc.log"))
                if rt.workdir:
                    await self.guest.identify(
                        sid, rt.generation, hostname=None, env=None, cpus=rt.cpus, workdir=rt.workdir
                    )
            marks["agent"] = time.perf_counter()
            self.limit_cpu(rt)
        except BaseException as e:
            self.runtimes.fail(
                rt, f"sandbox {sid} could not be started: {getattr(e, 'message', None) or e!r}"
            )
            log.warning(
                "sandbox create failed",
                extra={"sandbox_id": sid, "error": getattr(e, "message", None) or repr(e)},
            )
            with contextlib.suppress(Exception):  # a half-started sentry must not run on (files are kept)
                await asyncio.shield(self.stop_container(rt))
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
        return how

    def _booted(self, rt: Runtime) -> None:
        rt.sentry_pid = runsc.sandbox_pid(self.runsc_root, rt.cid)
        if rt.phase == Phase.CREATING:
            self.runtimes.advance(rt, Step.BOOTED)
        else:
            self.runtimes.save(rt)
        self.liveness.watch(rt)

    async def _reset_for_cold_boot(self, rt: Runtime, lower: str) -> None:
        """Throw away a failed image restore: the next generation boots cold in the same rootfs."""
        self.liveness.unwatch(rt.sandbox_id)
        await self.guest.close(rt.sandbox_id)
        await runsc.delete(self.runsc_root, rt.cid)
        cgroups.remove(rt.cgroup(self.install_id))
        rt.generation += 1
        rt.sentry_pid = None
        self.liveness.exited(rt.sandbox_id).clear()
        await netns.readdress(rt.name)
        self.write_bundle(rt, lower)
        self.runtimes.save(rt)

    async def _prepare_rootfs(self, rt: Runtime, lower: str, seed_upper: str | None = None) -> None:
        await storage.create_upper(self._p(rt, "upper.img"), self._p(rt, "upper"), rt.disk_mb)
        if seed_upper is not None:
            rc, _out, err = await hostcmd.run(
                "cp", "-a", seed_upper + "/.", self._p(rt, "upper", "upper") + "/", check=False
            )
            if rc != 0:
                if "No space left" in err:
                    raise errors.InsufficientStorage(
                        f"sandbox {rt.sandbox_id}'s disk (disk_mb={rt.disk_mb}) cannot hold the files it "
                        "starts with (its template's or its parent's writable layer); free space in the "
                        "parent or give a larger disk_mb"
                    )
                raise errors.RuntimeFailure(
                    f"the writable layer of sandbox {rt.sandbox_id} could not be prepared", detail=err[-800:]
                )
        layers.mark_used(lower)  # the layer cache's garbage collection keeps recently used layers
        await storage.mount_rootfs(lower, self._p(rt, "upper"), self._p(rt, "rootfs"))
        try:
            _write_identity_files(self._p(rt, "rootfs"), hostname(rt.sandbox_id))
        except OSError as e:  # its /etc is a symlink or a file (a parent sandbox replaced it)
            raise errors.Conflict(
                f"sandbox {rt.sandbox_id} cannot be given its identity: /etc in its root file system is "
                f"not a directory ({e.strerror}); a sandbox whose /etc was replaced cannot be copied",
                code="invalid_state",
            ) from None
        if rt.trust_pem:
            trust.install(self._p(rt, "rootfs"), rt.trust_pem)
        for m in rt.mounts:
            _check_mount_point(self._p(rt, "rootfs"), m)

    def write_bundle(self, rt: Runtime, lower: str | None = None) -> None:
        """Write config.json. The CPU quota is left out: runsc would apply it while the sentry boots
        or restores (runtime work, 50-300 ms slower on one core); `limit_cpu` sets it right after."""
        bundle.write(
            self._p(rt, "bundle"),
            bundle.BundleSpec(
                sandbox_id=rt.sandbox_id,
                hostname=hostname(rt.sandbox_id),
                rootfs=self._p(rt, "rootfs"),
                agent_dir=self.agent_dir_of(rt),
                netns_path=netns.path(rt.name),
                cgroup_path=rt.cgroup(self.install_id),
                memory_mb=rt.memory_mb,
                cpus=None,
                env=rt.env,
                generation=rt.generation,
                agent_entry=self._agent_entry(lower),
                visible_cpus=rt.cpus,
                agent_host=netns.SANDBOX_IP,
                binds=self._binds(rt),
            ),
        )

    def _binds(self, rt: Runtime) -> tuple[tuple[str, str, bool], ...]:
        if not rt.mounts:
            return ()
        if self.stores is None:
            raise errors.RuntimeFailure(f"sandbox {rt.sandbox_id} mounts volumes, but this worker keeps none")
        return tuple(
            (self.stores.fs(m["kind"], m["name"]), m["path"], bool(m["read_only"])) for m in rt.mounts
        )

    def _agent_entry(self, lower: str | None) -> str:
        if lower is None:  # restore: the process already runs; the entry is not used
            return agent_pack.SOURCE
        found = layers.find_file(lower.split(":"), bundle.AGENT_PYTHON[1:])
        py = os.readlink(found) if found and os.path.islink(found) else (found or "")
        ours = f"python{sys.version_info.major}.{sys.version_info.minor}"
        has_pyc = os.path.exists(os.path.join(self.agent_dir, agent_pack.COMPILED))
        return agent_pack.COMPILED if has_pyc and os.path.basename(py) == ours else agent_pack.SOURCE

    def limit_cpu(self, rt: Runtime) -> None:
        cgroups.set_cpu_limit(rt.cgroup(self.install_id), rt.cpus)

    async def stop_container(self, rt: Runtime) -> None:
        """Stop a failed sandbox's runtime (its sentry and gofer, its cgroups) and keep its files,
        namespaces and records for the delete: a failed sandbox holds no memory or CPU."""
        self.liveness.unwatch(rt.sandbox_id)
        await self.guest.close(rt.sandbox_id)
        await self.edge.detach(rt.sandbox_id)
        cg = rt.cgroup(self.install_id)
        if cgroups.freezer_state(cg) in ("FROZEN", "FREEZING"):  # frozen processes cannot die
            with contextlib.suppress(errors.AtollError):
                cgroups.thaw(cg)
        await runsc.delete(self.runsc_root, rt.cid)
        cgroups.remove(cg)

    async def discard_container(self, cid: str, cg: str) -> None:
        """Delete a container this runtime no longer uses (checkpointed, or a failed restore); what
        `runsc delete` leaves in its cgroup (a sentry it could not find, stubs) is killed."""
        await runsc.delete(self.runsc_root, cid)
        if not await sweep.remove_cgroup(cg):
            log.warning("the cgroup %s of a discarded container is still busy", cg)

    # ---- delete ---------------------------------------------------------------------------------
    async def delete(self, sid: str) -> list[str]:
        """Stop the sandbox and remove everything it had on this host (runsc state, images, upper).

        `runsc delete` runs in its own session (a stop signal to the worker cannot cut it short);
        then whatever it left — a sentry or gofer still running, state of other generations, a
        cgroup, a namespace, a mount — is found by name and removed (worker.sweep), down to the
        directory. If this is interrupted, the runtime says `deleting` and the next sweep finishes.
        Returns what the sweep had to remove."""
        rt = self.runtimes.find(sid)
        self.liveness.unwatch(sid)
        await self.guest.close(
            sid, errors.SandboxNotFound(f"sandbox {sid} was deleted while this call was in flight")
        )
        await self.edge.detach(sid)  # its sockets would keep the namespaces alive
        if rt is not None:
            if rt.phase != Phase.DELETING:
                with contextlib.suppress(OSError):
                    self.runtimes.advance(rt, Step.DELETE)
            cg = rt.cgroup(self.install_id)
            if cgroups.freezer_state(cg) in ("FROZEN", "FREEZING"):  # frozen processes cannot die
                with contextlib.suppress(errors.AtollError):
                    cgroups.thaw(cg)
            await runsc.delete(self.runsc_root, rt.cid)
        removed = await sweep.remove_sandbox(self.host, sid)
        for what in removed:
            if what.startswith("runsc process"):
                log.warning("runsc delete left %s running; killed it", what, extra={"sandbox_id": sid})
        self.runtimes.forget(sid)
        return removed

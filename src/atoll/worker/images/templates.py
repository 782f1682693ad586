"""Template layers: read-only root filesystems built from Debian packages, cached by content hash.

A template recipe (suite, packages, post-build files) hashes to a directory
`<template_dir>/<hash>/rootfs`; it is built once with mmdebstrap (into a temporary directory,
renamed when complete, so a crash never leaves a half layer), then shared read-only as the lower
layer of every sandbox of that template. Build progress is logged line by line and exposed through
`status()` for GET /v1/templates. The full template system (user images, snapshots of booted
templates) grows from `Recipe`. Called by worker.service.

Every layer's login profile is edited to start no programs (login_profile.py), and every layer
also gets atoll's compatibility shim (compat/atoll-compat.c, compiled on the host with
gcc and preloaded through /etc/ld.so.preload), which works around system-call flags this runsc
rejects; the shim's source is part of the layer's content hash.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field

from atoll.core import errors
from atoll.worker.host import hostcmd
from atoll.worker.images import login_profile

log = logging.getLogger(__name__)

RECIPE_VERSION = 2  # 2: the compatibility shim preloaded in every layer

# The shim's source ships as package data; the compiled library and the preload entry in a layer.
COMPAT_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compat", "atoll-compat.c")
COMPAT_LIBRARY = "/usr/lib/atoll/libatoll-compat.so"
COMPAT_CFLAGS = ("-shared", "-fPIC", "-O2", "-fno-stack-protector", "-Wall", "-Wextra", "-Werror")


@dataclass(frozen=True)
class Recipe:
    name: str
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: tuple[str, ...] = ()
    description: str = ""

    def content_hash(self) -> str:
        """The layer's identity: the recipe and the source of everything `_customize` adds to it."""
        blob = json.dumps(
            {
                "v": RECIPE_VERSION,
                **asdict(self),
                "compat_shim": compat_source_digest(COMPAT_SOURCE),
                "login_profile": login_profile.digest(),
            },
            sort_keys=True,
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def compat_source_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


BASE = Recipe(
    name="base",
    packages=(
        "python3",
        "python3-pip",
        "python3-venv",
        "bash",
        "coreutils",
        "procps",
        "curl",
        "git",
        "ca-certificates",
        "iproute2",
    ),
    description="Debian 12 (bookworm) with python3 (pip, venv), bash, coreutils, procps, curl, git, CA certificates",
)
RECIPES = {BASE.name: BASE}


@dataclass
class BuildStatus:
    name: str
    hash: str
    status: str = "missing"  # missing | building | ready | failed
    progress: str = ""
    error: str | None = None
    started_at: float | None = None
    built_at: float | None = None
    size_bytes: int | None = None
    lines: list[str] = field(default_factory=list)


class TemplateStore:
    def __init__(self, directory: str, mirror: str):
        self.dir = directory
        self.mirror = mirror
        os.makedirs(self.dir, mode=0o700, exist_ok=True)  # layers hold setuid programs: owner only
        self._locks: dict[str, asyncio.Lock] = {}
        self._status: dict[str, BuildStatus] = {}
        for r in RECIPES.values():
            st = BuildStatus(name=r.name, hash=r.content_hash())
            man = self._manifest_path(r)
            if os.path.exists(man):
                with open(man) as f:
                    m = json.load(f)
                st.status, st.built_at, st.size_bytes = "ready", m.get("built_at"), m.get("size_bytes")
            self._status[r.name] = st

    def _layer_dir(self, r: Recipe) -> str:
        return os.path.join(self.dir, r.content_hash())

    def _manifest_path(self, r: Recipe) -> str:
        return os.path.join(self._layer_dir(r), "manifest.json")

    def recipe(self, name: str) -> Recipe:
        try:
            return RECIPES[name]
        except KeyError:
            raise errors.TemplateNotFound(
                f"template {name!r} does not exist; available templates: {', '.join(sorted(RECIPES))}"
            ) from None

    def status(self) -> list[dict]:
        out = []
        for r in RECIPES.values():
            st = self._status[r.name]
            if st.status != "ready" and os.path.exists(self._manifest_path(r)):
                st.status, st.progress = "ready", "ready"  # built by another installation sharing the dir
            out.append(
                {
                    "name": r.name,
                    "hash": st.hash,
                    "status": st.status,
                    "progress": st.progress,
                    "error": st.error,
                    "description": r.description,
                    "packages": list(r.packages),
                    "built_at": st.built_at,
                    "size_bytes": st.size_bytes,
                }
            )
        return out

    async def ensure(self, name: str) -> str:
        """Return the template's read-only rootfs path, building it first if needed."""
        r = self.recipe(name)
        rootfs = os.path.join(self._layer_dir(r), "rootfs")
        if os.path.exists(self._manifest_path(r)):
            return rootfs
        lock = self._locks.setdefault(r.name, asyncio.Lock())
        async with lock:
            if not os.path.exists(self._manifest_path(r)):
                # Installations may share a template dir: one builds, the others wait for it.
                fd = os.open(
                    os.path.join(self.dir, f".lock-{r.content_hash()}"), os.O_CREAT | os.O_RDWR, 0o644
                )
                try:
                    await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                    if not os.path.exists(self._manifest_path(r)):
                        await self._build(r)
                    else:
                        self._status[r.name].status = "ready"
                finally:
                    os.close(fd)
        return rootfs

    async def _build(self, r: Recipe) -> None:
        st = self._status[r.name]
        st.status, st.error, st.started_at, st.lines = "building", None, time.time(), []
        h = r.content_hash()
        tmp = os.path.join(self.dir, f".build-{h}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        argv = [
            "mmdebstrap",
            f"--variant={r.variant}",
            f"--include={','.join(r.packages)}",
            "--verbose",
            r.suite,
            os.path.join(tmp, "rootfs"),
            self.mirror,
        ]
        log.info("template %s: building layer %s with mmdebstrap (first use; ~30-60 s)", r.name, h)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            st.lines = (st.lines + [line])[-40:]
            if line.startswith("I: "):
                st.progress = line[3:]
                log.info("template %s: %s (%.0fs)", r.name, st.progress, time.time() - st.started_at)
        rc = await proc.wait()
        if rc != 0:
            st.status = "failed"
            st.error = f"mmdebstrap exited {rc}: " + " | ".join(st.lines[-5:])
            shutil.rmtree(tmp, ignore_errors=True)
            raise errors.RuntimeFailure(
                f"building template {r.name!r} failed: {st.error}. Check that Debian's mirror "
                f"{self.mirror} is reachable (set ATOLL_DEBIAN_MIRROR) and retry."
            )
        try:
            await _customize(os.path.join(tmp, "rootfs"))
        except errors.RuntimeFailure as e:
            st.status, st.error = "failed", f"{e.message} {e.detail or ''}".strip()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        size = _du(os.path.join(tmp, "rootfs"))
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(
                {"name": r.name, "hash": h, "recipe": asdict(r), "built_at": time.time(), "size_bytes": size},
                f,
            )
        final = self._layer_dir(r)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        st.status, st.built_at, st.size_bytes, st.progress = "ready", time.time(), size, "ready"
        log.info("template %s: ready (%d MB, %.0fs)", r.name, size // 2**20, time.time() - st.started_at)


async def _customize(rootfs: str) -> None:
    """Post-build files: a local-only resolver, the guest agent's mount point, the compat shim, a
    login profile that starts no programs."""
    await install_compat_shim(rootfs)
    login_profile.patch(rootfs)
    os.makedirs(os.path.join(rootfs, "opt/atoll"), exist_ok=True)
    resolv = os.path.join(rootfs, "etc/resolv.conf")
    if os.path.islink(resolv) or os.path.exists(resolv):
        os.unlink(resolv)
    with open(resolv, "w") as f:
        # No egress in this release: lookups go to the sandbox's own loopback and fail fast,
        # never to the host machine's resolver.
        f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


async def install_compat_shim(rootfs: str, source: str = COMPAT_SOURCE) -> str:
    """Compile the shim into `rootfs` and preload it into every dynamically linked program there.

    /etc/ld.so.preload (unlike LD_PRELOAD) survives a user clearing the environment and applies to
    setuid programs too. The host compiler builds for the host's architecture, which is the
    template's (mmdebstrap builds the native one). Returns the library's path on the host.
    """
    cc = shutil.which("gcc")
    if cc is None:
        raise errors.RuntimeFailure(
            "building a template needs gcc and libc6-dev on the host (for atoll's compatibility shim); "
            "install them with scripts/install-deps.sh or `apt-get install gcc libc6-dev`"
        )
    out = os.path.join(rootfs, COMPAT_LIBRARY.lstrip("/"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    await hostcmd.run(cc, *COMPAT_CFLAGS, "-o", out, source)
    os.chmod(out, 0o644)
    with open(os.path.join(rootfs, "etc/ld.so.preload"), "w") as f:
        f.write(COMPAT_LIBRARY + "\n")
    return out


def _du(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(dirpath, fn)).st_size
            except OSError:
                pass
    return total

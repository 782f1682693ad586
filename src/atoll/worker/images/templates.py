"""Built-in template layers: read-only root filesystems built from Debian packages, cached by
content hash in the one layer cache (worker.images.layers).

A template recipe (suite, packages, post-build files) hashes to the layer key `<name>-<hash>`
(`<template_dir>/layers/<name>-<hash>/fs`); it is built once with mmdebstrap into the cache's
temporary directory under the key's lock (renamed when complete, so a crash never leaves a half
layer), then shared read-only as the bottom layer of every sandbox of that template and of the user
templates built FROM it. A layer an older version kept at `<template_dir>/<hash>/rootfs` is adopted
by hard links instead of built again. Build progress is logged line by line and exposed through
`status()` for GET /v1/templates. Called by worker.service and worker.images.builder.

Every layer's login profile is edited to start no programs (login_profile.py), and every layer
also gets atoll's compatibility shim (compat/atoll-compat.c, compiled on the host with
gcc and preloaded through /etc/ld.so.preload), which works around system-call flags this runsc
rejects; the shim's source is part of the layer's content hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import typing
from dataclasses import asdict, dataclass, field

from atoll.core import errors
from atoll.worker.host import hostcmd
from atoll.worker.images import login_profile, shim

if typing.TYPE_CHECKING:
    from atoll.worker.images.layers import LayerStore

log = logging.getLogger(__name__)

RECIPE_VERSION = 2  # 2: the compatibility shim preloaded in every layer


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
                "compat_shim": shim.digest(),
                "login_profile": login_profile.digest(),
            },
            sort_keys=True,
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


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
CODE_INTERPRETER_NAME = "code-interpreter-v1"
"""The template e2b_code_interpreter asks for (its DEFAULT_TEMPLATE; E2B's alias
`code-interpreter` is mapped onto it by e2b.control)."""
CODE_INTERPRETER = Recipe(
    name=CODE_INTERPRETER_NAME,
    packages=(
        *BASE.packages,
        "python3-ipykernel",
        "python3-jupyter-client",
        "python3-matplotlib",
        "python3-numpy",
    ),
    description="base with a Jupyter kernel (ipykernel, jupyter_client), matplotlib and numpy, for "
    "E2B's run_code (the service itself, atoll.guest.interpreter, comes with the guest agent's files)",
)
RECIPES = {BASE.name: BASE, CODE_INTERPRETER.name: CODE_INTERPRETER}


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
    def __init__(self, directory: str, mirror: str, layer_store: LayerStore, code_interpreter: bool = True):
        self.recipes = {n: r for n, r in RECIPES.items() if code_interpreter or n != CODE_INTERPRETER_NAME}
        """The built-in templates this worker has (ATOLL_E2B_CODE_INTERPRETER=0: base only)."""
        self.dir = directory
        self.mirror = mirror
        self.layers = layer_store
        os.makedirs(self.dir, mode=0o700, exist_ok=True)  # layers hold setuid programs: owner only
        self._locks: dict[str, asyncio.Lock] = {}
        self._status: dict[str, BuildStatus] = {}
        for r in self.recipes.values():
            st = BuildStatus(name=r.name, hash=r.content_hash())
            self._status[r.name] = st
            self._read_layer(r, st)

    def key(self, r: Recipe) -> str:
        """The recipe's layer key in the layer cache (the bottom of user templates FROM it)."""
        return f"{r.name}-{r.content_hash()}"

    def _read_layer(self, r: Recipe, st: BuildStatus) -> bool:
        try:
            with open(os.path.join(self.layers.dir, self.key(r), "layer.json")) as f:
                m = json.load(f)
        except (OSError, ValueError):
            return False
        st.status, st.progress = "ready", "ready"
        st.built_at, st.size_bytes = m.get("made_at"), m.get("size_bytes")
        return True

    def _legacy_rootfs(self, r: Recipe) -> str | None:
        """The layer as versions before the one layer cache kept it, if complete."""
        old = os.path.join(self.dir, r.content_hash())
        return os.path.join(old, "rootfs") if os.path.exists(os.path.join(old, "manifest.json")) else None

    def recipe(self, name: str) -> Recipe:
        try:
            return self.recipes[name]
        except KeyError:
            off = " (the server runs with ATOLL_E2B_CODE_INTERPRETER=0)" if name in RECIPES else ""
            raise errors.TemplateNotFound(
                f"template {name!r} does not exist{off}; available templates: "
                f"{', '.join(sorted(self.recipes))}"
            ) from None

    def status(self) -> list[dict]:
        out = []
        for r in self.recipes.values():
            st = self._status[r.name]
            if st.status != "ready":
                self._read_layer(r, st)  # built by another installation sharing the dir
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
        key = self.key(r)
        if await self.layers.use(key):
            return self.layers.path(key)
        async with self._locks.setdefault(r.name, asyncio.Lock()):
            # Installations may share a template dir: one builds, the others wait for it (the
            # layer cache's lock of the key) and find it made.
            async with self.layers.making(key) as fs:
                if fs is not None:
                    legacy = self._legacy_rootfs(r)
                    if legacy is not None:
                        await hostcmd.run("cp", "-al", legacy + "/.", fs + "/", timeout=600)
                        log.info("template %s: adopted the layer an older version built (%s)", r.name, legacy)
                    else:
                        await self._build(r, fs)
                    self.layers.commit(
                        key, fs, f"{r.name}: mmdebstrap {r.suite} {r.variant} ({r.description})"
                    )
            self._read_layer(r, self._status[r.name])
        return self.layers.path(key)

    async def _build(self, r: Recipe, rootfs: str) -> None:
        """mmdebstrap and atoll's additions into the empty directory `rootfs`."""
        st = self._status[r.name]
        st.status, st.error, st.started_at, st.lines = "building", None, time.time(), []
        h = r.content_hash()
        argv = [
            "mmdebstrap",
            f"--variant={r.variant}",
            f"--include={','.join(r.packages)}",
            "--verbose",
            r.suite,
            rootfs,
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
            raise errors.RuntimeFailure(
                f"building template {r.name!r} failed: {st.error}. Check that Debian's mirror "
                f"{self.mirror} is reachable (set ATOLL_DEBIAN_MIRROR) and retry."
            )
        try:
            await _customize(rootfs)
        except errors.RuntimeFailure as e:
            st.status, st.error = "failed", f"{e.message} {e.detail or ''}".strip()
            raise
        log.info("template %s: layer %s built in %.0fs", r.name, h, time.time() - st.started_at)


async def _customize(rootfs: str) -> None:
    """Post-build files: a local-only resolver, the guest agent's mount point, the compat shim, a
    login profile that starts no programs."""
    await shim.install(rootfs)
    login_profile.patch(rootfs)
    os.makedirs(os.path.join(rootfs, "opt/atoll"), exist_ok=True)
    resolv = os.path.join(rootfs, "etc/resolv.conf")
    if os.path.islink(resolv) or os.path.exists(resolv):
        os.unlink(resolv)
    with open(resolv, "w") as f:
        # No egress in this release: lookups go to the sandbox's own loopback and fail fast,
        # never to the host machine's resolver.
        f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

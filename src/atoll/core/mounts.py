"""Volumes and drives as a sandbox sees them: the rules for their names, sizes and the paths they are
mounted at, and the fixed mount slots every sandbox has for them.

A sandbox is made with one bind mount of a per-sandbox host directory at `SLOT_ROOT` (read-only,
holding `SLOTS` empty directories); attaching a volume or a drive mounts it on the host onto one
slot directory — host mounts propagate into the running gofer, so a pooled or restored sandbox can
take them too (measured: runsc 20221219 restores the checkpoint's mount layout, and this one mount
is always there) — and the guest agent binds the slot onto the user's path inside the sandbox.

Pure; used by the control plane (validating a create, volume and drive names and sizes) and by the
worker (worker.host.stores, worker.runtimes.sandboxes) and the guest agent's identity call.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from atoll.core import errors

KINDS = ("volume", "drive")
SLOT_ROOT = "/run/atoll/mounts"
"""Where the slot directories are inside every sandbox (made since worker protocol 7)."""
SLOTS = 8
"""At most this many volumes and drives together per sandbox."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.~-]{0,127}")
"""A store's name on its worker: the tenant's name, qualified by its tenant unless it is the
default one (`worker_name`); '~' is in no tenant's names, so no two tenants' stores collide."""
MIN_SIZE_MB = 8
MAX_SIZE_MB = 1024 * 1024  # 1 TiB
MAX_PATH = 1024

# Paths a volume or drive may not hide or sit inside: the kernel's trees, the guest agent's files,
# the slots themselves, the sandbox's identity and trust files, and /tmp (a mount of its own).
_RESERVED: tuple[str, ...] = ("/proc", "/dev", "/sys", "/opt/atoll", "/run/atoll", "/etc", "/tmp")
# ... and the programs and libraries the guest agent and every shell need (a mount on /usr would
# hide /usr/bin/python3: the sandbox could not start)
_RESERVED += ("/usr/bin", "/usr/sbin", "/usr/lib", "/bin", "/sbin", "/lib", "/lib64")
_NO_INSIDE: tuple[str, ...] = ("/proc", "/dev", "/sys", "/opt/atoll", "/run/atoll", "/usr/lib/atoll")
# ... and the system's shared libraries (hiding them stops every program, the guest agent's too)
_NO_INSIDE += (
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/python3",
)
MAX_COMPONENT = 255
"""Bytes in one path component (the kernel's NAME_MAX)."""


@dataclass(frozen=True)
class Mount:
    """One volume or drive as a create asks for it."""

    kind: str
    name: str
    path: str
    read_only: bool = False


def check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise errors.InvalidRequest(
            f"invalid {kind} name {name!r}: use 1-64 characters of letters, digits, '_', '.' and '-', "
            "starting with a letter or digit (no '/' or other path characters)"
        )
    return name


def worker_name(tenant_id: str, name: str) -> str:
    """The name of tenant `tenant_id`'s store `name` on its worker (and its filer)."""
    return name if tenant_id == "default" else f"{tenant_id}~{name}"


def check_worker_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not WORKER_NAME.fullmatch(name):
        raise errors.InvalidRequest(f"invalid {kind} name {name!r} on the worker")
    return name


def check_size(kind: str, size_mb: object) -> int:
    if isinstance(size_mb, bool) or not isinstance(size_mb, int) or not MIN_SIZE_MB <= size_mb <= MAX_SIZE_MB:
        raise errors.InvalidRequest(
            f"invalid {kind} size_mb {size_mb!r}: give an integer from {MIN_SIZE_MB} to {MAX_SIZE_MB} (1 TiB)"
        )
    return size_mb


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def check_path(kind: str, name: str, path: object) -> str:
    """The absolute, normalised path a volume or drive is mounted at; refuses what would hide the
    sandbox's own mounts or files atoll keeps there."""
    what = f"the path of {kind} {name!r}"
    if (
        not isinstance(path, str)
        or not path.startswith("/")
        or "\x00" in path
        or len(path.encode()) > MAX_PATH
    ):
        raise errors.InvalidPath(
            f"{what} must be an absolute path of at most {MAX_PATH} bytes without NUL, got {path!r}"
        )
    long = [part for part in path.split("/") if len(part.encode()) > MAX_COMPONENT]
    if long or "\n" in path:
        raise errors.InvalidPath(
            f"{what} has a component over {MAX_COMPONENT} bytes or a newline "
            f"({(long[0][:40] + '…') if long else 'newline'}); use a shorter, single-line path"
        )
    norm = posixpath.normpath(path)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    if any(part in (".", "..") for part in path.split("/")):
        raise errors.InvalidPath(
            f"{what} must not contain '.' or '..' components, got {path!r} (use {norm!r})"
        )
    if norm == "/":
        raise errors.InvalidPath(f"{what} cannot be '/': mount it at a directory such as /data")
    for reserved in _RESERVED:
        if _inside(reserved, norm):
            raise errors.InvalidPath(
                f"{what} {norm!r} would hide {reserved} (the sandbox's own); choose another directory"
            )
    for reserved in _NO_INSIDE:
        if _inside(norm, reserved):
            raise errors.InvalidPath(
                f"{what} {norm!r} is inside {reserved}, which atoll keeps; choose another"
            )
    return norm


def parse(volumes: object, drives: object) -> tuple[Mount, ...]:
    """The mounts of a create's `volumes` and `drives` lists (each `{name, path, read_only?}`),
    checked: names, paths, no name twice, no path inside another, at most SLOTS in all."""
    out: list[Mount] = []
    for kind, items in (("volume", volumes), ("drive", drives)):
        if items is None:
            continue
        if not isinstance(items, list | tuple):
            raise errors.InvalidRequest(
                f"{kind}s must be a list of {{name, path, read_only?}}, got {items!r}"
            )
        for item in items:
            if isinstance(item, Mount):
                item = {"name": item.name, "path": item.path, "read_only": item.read_only}
            if not isinstance(item, dict):
                raise errors.InvalidRequest(
                    f"each of {kind}s must be {{name, path, read_only?}}, got {item!r}"
                )
            unknown = sorted(set(item) - {"name", "path", "read_only"})
            if unknown:
                raise errors.InvalidRequest(f"unknown field(s) {unknown} in {kind}s entry {item!r}")
            name = check_name(kind, item.get("name"))
            ro = item.get("read_only", False)
            if not isinstance(ro, bool):
                raise errors.InvalidRequest(f"read_only of {kind} {name!r} must be true or false, got {ro!r}")
            out.append(Mount(kind, name, check_path(kind, name, item.get("path")), ro))
    if len(out) > SLOTS:
        raise errors.InvalidRequest(
            f"a sandbox takes at most {SLOTS} volumes and drives together, got {len(out)}"
        )
    seen: set[tuple[str, str]] = set()
    for i, m in enumerate(out):
        if (m.kind, m.name) in seen:
            raise errors.InvalidRequest(f"{m.kind} {m.name!r} is named twice in this create")
        seen.add((m.kind, m.name))
        for other in out[i + 1 :]:
            if _inside(m.path, other.path) or _inside(other.path, m.path):
                raise errors.InvalidPath(
                    f"{m.kind} {m.name!r} at {m.path} and {other.kind} {other.name!r} at {other.path} overlap: "
                    "one would hide the other; mount them at separate directories"
                )
    return tuple(out)

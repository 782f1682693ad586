"""Host storage of sandboxes: every host mount atoll makes, the per-sandbox layers, private modes.

The upper layer lives in an ext4 image file (sparse; its size is the sandbox's disk quota) that is
loop-mounted; the bundle's rootfs is a host overlayfs of the read-only template layer + that upper
dir. The upper dir is exactly the sandbox's filesystem diff, which is what a snapshot keeps.

What a sandbox writes is hostile content on the host: a setuid-root binary or a device node made
inside must never take effect outside. So every mount goes through `mount()`, which always adds
`nosuid,nodev` (and never `noexec`: gVisor maps host files executable, binaries would crash), and
atoll's state lives in 0700 directories (`private_dir`, `secure_home`) that no other host user can
traverse. Called by worker.service and worker.sweep.
"""

from __future__ import annotations

import contextlib
import os

from atoll.worker.host import hostcmd

# Options every host mount made by atoll carries.
SAFE_OPTIONS = ("nosuid", "nodev")
_UNSAFE = {"suid", "dev", "noexec", "exec"}


def mount_options(source_opts: str, *extra: str) -> str:
    """The `-o` value of a mount: SAFE_OPTIONS first, then the caller's. Options that would undo
    them (suid, dev) or break gVisor (noexec, and exec for symmetry) are refused."""
    opts = [o for part in (source_opts, *extra) for o in part.split(",") if o]
    bad = sorted(set(opts) & _UNSAFE)
    if bad:
        raise ValueError(f"mount option(s) {', '.join(bad)} are not allowed for atoll's host mounts")
    return ",".join([*SAFE_OPTIONS, *opts])


async def mount(source: str, target: str, *, options: str = "", fstype: str | None = None) -> None:
    """Mount `source` on `target` with nosuid,nodev added to `options` (the one way atoll mounts)."""
    argv = ["mount"]
    if fstype:
        argv += ["-t", fstype]
    await hostcmd.run(*argv, "-o", mount_options(options), source, target)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of every mount in this mount namespace."""
    with open("/proc/self/mountinfo") as f:
        return [(_unescape(ln.split()[4]), set(ln.split()[5].split(","))) for ln in f]


def mounts_under(directory: str) -> list[str]:
    """Mount points strictly below `directory`, deepest first (the order to unmount them in)."""
    base = os.path.realpath(directory).rstrip("/") + "/"
    return sorted({mp for mp, _ in mounts() if mp.startswith(base)}, key=len, reverse=True)


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    return any(mp == path for mp, _ in mounts())


async def harden_mounts(directory: str) -> list[str]:
    """Add nosuid,nodev to mounts below `directory` that lack them (made by earlier versions).
    A bind remount changes only this mount's flags (the ones named; the filesystem is untouched),
    so the flags worth keeping are named again. Returns the mount points it fixed."""
    base = os.path.realpath(directory).rstrip("/") + "/"
    fixed = []
    for mp, opts in mounts():
        if mp.startswith(base) and not set(SAFE_OPTIONS) <= opts:
            keep = [o for o in ("ro", "noexec", "noatime", "nodiratime", "relatime") if o in opts]
            await hostcmd.run("mount", "-o", ",".join(["remount", "bind", *SAFE_OPTIONS, *keep]), mp)
            fixed.append(mp)
    return fixed


async def create_upper(image: str, mountpoint: str, size_mb: int) -> None:
    """Create (if new) and mount the sandbox's upper-layer filesystem."""
    os.makedirs(mountpoint, mode=0o700, exist_ok=True)
    if not os.path.exists(image):
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.truncate(size_mb * 1024 * 1024)
        await hostcmd.run("mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1", image)
    if not is_mounted(mountpoint):
        await mount(image, mountpoint, options="loop,noatime")
    os.chmod(mountpoint, 0o700)  # the filesystem's root: holds upper/ and overlay's work/
    # upper/ is the sandbox's "/" (its mode shows inside): it keeps 0755
    os.makedirs(os.path.join(mountpoint, "upper"), exist_ok=True)
    os.makedirs(os.path.join(mountpoint, "work"), mode=0o700, exist_ok=True)


async def mount_rootfs(lower: str, upper_mount: str, rootfs: str) -> None:
    os.makedirs(rootfs, exist_ok=True)
    if is_mounted(rootfs):
        return
    opts = f"lowerdir={lower},upperdir={upper_mount}/upper,workdir={upper_mount}/work"
    await mount("overlay", rootfs, options=opts, fstype="overlay")


async def unmount(path: str) -> None:
    """Unmount if mounted (lazily, so a straggling gofer cannot keep us from cleaning up)."""
    if os.path.exists(path) and is_mounted(path):
        await hostcmd.run("umount", "-l", path, check=False)


# ---- private modes -------------------------------------------------------------------------------


def private_dir(path: str) -> str:
    """Create `path` (and missing parents) as a 0700 directory; make an existing one 0700."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def private_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, 0o600)


# Directories under $ATOLL_HOME holding only atoll's own files (0700 dirs, 0600 files throughout).
_OWN_TREES = ("runsc",)
# Inside a sandbox's directory these are mount points: rootfs's mode is the sandbox's "/", upper's
# contents are its files. Neither is walked.
_SANDBOX_MOUNTS = ("rootfs", "upper")


def secure_home(home: str, keep_modes: tuple[str, ...] = ("agent",)) -> None:
    """Make an installation's state private to its owner: $ATOLL_HOME and the directories atoll keeps
    there 0700, the files atoll wrote 0600. Fixes homes that earlier versions left 0755/0644.

    Never descends into a sandbox's filesystem or a template layer (their modes are what programs
    inside see; the home's 0700 already keeps other users out), and leaves `keep_modes` alone (the
    agent directory is bind-mounted into every sandbox, where non-root users must read it)."""
    private_dir(home)
    for entry in os.scandir(home):
        if entry.name in keep_modes:
            continue
        if entry.is_file(follow_symlinks=False):
            private_file(entry.path)
        elif not entry.is_dir(follow_symlinks=False):
            continue
        elif entry.name in _OWN_TREES:
            _secure_tree(entry.path)
        elif entry.name == "sandboxes":
            os.chmod(entry.path, 0o700)
            for sbx in os.scandir(entry.path):
                if sbx.is_dir(follow_symlinks=False):
                    _secure_sandbox_dir(sbx.path)
        else:  # e.g. a template dir inside the home: the directory itself only
            os.chmod(entry.path, 0o700)


def _secure_sandbox_dir(path: str) -> None:
    os.chmod(path, 0o700)
    for entry in os.scandir(path):
        if entry.name in _SANDBOX_MOUNTS:
            if entry.name == "upper" and is_mounted(entry.path):
                os.chmod(entry.path, 0o700)  # the ext4 root, holding upper/ and work/
            continue
        if entry.is_file(follow_symlinks=False):
            private_file(entry.path)
        elif entry.is_dir(follow_symlinks=False):
            _secure_tree(entry.path)


def _secure_tree(path: str) -> None:
    os.chmod(path, 0o700)
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            private_file(entry.path)
        elif entry.is_dir(follow_symlinks=False) and not os.path.ismount(entry.path):
            _secure_tree(entry.path)

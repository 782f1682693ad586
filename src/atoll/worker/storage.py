"""Per-sandbox writable storage: a disk-quota'd upper layer and the overlay root filesystem.

The upper layer lives in an ext4 image file (sparse; its size is the sandbox's disk quota) that is
loop-mounted; the bundle's rootfs is a host overlayfs of the read-only template layer + that upper
dir. The upper dir is exactly the sandbox's filesystem diff, which is what a snapshot keeps.
Called by worker.service.
"""

from __future__ import annotations

import os

from atoll.worker import hostcmd


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split()[4] == path:
                return True
    return False


async def create_upper(image: str, mountpoint: str, size_mb: int) -> None:
    """Create (if new) and mount the sandbox's upper-layer filesystem."""
    os.makedirs(mountpoint, exist_ok=True)
    if not os.path.exists(image):
        with open(image, "wb") as f:
            f.truncate(size_mb * 1024 * 1024)
        await hostcmd.run("mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1", image)
    if not is_mounted(mountpoint):
        await hostcmd.run("mount", "-o", "loop,noatime", image, mountpoint)
    os.makedirs(os.path.join(mountpoint, "upper"), exist_ok=True)
    os.makedirs(os.path.join(mountpoint, "work"), exist_ok=True)


async def mount_rootfs(lower: str, upper_mount: str, rootfs: str) -> None:
    os.makedirs(rootfs, exist_ok=True)
    if is_mounted(rootfs):
        return
    opts = f"lowerdir={lower},upperdir={upper_mount}/upper,workdir={upper_mount}/work"
    await hostcmd.run("mount", "-t", "overlay", "overlay", "-o", opts, rootfs)


async def unmount(path: str) -> None:
    """Unmount if mounted (lazily, so a straggling gofer cannot keep us from cleaning up)."""
    if os.path.exists(path) and is_mounted(path):
        await hostcmd.run("umount", "-l", path, check=False)

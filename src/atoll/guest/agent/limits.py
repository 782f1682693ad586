"""Process limits for user code through gVisor's own pids cgroup, used by `zygote.Init`.

The host-side pids cgroup of a sandbox counts host tasks (~6-8 per guest task on the ptrace
platform); hitting it kills the sentry and loses the sandbox. So the init mounts cgroupfs with the
pids controller inside the sandbox (at CGROUP_MOUNT, on the sandbox's /dev tmpfs) and keeps:

    <mount>/user          pids.max = USER_PIDS_MAX: every user process and thread, the init included
    <mount>/user/c<pid>   pids.max = COMMAND_PIDS_MAX: one per command tree, made at its spawn

The numbers are bounded by memory too: each guest process costs the host ~0.5 MB (measured: 200
sleeps ~100 MB), so 512 per command keeps a flood inside a 512 MB sandbox's memory limit (1,000
sleeps there end in the host OOM killer).
A fork or thread creation past a limit fails with EAGAIN inside the sandbox. One command at its
limit leaves room for others (a new exec still starts). A command is moved into its cgroup right
after its spawn; a child it forks before that (within microseconds of its exec) stays in `user`,
which still bounds it. This is a guard against accidents, not a security boundary: sandbox code
runs as root and could raise the limits; the host-side pids cgroup stays the last resort.
If cgroupfs cannot be mounted (not in gVisor, no CAP_SYS_ADMIN) there are no limits inside.
"""

from __future__ import annotations

import os

from .common import log

CGROUP_MOUNT = "/dev/.atoll-cgroup"
USER_PIDS_MAX = 1024
COMMAND_PIDS_MAX = 512
MAX_LINGERING = 4096


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class UserLimits:
    def __init__(self, root: str = CGROUP_MOUNT):
        self.root = root
        self.user = f"{root}/user"
        self.enabled = False
        self.lingering: list[str] = []  # command cgroups whose leftovers still run

    def setup(self) -> None:
        from .zygote import libc  # noqa: PLC0415 - one libc loader, imported late: no import cycle

        try:
            if not os.path.exists(f"{self.root}/cgroup.procs"):
                os.makedirs(self.root, exist_ok=True)
                if libc().mount(b"cgroup", self.root.encode(), b"cgroup", 0, b"pids") != 0:
                    raise OSError(f"mount cgroup (pids) on {self.root} failed")
            os.makedirs(self.user, exist_ok=True)
            _write(f"{self.user}/pids.max", str(USER_PIDS_MAX))
            _write(f"{self.user}/cgroup.procs", "0")
            self.enabled = True
        except OSError as e:
            log(f"atoll-init: no process limits inside the sandbox: {e}")

    def confine(self, pid: int) -> None:
        """Put a freshly spawned command into its own cgroup with COMMAND_PIDS_MAX."""
        if not self.enabled:
            return
        path = f"{self.user}/c{pid}"
        try:
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            _write(f"{path}/pids.max", str(COMMAND_PIDS_MAX))
            _write(f"{path}/cgroup.procs", str(pid))
        except OSError as e:
            log(f"atoll-init: cannot limit command {pid}: {e}")

    def release(self, pid: int) -> None:
        """The command's first process exited: remove its cgroup once its leftovers are gone."""
        if not self.enabled:
            return
        self.lingering.append(f"{self.user}/c{pid}")
        still = []
        for path in self.lingering:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                still.append(path)  # leftover descendants still in it (EBUSY)
        self.lingering = still[-MAX_LINGERING:]

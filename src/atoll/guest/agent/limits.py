"""Process limits for user code through gVisor's own pids cgroup, used by `zygote.Init`.

The host-side pids cgroup of a sandbox counts host tasks (~6-8 per guest task on the ptrace
platform); hitting it kills the sentry and loses the sandbox. So the init mounts cgroupfs with the
pids controller inside the sandbox (at CGROUP_MOUNT, on the sandbox's /dev tmpfs) and keeps:

    <mount>/user          pids.max = USER_PIDS_MAX: every user process and thread, the init included
    <mount>/user/c<n>     pids.max = COMMAND_PIDS_MAX: one per command tree (a pool, reused)

The numbers are bounded by memory too: each guest process costs the host ~0.5 MB (measured: 200
sleeps ~100 MB), so 512 per command keeps a flood inside a 512 MB sandbox's memory limit (1,000
sleeps there end in the host OOM killer).
A fork or thread creation past a limit fails with EAGAIN inside the sandbox. One command at its
limit leaves room for others (a new exec still starts). A command is moved into its cgroup right
after its spawn (once the init has answered the agent); a child it forks before that stays in
`user`, which still bounds it. This is a guard against accidents, not a security boundary: sandbox code
runs as root and could raise the limits; the host-side pids cgroup stays the last resort.
If cgroupfs cannot be mounted (not in gVisor, no CAP_SYS_ADMIN) there are no limits inside.
"""

from __future__ import annotations

import itertools
import os

from .common import log

CGROUP_MOUNT = "/dev/.atoll-cgroup"
USER_PIDS_MAX = 1024
COMMAND_PIDS_MAX = 512
MAX_LINGERING = 4096
POOL = 8  # command cgroups kept ready


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class UserLimits:
    """The init's cgroups: `setup` once, `confine` each spawned command, `release` at its exit.

    Command cgroups are made ahead of time and reused (a mkdir, a pids.max write and an rmdir cost
    ~0.7 ms per exec inside gVisor): `confine` only writes the pid into a ready one, `release`
    returns it to the pool once its leftovers are gone."""

    def __init__(self, root: str = CGROUP_MOUNT):
        self.root = root
        self.user = f"{root}/user"
        self.enabled = False
        self.ready: list[str] = []  # empty command cgroups with their pids.max set
        self.in_use: dict[int, str] = {}  # command pid -> its cgroup
        self.lingering: list[str] = []  # command cgroups whose leftovers still run
        self._names = itertools.count()

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
            return
        # cgroups a previous init left (it was killed): their processes died with its namespace
        for name in os.listdir(self.user):
            path = f"{self.user}/{name}"
            if os.path.isdir(path):
                self._recycle(path)
        while len(self.ready) < POOL:
            if not self._make():
                break

    def _make(self) -> bool:
        try:
            while True:
                path = f"{self.user}/c{next(self._names)}"
                try:
                    os.mkdir(path)
                    break
                except FileExistsError:  # pooled by an earlier init of this sandbox
                    continue
            _write(f"{path}/pids.max", str(COMMAND_PIDS_MAX))
        except OSError as e:
            log(f"atoll-init: cannot make a command cgroup: {e}")
            return False
        self.ready.append(path)
        return True

    def confine(self, pid: int) -> None:
        """Put a freshly spawned command into its own cgroup with COMMAND_PIDS_MAX."""
        if not self.enabled:
            return
        if not self.ready and not self._make():
            return
        path = self.ready.pop()
        try:
            _write(f"{path}/cgroup.procs", str(pid))
            self.in_use[pid] = path
        except OSError as e:
            self.ready.append(path)
            log(f"atoll-init: cannot limit command {pid}: {e}")

    def release(self, pid: int) -> None:
        """The command's first process exited: its cgroup is reused once its leftovers are gone."""
        path = self.in_use.pop(pid, None)
        if path is not None:
            self.lingering.append(path)
        still = []
        for path in self.lingering:
            if not self._recycle(path):
                still.append(path)
        self.lingering = still[-MAX_LINGERING:]
        if len(self.ready) < POOL:
            self._make()

    def _recycle(self, path: str) -> bool:
        """Back to the pool (or removed, past POOL) if no process is left in it."""
        try:
            with open(f"{path}/cgroup.procs", "rb") as f:
                if f.read().strip():
                    return False
            if len(self.ready) < POOL:
                self.ready.append(path)
            else:
                os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

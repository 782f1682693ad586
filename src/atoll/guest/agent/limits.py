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
The command's cgroup is also how its whole tree is found: what it started in the background, a
`setsid` daemon, an orphan reparented to the init all stay in it (`kill_command`, for a timeout
and a DELETE). It is known by the command's pid until it is empty again.
If cgroupfs cannot be mounted (not in gVisor, no CAP_SYS_ADMIN) there are no limits inside.
"""

from __future__ import annotations

import heapq
import itertools
import os
import signal
import threading
import time

from .common import libc, log

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
        self.lingering: dict[int, str] = {}  # exited command's pid -> its cgroup, leftovers still run
        self._names = itertools.count()
        self._spare_keys = itertools.count(1)

    def setup(self) -> None:

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
            earlier = self.lingering.pop(pid, None)
            if earlier is not None and earlier != path:  # the pid was reused: keep the earlier one
                self.lingering[-next(self._spare_keys)] = earlier  # until empty, under a key no pid has
            self.lingering[pid] = path
        for old, path in list(self.lingering.items()):
            if self._recycle(path):
                del self.lingering[old]
        while len(self.lingering) > MAX_LINGERING:
            del self.lingering[next(iter(self.lingering))]
        if len(self.ready) < POOL:
            self._make()

    def path_of(self, pid: int) -> str | None:
        return self.in_use.get(pid) or self.lingering.get(pid)

    def members(self, pid: int) -> list[int]:
        """Every process of the command started as `pid` (itself included while it runs)."""
        path = self.path_of(pid)
        if path is None:
            return []
        try:
            with open(f"{path}/cgroup.procs", "rb") as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill_command(self, pid: int, within: float = 2.0) -> int:
        """SIGKILL every process of the command started as `pid`, again until its cgroup is empty
        (a fork bomb forks between a read and the kills; a killed process forks no more) or
        `within` seconds passed. Returns how many kills were sent."""
        sent = 0
        deadline = time.monotonic() + within
        if self.path_of(pid) is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # its group at once, as one call (a bomb forks fast)
            except OSError:
                pass
        while time.monotonic() < deadline:
            victims = [p for p in self.members(pid) if p != os.getpid()]
            if not victims:
                break
            for victim in victims:
                try:
                    os.kill(victim, signal.SIGKILL)
                    sent += 1
                except OSError:
                    pass
            time.sleep(0.005)
        return sent

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


class Deadlines:
    """What a command with a timeout started dies with its timeout, leftovers included: a command
    that exits early (`server &`, a fork bomb's `:|:&`) leaves processes in its cgroup, and at the
    deadline they are killed (`UserLimits.kill_command`), unless the cgroup went back to the pool
    (empty: nothing to kill) or serves another command by now. One thread for all of them."""

    def __init__(self, limits: UserLimits, lock: threading.Lock):
        self.limits = limits
        self.lock = lock  # the init's: a spawn registers its pid and cgroup under it
        self._heap: list[tuple[float, int, str]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, pid: int, timeout_s: float) -> None:
        path = self.limits.path_of(pid)
        if path is None:
            return
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + timeout_s, pid, path))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="init-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _at, pid, path = heapq.heappop(self._heap)
            with self.lock:
                same = self.limits.path_of(pid) == path
            if same:
                n = self.limits.kill_command(pid)
                if n:
                    log(f"atoll-init: command {pid} reached its timeout; killed {n} process(es) it left")

"""Starting `atoll-init`, PID 1 of a child PID namespace in which every user command runs, so that
user code cannot see or signal the agent (issue 5: `pkill python3`, `kill -9 1`, `kill -STOP 1`
used to end or hang the whole sandbox), and the agent's helpers around it.

atoll-init is a small C program (`atoll/guest/init/atoll-init.c`, compiled by the worker into the
agent's directory: /opt/atoll/atoll-init; its header describes what it does and its protocol). It
was a fork of the agent, then a Python process of its own; in gVisor either cost ~8 MB of guest
memory per sandbox, saved into every snapshot (see the C file). `initclient.InitClient` starts it
(`start`) at the agent's start-up and again whenever it died, and speaks its protocol; the started
process unshares CLONE_NEWPID and forks the init, which is reparented to the agent: the agent's
reaper sees it stop (then sends SIGCONT) or die (then starts a new one; `processes.ProcessTable`
reports the commands it ran as killed).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import sys
import termios

from .common import libc, log

MNT_DETACH = 2
INIT = os.environ.get("ATOLL_INIT") or os.path.join(
    os.path.dirname(os.path.abspath(sys.argv[0])), "atoll-init"
)
"""The program: beside the agent's own file (/opt/atoll/agent.pyc in a sandbox), or ATOLL_INIT."""


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to a command's process group (it leads one: each command is a new session), or to
    the process alone if its group is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    except OSError:
        pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


MAX_MESSAGE = 1 << 20
"""The largest request atoll-init reads (MAX_MESSAGE in atoll-init.c): a spawn's argv and env."""


def socketpair() -> tuple[socket.socket, socket.socket]:
    """The agent's and the init's ends. A request is one datagram, which may not exceed the send
    buffer (gVisor's default, 208 KiB, refused ~300 KB of env with EMSGSIZE): the agent's is raised
    to hold MAX_MESSAGE (gVisor takes SO_SNDBUF up to 4 MiB and ignores SO_SNDBUFFORCE; Linux caps
    SO_SNDBUF at wmem_max, which SO_SNDBUFFORCE passes for root). Best effort."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for opt in (socket.SO_SNDBUF, getattr(socket, "SO_SNDBUFFORCE", 32)):
        try:
            ours.setsockopt(socket.SOL_SOCKET, opt, 2 * MAX_MESSAGE)
            if ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= MAX_MESSAGE:
                break
        except OSError:
            continue
    return ours, theirs


def start(sandbox_id: str, env: dict[str, str]) -> tuple[int, socket.socket]:
    """Start an init: exec `atoll-init FD` with the other end of a new socketpair as FD; returns the
    init's pid (in the agent's namespace) and the agent's end once the init said hello."""
    ours, theirs = socketpair()
    theirs.set_inheritable(True)  # every other descriptor of the agent is close-on-exec (PEP 446)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        # (the agent's reaper reaps the process started, which exits once it forked the init)
        # Its stdin, stdout and stderr are /dev/null: commands can write to /proc/1/fd/N, and the
        # agent's own are the host's log file (outside the sandbox's disk quota). It sends its log
        # lines on the socket instead.
        os.posix_spawn(
            INIT,
            ["atoll-init", str(theirs.fileno())],
            {**env, "ATOLL_SANDBOX_ID": sandbox_id},
            file_actions=[(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)],
            setsid=True,
        )
    finally:
        os.close(devnull)
        theirs.close()
    while True:
        data = ours.recv(4096)
        hello = json.loads(data) if data else {}
        if "log" not in hello:
            break
        log(str(hello["log"]))
    if "init" not in hello:
        ours.close()
        raise OSError(f"atoll-init did not start: {hello.get('error', 'no answer')}")
    return int(hello["init"]), ours


AGENT_PROC = "/dev/.atoll-proc"


def mount_agent_proc() -> str:
    """A proc of the sandbox's root PID namespace for the agent's own reads (the checkpoint gate):
    /proc becomes the init's namespace view, where the agent has no pid and /proc/self and
    /proc/net (a link to self/net) do not resolve for it. Returns the path to read, /proc if the
    mount failed."""
    try:
        os.makedirs(AGENT_PROC, exist_ok=True)
        if not os.path.exists(f"{AGENT_PROC}/self"):
            _check(
                libc().mount(b"proc", AGENT_PROC.encode(), b"proc", 0, None), f"mount proc on {AGENT_PROC}"
            )
        return AGENT_PROC
    except OSError as e:
        log(f"cannot mount the agent's own proc ({e}); the checkpoint gate reads /proc")
        return "/proc"


def unmount_proc() -> None:
    """Drop the proc mount of a namespace whose init died (the next init mounts its own)."""
    libc().umount2(b"/proc", MNT_DETACH)


def set_environ_in_place(name: str, value: str) -> bool:
    """Overwrite `name=` in this process's original environ block (what /proc/<pid>/environ shows)
    if the new value has the same length (sandbox ids do). Returns whether it was found."""
    try:
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc(), "environ")
    except ValueError:
        return False
    prefix = name.encode() + b"="
    new = prefix + value.encode()
    i = 0
    while environ[i]:
        addr = environ[i]
        current = ctypes.string_at(addr)
        if current.startswith(prefix):
            if len(current) != len(new):
                return False
            ctypes.memmove(addr, new, len(new))
            return True
        i += 1
    return False


def take_controlling_tty() -> None:
    """preexec_fn of a terminal's command (after setsid) when the agent spawns it itself: its stdin,
    a pty slave, becomes the new session's controlling terminal (TIOCSCTTY)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)

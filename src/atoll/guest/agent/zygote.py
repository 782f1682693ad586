"""`atoll-init`: PID 1 of a child PID namespace in which every user command runs, so that user code
cannot see or signal the agent (issue 5: `pkill python3`, `kill -9 1`, `kill -STOP 1` used to end
or hang the whole sandbox).

The agent (PID 1 of the sandbox) starts it once (`start_first`: a fork before the agent has any
thread; a restart after it died: `start_exec`, a fresh `python3 ... --zygote FD`). Either way an
intermediate process unshares CLONE_NEWPID and forks; the child is init of the new namespace and
is reparented to the agent, whose reaper sees it stop (then sends SIGCONT) or die (then restarts
it; `processes.ProcessTable` reports the commands it ran as killed). The init:

* mounts a fresh proc on /proc (this gVisor has no per-process mount namespaces: the mount is seen
  by the agent too, which is fine: the agent reads /proc only for the checkpoint gate, and user
  processes are what it looks for), so `ps`/`pkill` show only the user's processes;
* names itself `atoll-init` (comm and cmdline overwritten in place), installs a no-op handler for
  every catchable signal (handlers, unlike SIG_IGN, are not inherited across exec), reaps every
  orphan of the namespace;
* keeps user processes under this gVisor's own pids cgroup (`limits`): all of them at most
  USER_PIDS_MAX tasks, each command tree at most COMMAND_PIDS_MAX, so a flood or a fork bomb gets
  EAGAIN instead of exhausting the host-side pids cgroup that would kill the sentry;
* serves the agent over an AF_UNIX SOCK_SEQPACKET socketpair with JSON messages (blocking I/O and
  threads only, no epoll: see the package docstring):
    agent -> init  {"op": "spawn", "id", "argv", "cwd", "env", "user": [uid, gid, groups]|null}
                   + 3 fds (stdin, stdout, stderr) by SCM_RIGHTS  -> {"id", "pid"} | {"id", "error": {...}}
                   ("ctty": true: stdin is a terminal's slave, made the new session's controlling tty;
                    "deadline_s": the command's timeout, which its leftovers die with: limits.Deadlines)
                   {"op": "kill", "pid", "root_alive"}   (kill_tree and its cgroup inside; no answer)
                   {"op": "signal", "pid", "sig"}  (killpg inside: a command's group, a terminal's ^C; no answer)
                   {"op": "identity", "sandbox_id", "cpus"} (rewrites ATOLL_SANDBOX_ID in its environ;
                                                          narrows the CPU affinity commands inherit)
    init -> agent  {"exit": pid, "code": exit code as a shell reports it}, for spawned commands

Pids in messages are pids in the child namespace: what `ps` shows and what the API reports.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import termios
import threading

from . import limits, proctree
from .common import libc, limit_cpus, log

CLONE_NEWPID = 0x20000000
MNT_DETACH = 2
MSG_CMSG_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0x40000000)
PR_SET_NAME = 15
NAME = b"atoll-init"
MAX_MESSAGE = 1 << 20  # an exec request with its environment; the agent checks sizes before
_REAPER_OWNS_STATUS = -(1 << 30)


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


# ---- starting it (called in the agent) --------------------------------------------------------


def socketpair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def start_first(sandbox_id: str) -> tuple[int, socket.socket]:
    """Fork the init from the agent while it has a single thread (~15 ms, no interpreter start)."""
    ours, theirs = socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            _become_init(theirs, sandbox_id)
        finally:
            os._exit(70)
    theirs.close()
    return _handshake(pid, ours)


def start_exec(sandbox_id: str, env: dict[str, str]) -> tuple[int, socket.socket]:
    """Start a fresh init by exec (the agent runs threads now: forking it could copy a held lock)."""
    ours, theirs = socketpair()
    theirs.set_inheritable(True)
    n = len(sys.orig_argv) - len(sys.argv) + 1  # the interpreter, its options and the script/-m
    argv = ["atoll-init", *sys.orig_argv[1:n], "--zygote", str(theirs.fileno())]
    try:
        subprocess.Popen(
            argv,
            executable=sys.executable,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env={**env, "ATOLL_SANDBOX_ID": sandbox_id},
            start_new_session=True,
        ).returncode = _REAPER_OWNS_STATUS
    finally:
        theirs.close()
    return _handshake(None, ours)


def _handshake(intermediate: int | None, sock: socket.socket) -> tuple[int, socket.socket]:
    data = sock.recv(4096)
    if intermediate is not None:
        try:
            os.waitpid(intermediate, 0)  # the reaper is not running yet
        except ChildProcessError:
            pass
    hello = json.loads(data) if data else {}
    if "init" not in hello:
        sock.close()
        raise OSError(f"atoll-init did not start: {hello.get('error', 'no answer')}")
    return int(hello["init"]), sock


def exec_main(fd: int) -> None:
    """Entry of `--zygote FD` (see start_exec)."""
    _become_init(socket.socket(fileno=fd), os.environ.get("ATOLL_SANDBOX_ID", ""))
    os._exit(70)


def _become_init(sock: socket.socket, sandbox_id: str) -> None:
    """In the intermediate process: unshare the PID namespace, fork the init, report its pid, exit."""
    try:
        _check(libc().unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        pid = os.fork()
    except OSError as e:
        sock.send(json.dumps({"error": str(e)}).encode())
        os._exit(71)
    if pid:
        sock.send(json.dumps({"init": pid}).encode())
        os._exit(0)
    try:
        Init(sock, sandbox_id).run()
    except BaseException:
        import traceback

        log("atoll-init failed:\n" + traceback.format_exc())
    os._exit(70)


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


# ---- the init itself ------------------------------------------------------------------------------


def rename_self(name: bytes) -> None:
    """Set comm and overwrite the argv block in place, so `pkill python3` / `pkill -f python` miss us."""
    lib = libc()
    lib.prctl(PR_SET_NAME, name, 0, 0, 0)
    try:
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(lib, "environ")
        args = b"".join(a.encode() + b"\0" for a in sys.orig_argv)
        start = environ[0] - len(args) if environ[0] else 0
        if start and ctypes.string_at(start, len(args)) == args:
            ctypes.memmove(start, name[: len(args) - 1].ljust(len(args), b"\0"), len(args))
    except (ValueError, OSError):
        pass


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
    """preexec_fn of a terminal's command (after setsid): its stdin, a pty slave, becomes the new
    session's controlling terminal (TIOCSCTTY), so job control, ^C and SIGWINCH reach it."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _noop(signum, frame) -> None:
    pass


class Init:
    def __init__(self, sock: socket.socket, sandbox_id: str):
        self.sock = sock
        self.sandbox_id = sandbox_id
        self.lock = threading.Lock()  # a spawn's answer goes out before that pid's exit message
        self.spawned: set[int] = set()
        self.limits = limits.UserLimits()
        self.deadlines = limits.Deadlines(self.limits, self.lock)
        self.children = threading.Event()  # set after each spawn: wakes a reaper that had no child

    def run(self) -> None:
        rename_self(NAME)
        for sig in range(1, signal.NSIG):
            if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT):
                continue
            try:
                signal.signal(sig, _noop)
            except (OSError, ValueError, RuntimeError):
                pass
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            _check(libc().mount(b"proc", b"/proc", b"proc", 0, None), "mount proc on /proc")
        except OSError as e:
            log(f"atoll-init: {e}; ps in the sandbox lists the agent too")
        if self.sandbox_id:
            set_environ_in_place("ATOLL_SANDBOX_ID", self.sandbox_id)
        limit_cpus(os.environ.get("ATOLL_CPUS"))  # this thread forks every command
        self.limits.setup()
        threading.Thread(target=self._reap_forever, name="init-reaper", daemon=True).start()
        self._serve()

    def _send(self, msg: dict) -> None:
        try:
            self.sock.send(json.dumps(msg).encode())
        except OSError:
            os._exit(0)  # the agent is gone: so are we (and with us the namespace)

    def _serve(self) -> None:
        while True:
            try:
                # commands are spawned with close_fds=False and must inherit only 0, 1, 2
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 3, MSG_CMSG_CLOEXEC)
            except InterruptedError:
                continue
            if not data:
                os._exit(0)
            for fd in fds:  # this gVisor ignores MSG_CMSG_CLOEXEC (measured): set it by hand
                os.set_inheritable(fd, False)
            try:
                msg = json.loads(data)
                op = msg.get("op")
                if op == "spawn":
                    self._spawn(msg, fds)
                    fds = []
                elif op == "kill":
                    pid = int(msg["pid"])
                    proctree.kill_tree(pid, root_alive=bool(msg.get("root_alive", True)))
                    self.limits.kill_command(pid)  # what left its session and group (setsid, orphans)
                elif op == "signal":
                    signal_group(int(msg["pid"]), int(msg["sig"]))
                elif op == "identity":
                    self.sandbox_id = str(msg["sandbox_id"])
                    set_environ_in_place("ATOLL_SANDBOX_ID", self.sandbox_id)
                    if msg.get("cpus") is not None:
                        limit_cpus(msg["cpus"])
            except Exception as e:  # never let the init die on one bad message
                log(f"atoll-init: request failed: {e!r}")
            finally:
                for fd in fds:
                    os.close(fd)

    def _spawn(self, msg: dict, fds: list[int]) -> None:
        user = msg.get("user")
        kwargs = {"user": user[0], "group": user[1], "extra_groups": user[2]} if user else {}
        with self.lock:
            try:
                if len(fds) != 3:
                    raise ValueError(f"spawn needs 3 descriptors, got {len(fds)}")
                popen = subprocess.Popen(
                    msg["argv"],
                    stdin=fds[0],
                    stdout=fds[1],
                    stderr=fds[2],
                    cwd=msg.get("cwd"),
                    env=msg.get("env"),
                    close_fds=False,
                    start_new_session=True,
                    bufsize=0,
                    preexec_fn=take_controlling_tty if msg.get("ctty") else None,
                    **kwargs,
                )
            except OSError as e:
                err = {"kind": "os", "errno": e.errno, "strerror": e.strerror, "filename": e.filename}
                self._send({"id": msg.get("id"), "error": err})
                return
            except Exception as e:
                kind = "value" if isinstance(e, ValueError) else "other"
                self._send({"id": msg.get("id"), "error": {"kind": kind, "message": str(e)}})
                return
            finally:
                for fd in fds:
                    os.close(fd)
            popen.returncode = _REAPER_OWNS_STATUS
            self.spawned.add(popen.pid)
            # answer first: the agent waits for the pid, the cgroup write need not delay it
            self._send({"id": msg.get("id"), "pid": popen.pid})
            self.limits.confine(popen.pid)
            if msg.get("deadline_s"):
                self.deadlines.add(popen.pid, float(msg["deadline_s"]))
        self.children.set()

    def _reap_forever(self) -> None:
        while True:
            self.children.clear()
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self.children.wait(60.0)  # no child yet: wait for a spawn (no polling while idle)
                continue
            except InterruptedError:
                continue
            code = os.waitstatus_to_exitcode(status)
            if code < 0:
                code = 128 - code
            with self.lock:
                if pid in self.spawned:
                    self.spawned.discard(pid)
                    self._send({"exit": pid, "code": code})
                    try:
                        self.limits.release(pid)
                    except Exception as e:  # never stop reporting exits over a cgroup's bookkeeping
                        log(f"atoll-init: releasing the cgroup of {pid} failed: {e!r}")

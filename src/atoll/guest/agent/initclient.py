"""The agent's side of `atoll-init` (see `zygote`; the program is atoll/guest/init/atoll-init.c): start
it, send it spawn/kill/signal/identity requests, receive the exit statuses of the commands it
started, and restart it if user code killed it.

`processes.ProcessTable` owns one InitClient when the agent runs as PID 1 (`__main__` calls
`ProcessTable.start_init`); `proctree.kill_tree` is routed here so that pids are the namespace's.
Spawns are serialised (one request, one answer, on one socket); a reader thread takes the answers
and the exit messages, which it hands to `on_exit`.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import queue
import socket
import threading
import time

from . import zygote
from .common import PIPE, log
from .errors import ApiError, NotRunnable, SpawnFailed

RESTART_WAIT_S = 30.0
REPLY_WAIT_S = 60.0  # a live init answers a spawn in milliseconds; SIGCONT is sent when it stops


def request(*fields) -> bytes:
    """One request to atoll-init: NUL-terminated fields, strings as subprocess passes them to exec
    (os.fsencode), numbers in decimal. A field holding NUL cannot be sent (nor exec'd)."""
    parts = [os.fsencode(f) if isinstance(f, str) else str(f).encode() for f in fields]
    if any(b"\0" in p for p in parts):
        raise ValueError("embedded null byte")
    return b"\0".join(parts) + b"\0"


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        400,
        "invalid_request",
        f"the command's arguments and environment take {size} bytes, more than the sandbox's "
        f"process init takes in one request (about {limit} bytes here); pass large data in a "
        "file or on stdin instead",
    )


class Spawned:
    """What the exec handlers use of a started command: its pid and the read ends of its pipes."""

    __slots__ = ("pid", "stdout", "stderr", "epoch")

    def __init__(self, pid: int, stdout, stderr, epoch: int = 0):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.epoch = epoch  # the InitClient.epoch of the init that started it


class InitClient:
    def __init__(self, on_exit, on_restart):
        self._on_exit = on_exit  # (pid, code, signal or None) for every exit message
        self._on_restart = on_restart  # () after a dead init was replaced: running commands died
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.pid = 0
        self.sandbox_id = os.environ.get("ATOLL_SANDBOX_ID", "")
        self.cpus: float | str | None = os.environ.get("ATOLL_CPUS")  # the sandbox's CPU quota
        self._sock: socket.socket | None = None
        # the queue of the answers that arrive on self._sock (a new one with each init)
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self.epoch = 0
        """Counts the inits that died: a command started by an init of an earlier epoch was killed
        with it (ProcessTable checks when it registers the command, see died)."""
        self._sock_epoch = 0
        self._ids = itertools.count(1)

    def start_first(self) -> None:
        self._attach(*zygote.start(self.sandbox_id, self._env()))

    def _env(self) -> dict[str, str]:
        """The init's environment (each command gets its own with its spawn request)."""
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C.UTF-8"}
        if self.cpus is not None:
            env["ATOLL_CPUS"] = str(self.cpus)
        return env

    def _attach(self, pid: int, sock: socket.socket) -> None:
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self.pid, self._sock, self._replies, self._sock_epoch = pid, sock, replies, self.epoch
        threading.Thread(target=self._read_forever, args=(sock, replies), daemon=True).start()
        self._ready.set()

    def _read_forever(self, sock: socket.socket, replies: queue.SimpleQueue) -> None:
        while True:
            try:
                data = sock.recv(1 << 16)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                if self._sock is sock:
                    self._ready.clear()  # later requests wait for the successor (see died)
                replies.put(None)
                return
            msg = json.loads(data)
            if "log" in msg:  # a line of the init's (its stdout and stderr are /dev/null)
                log(str(msg["log"]))
            elif "exit" in msg:
                sig = msg.get("signal")  # absent from an init of an older agent
                self._on_exit(int(msg["exit"]), int(msg["code"]), int(sig) if sig is not None else None)
            else:
                replies.put(msg)

    # ---- the init died or stopped (called by the agent's reaper) --------------------------------

    def died(self) -> None:
        """User code killed the init (and with it every process of its namespace): start a new one.
        The epoch moves on first: a spawn whose answer came from the dead init, registered after
        `on_restart` looked at the running commands, is then seen as killed when it registers."""
        self.epoch += 1
        self._ready.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        log(f"atoll-init (pid {self.pid}) died; its commands are reported killed; starting a new one")
        threading.Thread(target=self._restart, daemon=True).start()

    def _restart(self) -> None:
        self._on_restart()
        delay = 0.1
        while True:
            try:
                zygote.unmount_proc()  # the dead namespace's proc
                self._attach(*zygote.start(self.sandbox_id, self._env()))
                return
            except Exception as e:  # keep trying: without an init no command can run
                log(f"cannot restart atoll-init: {e!r}")
                threading.Event().wait(delay)
                delay = min(delay * 2, 5.0)

    # ---- requests --------------------------------------------------------------------------------

    def _request(self, msg: bytes, fds: list[int] = ()) -> queue.SimpleQueue:
        return self._request_on(msg, fds)[0]

    def _request_on(self, msg: bytes, fds: list[int] = ()) -> tuple[queue.SimpleQueue, int]:
        """Send `msg` (see `request`) to the current init (waiting for a restarted one); return the
        queue its answers arrive in — the queue of the socket it was sent on, never a dead init's —
        and that init's epoch."""
        if not self._ready.wait(RESTART_WAIT_S):
            raise ApiError(500, "runtime_error", "the sandbox's process init (atoll-init) is not running")
        sock, replies, epoch = self._sock, self._replies, self._sock_epoch
        if sock is None:
            raise ApiError(500, "runtime_error", "the sandbox's process init (atoll-init) is not running")
        if len(msg) > zygote.MAX_MESSAGE:
            raise _too_large(len(msg), zygote.MAX_MESSAGE)
        try:
            socket.send_fds(sock, [msg], list(fds))
        except OSError as e:
            if e.errno in (errno.EMSGSIZE, errno.ENOBUFS):  # the init lives on: the request was too big
                raise _too_large(len(msg), sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)) from None
            if self._sock is sock:
                self._ready.clear()  # it died: wait for the successor (see died), not a timeout
            raise
        return replies, epoch

    def spawn(
        self, argv, *, cwd, env, user_kwargs, stdin, stdout, stderr, ctty: bool = False, deadline_s=None
    ) -> Spawned:
        pipes: list[int] = []
        ends: list = [None, None]
        try:
            fds = [stdin]
            for i, target in enumerate((stdout, stderr)):
                if target == PIPE:
                    r, w = os.pipe2(os.O_CLOEXEC)
                    pipes.append(w)
                    ends[i] = open(r, "rb", buffering=0)  # noqa: SIM115 - returned to the caller
                    fds.append(w)
                else:
                    fds.append(target)
            user: list = ["", ""]
            groups: list = []
            if user_kwargs:
                user = [user_kwargs["user"], user_kwargs["group"]]
                groups = list(user_kwargs.get("extra_groups", []))
            request_id = next(self._ids)
            msg = request(
                "spawn",
                request_id,
                "c" if ctty else "",  # a terminal (ptys): stdin is the pty slave, its controlling tty
                deadline_s or "",  # what the command leaves running dies with its timeout
                cwd or "",
                *user,
                len(groups),
                *groups,
                len(argv),
                *argv,
                len(env),
                *(f"{k}={v}" for k, v in env.items()),
            )
            answer = None
            for _attempt in range(2):
                with self._lock:
                    try:
                        replies, epoch = self._request_on(msg, fds)
                    except OSError:  # not delivered (the init is gone): safe to send again
                        continue
                    answer = self._answer(replies, request_id)
                break
            if answer is None:
                # Never sent twice: the init may have started it before it died (at most once). A
                # command that kills the init at once (`kill -9 1`) ends here too: killed, like every
                # process of the init's namespace.
                raise NotRunnable(
                    137,
                    "atoll: the sandbox's process init was killed while this command started (kill -9 1?); "
                    "the command was killed with it, if it ran at all; atoll started a new init\n",
                )
        except BaseException:
            for f in ends:
                if f is not None:
                    f.close()
            raise
        finally:
            for w in pipes:
                os.close(w)
        if "pid" in answer:
            return Spawned(int(answer["pid"]), ends[0], ends[1], epoch)
        for f in ends:
            if f is not None:
                f.close()
        err = answer.get("error", {})
        if err.get("kind") == "os":  # as subprocess raises it: the file is the program or the cwd
            filename = {"exec": argv[0], "chdir": cwd}.get(err.get("step"))
            raise OSError(err.get("errno"), os.strerror(err.get("errno", 0)), filename)
        if err.get("kind") == "value":
            raise ValueError(err.get("message"))
        raise SpawnFailed(err.get("message", "unknown failure in atoll-init"))

    @staticmethod
    def _answer(replies: queue.SimpleQueue, request_id: int) -> dict | None:
        """The init's answer to request `request_id`; None if it died first. Answers to earlier
        requests (whose caller gave up) are dropped."""
        deadline = time.monotonic() + REPLY_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                answer = replies.get(timeout=left)
            except queue.Empty:
                return None
            if answer is None or answer.get("id") == request_id:
                return answer
        return None

    def kill_tree(self, pid: int, *, root_alive: bool = True) -> None:
        try:
            self._request(request("kill", pid, int(root_alive)))
        except (OSError, ApiError) as e:
            log(f"cannot ask atoll-init to kill {pid}: {e}")

    def signal(self, pid: int, sig: int) -> None:
        try:
            self._request(request("signal", pid, sig))
        except (OSError, ApiError) as e:
            log(f"cannot ask atoll-init to signal {pid}: {e}")

    def signal_group(self, pgid: int, sig: int) -> None:
        """A terminal's ^C/^Z/SIGWINCH to its foreground group (the same op: killpg inside)."""
        self.signal(pgid, sig)

    def set_identity(self, sandbox_id: str, cpus: float | None = None) -> None:
        self.sandbox_id = sandbox_id
        if cpus is not None:
            self.cpus = cpus
        zygote.set_environ_in_place("ATOLL_SANDBOX_ID", sandbox_id)  # the agent's own
        try:
            self._request(request("identity", sandbox_id, "" if self.cpus is None else self.cpus))
        except (OSError, ApiError) as e:
            log(f"cannot pass the identity to atoll-init: {e}")

    def kill_all(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, 9)  # the namespace's init: every user process dies with it
            except OSError:
                pass

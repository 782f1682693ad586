"""atoll guest agent: the daemon that runs as PID 1 inside every gVisor sandbox.

The atoll worker on the host is its only client: it calls this agent over HTTP/1.1 on TCP to run
commands, move files, list and kill processes, check health, set the sandbox identity after a
restore or fork, and ask whether the sandbox can be checkpointed right now (`GET /gate`). The image
build copies this file to /opt/atoll/agent.py; the sandbox starts it as

    python3 /opt/atoll/agent.py --port 49999 [--host 0.0.0.0]

Standard library only (Python 3.11), one file. Design rules, from measured gVisor behaviour:

* No epoll anywhere. gVisor cannot checkpoint a TCP endpoint registered with epoll ("endpoint still
  has waiters upon save"), so there is no asyncio/selectors: the main thread blocks in accept() and
  each connection gets a (pooled) thread doing blocking recv. A command's two pipes are read with a
  plain poll() by the thread serving the exec request: poll, like a blocking recv, registers nothing
  that outlives the call, and one thread instead of two reader threads saves ~50 futex calls of GIL
  hand-offs per exec.
* The agent never closes a connection first on the normal path (the closer keeps TIME_WAIT, which
  blocks a checkpoint for 60 s): HTTP/1.1 keep-alive, every response has Content-Length or is
  chunked, no `Connection: close` on success; the host closes (with RST). If the agent must end a
  connection (malformed request, or the client sent `Connection: close`) it waits up to 2 s for the
  client to close and otherwise resets it (SO_LINGER 0) rather than sending the first FIN.
* PID 1 duties. One reaper thread is the only code that collects exit statuses (waitpid(-1)):
  statuses of processes the agent started go to their records, orphans' statuses are dropped.
  subprocess.Popen objects are made inert right after the spawn so they never wait on a pid.
  SIGCHLD is reset to default, SIGPIPE is ignored (children get the default back through
  subprocess's restore_signals), SIGTERM/SIGINT SIGKILL the tracked process groups and exit 0.
* Syscalls are slow in gVisor (~50 us) and spawns ~9x slower than native: an exec of `true` is one
  Popen (vfork path unless switching users; no shell for argv commands), a poll loop and the
  reaper's wait4: about 30 syscalls in the agent.

HTTP API. JSON unless stated; errors are {"error": {"code": str, "message": str}} with status
400 (invalid_request, invalid_path), 404 (not_found, file_not_found, process_not_found),
413 (payload_too_large) or 500 (runtime_error).

  GET    /health               {"ok", "pid", "generation", "sandbox_id", "hostname", "time", "uptime_s"}
  POST   /identity             {"sandbox_id": str, "generation": int, "hostname": str|null, "env": {..}|null}
                               -> 200 {"sandbox_id", "generation", "hostname"}; sethostname failures ignored
  POST   /exec                 {"cmd": str|[str], "cwd", "env", "timeout_s", "background", "user"}
      str cmd runs as /bin/sh -c cmd; a list is the argv (a missing binary gives exit_code 127 and
      "<name>: command not found", a non-executable file 126). stdin is /dev/null. env is merged over
      the agent's environment (ATOLL_* removed, PATH and LANG=C.UTF-8 defaulted, HOME/USER/LOGNAME
      from the user's passwd entry). cwd defaults to the agent's cwd. Each command is a new session;
      on timeout the session, its process group and every descendant (by /proc ppid links) get
      SIGKILL and the result has timed_out=true and exit_code 137. A command killed by signal N
      reports 128+N, like a shell.
      * default: 200 {"exit_code", "stdout", "stderr", "duration_ms", "timed_out"}, output decoded as
        UTF-8 (errors replaced), each stream capped at 64 MiB (the head is kept, then
        "…[truncated N bytes]").
      * `Accept: application/x-ndjson`: a chunked stream of {"stdout": text} / {"stderr": text} lines
        as output arrives, then {"exit_code", "timed_out", "duration_ms"}. If the client goes away
        mid-stream the command's process tree is killed.
      * Once the command itself has exited, output is collected for 0.3 s more; a descendant that
        still holds the pipes (`cmd &` without redirection) is then left running, its further output
        is read and dropped, and the call returns.
      * background=true: 200 {"pid", "log_path"} at once; stdout+stderr go to
        /tmp/.atoll/proc-<pid>.log (removed with the record). timeout_s still applies to it. A
        background command that cannot start is a 400.
  GET    /processes            {"items": [{"pid", "cmd", "running", "exit_code", "background",
                               "started_at", "log_path"}]}: background commands (finished ones stay
                               until deleted; the 1000 newest finished are kept) and running
                               foreground ones.
  DELETE /processes/<pid>      SIGKILL its session, group and descendants; forget a background
                               record and its log -> 204; unknown pid -> 404 process_not_found
  PUT    /files?path=/abs[&mode=0644]   raw body (Content-Length or chunked), streamed to a temp
                               file in the same directory, then renamed over the path -> 204.
                               Parents are created. Mode defaults to the replaced file's (else 0644).
  GET    /files?path=/abs      200 application/octet-stream with Content-Length
  GET    /files/list?path=/dir {"items": [{"name", "path", "type": file|dir|symlink|other, "size",
                               "mode": permission bits as int, "mtime": unix float}]} sorted by name
  DELETE /files?path=/abs      unlink a file/symlink or remove a directory tree -> 204
  GET    /gate                 {"blockers": [str], "external_connections": int, "epoll_tcp_pids": [int]}
      Blockers: non-loopback TCP connections in /proc/net/tcp{,6} that are not LISTEN and not the
      worker's own connections to the agent port (a TIME_WAIT on the agent port still counts: the
      worker cannot abort it); processes holding an epoll fd and a TCP socket (a socket whose inode
      is in no /proc/net table counts as TCP: conservative); or why /proc could not be read.
"""

from __future__ import annotations

import codecs
import errno
import itertools
import json
import os
import pwd
import queue
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from urllib.parse import parse_qsl, urlsplit

DEFAULT_PORT = 49999
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IO_CHUNK = 1 << 20  # file transfer piece
PIPE_READ = 1 << 16  # one read() from a command's pipe
MAX_CAPTURE = 64 << 20  # per stream, non-streaming exec
MAX_JSON_BODY = 16 << 20
MAX_DRAIN = 16 << 20  # unread request body we discard to keep a connection alive
MAX_ZERO_SIZE_READ = 16 << 20  # /proc-style files that report size 0
MAX_LINE = 65536
MAX_HEADERS = 100
MAX_PROCESS_RECORDS = 1000
LOG_DIR = "/tmp/.atoll"
TIMEOUT_EXIT_CODE = 137  # 128 + SIGKILL, what a shell reports for a killed command
EXIT_DRAIN_GRACE_S = 0.3
CLOSE_WAIT_S = 2.0
MAX_IDLE_THREADS = 8

_REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    404: "Not Found",
    413: "Payload Too Large",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    505: "HTTP Version Not Supported",
}

_TCP_STATES = {
    0x01: "ESTABLISHED",
    0x02: "SYN_SENT",
    0x03: "SYN_RECV",
    0x04: "FIN_WAIT1",
    0x05: "FIN_WAIT2",
    0x06: "TIME_WAIT",
    0x07: "CLOSE",
    0x08: "CLOSE_WAIT",
    0x09: "LAST_ACK",
    0x0A: "LISTEN",
    0x0B: "CLOSING",
}
_TCP_LISTEN = 0x0A
_TCP_TIME_WAIT = 0x06

_ROUTES_HELP = (
    "the agent serves GET /health, POST /identity, POST /exec, GET /processes, DELETE /processes/<pid>, "
    "GET|PUT|DELETE /files?path=, GET /files/list?path=, GET /gate"
)


def log(message: str) -> None:
    try:
        sys.stderr.write(f"atoll-agent: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _format_exc() -> str:
    import traceback  # only on failures: keeps start-up imports small

    return traceback.format_exc()


class _ThreadPool:
    """Reusable daemon threads for pipe readers and connections (thread creation costs ~10 syscalls).

    Threads are started on demand, never queued behind busy ones; up to MAX_IDLE_THREADS finished
    ones stay parked (blocked on a futex, which checkpoints fine) for the next job.
    """

    def __init__(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn, *args) -> None:
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1
        self._jobs.put((fn, args))
        if not reuse:
            try:
                threading.Thread(target=self._work, daemon=True).start()
            except RuntimeError as e:  # can't start new thread: the job waits for the next free one
                log(f"cannot start a thread ({e}); the job waits for a busy thread to finish")
                with self._lock:
                    self._idle -= 1  # that thread will take the queued job instead of parking

    def _work(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                fn(*args)
            except BaseException:
                log("background job failed:\n" + _format_exc())
            fn = args = None
            with self._lock:
                if self._idle >= MAX_IDLE_THREADS:
                    return
                self._idle += 1


_pool = _ThreadPool()


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def _printable(name: str) -> str:
    """A file name as valid Unicode (names that are not UTF-8 come from os.* with surrogate escapes)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class ApiError(Exception):
    """An error reported to the client as {"error": {"code", "message"}}."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)


def _invalid_path(message: str) -> ApiError:
    return ApiError(400, "invalid_path", message)


class _PeerGone(Exception):
    """The client closed or reset the connection; stop serving it quietly."""


class _BadRequest(Exception):
    """The request cannot be parsed; answer with an error and end the connection."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------------------------
# /proc helpers


def _read_small(path: str, limit: int = 65536) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _scan_stats(proc_root: str = "/proc") -> list[tuple[int, bytes, int, int, int]]:
    """(pid, state, ppid, pgrp, session) of every process visible in /proc; unreadable ones skipped."""
    out = []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            data = _read_small(f"{proc_root}/{name}/stat", 4096)
            fields = data[data.rindex(b")") + 2 :].split()
            out.append((int(name), fields[0], int(fields[1]), int(fields[2]), int(fields[3])))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _tree_members(root: int, *, root_alive: bool) -> set[int]:
    """Live processes in root's session or process group, plus their descendants by ppid.

    Descendants of the root itself are followed only while it is alive (a dead root's pid could
    have been reused by an unrelated process).
    """
    stats = _scan_stats()
    children: dict[int, list[int]] = {}
    live = set()
    members = set()
    for pid, state, ppid, pgrp, sid in stats:
        if state in (b"Z", b"X"):
            continue
        live.add(pid)
        children.setdefault(ppid, []).append(pid)
        if pgrp == root or sid == root:
            members.add(pid)
    stack = list(members)
    if root_alive:
        stack.append(root)
    seen = set(stack)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    seen &= live
    seen.discard(os.getpid())
    seen.discard(1)
    return seen


def kill_tree(root: int, *, root_alive: bool = True) -> None:
    """SIGKILL a command's session/process group and every descendant (re-scanned a few times for forks)."""
    for _ in range(3):
        victims = _tree_members(root, root_alive=root_alive)
        if root_alive:
            victims.add(root)
        try:
            os.killpg(root, signal.SIGKILL)
        except OSError:
            pass
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        root_alive = False  # it has been sent SIGKILL; later rounds only sweep up stragglers


# --------------------------------------------------------------------------------------------
# Processes: records, spawning and the reaper (PID 1)


class Proc:
    __slots__ = ("pid", "cmd", "background", "started_at", "exit_code", "notify", "log_path", "timer")

    def __init__(self, pid: int, cmd, background: bool, notify, log_path):
        self.pid = pid
        self.cmd = cmd
        self.background = background
        self.started_at = time.time()
        self.exit_code: int | None = None
        self.notify = notify  # queue that receives ("exit", code), for foreground commands
        self.log_path = log_path
        self.timer = None

    def info(self) -> dict:
        item = {
            "pid": self.pid,
            "cmd": self.cmd,
            "running": self.exit_code is None,
            "exit_code": self.exit_code,
            "background": self.background,
            "started_at": self.started_at,
        }
        if self.background:
            item["log_path"] = self.log_path
        return item


class _NotRunnable(Exception):
    """exec() of the command failed the way a shell reports as exit status 126/127."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


_REAPER_OWNS_STATUS = -(1 << 30)  # returncode given to inert Popen objects; never reported


class ProcessTable:
    """Records of the processes the agent started, and the reaper that collects every exit status.

    The reaper is the only caller of waitpid. A child can exit before its spawner registered it, so
    a reaped pid that is not (yet) in the table is matched after the spawns that were in flight at
    reap time have finished; if still unknown it was an orphan and its status is dropped.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._procs: dict[int, Proc] = {}
        self._inflight: set[int] = set()
        self._tickets = itertools.count()
        self._seq = 0  # bumped after every spawn, so the reaper notices new children
        try:
            self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._devnull = subprocess.DEVNULL

    def start_reaper(self) -> None:
        threading.Thread(target=self._reap_forever, name="reaper", daemon=True).start()

    def spawn(self, argv, *, cmd, background, cwd, env, user_kwargs, stdout, stderr, notify=None):
        ticket = next(self._tickets)
        with self._cond:
            self._inflight.add(ticket)
        try:
            popen = subprocess.Popen(
                argv,
                stdin=self._devnull,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                env=env,
                # Every fd the agent opens is non-inheritable (PEP 446; checked by a test), so the
                # child need not scan /proc/self/fd to close them: ~0.3 ms less per spawn in gVisor.
                close_fds=False,
                start_new_session=True,
                bufsize=0,
                **user_kwargs,
            )
            # The reaper owns this pid's exit status: make the Popen inert so neither it nor
            # subprocess's _cleanup() ever waits on the pid (which may be reused later).
            popen.returncode = _REAPER_OWNS_STATUS
            proc = Proc(popen.pid, cmd, background, notify, None)
            with self._cond:
                stale = self._procs.pop(popen.pid, None)  # the pid was reused
                self._procs[popen.pid] = proc
                evicted = self._evict_locked() if background else []
            for old in ([stale] if stale else []) + evicted:
                _remove_log(old)
            return proc, popen
        finally:
            with self._cond:
                self._inflight.discard(ticket)
                self._seq += 1
                self._cond.notify_all()

    def _evict_locked(self) -> list[Proc]:
        finished = [p for p in self._procs.values() if p.background and p.exit_code is not None]
        evicted = finished[: max(0, len(finished) - MAX_PROCESS_RECORDS)]
        for p in evicted:
            del self._procs[p.pid]
        return evicted

    def _reap_forever(self) -> None:
        while True:
            with self._cond:
                seq = self._seq
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                with self._cond:
                    if self._seq == seq:
                        # No children. Wake on the next spawn, or now and then in case runsc-exec'd
                        # processes leave orphans to PID 1.
                        self._cond.wait(5.0)
                continue
            except Exception as e:  # never let the reaper die
                log(f"reaper: waitpid failed: {e!r}")
                time.sleep(0.1)
                continue
            try:
                self._deliver(pid, status)
            except Exception:
                log("reaper: delivering an exit status failed:\n" + _format_exc())

    def _deliver(self, pid: int, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            code = 128 - code  # killed by signal N -> 128+N, like a shell
        with self._cond:
            pending = set(self._inflight)
            deadline = time.monotonic() + 60.0
            proc = self._procs.get(pid)
            while (proc is None or proc.exit_code is not None) and (pending & self._inflight):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 1.0))
                proc = self._procs.get(pid)
            if proc is None or proc.exit_code is not None:
                return  # an orphan (PID 1 inherits them) or a forgotten record
            proc.exit_code = code
            notify, timer = proc.notify, proc.timer
        if timer is not None:
            timer.cancel()
        if notify is not None:
            notify.put(("exit", code))

    def get(self, pid: int) -> Proc | None:
        with self._cond:
            return self._procs.get(pid)

    def forget(self, proc: Proc) -> None:
        with self._cond:
            if self._procs.get(proc.pid) is proc:
                del self._procs[proc.pid]

    def items(self) -> list[dict]:
        with self._cond:
            procs = list(self._procs.values())
        procs.sort(key=lambda p: p.started_at)
        return [p.info() for p in procs]

    def all_pids(self) -> list[int]:
        return list(self._procs)


def _remove_log(proc: Proc) -> None:
    if proc.log_path:
        try:
            os.unlink(proc.log_path)
        except OSError:
            pass


def _spawn_error(e: OSError, argv: list[str], cwd, user) -> Exception:
    """Map a Popen failure to what a shell would report (126/127) or to an API error."""
    name = argv[0]
    if e.filename is not None and e.filename == name:  # exec() itself failed
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            if "/" in name:
                return _NotRunnable(127, f"{name}: No such file or directory\n")
            return _NotRunnable(127, f"{name}: command not found\n")
        if isinstance(e, (PermissionError, IsADirectoryError)):
            return _NotRunnable(126, f"{name}: Permission denied\n")
        if e.errno == errno.ENOEXEC:
            return _NotRunnable(126, f"{name}: cannot execute: Exec format error\n")
        return _NotRunnable(126, f"{name}: {e.strerror or e}\n")
    if cwd is not None and isinstance(e, (FileNotFoundError, NotADirectoryError, PermissionError)):
        return _invalid(f"cannot change to cwd {cwd!r}: {e.strerror}; pass an existing, accessible directory")
    if user is not None and isinstance(e, PermissionError):
        return _invalid(
            f"cannot start the command as user {user!r}: {e.strerror}; the agent must run as root to switch users"
        )
    return ApiError(500, "runtime_error", f"could not start {name!r}: {e}")


# --------------------------------------------------------------------------------------------
# Checkpoint gate


def _decode_addr(field: str) -> tuple[bytes, int]:
    addr_hex, _, port_hex = field.partition(":")
    raw = bytes.fromhex(addr_hex)
    if len(raw) not in (4, 16):
        raise ValueError(f"bad address {field!r}")
    if sys.byteorder == "little":  # the kernel prints each 32-bit word in host byte order
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return raw, int(port_hex, 16)


def _is_loopback(packed: bytes) -> bool:
    if len(packed) == 4:
        return packed[0] == 127
    if packed == b"\0" * 15 + b"\1":
        return True
    return packed[:12] == b"\0" * 10 + b"\xff\xff" and packed[12] == 127


def _fmt_endpoint(packed: bytes, port: int) -> str:
    if len(packed) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, packed)}:{port}"
    return f"[{socket.inet_ntop(socket.AF_INET6, packed)}]:{port}"


def _read_tcp_table(path: str) -> list[tuple[bytes, int, bytes, int, int, int]]:
    """(local, lport, remote, rport, state, inode) rows of /proc/net/tcp or tcp6; bad rows skipped."""
    with open(path, encoding="ascii", errors="replace") as f:
        lines = f.read().splitlines()
    rows = []
    for line in lines[1:]:
        fields = line.split()
        try:
            local, lport = _decode_addr(fields[1])
            remote, rport = _decode_addr(fields[2])
            state = int(fields[3], 16)
            inode = int(fields[9]) if len(fields) > 9 else 0
        except (ValueError, IndexError):
            continue
        rows.append((local, lport, remote, rport, state, inode))
    return rows


def _other_socket_inodes(proc_root: str) -> set[int]:
    """Inodes of non-TCP sockets (udp, raw, unix, netlink, packet), so they are not taken for TCP."""
    inodes: set[int] = set()
    for name in ("udp", "udp6", "raw", "raw6", "unix", "netlink", "packet"):
        try:
            with open(f"{proc_root}/net/{name}", encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        if name.startswith(("udp", "raw")):
            column = 9
        else:
            header = [h.lower() for h in lines[0].split()]
            if "inode" not in header:
                continue
            column = header.index("inode")
        for line in lines[1:]:
            fields = line.split()
            try:
                inodes.add(int(fields[column]))
            except (ValueError, IndexError):
                continue
    return inodes


def gate_report(proc_root: str = "/proc", *, own_pid: int | None = None, own_port: int | None = None) -> dict:
    """What would make a gVisor checkpoint of this sandbox fail right now (see the module docstring)."""
    blockers: list[str] = []
    external = 0
    epoll_pids: list[int] = []
    tcp_inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        path = f"{proc_root}/net/{name}"
        try:
            rows = _read_tcp_table(path)
        except FileNotFoundError:
            if name == "tcp6":
                continue  # IPv6 disabled
            blockers.append(f"the checkpoint gate could not be evaluated: {path} does not exist")
            continue
        except (OSError, UnicodeError) as e:
            blockers.append(f"the checkpoint gate could not be evaluated: reading {path} failed: {e}")
            continue
        for local, lport, remote, rport, state, inode in rows:
            if inode:
                tcp_inodes.add(inode)
            if state == _TCP_LISTEN or (rport == 0 and not any(remote)):
                continue  # listening or not connected
            if _is_loopback(local) and _is_loopback(remote):
                continue
            if own_port is not None and lport == own_port and state != _TCP_TIME_WAIT:
                continue  # the worker's own channel; it aborts these before checkpointing
            external += 1
            blockers.append(
                f"TCP connection {_fmt_endpoint(local, lport)} -> {_fmt_endpoint(remote, rport)} "
                f"({_TCP_STATES.get(state, f'state {state:#04x}')}) on the sandbox's external interface "
                "cannot be checkpointed"
            )

    other_inodes = _other_socket_inodes(proc_root)
    try:
        names = os.listdir(proc_root)
    except OSError as e:
        blockers.append(f"the checkpoint gate could not be evaluated: listing {proc_root} failed: {e}")
        names = []
    for name in sorted((n for n in names if n.isdigit()), key=int):
        pid = int(name)
        if pid == own_pid:
            continue
        fd_dir = f"{proc_root}/{name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # exited, or not ours to read
        has_epoll = has_tcp = False
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if "eventpoll" in target:
                has_epoll = True
            elif target.startswith("socket:["):
                try:
                    inode = int(target[8:-1])
                except ValueError:
                    inode = -1
                if inode in tcp_inodes or inode not in other_inodes:
                    has_tcp = True  # unknown sockets count as TCP: a false positive only keeps it in memory
            if has_epoll and has_tcp:
                break
        if not (has_epoll and has_tcp):
            continue
        try:
            comm = _read_small(f"{proc_root}/{name}/comm", 256).decode("utf-8", "replace").strip()
        except OSError:
            comm = "?"
        epoll_pids.append(pid)
        blockers.append(
            f"process {pid} ({comm}) watches TCP sockets with epoll (e.g. asyncio/uvicorn/node); "
            "gVisor cannot checkpoint it — the sandbox stays in the memory tier"
        )
    return {"blockers": blockers, "external_connections": external, "epoll_tcp_pids": epoll_pids}


# --------------------------------------------------------------------------------------------
# HTTP/1.1 plumbing (no http.server: it costs ~30 ms of imports and sends `Connection: close`
# with every error)


class _Body:
    """A request body, Content-Length or chunked, read in bounded pieces."""

    def __init__(self, conn: _Conn, *, length: int = 0, chunked: bool = False, expect_continue: bool = False):
        self._conn = conn
        self._rfile = conn.rfile
        self._left = length  # Content-Length bytes, or bytes left in the current chunk
        self.chunked = chunked
        self.done = not chunked and length == 0
        self.continue_pending = expect_continue and not self.done

    def remaining_known(self) -> int | None:
        return None if self.chunked else self._left

    def _start(self) -> None:
        if self.continue_pending:
            self.continue_pending = False
            self._conn.send_raw(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _readline(self) -> bytes:
        try:
            line = self._rfile.readline(MAX_LINE + 1)
        except OSError as e:
            raise _PeerGone(str(e)) from None
        if not line:
            raise _PeerGone("client closed the connection in the middle of the request body")
        if len(line) > MAX_LINE:
            raise _BadRequest(400, "chunked request body has an over-long line")
        return line

    def readinto(self, buf: memoryview) -> int:
        """Read up to len(buf) bytes; 0 means the body is complete."""
        if self.done:
            return 0
        self._start()
        if self.chunked and self._left == 0:
            line = self._readline()
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadRequest(400, f"malformed chunk size line {line[:40]!r}") from None
            if size < 0:
                raise _BadRequest(400, f"malformed chunk size line {line[:40]!r}")
            if size == 0:
                while self._readline() not in (b"\r\n", b"\n"):
                    pass  # trailers
                self.done = True
                return 0
            self._left = size
        try:
            got = self._rfile.readinto(buf[: min(len(buf), self._left)])
        except OSError as e:
            raise _PeerGone(str(e)) from None
        if not got:
            raise _PeerGone("client closed the connection in the middle of the request body")
        self._left -= got
        if self._left == 0:
            if self.chunked:
                if self._readline() not in (b"\r\n", b"\n"):
                    raise _BadRequest(400, "chunk data is not followed by CRLF")
            else:
                self.done = True
        return got

    def read_all(self, limit: int) -> bytes:
        if not self.chunked and self._left > limit:
            raise ApiError(
                413, "payload_too_large", f"request body of {self._left} bytes exceeds {limit} bytes"
            )
        out = bytearray()
        buf = memoryview(bytearray(min(limit + 1, max(self._left, 65536))))
        while True:
            n = self.readinto(buf)
            if not n:
                return bytes(out)
            out += buf[:n]
            if len(out) > limit:
                raise ApiError(413, "payload_too_large", f"request body exceeds {limit} bytes")

    def drain(self, limit: int) -> bool:
        """Discard the rest of the body; False if it is larger than `limit` (then close instead)."""
        if self.done:
            return True
        if self.continue_pending:
            return False  # the client is still waiting for 100 Continue and may never send it
        if not self.chunked and self._left > limit:
            return False
        buf = memoryview(bytearray(65536))
        total = 0
        while True:
            n = self.readinto(buf)
            if not n:
                return True
            total += n
            if total > limit:
                return False


class Request:
    __slots__ = ("method", "path", "query", "headers", "keep_alive", "body")


class _Conn:
    """One client connection, served by its own thread with blocking I/O."""

    def __init__(self, agent: Agent, sock: socket.socket):
        self.agent = agent
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self.keep_alive = True
        self.head_only = False
        self.started = False  # status line of the current response sent
        self.peer_closed = False
        self.abort = False  # reset the connection (the response cannot be completed)

    # ---- lifecycle

    def run(self) -> None:
        try:
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            while self._serve_one():
                pass
        except _PeerGone:
            self.peer_closed = True
        except Exception:
            log("connection handler crashed:\n" + _format_exc())
            self.abort = True
        finally:
            self._finish()

    def _finish(self) -> None:
        try:
            self.rfile.close()
        except OSError:
            pass
        sock = self.sock
        if not self.peer_closed and not self.abort:
            # We are ending the connection: let the client close first so the sandbox never
            # holds a TIME_WAIT endpoint (it would block a checkpoint for 60 s).
            deadline = time.monotonic() + CLOSE_WAIT_S
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    sock.settimeout(remaining)
                    if not sock.recv(65536):
                        self.peer_closed = True
                        break
            except TimeoutError:
                pass
            except OSError:
                self.peer_closed = True  # reset by the client
        if not self.peer_closed:
            try:  # abortive close: RST, no TIME_WAIT
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        try:
            sock.close()
        except OSError:
            pass

    def _serve_one(self) -> bool:
        """Serve one request; False when the connection is done."""
        try:
            req = self._read_request()
        except _BadRequest as e:
            self.keep_alive = False
            self.head_only = False
            self.started = False
            self.send_json(e.status, {"error": {"code": "invalid_request", "message": e.message}})
            return False
        if req is None:
            self.peer_closed = True
            return False
        self.keep_alive = req.keep_alive
        self.head_only = req.method == "HEAD"
        self.started = False
        try:
            self.agent.dispatch(self, req)
        except _PeerGone:
            raise
        except _BadRequest as e:
            self.keep_alive = False
            if self.started:
                self.abort = True
            else:
                self.send_json(e.status, {"error": {"code": "invalid_request", "message": e.message}})
            return False
        except ApiError as e:
            if self.started:
                log(f"{req.method} {req.path} failed after the response started: {e.message}")
                self.abort = True
                return False
            self._send_api_error(req, e)
        except Exception as e:
            log(f"{req.method} {req.path} failed:\n" + _format_exc())
            if self.started:
                self.abort = True
                return False
            self._send_api_error(
                req, ApiError(500, "runtime_error", f"internal error in the agent: {type(e).__name__}: {e}")
            )
        if not self.keep_alive:
            return False
        try:
            drained = req.body.drain(MAX_DRAIN)
        except _BadRequest:
            drained = False
        if not drained:
            self.keep_alive = False
        return drained

    def _send_api_error(self, req: Request, e: ApiError) -> None:
        body = req.body
        if not body.done:
            left = body.remaining_known()
            if body.continue_pending or left is None or left > MAX_DRAIN:
                self.keep_alive = False  # we will not read the rest; say so
        self.send_json(e.status, {"error": {"code": e.code, "message": e.message}})

    def _readline(self) -> bytes:
        try:
            return self.rfile.readline(MAX_LINE + 1)
        except OSError as e:
            raise _PeerGone(str(e)) from None

    def _read_request(self) -> Request | None:
        line = self._readline()
        for _ in range(4):  # tolerate stray CRLFs between requests
            if line not in (b"\r\n", b"\n"):
                break
            line = self._readline()
        if not line:
            return None
        if len(line) > MAX_LINE:
            raise _BadRequest(414, "request line is longer than 64 KiB")
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            raise _BadRequest(400, f"malformed request line {line[:100]!r}")
        method, target, version = parts
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise _BadRequest(505, f"unsupported protocol {version!r}; use HTTP/1.1")
        headers: dict[str, str] = {}
        for i in range(MAX_HEADERS + 1):
            raw = self._readline()
            if raw in (b"\r\n", b"\n"):
                break
            if not raw:
                raise _PeerGone("client closed the connection in the middle of the request headers")
            if i == MAX_HEADERS or len(raw) > MAX_LINE:
                raise _BadRequest(431, f"more than {MAX_HEADERS} request headers or an over-long header")
            name, sep, value = raw.decode("latin-1").partition(":")
            if not sep:
                raise _BadRequest(400, f"malformed header line {raw[:100]!r}")
            name = name.strip().lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
        expect = headers.get("expect", "").lower() == "100-continue"
        if "transfer-encoding" in headers:
            codings = [c.strip().lower() for c in headers["transfer-encoding"].split(",")]
            if codings[-1] != "chunked":
                raise _BadRequest(501, f"unsupported Transfer-Encoding {headers['transfer-encoding']!r}")
            body = _Body(self, chunked=True, expect_continue=expect)
        elif "content-length" in headers:
            value = headers["content-length"]
            if not value.isdigit():
                raise _BadRequest(400, f"invalid Content-Length {value!r}")
            body = _Body(self, length=int(value), expect_continue=expect)
        else:
            body = _Body(self)
        try:
            split = urlsplit(target)
            query = dict(parse_qsl(split.query, keep_blank_values=True, errors="surrogateescape"))
        except ValueError as e:
            raise _BadRequest(400, f"malformed request target {target[:100]!r}: {e}") from None
        req = Request()
        req.method = method.upper()
        req.path = split.path or "/"
        req.query = query
        req.headers = headers
        req.keep_alive = keep_alive
        req.body = body
        return req

    # ---- responses

    def send_raw(self, data) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise _PeerGone(str(e)) from None

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if not self.keep_alive:
            lines.append("Connection: close")
        self.started = True
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        headers = []
        if status != 204:
            headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        head = self._head(status, headers)
        if self.head_only or status == 204:
            self.send_raw(head)
        elif len(body) <= 65536:
            self.send_raw(head + body)  # one segment
        else:
            self.send_raw(head)
            self.send_raw(body)

    def send_json(self, status: int, obj) -> None:
        self.send(status, _dumps(obj))

    def send_no_content(self) -> None:
        self.send(204)

    def start_chunked(self, content_type: str) -> None:
        self.send_raw(self._head(200, [("Content-Type", content_type), ("Transfer-Encoding", "chunked")]))

    def write_chunk(self, data: bytes) -> None:
        if data:
            self.send_raw(b"%x\r\n%b\r\n" % (len(data), data))

    def end_chunked(self) -> None:
        self.send_raw(b"0\r\n\r\n")


# --------------------------------------------------------------------------------------------
# Exec


class _ExecSpec:
    __slots__ = ("argv", "cmd", "cwd", "env", "timeout", "background", "user", "user_kwargs")


class _Capture:
    """Non-streaming output: the head of each stream, up to MAX_CAPTURE bytes."""

    def __init__(self) -> None:
        self.parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.size = {"stdout": 0, "stderr": 0}
        self.dropped = {"stdout": 0, "stderr": 0}

    def add(self, kind: str, data: bytes) -> None:
        room = MAX_CAPTURE - self.size[kind]
        if len(data) > room:
            self.dropped[kind] += len(data) - max(room, 0)
            data = data[: max(room, 0)]
        if data:
            self.parts[kind].append(data)
            self.size[kind] += len(data)

    def end(self, kind: str) -> None:
        pass

    def text(self, kind: str) -> str:
        text = b"".join(self.parts[kind]).decode("utf-8", "replace")
        if self.dropped[kind]:
            text += f"…[truncated {self.dropped[kind]} bytes]"
        return text


class _Stream:
    """Streaming output: one ndjson line per piece, decoded incrementally."""

    def __init__(self, conn: _Conn):
        self.conn = conn
        self.decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("stdout", "stderr")}

    def add(self, kind: str, data: bytes) -> None:
        text = self.decoders[kind].decode(data)
        if text:
            self.conn.write_chunk(_dumps({kind: text}) + b"\n")

    def end(self, kind: str) -> None:
        self.add_final(kind)

    def add_final(self, kind: str) -> None:
        text = self.decoders[kind].decode(b"", final=True)
        if text:
            self.conn.write_chunk(_dumps({kind: text}) + b"\n")


def _drain_leftovers(files: list) -> None:
    """Read and drop what a command's leftover descendants still write to its pipes, until EOF.

    Closing the pipes instead would kill such a descendant (`server &` started without redirection)
    with SIGPIPE on its next write.
    """
    poller = select.poll()
    by_fd = {f.fileno(): f for f in files}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    while by_fd:
        for fd, _ in poller.poll():
            try:
                data = os.read(fd, PIPE_READ)
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                by_fd.pop(fd).close()


# --------------------------------------------------------------------------------------------
# The agent


class Agent:
    def __init__(self, host: str, port: int):
        self.host = host
        self.port = port
        self.pid = os.getpid()
        self.started = time.monotonic()
        self.sandbox_id = os.environ.get("ATOLL_SANDBOX_ID", "")
        try:
            self.generation = int(os.environ.get("ATOLL_GENERATION", "0") or 0)
        except ValueError:
            log(f"ignoring ATOLL_GENERATION={os.environ.get('ATOLL_GENERATION')!r}: not an integer")
            self.generation = 0
        self.procs = ProcessTable()
        self._log_dir_ready = False
        self._log_names = itertools.count()
        self._tmp_names = itertools.count()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
        env.setdefault("PATH", DEFAULT_PATH)
        env.setdefault("LANG", "C.UTF-8")
        try:
            env["HOME"] = pwd.getpwuid(os.geteuid()).pw_dir
        except KeyError:
            env.setdefault("HOME", "/root" if os.geteuid() == 0 else "/")
        self.base_env = env

    # ---- routing

    def dispatch(self, conn: _Conn, req: Request) -> None:
        method, path = req.method, req.path
        if len(path) > 1:
            path = path.rstrip("/")
        if path == "/health" and method == "GET":
            return self.health(conn)
        if path == "/exec" and method == "POST":
            return self.exec(conn, req)
        if path == "/files":
            if method == "GET":
                return self.read_file(conn, req)
            if method == "PUT":
                return self.write_file(conn, req)
            if method == "DELETE":
                return self.delete_file(conn, req)
        if path == "/files/list" and method == "GET":
            return self.list_dir(conn, req)
        if path == "/processes" and method == "GET":
            return conn.send_json(200, {"items": self.procs.items()})
        if path.startswith("/processes/") and method == "DELETE":
            return self.kill_process(conn, path[len("/processes/") :])
        if path == "/identity" and method == "POST":
            return self.identity(conn, req)
        if path == "/gate" and method == "GET":
            report = gate_report("/proc", own_pid=self.pid, own_port=self.port)
            return conn.send_json(200, report)
        raise ApiError(404, "not_found", f"no route for {method} {req.path}; {_ROUTES_HELP}")

    @staticmethod
    def _json_body(req: Request) -> dict:
        data = req.body.read_all(MAX_JSON_BODY)
        if not data.strip():
            return {}
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise _invalid(f"request body is not valid JSON ({e}); send a JSON object") from None
        if not isinstance(obj, dict):
            raise _invalid(f"request body must be a JSON object, got {type(obj).__name__}")
        return obj

    # ---- health / identity

    def health(self, conn: _Conn) -> None:
        conn.send_json(
            200,
            {
                "ok": True,
                "pid": self.pid,
                "generation": self.generation,
                "sandbox_id": self.sandbox_id,
                "hostname": socket.gethostname(),
                "time": time.time(),
                "uptime_s": round(time.monotonic() - self.started, 3),
            },
        )

    def identity(self, conn: _Conn, req: Request) -> None:
        body = self._json_body(req)
        sandbox_id = body.get("sandbox_id")
        generation = body.get("generation")
        hostname = body.get("hostname")
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise _invalid(f"sandbox_id must be a non-empty string, got {sandbox_id!r}")
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise _invalid(f"generation must be a non-negative integer, got {generation!r}")
        if hostname is not None and (not isinstance(hostname, str) or not hostname or "\x00" in hostname):
            raise _invalid(f"hostname must be a non-empty string or null, got {hostname!r}")
        env = body.get("env")
        if env is not None:
            if not isinstance(env, dict) or not all(
                isinstance(k, str)
                and k
                and "=" not in k
                and "\x00" not in k
                and isinstance(v, str)
                and "\x00" not in v
                for k, v in env.items()
            ):
                raise _invalid("env must be an object of string values with names without '=' or NUL")
            # A sandbox restored from its template's image gets its own environment here: every
            # later exec starts from it.
            self.base_env.update(env)
        self.sandbox_id = sandbox_id
        self.generation = generation
        if hostname is not None and hostname != socket.gethostname():
            try:
                socket.sethostname(hostname)
            except OSError as e:
                log(f"sethostname({hostname!r}) failed (ignored): {e}")
        conn.send_json(
            200, {"sandbox_id": sandbox_id, "generation": generation, "hostname": socket.gethostname()}
        )

    # ---- exec

    def _exec_spec(self, body: dict) -> _ExecSpec:
        spec = _ExecSpec()
        cmd = body.get("cmd")
        if isinstance(cmd, str) and cmd.strip():
            argv = ["/bin/sh", "-c", cmd]
        elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd) and cmd[0]:
            argv = list(cmd)
        else:
            raise _invalid(
                "cmd must be a non-empty string (run with /bin/sh -c) or a non-empty list of strings "
                f"(the argv), got {cmd!r}"[:500]
            )
        if any("\x00" in a for a in argv):
            raise _invalid("cmd contains a NUL byte; remove it")
        spec.argv, spec.cmd = argv, cmd

        cwd = body.get("cwd")
        if cwd is not None:
            if not isinstance(cwd, str) or not cwd or "\x00" in cwd:
                raise _invalid(f"cwd must be a directory path string or null, got {cwd!r}")
            if not os.path.isdir(cwd):
                raise _invalid(
                    f"cwd {cwd!r} does not exist or is not a directory; create it first (mkdir -p) "
                    "or pass an existing directory"
                )
        spec.cwd = cwd

        timeout = body.get("timeout_s")
        if timeout is not None:
            if (
                not isinstance(timeout, (int, float))
                or isinstance(timeout, bool)
                or not (0 < timeout < float("inf"))
            ):
                raise _invalid(f"timeout_s must be a positive number of seconds or null, got {timeout!r}")
        spec.timeout = timeout

        background = body.get("background", False)
        if background is None:
            background = False
        if not isinstance(background, bool):
            raise _invalid(f"background must be true or false, got {background!r}")
        spec.background = background

        user = body.get("user")
        env = dict(self.base_env)
        spec.user_kwargs = {}
        if user is not None:
            if not isinstance(user, str) or not user:
                raise _invalid(f"user must be a user name or null, got {user!r}")
            try:
                pw = pwd.getpwnam(user)
            except KeyError:
                raise _invalid(
                    f"unknown user {user!r}: no such entry in /etc/passwd; create it in the template "
                    "(useradd) or omit 'user' to run as the agent's user"
                ) from None
            if pw.pw_uid != os.geteuid() or pw.pw_gid != os.getegid():
                try:
                    groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
                except OSError:
                    groups = []
                spec.user_kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": groups}
            env["HOME"] = pw.pw_dir or "/"
            env["USER"] = env["LOGNAME"] = pw.pw_name
        spec.user = user

        extra = body.get("env")
        if extra is not None:
            if not isinstance(extra, dict):
                raise _invalid(f"env must be an object of string values or null, got {type(extra).__name__}")
            for k, v in extra.items():
                if not k or "=" in k or "\x00" in k or not isinstance(v, str) or "\x00" in v:
                    raise _invalid(
                        f"env entry {k!r}={v!r} is invalid: names must be non-empty without '=' and "
                        "values must be strings without NUL"[:500]
                    )
            env.update(extra)
        spec.env = env
        return spec

    def _spawn(self, spec: _ExecSpec, *, stdout, stderr, notify=None):
        try:
            return self.procs.spawn(
                spec.argv,
                cmd=spec.cmd,
                background=spec.background,
                cwd=spec.cwd,
                env=spec.env,
                user_kwargs=spec.user_kwargs,
                stdout=stdout,
                stderr=stderr,
                notify=notify,
            )
        except OSError as e:
            raise _spawn_error(e, spec.argv, spec.cwd, spec.user) from None
        except ValueError as e:
            raise _invalid(f"cannot start the command: {e}") from None
        except subprocess.SubprocessError as e:
            raise ApiError(500, "runtime_error", f"could not start {spec.argv[0]!r}: {e}") from None

    def exec(self, conn: _Conn, req: Request) -> None:
        spec = self._exec_spec(self._json_body(req))
        if spec.background:
            return self._exec_background(conn, spec)
        streaming = "application/x-ndjson" in req.headers.get("accept", "").lower()
        started = time.monotonic()
        q = queue.SimpleQueue()
        try:
            proc, popen = self._spawn(spec, stdout=subprocess.PIPE, stderr=subprocess.PIPE, notify=q)
        except _NotRunnable as e:
            duration = round((time.monotonic() - started) * 1000)
            if streaming:
                conn.start_chunked("application/x-ndjson")
                conn.write_chunk(_dumps({"stderr": e.message}) + b"\n")
                conn.write_chunk(
                    _dumps({"exit_code": e.exit_code, "timed_out": False, "duration_ms": duration}) + b"\n"
                )
                conn.end_chunked()
            else:
                conn.send_json(
                    200,
                    {
                        "exit_code": e.exit_code,
                        "stdout": "",
                        "stderr": e.message,
                        "duration_ms": duration,
                        "timed_out": False,
                    },
                )
            return
        pipes = [popen.stdout, popen.stderr]
        try:
            sink = _Stream(conn) if streaming else _Capture()
            if streaming:
                conn.start_chunked("application/x-ndjson")
            exit_code, timed_out = self._collect(proc, pipes, q, sink, started, spec.timeout, conn.sock)
        except BaseException:
            # The caller went away (or the agent failed): cancel the command rather than orphan it.
            self.procs.forget(proc)
            kill_tree(proc.pid, root_alive=proc.exit_code is None)
            for f in pipes:
                f.close()
            raise
        self.procs.forget(proc)
        if pipes:
            _pool.submit(_drain_leftovers, pipes)
        duration = round((time.monotonic() - started) * 1000)
        if streaming:
            for kind in ("stdout", "stderr"):
                sink.add_final(kind)
            conn.write_chunk(
                _dumps({"exit_code": exit_code, "timed_out": timed_out, "duration_ms": duration}) + b"\n"
            )
            conn.end_chunked()
        else:
            conn.send_json(
                200,
                {
                    "exit_code": exit_code,
                    "stdout": sink.text("stdout"),
                    "stderr": sink.text("stderr"),
                    "duration_ms": duration,
                    "timed_out": timed_out,
                },
            )

    @staticmethod
    def _collect(proc: Proc, pipes: list, q, sink, started: float, timeout, client=None) -> tuple[int, bool]:
        """Feed the command's output to `sink` until it exited and its pipes closed.

        The pipes are read with poll() in this thread (poll registers nothing that outlives the call,
        unlike epoll; one thread instead of two readers cuts ~50 futex calls per exec from GIL
        hand-offs). Closed pipes are removed from `pipes`; any left open when this returns belong to
        a descendant that outlived the command by more than EXIT_DRAIN_GRACE_S.
        """
        deadline = started + timeout if timeout else None
        timed_out = False
        kinds = {pipes[0].fileno(): "stdout", pipes[1].fileno(): "stderr"}
        files = {f.fileno(): f for f in pipes}
        poller = select.poll()
        for fd in kinds:
            poller.register(fd, select.POLLIN)
        # Watch the caller's connection too: if it goes away (reset by the worker because the API
        # client disconnected), the command is killed rather than left running unobserved.
        client_fd = client.fileno() if client is not None else -1
        if client_fd >= 0:
            poller.register(client_fd, select.POLLIN | getattr(select, "POLLRDHUP", 0x2000))
        check = 0.02  # how often to look for the command's own exit while its pipes stay open
        grace_end = None
        while kinds:
            now = time.monotonic()
            if deadline is not None and not timed_out and now >= deadline:
                timed_out = True
                kill_tree(proc.pid, root_alive=proc.exit_code is None)
                continue
            if grace_end is None and proc.exit_code is not None:
                grace_end = now + EXIT_DRAIN_GRACE_S
            if grace_end is not None and now >= grace_end:
                break  # a descendant still holds the pipes: leave it running
            wait = check
            if deadline is not None and not timed_out:
                wait = min(wait, deadline - now)
            if grace_end is not None:
                wait = min(wait, grace_end - now)
            events = poller.poll(max(1, int(wait * 1000) + 1))
            if not events:
                check = min(check * 2, 0.5)
                continue
            for fd, _ in events:
                if fd == client_fd:
                    try:
                        gone = client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    poller.unregister(client_fd)
                    client_fd = -1
                    if gone:
                        kill_tree(proc.pid, root_alive=proc.exit_code is None)
                        raise _PeerGone()
                    continue
                try:
                    data = os.read(fd, PIPE_READ)
                except OSError:
                    data = b""
                if data:
                    sink.add(kinds[fd], data)
                else:
                    poller.unregister(fd)
                    sink.end(kinds.pop(fd))
                    f = files.pop(fd)
                    pipes.remove(f)
                    f.close()
        while proc.exit_code is None:  # pipes closed: wait for the exit status from the reaper
            wait = None
            if deadline is not None and not timed_out:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    timed_out = True
                    kill_tree(proc.pid)
                    continue
            try:
                q.get(timeout=wait) if wait is not None else q.get()
            except queue.Empty:
                pass
        return (TIMEOUT_EXIT_CODE if timed_out else proc.exit_code), timed_out

    def _exec_background(self, conn: _Conn, spec: _ExecSpec) -> None:
        if not self._log_dir_ready:
            try:
                os.makedirs(LOG_DIR, mode=0o755, exist_ok=True)
            except OSError as e:
                raise ApiError(
                    500, "runtime_error", f"cannot create the log directory {LOG_DIR}: {e}"
                ) from None
            self._log_dir_ready = True
        tmp_log = f"{LOG_DIR}/spawn-{os.getpid()}-{next(self._log_names)}.log"
        try:
            fd = os.open(tmp_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._log_dir_ready = False
            raise ApiError(500, "runtime_error", f"cannot create the log file {tmp_log}: {e}") from None
        try:
            try:
                proc, _ = self._spawn(spec, stdout=fd, stderr=fd)
            except _NotRunnable as e:
                raise _invalid(f"cannot start the background command: {e.message.strip()}") from None
        except BaseException:
            try:
                os.unlink(tmp_log)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        log_path = f"{LOG_DIR}/proc-{proc.pid}.log"
        try:
            os.replace(tmp_log, log_path)
        except OSError:
            log_path = tmp_log
        proc.log_path = log_path
        if spec.timeout:
            timer = threading.Timer(spec.timeout, self._background_timeout, (proc,))
            timer.daemon = True
            proc.timer = timer
            timer.start()
            if proc.exit_code is not None:
                timer.cancel()
        conn.send_json(200, {"pid": proc.pid, "log_path": log_path})

    def _background_timeout(self, proc: Proc) -> None:
        if proc.exit_code is None and self.procs.get(proc.pid) is proc:
            kill_tree(proc.pid)

    def kill_process(self, conn: _Conn, pid_text: str) -> None:
        try:
            pid = int(pid_text)
        except ValueError:
            raise _invalid(f"process id must be an integer, got {pid_text!r}") from None
        proc = self.procs.get(pid)
        if proc is None:
            raise ApiError(
                404,
                "process_not_found",
                f"no process with pid {pid} was started by the agent (or it was already removed); "
                "list them with GET /processes",
            )
        kill_tree(pid, root_alive=proc.exit_code is None)
        if proc.background:  # a foreground record belongs to its exec call, which reports the exit
            self.procs.forget(proc)
            if proc.timer is not None:
                proc.timer.cancel()
            _remove_log(proc)
        conn.send_no_content()

    def kill_all(self) -> None:
        for pid in self.procs.all_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    # ---- files

    @staticmethod
    def _path(req: Request) -> str:
        path = req.query.get("path")
        if path is None or path == "":
            raise _invalid_path(
                "missing ?path= query parameter; pass an absolute path such as /home/user/a.txt"
            )
        if "\x00" in path:
            raise _invalid_path(f"path {path!r} contains a NUL byte; remove it")
        if not path.startswith("/"):
            raise _invalid_path(f"path {path!r} is not absolute; paths must start with '/'")
        return path

    def write_file(self, conn: _Conn, req: Request) -> None:
        path = self._path(req)
        mode = None
        mode_text = req.query.get("mode")
        if mode_text:
            try:
                mode = int(mode_text, 8)
            except ValueError:
                mode = -1
            if not 0 <= mode <= 0o7777:
                raise _invalid(f"mode {mode_text!r} is not an octal permission mode like 0644")
        try:
            old = os.stat(path)
        except FileNotFoundError:
            old = None
        except NotADirectoryError:
            raise _invalid_path(f"cannot write {path!r}: a parent of it is a file, not a directory") from None
        except OSError as e:
            raise _invalid_path(f"cannot write {path!r}: {e.strerror}") from None
        if old is not None and stat.S_ISDIR(old.st_mode):
            raise _invalid_path(f"path {path!r} is a directory; pass a file path")
        parent, base = os.path.split(path)
        parent = parent or "/"
        if not base:
            raise _invalid_path(f"path {path!r} ends with '/'; pass a file path")
        try:
            os.makedirs(parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise _invalid_path(f"cannot create {parent!r} for {path!r}: a component is a file") from None
        except OSError as e:
            raise ApiError(
                500, "runtime_error", f"cannot create directory {parent!r}: {e.strerror}"
            ) from None
        while True:
            tmp = f"{parent.rstrip('/')}/.{base[:64]}.atoll-{os.getpid()}-{next(self._tmp_names)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise ApiError(
                    500, "runtime_error", f"cannot create a temp file in {parent!r}: {e}"
                ) from None
        try:
            buf = memoryview(bytearray(IO_CHUNK))
            while True:
                n = req.body.readinto(buf)
                if not n:
                    break
                view = buf[:n]
                while view:
                    try:
                        written = os.write(fd, view)
                    except OSError as e:
                        raise ApiError(
                            500, "runtime_error", f"writing {path!r} failed: {e.strerror}"
                        ) from None
                    view = view[written:]
            try:
                if old is not None and stat.S_ISREG(old.st_mode):
                    try:
                        os.fchown(fd, old.st_uid, old.st_gid)
                    except OSError:
                        pass
                    os.fchmod(fd, mode if mode is not None else stat.S_IMODE(old.st_mode))
                else:
                    os.fchmod(fd, mode if mode is not None else 0o644)
                os.close(fd)
                fd = -1
                os.replace(tmp, path)
            except OSError as e:
                raise ApiError(500, "runtime_error", f"finishing {path!r} failed: {e}") from None
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        conn.send_no_content()

    def read_file(self, conn: _Conn, req: Request) -> None:
        path = self._path(req)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, "file_not_found", f"file {path!r} does not exist") from None
        except OSError as e:
            raise _invalid_path(f"cannot open {path!r}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise _invalid_path(f"path {path!r} is a directory; list it with GET /files/list?path=")
            if not stat.S_ISREG(st.st_mode):
                raise _invalid_path(f"path {path!r} is not a regular file (device, fifo or socket)")
            size = st.st_size
            if size == 0:  # empty, or a /proc-style file that does not know its size
                data = bytearray()
                while len(data) < MAX_ZERO_SIZE_READ:
                    piece = os.read(fd, 65536)
                    if not piece:
                        break
                    data += piece
                return conn.send(200, bytes(data), "application/octet-stream")
            conn.send_raw(
                conn._head(200, [("Content-Type", "application/octet-stream"), ("Content-Length", str(size))])
            )
            if not conn.head_only:
                self._send_file_body(conn, fd, size, path)
        finally:
            os.close(fd)

    @staticmethod
    def _send_file_body(conn: _Conn, fd: int, size: int, path: str) -> None:
        out = conn.sock.fileno()
        offset = 0
        use_sendfile = True
        while offset < size:
            if use_sendfile:
                try:
                    sent = os.sendfile(out, fd, offset, min(IO_CHUNK, size - offset))
                except OSError as e:
                    if offset == 0 and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        use_sendfile = False
                        continue
                    if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN):
                        raise _PeerGone(str(e)) from None
                    raise
            else:
                try:
                    data = os.pread(fd, min(IO_CHUNK, size - offset), offset)
                except OSError as e:
                    raise ApiError(500, "runtime_error", f"reading {path!r} failed: {e}") from None
                conn.send_raw(data)
                sent = len(data)
            if sent == 0:  # the file shrank after we promised Content-Length bytes
                raise ApiError(500, "runtime_error", f"{path!r} shrank while it was being read")
            offset += sent

    def list_dir(self, conn: _Conn, req: Request) -> None:
        path = self._path(req)
        try:
            it = os.scandir(path)
        except FileNotFoundError:
            raise ApiError(404, "file_not_found", f"directory {path!r} does not exist") from None
        except NotADirectoryError:
            if os.path.exists(path):
                raise _invalid_path(
                    f"path {path!r} is not a directory; read it with GET /files?path="
                ) from None
            raise ApiError(404, "file_not_found", f"directory {path!r} does not exist") from None
        except OSError as e:
            raise _invalid_path(f"cannot list {path!r}: {e.strerror}") from None
        items = []
        prefix = path.rstrip("/")
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                mode = st.st_mode
                if stat.S_ISLNK(mode):
                    kind = "symlink"
                elif stat.S_ISDIR(mode):
                    kind = "dir"
                elif stat.S_ISREG(mode):
                    kind = "file"
                else:
                    kind = "other"
                items.append(
                    {
                        "name": _printable(entry.name),
                        "path": _printable(f"{prefix}/{entry.name}"),
                        "type": kind,
                        "size": st.st_size,
                        "mode": stat.S_IMODE(mode),
                        "mtime": st.st_mtime,
                    }
                )
        items.sort(key=lambda i: i["name"])
        conn.send_json(200, {"items": items})

    def delete_file(self, conn: _Conn, req: Request) -> None:
        path = self._path(req)
        if not os.path.normpath(path).strip("/"):
            raise _invalid_path("refusing to delete '/'; pass a path below it")
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, "file_not_found", f"path {path!r} does not exist") from None
        try:
            if stat.S_ISDIR(st.st_mode):
                import shutil  # only needed here

                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ApiError(500, "runtime_error", f"deleting {path!r} failed: {e}") from None
        conn.send_no_content()


# --------------------------------------------------------------------------------------------
# Main


def _parse_args(argv: list[str]) -> tuple[str, int]:
    host, port = "0.0.0.0", DEFAULT_PORT
    usage = "usage: agent.py [--host ADDR] [--port PORT]"
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(usage)
            sys.exit(0)
        name, eq, value = arg.partition("=")
        if name not in ("--host", "--port"):
            sys.exit(f"{usage}\nunknown argument {arg!r}")
        if not eq:
            if not args:
                sys.exit(f"{usage}\n{name} needs a value")
            value = args.pop(0)
        if name == "--host":
            host = value
        else:
            try:
                port = int(value)
            except ValueError:
                sys.exit(f"{usage}\n--port must be an integer, got {value!r}")
    return host, port


def main(argv: list[str] | None = None) -> None:
    host, port = _parse_args(sys.argv[1:] if argv is None else argv)
    agent = Agent(host, port)

    def on_term(signum, frame):
        agent.kill_all()
        os._exit(0)

    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # SIG_IGN inherited from a parent would auto-reap
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        sys.exit(f"atoll-agent: cannot listen on {host}:{port}: {e}")
    listener.listen(128)
    agent.procs.start_reaper()
    log(f"pid {agent.pid} listening on {host}:{port}")
    while True:
        try:
            sock, _ = listener.accept()
        except OSError as e:
            log(f"accept failed: {e}")
            time.sleep(0.05)
            continue
        try:
            _pool.submit(_Conn(agent, sock).run)
        except Exception as e:
            log(f"cannot serve a connection: {e!r}")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            except OSError:
                pass


if __name__ == "__main__":
    main()

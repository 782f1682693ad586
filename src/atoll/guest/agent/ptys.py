"""Terminals (PTY sessions): a command on a pseudo-terminal, its recent output, and the clients
attached to it, which come and go while the session lives on.

`PtyHandlers` is mixed into `routing.Agent`, which routes here:

  POST   /pty              {"cols", "rows", "term", "cmd", "env", "cwd", "user"} -> 200 {"pty_id", "pid"}
  GET    /pty              {"items": [session info]}
  GET    /pty/<id>         session info {"pty_id", "pid", "cmd", "cols", "rows", "term", "running",
                           "exit_code", "created_at", "attached"}
  DELETE /pty/<id>         kill its process tree, forget it -> 204
  GET    /pty/<id>/attach  with `Upgrade: atoll-pty` -> 101, then the socket carries `ptyframes` both
                           ways: the scrollback first (one DATA frame), live output, and EXIT at the end

The command runs through atoll-init like every command (`ProcessTable.spawn_terminal`: the slave
as stdin/stdout/stderr and controlling terminal), so kill-all, the reaper and exit codes work as
for exec. One reader thread per session reads the master with a blocking read (no epoll) into a
bounded scrollback (ptyframes.SCROLLBACK_BYTES) and to every attached socket; a slow client slows
the program like a real terminal does. A finished session is kept FINISHED_KEEP_S so that a late
attach still gets the exit code. Attach sockets are the worker's connections on the agent port:
the worker resets them (RST) before a checkpoint, like its other connections.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import queue
import re
import select
import shlex
import signal
import struct
import termios
import threading
import time

from . import ptyframes, shells
from .common import log
from .connection import Conn, Request, json_body
from .errors import ApiError, PeerGone, invalid
from .processes import spawn_error
from .proctree import kill_tree

MAX_SESSIONS = 64
FINISHED_KEEP_S = 300.0
EXIT_GRACE_S = 0.3  # after the exit status, output still in flight is read this long before EXIT
READ_SIZE = 65536
DEFAULT_TERM = "xterm-256color"
_TERM_RE = re.compile(r"^[A-Za-z0-9._+-]{1,64}$")
_NO_LOGIN = ("nologin", "false")


_ldisc_signals: bool | None = None


def ldisc_signals() -> bool:
    """Whether the kernel's line discipline turns ^C/^\\/^Z into signals itself. Linux does; the
    gVisor release here passes them to the program as bytes (measured: `sleep` in a pty from
    Python's pty.fork survives ^C), so the agent does it (`Session.write`). Probed once: with
    ISIG set and no session, Linux drops a ^C before "x\\n"; this gVisor keeps it."""
    global _ldisc_signals
    if _ldisc_signals is None:
        master, slave = os.openpty()
        try:
            os.write(master, b"\x03x\n")
            ready, _, _ = select.select([slave], [], [], 1.0)
            data = os.read(slave, 64) if ready else b""
            _ldisc_signals = not data.startswith(b"\x03")
        except OSError:
            _ldisc_signals = True
        finally:
            os.close(master)
            os.close(slave)
    return _ldisc_signals


def foreground_group(leader: int, proc_root: str = "/proc") -> int | None:
    """The session's foreground process group as well as this gVisor lets us tell: it answers
    TIOCGPGRP to no one outside the session and shows tpgid 0 in /proc, so: the newest process
    group of the session other than the leader's (a shell's foreground job), else the leader's.
    A background job started after the foreground one is taken for it (documented). `leader` and
    the answer are pids of the commands' namespace (/proc is atoll-init's)."""
    groups: dict[int, int] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "pid (comm)": state ppid pgrp session tty_nr tpgid ... starttime (22nd field overall)
        if len(fields) < 20 or int(fields[3]) != leader:
            continue
        pgrp, started = int(fields[2]), int(fields[19])
        groups[pgrp] = max(groups.get(pgrp, 0), started)
    others = {g: t for g, t in groups.items() if g != leader}
    if others:
        return max(others, key=lambda g: others[g])
    return leader if leader in groups else None


def set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def get_size(fd: int) -> tuple[int, int]:
    rows, cols = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))[:2]
    return cols, rows


# When to look again after resizing a live terminal (seconds after the previous look).
_RESIZE_CHECKS = (0.002, 0.003, 0.005, 0.01, 0.03)


def set_size_surely(master: int, cols: int, rows: int) -> None:
    """TIOCSWINSZ on a live terminal's master, set again if it did not hold. This gVisor now and
    then puts the old size back within ~10 ms of the call (measured: 1 fresh session in ~15 lost its
    first resize for good; the shell's `stty size` kept the old size); each time it was seen at the
    first look, so a resize is watched for 50 ms and set again, at most 5 times."""
    set_size(master, cols, rows)
    for _attempt in range(5):
        for wait in _RESIZE_CHECKS:
            time.sleep(wait)
            if get_size(master) != (cols, rows):
                break
        else:
            return
        log(
            f"pty resize to {cols}x{rows} did not hold (the terminal says {get_size(master)}); setting it again"
        )
        set_size(master, cols, rows)


def login_shell(user: str | None) -> str:
    """The user's login shell from /etc/passwd, or /bin/sh when it has none usable."""
    try:
        pw = pwd.getpwnam(user) if user else pwd.getpwuid(os.geteuid())
        shell = pw.pw_shell
    except KeyError:
        shell = ""
    if not shell or os.path.basename(shell) in _NO_LOGIN or not os.access(shell, os.X_OK):
        return "/bin/sh"
    return shell


class Session:
    def __init__(self, pty_id: str, master: int, cmd, cols: int, rows: int, term: str, slave_path: str):
        self.pty_id = pty_id
        self.master = master
        self.slave_path = slave_path
        self.cmd = cmd
        self.cols, self.rows, self.term = cols, rows, term
        self.pid = 0
        self.created_at = time.time()
        self.exit_code: int | None = None
        self.finished_at: float | None = None
        self.lock = threading.Lock()  # scrollback, attached, exit_code; held while sending
        self.fd_lock = threading.Lock()  # the master's lifetime: never write to a reused fd number
        self.scrollback = bytearray()
        self.attached: list = []
        self.output_ended = threading.Event()
        self.signal_group = None  # ProcessTable.signal_group, set by open_pty

    def info(self) -> dict:
        return {
            "pty_id": self.pty_id,
            "pid": self.pid,
            "cmd": self.cmd,
            "cols": self.cols,
            "rows": self.rows,
            "term": self.term,
            "running": self.exit_code is None,
            "exit_code": self.exit_code,
            "created_at": self.created_at,
            "attached": len(self.attached),
        }

    def _send_locked(self, frame: bytes) -> None:
        for sock in list(self.attached):
            try:
                sock.sendall(frame)
            except OSError:
                self.attached.remove(sock)  # its attach thread sees the failure on recv

    def pump(self) -> None:
        """The reader thread: master -> scrollback and attached clients, until every slave closed."""
        try:
            while True:
                try:
                    data = os.read(self.master, READ_SIZE)
                except InterruptedError:
                    continue
                except OSError:
                    data = b""  # EIO: the last slave descriptor closed
                if not data:
                    break
                with self.lock:
                    self.scrollback += data
                    if len(self.scrollback) > ptyframes.SCROLLBACK_BYTES:
                        del self.scrollback[: -ptyframes.SCROLLBACK_BYTES]
                    self._send_locked(ptyframes.data(data))
        finally:
            self.output_ended.set()
            with self.fd_lock:
                try:
                    os.close(self.master)
                except OSError:
                    pass
                self.master = -1

    def wait_exit(self, notify: queue.SimpleQueue) -> None:
        """The waiter thread: the reaper's exit status, then (after the last output) EXIT to all."""
        while True:
            kind, code = notify.get()
            if kind == "exit":
                break
        self.output_ended.wait(EXIT_GRACE_S)
        with self.lock:
            self.exit_code = code
            self.finished_at = time.monotonic()
            self._send_locked(ptyframes.exit_frame(code))

    def resize(self, cols: int, rows: int) -> None:
        with self.fd_lock:
            if self.master < 0:
                return
            set_size_surely(self.master, cols, rows)
        self.cols, self.rows = cols, rows
        if not ldisc_signals():  # as for ^C: SIGWINCH to the foreground group ourselves
            pgid = foreground_group(self.pid)
            if pgid and self.signal_group is not None:
                self.signal_group(pgid, signal.SIGWINCH)

    def write(self, data: bytes) -> None:
        if (3 in data or 0x1C in data or 0x1A in data) and not ldisc_signals():
            return self._write_signalling(data)
        self._write(data)

    def _write_signalling(self, data: bytes) -> None:
        """What the line discipline does with ISIG: the terminal's INTR/QUIT/SUSP characters send
        SIGINT/SIGQUIT/SIGTSTP to the foreground process group (read on the slave: this gVisor
        has no TIOCGPGRP on a master), echo as ^C, and flush pending input."""
        try:
            fd = os.open(self.slave_path, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return self._write(data)
        try:
            attrs = termios.tcgetattr(fd)
            lflag, cc = attrs[3], attrs[6]
            if not lflag & termios.ISIG:
                return self._write(data)
            sigs = {
                cc[termios.VINTR]: signal.SIGINT,
                cc[termios.VQUIT]: signal.SIGQUIT,
                cc[termios.VSUSP]: signal.SIGTSTP,
            }
            pending = bytearray()
            for byte in data:
                sig = sigs.get(bytes([byte]))
                if sig is None:
                    pending.append(byte)
                    continue
                if pending:
                    self._write(bytes(pending))
                    pending.clear()
                pgid = foreground_group(self.pid)
                if pgid and self.signal_group is not None:
                    self.signal_group(pgid, sig)
                if not lflag & termios.NOFLSH:
                    try:
                        termios.tcflush(fd, termios.TCIFLUSH)
                    except termios.error:  # this gVisor has no TCFLSH: erase the pending line
                        if lflag & termios.ICANON:
                            self._write(cc[termios.VKILL])
                if lflag & termios.ECHO:
                    os.write(fd, b"^" + bytes([byte + 64]))
            if pending:
                self._write(bytes(pending))
        except (OSError, termios.error) as e:
            log(f"pty {self.pty_id}: signal characters: {e}")
        finally:
            os.close(fd)

    def _write(self, data: bytes) -> None:
        with self.fd_lock:
            self._write_locked(data)

    def _write_locked(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self.master >= 0:
            try:
                n = os.write(self.master, view)
            except InterruptedError:
                continue
            except OSError:
                return  # the session ended: input is dropped, like a closed terminal's
            view = view[n:]


class PtyHandlers:
    """POST|GET /pty, GET|DELETE /pty/<id>, GET /pty/<id>/attach. A mixin of `routing.Agent`, whose
    __init__ sets `procs`, `base_env` and `ptys` (a dict of Sessions) and `_exec_spec`."""

    def _sessions_gc(self) -> None:
        now = time.monotonic()
        for pid, s in list(self.ptys.items()):
            if s.finished_at is not None and now - s.finished_at > FINISHED_KEEP_S:
                self.ptys.pop(pid, None)

    def _session(self, pty_id: str) -> Session:
        self._sessions_gc()
        s = self.ptys.get(pty_id)
        if s is None:
            raise ApiError(
                404,
                "pty_not_found",
                f"no terminal {pty_id!r} in this sandbox (it was killed, or finished over "
                f"{FINISHED_KEEP_S:.0f}s ago); list them with GET /pty",
            )
        return s

    def open_pty(self, conn: Conn, req: Request) -> None:
        body = json_body(req)
        cols, rows = body.get("cols", 80), body.get("rows", 24)
        problem = ptyframes.size_problem(cols, rows)
        if problem:
            raise invalid(f"terminal size: {problem}")
        term = body.get("term") or DEFAULT_TERM
        if not isinstance(term, str) or not _TERM_RE.match(term):
            raise invalid(f"term must be a terminal type name such as xterm-256color, got {term!r}"[:300])
        user = body.get("user")
        cmd = body.get("cmd")
        if cmd is None:
            shell = login_shell(user if isinstance(user, str) else None)
            argv = [shell, "-l"]
        elif isinstance(cmd, str):
            argv = [login_shell(user if isinstance(user, str) else None), "-c", cmd]
        else:
            argv = cmd
        spec = self._exec_spec({"cmd": argv, "cwd": body.get("cwd"), "env": body.get("env"), "user": user})
        env = dict(spec.env)
        env["TERM"] = term
        if self.sandbox_id:
            env["ATOLL_SANDBOX_ID"], env["ATOLL_GENERATION"] = self.sandbox_id, str(self.generation)
        run_argv = spec.argv
        if cmd is None and os.path.basename(argv[0]) == "bash":
            # The login profile resets PATH: as for exec (shells.argv), the template's, sandbox's and
            # call's env are exported again after it, then an interactive bash takes over.
            run_argv = shells.argv("bash", f"exec {shlex.quote(argv[0])} -i", env)
        self._sessions_gc()
        live = sum(1 for s in self.ptys.values() if s.exit_code is None)
        if live >= MAX_SESSIONS:
            raise ApiError(
                409,
                "invalid_state",
                f"the sandbox has {live} live terminals, the most it keeps; kill one first",
            )
        master, slave = os.openpty()
        notify: queue.SimpleQueue = queue.SimpleQueue()
        session = Session("pty_" + os.urandom(6).hex(), master, cmd, cols, rows, term, os.ttyname(slave))
        try:
            set_size(slave, cols, rows)
            try:
                proc, _ = self.procs.spawn_terminal(
                    run_argv,
                    cmd=cmd if cmd is not None else argv,
                    cwd=spec.cwd,
                    env=env,
                    user_kwargs=spec.user_kwargs,
                    slave=slave,
                    notify=notify,
                )
            except OSError as e:
                err = spawn_error(e, spec.argv, spec.cwd, spec.user)
                if isinstance(err, ApiError):
                    raise err from None
                raise invalid(f"cannot start the terminal's command: {err.message.strip()}") from None
            except ValueError as e:
                raise invalid(f"cannot start the terminal's command: {e}") from None
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        session.pid = proc.pid
        session.signal_group = self.procs.signal_group
        self.ptys[session.pty_id] = session
        threading.Thread(target=session.pump, name=f"pty-{proc.pid}", daemon=True).start()
        threading.Thread(target=self._wait_session, args=(session, proc, notify), daemon=True).start()
        conn.send_json(200, {"pty_id": session.pty_id, "pid": proc.pid})

    def _wait_session(self, session: Session, proc, notify) -> None:
        try:
            session.wait_exit(notify)
        finally:
            self.procs.forget(proc)

    def list_ptys(self, conn: Conn) -> None:
        self._sessions_gc()
        items = sorted((s.info() for s in self.ptys.values()), key=lambda i: i["created_at"])
        conn.send_json(200, {"items": items})

    def get_pty(self, conn: Conn, pty_id: str) -> None:
        conn.send_json(200, self._session(pty_id).info())

    def kill_pty(self, conn: Conn, pty_id: str) -> None:
        s = self._session(pty_id)
        if s.exit_code is None:
            kill_tree(s.pid)
        self.ptys.pop(pty_id, None)
        conn.send_no_content()

    def attach_pty(self, conn: Conn, req: Request, pty_id: str) -> None:
        s = self._session(pty_id)
        if "upgrade" not in req.headers:
            raise invalid("attach needs 'Upgrade: atoll-pty' (the connection then carries pty frames)")
        sock = conn.sock
        conn.keep_alive = False
        conn.send_raw(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: atoll-pty\r\nConnection: Upgrade\r\n\r\n"
        )
        with s.lock:
            sock.sendall(ptyframes.data(bytes(s.scrollback)) if s.scrollback else b"")
            if s.exit_code is not None:
                sock.sendall(ptyframes.exit_frame(s.exit_code))
            else:
                s.attached.append(sock)
        decoder = ptyframes.Decoder()
        try:
            while True:
                try:
                    chunk = conn.rfile.read1(READ_SIZE)
                except OSError:
                    chunk = b""
                if not chunk:
                    conn.peer_closed = True
                    return
                try:
                    frames = decoder.feed(chunk)
                except ValueError as e:
                    log(f"pty {pty_id}: bad frame from the client ({e}); resetting the attach")
                    conn.abort = True
                    return
                for kind, payload in frames:
                    self._on_frame(s, sock, kind, payload)
        finally:
            with s.lock:
                if sock in s.attached:
                    s.attached.remove(sock)

    @staticmethod
    def _on_frame(s: Session, sock, kind: int, payload: bytes) -> None:
        if kind == ptyframes.DATA:
            s.write(payload)
            return
        if kind == ptyframes.RESIZE:
            try:
                cols, rows = ptyframes.parse_resize(payload)
                problem = ptyframes.size_problem(cols, rows)
            except ValueError as e:
                problem = str(e)
            if problem is None and s.exit_code is None:
                try:
                    s.resize(cols, rows)
                except OSError as e:
                    problem = f"resize failed: {e}"
            if problem is None:
                return
            message = f"terminal size: {problem}"
        else:
            message = f"a client sends DATA or RESIZE frames, not type {kind}"
        with s.lock:
            try:
                sock.sendall(ptyframes.error("invalid_request", message))
            except OSError:
                raise PeerGone() from None

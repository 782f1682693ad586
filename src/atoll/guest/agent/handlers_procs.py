"""Process handles: one process's record, its output from an offset (re-read or followed), its
stdin, signals and waiting for its exit.

`ProcHandlers` is mixed into `routing.Agent`, which routes GET /processes/<pid>,
GET /processes/<pid>/output, POST /processes/<pid>/stdin, POST /processes/<pid>/signal and
POST /processes/<pid>/wait here. The buffers and pipes themselves are in `procio`.
"""

from __future__ import annotations

import base64
import select
import signal
import socket
import threading
import time

from . import zygote
from .common import dumps
from .connection import Conn, Request, json_body
from .errors import ApiError, BadRequest, PeerGone, invalid
from .procio import STDIN_WRITE_TIMEOUT_S, StdinClosed
from .threads import pool

NDJSON = "application/x-ndjson"
STDIN_CHUNK = 1 << 16
MAX_STDIN_DRAIN = 64 << 20
WAKE_S = 0.5  # how often a follower or waiter looks whether its caller went away
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
SIGNALS = {s.name[3:]: s for s in signal.Signals if not s.name.startswith("SIG_")}


PUMP_END_BYTES = 4096
"""At most this much output left unsent when the log closes: the pump's thread writes it and the
exit line itself (`_Tail.end_from_pump`)."""


class _Tail:
    """Where one follower of a process's output is (`offset`), and whether its answer has ended.
    Whoever holds `lock` writes to the follower's connection: its own thread, or the pump's as it
    closes the log, which then writes what is left and the exit line at once instead of waking the
    follower's thread to do it (a hand-off between threads costs 0.25–1.5 ms under gVisor's ptrace
    platform, measured inside a sandbox). The pump never waits for the lock, nor writes more than
    PUMP_END_BYTES, nor to a connection that cannot take it at once."""

    def __init__(self, conn: Conn, proc, offset: int) -> None:
        self.conn = conn
        self.proc = proc
        self.offset = offset
        self.lock = threading.Lock()
        self.ended = False
        self.gone = False

    def end_from_pump(self) -> None:
        if not self.lock.acquire(blocking=False):
            return  # the follower's thread is writing: it ends the answer itself
        try:
            if self.ended:
                return
            dropped, pieces = self.proc.output.read(self.offset)
            if dropped or sum(len(data) for _, data, _ in pieces) > PUMP_END_BYTES:
                return
            if not _writable(self.conn.sock):
                return
            lines = [dumps(_output_line(kind, data, end)) + b"\n" for kind, data, end in pieces]
            offset = pieces[-1][2] if pieces else self.offset
            lines.append(dumps(ProcHandlers._exit_line(self.proc, offset)) + b"\n")
            self.offset = offset
            self.ended = True
            try:
                self.conn.end_chunked(b"".join(lines))
            except PeerGone:
                self.gone = True
        finally:
            self.lock.release()


def _writable(sock: socket.socket) -> bool:
    """Whether a short write to `sock` goes out at once; never blocks."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLOUT)
    return bool(p.poll(0))


def parse_signal(value) -> signal.Signals:
    """TERM, SIGTERM, sigterm, "15" or 15 -> signal.SIGTERM; 400 listing the valid names otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return signal.Signals(value)
        except ValueError:
            pass
    elif isinstance(value, str):
        text = value.strip().upper()
        if text.isdigit():
            try:
                return signal.Signals(int(text))
            except ValueError:
                pass
        name = text[3:] if text.startswith("SIG") else text
        if name in SIGNALS:
            return SIGNALS[name]
    raise invalid(
        f"unknown signal {value!r}; use a name or number such as TERM, SIGTERM or 15. Valid names: "
        + ", ".join(sorted(SIGNALS, key=lambda n: SIGNALS[n].value))
    )


def _peer_gone(sock: socket.socket) -> bool:
    """Whether the caller closed (or reset) its connection; never blocks."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN | _POLLRDHUP)
    if not p.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class ProcHandlers:
    """A mixin of `routing.Agent` (it uses `self.procs`, the ProcessTable)."""

    def _proc(self, pid_text: str, *, background: bool = False):
        try:
            pid = int(pid_text)
        except ValueError:
            raise invalid(f"process id must be a positive integer, got {pid_text!r}") from None
        proc = self.procs.get(pid)
        if proc is None:
            raise ApiError(
                404,
                "process_not_found",
                f"no process with pid {pid} was started by the agent (or it was already removed); "
                "list them with GET /processes",
            )
        if background and proc.output is None:
            raise invalid(
                f"process {pid} is a foreground exec: its output and stdin belong to that exec call; "
                "start the command with background=true to get a handle"
            )
        return proc

    def process_info(self, conn: Conn, pid_text: str) -> None:
        conn.send_json(200, self._proc(pid_text).info())

    def process_output(self, conn: Conn, req: Request, pid_text: str) -> None:
        proc = self._proc(pid_text, background=True)
        text = req.query.get("offset", "0") or "0"
        if not (text.isascii() and text.isdigit()):
            raise invalid(f"offset must be a byte offset (an integer >= 0), got {text!r}")
        offset = int(text)
        follow = req.query.get("follow", "").lower() in ("1", "true", "yes")
        log = proc.output
        if offset > log.end:
            raise invalid(
                f"offset {offset} is past the end of process {proc.pid}'s output ({log.end} bytes so far); "
                "pass an offset from an earlier line, or 0"
            )
        conn.start_chunked(NDJSON)
        self._follow_output(conn, proc, offset, follow)

    def _follow_pumping(self, conn: Conn, proc, pump) -> None:
        """`_follow_output` from the start of a process just started, its pump (procio.Pump) run
        on this thread while the follower keeps up: no pooled thread is woken while the command
        starts (a hand-off costs 0.25–1.5 ms under gVisor's ptrace platform, and a command started
        beside one ran that much longer). Only small writes a connection takes at once are made
        here (at most PUMP_END_BYTES at a time): at more output, or a follower that is behind, the
        pump goes on on a pooled thread and this thread follows as `_follow_output` does, so a slow
        reader never holds the command back; when the follower goes away (PeerGone) or anything
        fails, the pump goes on there and the process runs on."""
        log = proc.output
        sock = conn.sock
        offset = 0
        slow = False
        try:
            checked = time.monotonic()
            while pump.step(int(WAKE_S * 1000)):
                dropped, pieces = log.read(offset)
                if dropped or pieces:
                    if dropped or sum(len(d) for _, d, _ in pieces) > PUMP_END_BYTES or not _writable(sock):
                        slow = True  # much output, or a follower behind: this thread must not block
                        break
                    if dropped:
                        offset += dropped
                        conn.write_chunk(dumps({"dropped": dropped, "offset": offset}) + b"\n")
                    for kind, data, end in pieces:
                        offset = end
                        conn.write_chunk(dumps(_output_line(kind, data, end)) + b"\n")
                now = time.monotonic()
                if now - checked >= WAKE_S:
                    checked = now
                    if _peer_gone(sock):
                        raise PeerGone()  # the follower went away: the process runs on
            if not slow:
                # the pipes are closed (or the grace after the exit passed): its exit, then the end
                while not proc.ended.wait(WAKE_S):
                    if _peer_gone(sock):
                        raise PeerGone()
                pump.close()
                pump.leftovers(later=pool.submit)
        except BaseException:
            if not pump.done:
                pool.submit(pump.run)
            raise
        if slow:
            pool.submit(pump.run)
        self._follow_output(conn, proc, offset, slow)

    def _follow_output(self, conn: Conn, proc, offset: int, follow: bool) -> None:
        """The output lines of `proc` from `offset` (and its exit line once it exited; `follow`:
        waiting for more until then) on a chunked answer already started, then its end. A
        follower that goes away leaves the process running (PeerGone). Following, the end may be
        written by the pump's thread as it closes the log (`_Tail.end_from_pump`)."""
        log = proc.output
        tail = _Tail(conn, proc, offset)
        if follow:
            log.closers.append(tail.end_from_pump)
        try:
            while True:
                with tail.lock:
                    if tail.ended:
                        break
                    dropped, pieces = log.read(tail.offset)
                    if dropped:
                        tail.offset += dropped
                        conn.write_chunk(dumps({"dropped": dropped, "offset": tail.offset}) + b"\n")
                    for kind, data, end in pieces:
                        tail.offset = end
                        conn.write_chunk(dumps(_output_line(kind, data, end)) + b"\n")
                if dropped or pieces:
                    continue
                with log.cond:
                    if log.end > tail.offset:
                        continue
                    if log.closed or not follow:
                        break
                    log.cond.wait(WAKE_S)
                if _peer_gone(conn.sock):
                    raise PeerGone()  # the follower went away: the process runs on
            with tail.lock:
                if not tail.ended:
                    tail.ended = True
                    closed = log.closed and tail.offset >= log.end
                    conn.end_chunked(dumps(self._exit_line(proc, tail.offset)) + b"\n" if closed else b"")
        finally:
            if follow:
                with log.cond:
                    if tail.end_from_pump in log.closers:
                        log.closers.remove(tail.end_from_pump)
        if tail.gone:
            raise PeerGone()

    @staticmethod
    def _exit_line(proc, offset: int) -> dict:
        ended = proc.ended_at or proc.started_at
        line = {
            "exit_code": proc.exit_code,
            "timed_out": proc.timed_out,
            "duration_ms": max(0, round((ended - proc.started_at) * 1000)),
            "offset": offset,
        }
        if proc.signal is not None:
            line["signal"] = proc.signal
        return line

    def process_stdin(self, conn: Conn, req: Request, pid_text: str) -> None:
        try:
            written, eof = self._stdin(req, pid_text)
        except ApiError:
            try:  # the caller sends the whole body before it reads the answer
                req.body.drain(MAX_STDIN_DRAIN)
            except BadRequest:
                pass
            raise
        conn.send_json(200, {"written": written, "eof": eof})

    def _stdin(self, req: Request, pid_text: str) -> tuple[int, bool]:
        proc = self._proc(pid_text, background=True)
        eof = req.query.get("eof", "").lower() in ("1", "true", "yes")
        pipe = proc.stdin
        if proc.exit_code is not None:
            raise ApiError(
                409,
                "process_exited",
                f"process {proc.pid} has exited (exit code {proc.exit_code}); its stdin takes no more "
                "input — start a new process",
            )
        if pipe.closed:
            raise ApiError(
                409,
                "stdin_closed",
                f"the stdin of process {proc.pid} is closed (by an earlier eof, or it was given as a "
                "string at start); start a new process to send more input",
            )
        written = 0
        buf = memoryview(bytearray(STDIN_CHUNK))
        try:
            while n := req.body.readinto(buf):
                written += pipe.write(bytes(buf[:n]), proc.ended.is_set)
        except StdinClosed:
            if proc.exit_code is not None:
                raise ApiError(
                    409,
                    "process_exited",
                    f"process {proc.pid} exited (exit code {proc.exit_code}) after reading {written} "
                    "bytes of this input; the rest was not delivered",
                ) from None
            raise ApiError(
                409,
                "stdin_closed",
                f"process {proc.pid} closed its stdin after {written} bytes of this input; the rest "
                "was not delivered",
            ) from None
        except TimeoutError as e:
            done = written + (e.args[0] if e.args else 0)
            raise ApiError(
                409,
                "invalid_state",
                f"process {proc.pid} did not read its stdin for {int(STDIN_WRITE_TIMEOUT_S)} s (or exited): "
                f"{done} bytes of this input were delivered, the rest was not; send less at a time",
            ) from None
        if eof:
            pipe.close()
        return written, eof

    def process_signal(self, conn: Conn, req: Request, pid_text: str) -> None:
        proc = self._proc(pid_text)
        sig = parse_signal(json_body(req).get("signal"))
        if proc.exit_code is None:
            if self.procs.init is not None:
                self.procs.init.signal(proc.pid, int(sig))
            else:
                zygote.signal_group(proc.pid, int(sig))
        conn.send_json(200, {"pid": proc.pid, "signal": sig.name[3:], "running": proc.exit_code is None})

    def process_wait(self, conn: Conn, req: Request, pid_text: str) -> None:
        proc = self._proc(pid_text)
        timeout = json_body(req).get("timeout_s")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < 1e9
        ):
            raise invalid(f"timeout_s must be a number of seconds >= 0 or null (no limit), got {timeout!r}")
        done = proc.ended if proc.output is None else None
        log = proc.output
        left = timeout
        while True:
            step = WAKE_S if left is None else min(WAKE_S, left)
            if done is not None:
                finished = done.wait(step)
            else:
                with log.cond:
                    finished = log.cond.wait_for(lambda: log.closed, step)
            if finished:
                break
            if left is not None:
                left -= step
                if left <= 0:
                    raise ApiError(
                        409,
                        "process_running",
                        f"process {proc.pid} is still running after timeout_s={timeout}; wait again, "
                        "or signal or kill it",
                    )
            if _peer_gone(conn.sock):
                raise PeerGone()
        info = proc.info()
        info["timed_out"] = proc.timed_out
        conn.send_json(200, info)


def _output_line(kind: str, data: bytes, end: int) -> dict:
    """One piece of output as text; bytes that are not UTF-8 (text has U+FFFD for them) also
    travel exactly, as base64 in `b64`, for callers that need them (the E2B edge)."""
    text = data.decode("utf-8", "replace")
    line: dict = {kind: text, "offset": end}
    if "\ufffd" in text and text.encode() != data:
        line["b64"] = base64.b64encode(data).decode("ascii")
    return line

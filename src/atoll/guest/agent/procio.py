"""A background process's pipes: `OutputLog` keeps its stdout and stderr as one bounded sequence
addressed by byte offsets that readers can re-read and follow; `Pump` reads the process's pipes
into that log (and into its log file) on a pooled thread or a follower's; `StdinPipe` feeds its stdin.

Used by `handlers_exec` (starting background commands, stdin given as a string) and
`handlers_procs` (GET /processes/<pid>/output, POST /processes/<pid>/stdin, wait).

Offsets count bytes of the combined output sequence: every piece of stdout or stderr, in the
order the agent read them. A piece is never split inside a UTF-8 character (an incomplete
character at the end of a read waits for the rest). The log keeps the newest OUTPUT_KEEP bytes
of a process; a reader asking for an older offset gets a `{"dropped": n, "offset": oldest}` line
first. Like the pipes themselves, it uses poll() and blocking calls only (no epoll: see the
package docstring).
"""

from __future__ import annotations

import collections
import errno
import os
import select
import threading
import time

from .capture import PIPE_READ, drain_leftovers

OUTPUT_KEEP = 4 << 20  # bytes of output kept per background process (stdout and stderr together)
EXIT_DRAIN_GRACE_S = 0.3  # as for a foreground exec: output read after the process's own exit
STDIN_WRITE_TIMEOUT_S = 30.0  # a write to a stdin the process does not read gives up after this


def complete_utf8(data: bytes) -> int:
    """How many leading bytes of `data` end on a UTF-8 character boundary."""
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if c < 0x80:
            return n
        if c >= 0xC0:
            need = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return n if i >= need else n - i
    return n


class OutputLog:
    """The newest `keep` bytes of a process's output as (offset, kind, bytes) pieces; `closed` once
    no more output will come (the process exited and its pipes were drained)."""

    def __init__(self, keep: int = OUTPUT_KEEP) -> None:
        self.keep = keep
        self.cond = threading.Condition()
        self.pieces: collections.deque = collections.deque()
        self.start = 0  # offset of the oldest byte kept
        self.end = 0  # offset after the newest byte
        self.closed = False
        self._pending = {"stdout": b"", "stderr": b""}
        self.closers: list = []
        """Called by `close` (the pump's thread) once it is closed, before the waiters are woken:
        a follower's `_Tail.end_from_pump`, which writes the end itself when it can."""

    def add(self, kind: str, data: bytes) -> None:
        data = self._pending[kind] + data
        cut = complete_utf8(data)
        self._pending[kind] = data[cut:]
        if cut:
            self._append(kind, data[:cut])

    def _append(self, kind: str, data: bytes) -> None:
        with self.cond:
            if self.closed:
                return
            if len(data) > self.keep:
                self.end += len(data) - self.keep
                data = data[-self.keep :]
            self.pieces.append((self.end, kind, data))
            self.end += len(data)
            while self.end - self.pieces[0][0] > self.keep:
                off, k, d = self.pieces[0]
                over = self.end - off - self.keep  # bytes to drop from the front
                if over < len(d):
                    self.pieces[0] = (off + over, k, d[over:])
                    break
                self.pieces.popleft()
            self.start = self.pieces[0][0] if self.pieces else self.end
            self.cond.notify_all()

    def close(self) -> None:
        for kind in ("stdout", "stderr"):
            rest, self._pending[kind] = self._pending[kind], b""
            if rest:
                self._append(kind, rest)
        with self.cond:
            self.closed = True
            closers = list(self.closers)
        for closer in closers:
            try:
                closer()
            except Exception:  # noqa: BLE001 - the follower's thread ends its answer instead
                pass
        with self.cond:
            self.cond.notify_all()

    def read(self, offset: int, limit: int = 1 << 20) -> tuple[int, list[tuple[str, bytes, int]]]:
        """(bytes dropped before `offset`'s data, [(kind, data, end offset)]) from `offset` on, at
        most about `limit` bytes; call with the cond held or not (it takes it)."""
        with self.cond:
            dropped = max(0, self.start - offset)
            offset = max(offset, self.start)
            out: list[tuple[str, bytes, int]] = []
            size = 0
            for off, kind, data in self.pieces:
                if off + len(data) <= offset:
                    continue
                part = data[max(0, offset - off) :]
                end = off + len(data)
                if out and out[-1][0] == kind:  # merge neighbours of one stream into one line
                    out[-1] = (kind, out[-1][1] + part, end)
                else:
                    out.append((kind, part, end))
                size += len(part)
                if size >= limit:
                    break
            return dropped, out


class ExitWake:
    """The `notify` of a background process's record: the reaper's ("exit", code) wakes its pump
    through a pipe, so an idle pump sleeps in poll() without a timeout (no wake-ups: an idle
    sandbox uses no CPU)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC)

    def put(self, _item) -> None:
        try:
            os.write(self.w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass


class Pump:
    """Reads a background process's stdout and stderr into its `OutputLog` and its log file until
    they close, or until EXIT_DRAIN_GRACE_S after the process exited (a descendant still holding
    them then keeps writing to the log file only); then closes the log. In steps, so that a
    follower's own thread can run it while it follows (the agent's
    `POST /exec` background with its output followed: no thread to wake while the command starts,
    a hand-off that costs 0.25–1.5 ms under gVisor's ptrace platform) and hand the rest to a pooled
    thread (`run`) when it stops following."""

    def __init__(self, proc, pipes: list, log: OutputLog, log_fd: int, wake: ExitWake) -> None:
        self.proc = proc
        self.log = log
        self.log_fd = log_fd
        self.wake = wake
        self.kinds = {pipes[0].fileno(): "stdout", pipes[1].fileno(): "stderr"}
        self.files = {f.fileno(): f for f in pipes}
        self.poller = select.poll()
        for fd in self.kinds:
            self.poller.register(fd, select.POLLIN)
        self.poller.register(wake.r, select.POLLIN)
        self.grace_end: float | None = None
        self.done = False  # the log is closed (`close`)

    def step(self, wait_ms: int = -1) -> bool:
        """Read what the pipes have, waiting up to `wait_ms` (-1: until something happens); False
        once they are all closed or the grace after the exit has passed."""
        if not self.kinds:
            return False
        now = time.monotonic()
        if self.grace_end is None and self.proc.ended.is_set():
            self.grace_end = now + EXIT_DRAIN_GRACE_S
            self.poller.unregister(self.wake.r)
        if self.grace_end is not None and now >= self.grace_end:
            return False
        timeout = -1 if self.grace_end is None else max(1, int((self.grace_end - now) * 1000))
        if wait_ms >= 0:
            timeout = wait_ms if timeout < 0 else min(timeout, wait_ms)
        for fd, _ in self.poller.poll(timeout):
            if fd == self.wake.r:
                continue  # the exit: seen at the top of the next step
            try:
                data = os.read(fd, PIPE_READ)
            except OSError:
                data = b""
            if data:
                self.log.add(self.kinds[fd], data)
                _write_all(self.log_fd, data)
            else:
                self.poller.unregister(fd)
                self.kinds.pop(fd)
                self.files.pop(fd).close()
        return bool(self.kinds)

    def close(self) -> None:
        """After the pipes (and the process's exit, waited for by the caller): close the log, the
        wake and stdin; then `leftovers` for what a descendant still writes."""
        if self.done:
            return
        self.done = True
        try:
            self.wake.close()
            self.log.close()
        finally:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the process is gone: nothing will read more input

    def leftovers(self, later=None) -> None:
        """The pipes a descendant still holds, to the log file only (`_to_log_file`), on `later`
        (a pool's submit) when given; else the log file is closed."""
        if self.files:
            files = list(self.files.values())
            self.files = {}
            if later is not None:
                later(_to_log_file, files, self.log_fd)
            else:
                _to_log_file(files, self.log_fd)
        else:
            os.close(self.log_fd)

    def run(self) -> None:
        """The rest of the pump, to its end (on a pooled thread)."""
        if self.done:
            return
        try:
            while self.step():
                pass
            self.proc.ended.wait()
        finally:
            self.close()
        self.leftovers()


def _to_log_file(files: list, log_fd: int) -> None:
    """What a process's leftover descendants write, after it exited: to the log file only."""
    try:
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
                if data:
                    _write_all(log_fd, data)
                else:
                    poller.unregister(fd)
                    by_fd.pop(fd).close()
    except Exception:
        drain_leftovers([f for f in files if not f.closed])
    finally:
        os.close(log_fd)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # the log file is a convenience; the OutputLog is the record


class StdinClosed(Exception):
    """The process's stdin is closed: by an earlier eof, or because the process (and every holder
    of the pipe) is gone."""


class StdinPipe:
    """The write end of a process's stdin pipe, non-blocking, written under a lock; without `fd`
    (a process whose stdin is /dev/null), one that is closed from the start."""

    def __init__(self, fd: int | None) -> None:
        if fd is not None:
            os.set_blocking(fd, False)
        self.fd = -1 if fd is None else fd
        self.lock = threading.Lock()
        self.closed = fd is None
        self.broken = False  # the reader went away (EPIPE)

    def write(self, data: bytes, ended=lambda: False, timeout: float = STDIN_WRITE_TIMEOUT_S) -> int:
        """Write all of `data`; raise StdinClosed if closed or the reader is gone, TimeoutError if
        the process did not read for `timeout` seconds (or it ended while the pipe was full)."""
        view = memoryview(data)
        done = 0
        with self.lock:
            if self.closed:
                raise StdinClosed()
            poller = select.poll()
            poller.register(self.fd, select.POLLOUT)
            deadline = time.monotonic() + timeout
            while done < len(view):
                try:
                    done += os.write(self.fd, view[done:])
                    deadline = time.monotonic() + timeout
                    continue
                except BlockingIOError:
                    pass
                except OSError as e:
                    if e.errno == errno.EPIPE:
                        self.broken = True
                        raise StdinClosed() from None
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(done)
                if not poller.poll(int(min(left, 0.5) * 1000) + 1) and ended():
                    raise TimeoutError(done)
        return done

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                try:
                    os.close(self.fd)
                except OSError:
                    pass


def feed_soon(pipe: StdinPipe, data: bytes, ended, submit) -> None:
    """`feed`, without a thread when `data` fits in the pipe at once (an empty stdin, a short
    input): a hand-off to a pooled thread costs 0.25–1.5 ms under gVisor's ptrace platform
    (bench_agent_parts; more on a busy machine). What does not fit is fed by `feed` on a thread `submit` gives it."""
    with pipe.lock:
        if pipe.closed:
            return
        try:
            done = os.write(pipe.fd, data) if data else 0
        except BlockingIOError:
            done = 0
        except OSError:  # EPIPE: the process is gone already, and its input with it
            done = len(data)
    if done >= len(data):
        pipe.close()
    else:
        submit(feed, pipe, data[done:], ended)


def feed(pipe: StdinPipe, data: bytes, ended) -> None:
    """Write `data` then close the pipe (stdin given as a string); on a pooled thread. A process
    that exits without reading it all simply loses the rest, as with `echo data | cmd`."""
    try:
        pipe.write(data, ended, timeout=float("inf"))
    except (StdinClosed, TimeoutError, OSError):
        pass
    finally:
        pipe.close()

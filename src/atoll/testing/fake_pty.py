"""Terminals for `atoll.testing.FakeWorker`: a real pseudo-terminal on this host running a tiny
line-echo program (not a shell), spoken to in guest.agent.ptyframes, so tests of the control plane, the
SDK and the CLI exercise the framing, the tty's own echo, resizes and exit codes for real.

The program answers each line it reads: `size` prints `COLSxROWS` (the tty's size), `term` prints
$TERM, `exit N` exits with N, anything else prints `you said: <line>`. The terminal line
discipline echoes what is typed, as in a sandbox. `FakePtys` is owned by FakeWorker (one per
worker); `close_all` kills every program it started (FakeWorker.delete / aclose call it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import os
import secrets
import signal
import struct
import subprocess
import sys
import termios
import time

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.guest.agent import ptyframes

PROGRAM = r"""
import os, sys
print("fake-tty ready", flush=True)
for line in sys.stdin:
    line = line.strip()
    if line.startswith("exit"):
        sys.exit(int(line.split()[1]) if len(line.split()) > 1 else 0)
    if line == "size":
        c, r = os.get_terminal_size(0)
        print(f"{c}x{r}", flush=True)
    elif line == "term":
        print(os.environ.get("TERM", ""), flush=True)
    else:
        print("you said: " + line, flush=True)
"""


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class _Attach:
    """An attached client of a fake session (api.PortStream): frames out through a queue."""

    def __init__(self, session: _Session):
        self.session = session
        self.out: asyncio.Queue[bytes] = asyncio.Queue()
        self.decoder = ptyframes.Decoder()
        self._closed = False

    async def read(self, n: int) -> bytes:
        if self._closed:
            return b""
        return await self.out.get()  # b"" once closed

    async def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionResetError("the fake terminal attach is closed")
        for kind, payload in self.decoder.feed(data):
            self.session.on_frame(self, kind, payload)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.session.attached.discard(self)
            self.out.put_nowait(b"")

    @property
    def closed(self) -> bool:
        return self._closed

    def detach(self) -> None:
        return None  # a terminal's frames are not a socket


class _Session:
    def __init__(self, pty_id: str, spec: api.PtySpec):
        self.pty_id = pty_id
        self.spec = spec
        self.cols, self.rows = spec.cols, spec.rows
        self.term = spec.term or "xterm-256color"
        self.master, slave = os.openpty()
        _set_size(slave, spec.cols, spec.rows)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", PROGRAM],
                stdin=slave,
                stdout=slave,
                stderr=slave,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TERM": self.term},
                start_new_session=True,
            )
        finally:
            os.close(slave)
        self.created_at = time.time()
        self.scrollback = bytearray()
        self.attached: set[_Attach] = set()
        self.exit_code: int | None = None
        self.output_ended = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(self.master, self._readable)
        self.waiter = asyncio.ensure_future(self._wait())

    def _readable(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self.master)
            self.output_ended.set()
            return
        self.scrollback += data
        del self.scrollback[: -ptyframes.SCROLLBACK_BYTES]
        for a in list(self.attached):
            a.out.put_nowait(ptyframes.data(data))

    async def _wait(self) -> None:
        # A pidfd turns readable when the program exits: no executor thread blocks in waitpid (a
        # program nobody killed would hold the loop's default executor, and its shutdown, forever).
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        pidfd = os.pidfd_open(self.proc.pid)
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        code = self.proc.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.output_ended.wait(), 0.3)
        self.exit_code = 128 - code if code < 0 else code
        for a in list(self.attached):
            a.out.put_nowait(ptyframes.exit_frame(self.exit_code))
        self._close_master()

    def _close_master(self) -> None:
        if self.master >= 0:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self.master)
            os.close(self.master)
            self.master = -1

    def attach(self) -> _Attach:
        a = _Attach(self)
        if self.scrollback:
            a.out.put_nowait(ptyframes.data(bytes(self.scrollback)))
        if self.exit_code is not None:
            a.out.put_nowait(ptyframes.exit_frame(self.exit_code))
        else:
            self.attached.add(a)
        return a

    def on_frame(self, a: _Attach, kind: int, payload: bytes) -> None:
        if kind == ptyframes.DATA:
            if self.master >= 0 and self.exit_code is None:
                os.write(self.master, payload)
            return
        problem = f"a client sends DATA or RESIZE frames, not type {kind}"
        if kind == ptyframes.RESIZE:
            try:
                cols, rows = ptyframes.parse_resize(payload)
                problem = ptyframes.size_problem(cols, rows) or ""
            except ValueError as e:
                problem = str(e)
            if not problem:
                if self.master >= 0:
                    _set_size(self.master, cols, rows)  # the kernel sends SIGWINCH
                self.cols, self.rows = cols, rows
                return
        a.out.put_nowait(ptyframes.error("invalid_request", f"terminal size: {problem}"))

    def info(self) -> api.PtyInfo:
        return api.PtyInfo(
            self.pty_id,
            self.proc.pid,
            self.spec.cmd,
            self.cols,
            self.rows,
            self.term,
            self.exit_code is None,
            self.exit_code,
            self.created_at,
            len(self.attached),
        )

    def kill(self) -> None:
        for a in list(self.attached):
            a.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


class FakePtys:
    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, _Session]] = {}
        atexit.register(self._kill_programs)  # a test that never deleted its sandbox leaves none

    def _kill_programs(self) -> None:
        for sessions in self.sessions.values():
            for s in sessions.values():
                if s.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(s.proc.pid, signal.SIGKILL)

    def open(self, sid: str, spec: api.PtySpec) -> api.PtyStarted:
        problem = ptyframes.size_problem(spec.cols, spec.rows)
        if problem:
            raise errors.InvalidRequest(f"terminal size: {problem}")
        s = _Session("pty_" + secrets.token_hex(6), spec)
        self.sessions.setdefault(sid, {})[s.pty_id] = s
        return api.PtyStarted(s.pty_id, s.proc.pid)

    def get(self, sid: str, pty_id: str) -> _Session:
        s = self.sessions.get(sid, {}).get(pty_id)
        if s is None:
            raise errors.PtyNotFound(f"no terminal {pty_id!r} in sandbox {sid}")
        return s

    def kill(self, sid: str, pty_id: str) -> None:
        self.get(sid, pty_id).kill()
        self.sessions[sid].pop(pty_id, None)

    def detach_all(self, sid: str) -> None:
        """A disk checkpoint resets attach streams (the sessions live on)."""
        for s in self.sessions.get(sid, {}).values():
            for a in list(s.attached):
                a.close()

    def close_all(self, sid: str | None = None) -> None:
        for key in [sid] if sid is not None else list(self.sessions):
            for s in self.sessions.pop(key, {}).values():
                s.kill()

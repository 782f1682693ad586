"""Messages between atoll's own processes: JSON over a unix SOCK_SEQPACKET socket, with
descriptors handed over beside them (SCM_RIGHTS).

The data plane runs in processes of its own — the egress gateway beside each worker, the ingress
router beside the control plane — and each talks to its parent over one socketpair made before the
child starts (no path in the filesystem, so nobody else can connect). A message is a JSON object:
a call (`{"t": "call", "id", "op", ...}`) gets one reply (`{"t": "reply", "id", "ok", ...}` or
`"error": {"code", "message", "errno"}`), an event (`{"t": "event", ...}`) gets none. Sockets born
where only the sender can make them (inside a sandbox's network namespace) or accepted by one
process and served by another travel as descriptors with the message; the receiver owns them.

Messages are sent in order from one queue; one larger than FRAGMENT bytes goes as several packets
(a first byte `+` says more follow, `.` ends it), so no socket buffer size limits a policy or a
certificate. A peer that goes away ends every call in flight with `ChannelClosed`.
Called by worker.edge and gateway.service (the gateway's channel), controlplane.ingress_host and
ingress.service (the router's). Imports no process package.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno as errno_mod
import json
import logging
import os
import socket
import time
import typing

log = logging.getLogger(__name__)
FRAGMENT = 60 * 1024
MAX_MESSAGE = 64 * 1024 * 1024
MAX_FDS = 8
"""Descriptors one message may carry."""
_ANC = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)

Handler = typing.Callable[[dict, list[socket.socket]], typing.Awaitable[typing.Any]]
"""Serves a call: returns the reply's fields (a dict), or (fields, sockets) to hand some over;
raises CallError (or OSError) for an error reply."""


class ChannelClosed(ConnectionError):
    """The peer process is gone (or the channel was closed here)."""


class CallError(Exception):
    """An error reply: a stable `code`, a human `message`, and for OS errors their `errno`."""

    def __init__(self, code: str, message: str, errno: int | None = None):
        super().__init__(message)
        self.code, self.message, self.errno = code, message, errno


def pair() -> tuple[socket.socket, socket.socket]:
    """The two ends of a new channel (the child's end is made inheritable by the caller)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return a, b


class Channel:
    """One end of a channel, served on the running event loop (`start`)."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler | None = None,
        on_event: typing.Callable[[dict], None] | None = None,
        name: str = "channel",
    ):
        sock.setblocking(False)
        self.sock = sock
        self.name = name
        self._handler = handler
        self._on_event = on_event
        self._calls: dict[int, asyncio.Future] = {}
        self._next = 0
        self._out: asyncio.Queue[tuple[bytes, list[int]] | None] = asyncio.Queue()
        self._parts: list[bytes] = []
        self._part_fds: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self._writer: asyncio.Task | None = None
        self._busy = False  # the writer task holds a message it has not wholly sent
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = asyncio.Event()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._readable)
        self._writer = asyncio.ensure_future(self._write_loop())

    # ---- sending ----------------------------------------------------------------------------
    def send(self, msg: dict, fds: typing.Sequence[socket.socket | int] = ()) -> None:
        """Queue `msg` (and copies of `fds`: the caller keeps its own) to go in order."""
        if self.closed.is_set():
            raise ChannelClosed(f"the {self.name} is closed")
        data = json.dumps(msg, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"a message of {len(data)} bytes is over {MAX_MESSAGE}")
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} descriptors in one message (at most {MAX_FDS})")
        if len(data) <= FRAGMENT and not self._busy and self._out.empty():
            # nothing queued before it: straight to the socket (a task switch less per message)
            nums = [f if isinstance(f, int) else f.fileno() for f in fds]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", nums))] if nums else []
            try:
                self.sock.sendmsg([b".", data], anc)
                return
            except BlockingIOError:
                pass  # the socket is full: queued below, in order
            except OSError as e:
                log.debug("%s: send failed: %r", self.name, e)
                self._closed()
                raise ChannelClosed(f"the {self.name} went away") from None
        dups = [os.dup(f if isinstance(f, int) else f.fileno()) for f in fds]
        self._out.put_nowait((data, dups))

    def event(self, **fields: typing.Any) -> None:
        self.send({"t": "event", **fields})

    async def call(
        self,
        op: str,
        fds: typing.Sequence[socket.socket | int] = (),
        timeout: float | None = 30.0,
        **fields: typing.Any,
    ) -> tuple[dict, list[socket.socket]]:
        """Ask the peer; returns (reply fields, sockets handed over). Raises CallError for an
        error reply, ChannelClosed when the peer is gone, TimeoutError."""
        self._next += 1
        cid = self._next
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        try:
            self.send({"t": "call", "id": cid, "op": op, **fields}, fds)
            reply, got = await asyncio.wait_for(fut, timeout) if timeout else await fut
        finally:
            self._calls.pop(cid, None)
        if not reply.get("ok"):
            for s in got:
                s.close()
            err = reply.get("error") or {}
            raise CallError(
                err.get("code", "internal_error"), err.get("message", "no message"), err.get("errno")
            )
        return reply, got

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                item = await self._out.get()
                if item is None:
                    return
                data, fds = item
                self._busy = True
                try:
                    parts = [data[i : i + FRAGMENT] for i in range(0, len(data), FRAGMENT)] or [b""]
                    for i, part in enumerate(parts):
                        flag = b"." if i == len(parts) - 1 else b"+"
                        anc = (
                            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                            if fds and not i
                            else []
                        )
                        while True:
                            try:
                                self.sock.sendmsg([flag, part], anc)
                                break
                            except BlockingIOError:
                                await _writable(loop, self.sock)
                finally:
                    self._busy = False
                    for fd in fds:
                        os.close(fd)
        except (OSError, ValueError) as e:
            if not self.closed.is_set():
                log.debug("%s: send failed: %r", self.name, e)
            self._closed()

    # ---- receiving --------------------------------------------------------------------------
    def _readable(self) -> None:
        while True:
            try:
                data, anc, flags, _ = self.sock.recvmsg(FRAGMENT + 1, _ANC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._closed()
                return
            fds = _fds_of(anc)
            if not data:
                for s in fds:
                    s.close()
                self._closed()
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                for s in fds:
                    s.close()
                log.error("%s: a truncated message was dropped", self.name)
                self._closed()
                return
            self._parts.append(data[1:])
            self._part_fds += fds
            if data[:1] == b"+":
                if sum(map(len, self._parts)) > MAX_MESSAGE:
                    self._closed()
                    return
                continue
            raw, got = b"".join(self._parts), self._part_fds
            self._parts, self._part_fds = [], []
            try:
                msg = json.loads(raw)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except ValueError:
                for s in got:
                    s.close()
                log.error("%s: a message that is not a JSON object was dropped", self.name)
                continue
            self._dispatch(msg, got)

    def _dispatch(self, msg: dict, fds: list[socket.socket]) -> None:
        kind = msg.get("t")
        if kind == "reply":
            fut = self._calls.get(msg.get("id", -1))
            if fut is not None and not fut.done():
                fut.set_result((msg, fds))
            else:
                for s in fds:
                    s.close()
        elif kind == "call" and self._handler is not None:
            t = asyncio.ensure_future(self._serve(msg, fds))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        elif kind == "event" and self._on_event is not None:
            for s in fds:
                s.close()
            try:
                self._on_event(msg)
            except Exception:  # noqa: BLE001 - one bad event must not end the channel
                log.exception("%s: event handler failed", self.name)
        else:
            for s in fds:
                s.close()

    async def _serve(self, msg: dict, fds: list[socket.socket]) -> None:
        assert self._handler is not None
        cid = msg.get("id")
        out_fds: typing.Sequence[socket.socket] = ()
        try:
            result = await self._handler(msg, fds)
            if isinstance(result, tuple):
                result, out_fds = result
            reply = {"t": "reply", "id": cid, "ok": True, **(result or {})}
        except CallError as e:
            reply = {
                "t": "reply",
                "id": cid,
                "ok": False,
                "error": {"code": e.code, "message": e.message, "errno": e.errno},
            }
        except OSError as e:
            refused = isinstance(e, ConnectionRefusedError) or e.errno in (
                errno_mod.ECONNREFUSED,
                errno_mod.ECONNRESET,
            )
            code = "refused" if refused else "os_error"
            reply = {
                "t": "reply",
                "id": cid,
                "ok": False,
                "error": {"code": code, "message": e.strerror or str(e), "errno": e.errno},
            }
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug must answer the caller, not leave it waiting
            log.exception("%s: call %r failed", self.name, msg.get("op"))
            reply = {
                "t": "reply",
                "id": cid,
                "ok": False,
                "error": {"code": "internal_error", "message": type(e).__name__},
            }
        with contextlib.suppress(ChannelClosed):
            self.send(reply, out_fds)
        for s in out_fds:
            s.close()

    # ---- closing ----------------------------------------------------------------------------
    def _closed(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self.sock.fileno())
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(f"the {self.name} went away"))
        self._out.put_nowait(None)
        for s in self._part_fds:
            s.close()
        self._part_fds = []

    async def aclose(self) -> None:
        self._closed()
        for t in list(self._tasks):
            t.cancel()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(BaseException):
                await self._writer
        while not self._out.empty():
            item = self._out.get_nowait()
            if item is not None:
                for fd in item[1]:
                    os.close(fd)
        self.sock.close()


def _fds_of(anc: list) -> list[socket.socket]:
    out: list[socket.socket] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
            for fd in fds:
                try:
                    out.append(socket.socket(fileno=fd))
                except OSError:  # not a socket: nothing here hands over other descriptors
                    os.close(fd)
    return out


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


class Child:
    """A process of atoll's own beside this one, kept running, with a channel to it.

    `argv(channel_fd, extra_fds)` is its command line; `extra_fds()` gives descriptors it inherits
    besides the channel (a listening socket); `on_start(channel)` tells a new process what it must
    know (sent before `ready` is set, again after every restart). If the process ends while this
    one runs, it is started again after a short back-off. `aclose` stops it (SIGTERM, then SIGKILL).
    Used by worker.edge (the egress gateway) and controlplane.ingress_host (the ingress router)."""

    BACKOFF_S = (0.2, 1.0, 3.0, 5.0)

    def __init__(
        self,
        name: str,
        argv: typing.Callable[[int, list[int]], list[str]],
        *,
        env: dict[str, str] | None = None,
        extra_fds: typing.Callable[[], list[int]] = list,
        on_start: typing.Callable[[Channel], typing.Awaitable[None]] | None = None,
        handler: Handler | None = None,
        on_event: typing.Callable[[dict], None] | None = None,
        ping_every_s: float = 5.0,
    ):
        self.name = name
        self.ping_every_s = ping_every_s
        self._argv, self._env, self._extra_fds = argv, env, extra_fds
        self._on_start, self._handler, self._on_event = on_start, handler, on_event
        self.ready = asyncio.Event()
        self.channel: Channel | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.started_at = 0.0
        """When the running process was last ready (time.monotonic())."""
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._first: asyncio.Future | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self, timeout: float = 20.0) -> None:
        """Start it and wait until it is ready; raises what its first start raised, or
        TimeoutError (it goes on trying in the background)."""
        if self._task is None:
            self._first = asyncio.get_running_loop().create_future()
            self._task = asyncio.ensure_future(self._supervise())
        assert self._first is not None
        await asyncio.wait_for(asyncio.shield(self._first), timeout)

    async def _supervise(self) -> None:
        tries = 0
        while not self._stopping:
            started = asyncio.get_running_loop().time()
            try:
                await self._run_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - started again below; the first failure is raised
                if self._first is not None and not self._first.done():
                    self._first.set_exception(e)
                log.exception("the %s failed", self.name)
            if self._stopping:
                return
            tries = 0 if asyncio.get_running_loop().time() - started > 30 else tries + 1
            delay = self.BACKOFF_S[min(tries, len(self.BACKOFF_S) - 1)]
            log.warning("the %s stopped; starting it again in %.1f s", self.name, delay)
            self.restarts += 1
            await asyncio.sleep(delay)

    async def _run_once(self) -> None:
        ours, theirs = pair()
        extra = self._extra_fds()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self._argv(theirs.fileno(), extra),
                pass_fds=[theirs.fileno(), *extra],
                stdin=asyncio.subprocess.DEVNULL,
                env=self._env,
            )
        finally:
            theirs.close()
        chan = Channel(ours, handler=self._handler, on_event=self._on_event, name=f"{self.name} channel")
        chan.start()
        self.channel = chan
        try:
            if self._on_start is not None:
                await self._on_start(chan)
            self.started_at = time.monotonic()
            self.ready.set()
            if self._first is not None and not self._first.done():
                self._first.set_result(None)
            log.info("%s started (pid %d)", self.name, self.proc.pid)
            watch = asyncio.ensure_future(self._watch(chan, self.proc))
            try:
                await chan.closed.wait()
            finally:
                watch.cancel()
        finally:
            self.ready.clear()
            self.channel = None
            await chan.aclose()
            await self._reap()

    async def _watch(self, chan: Channel, proc: asyncio.subprocess.Process) -> None:
        """A process that stops answering (hung, or stopped with SIGSTOP) is killed, and so
        started again: two pings in a row unanswered within ping_every_s each."""
        missed = 0
        while not self.ping_every_s <= 0:
            await asyncio.sleep(self.ping_every_s)
            try:
                await chan.call("ping", timeout=self.ping_every_s)
                missed = 0
            except (TimeoutError, CallError):
                missed += 1
            except ChannelClosed:
                return
            if missed >= 2:
                log.error(
                    "the %s (pid %d) stopped answering; killing it to start it again", self.name, proc.pid
                )
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await self._unstick(proc)
                return

    async def _unstick(self, proc: asyncio.subprocess.Process) -> None:
        """A stopped process dies of SIGKILL too; its channel then closes."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, 18)  # SIGCONT, harmless after the kill

    async def _reap(self) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            await asyncio.wait_for(proc.wait(), 2.5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def running(self) -> Channel | None:
        """The channel of the running process, or None while it is (re)starting."""
        return self.channel if self.ready.is_set() else None

    async def aclose(self) -> None:
        self._stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

"""The egress gateway's byte relay: one direction of a connection moved in the kernel (splice(2)).

Socket → pipe → socket, driven from the event loop's readiness callbacks: no task wakes per chunk
and no byte passes through Python, so relaying costs the gateway almost nothing whatever a sandbox
sends. Used for every connection the gateway does not read request by request (TLS it passes
through, raw TCP, connections into a sandbox's port); `moved(n)` is told of every chunk (activity,
and the in-use guess of gateway.egress). Falls back to reads and writes through the streams where
the loop or the transports are not the plain selector kind.
Called by gateway.egress.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import typing

_CHUNK = 1024 * 1024
Moved = typing.Callable[[int], None]


async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, moved: Moved) -> None:
    """Relay src to dst until src's end: splice(2) between the two sockets when both are plain
    stream sockets of a selector loop (zero-copy, as fast as the kernel moves them), else read and
    write through the streams."""
    src_t, dst_t = getattr(src, "_transport", None), dst.transport
    if (
        _SPLICE
        and isinstance(src, asyncio.StreamReader)
        and isinstance(src_t, _SocketTransport)
        and isinstance(dst_t, _SocketTransport)
    ):
        await _splice(src, src_t, dst, dst_t, moved)
        return
    while True:
        data = await src.read(_CHUNK)
        if not data:
            return
        moved(len(data))
        dst.write(data)
        await dst.drain()


_SPLICE = hasattr(os, "splice") and hasattr(asyncio.selector_events.BaseSelectorEventLoop, "_add_reader")
_SocketTransport = getattr(asyncio.selector_events, "_SelectorSocketTransport", ())
_PIPES: list[tuple[int, int]] = []
"""Empty pipes for splice, kept for the next chunk of any connection (an idle one holds none)."""
_PIPES_KEPT = 32
_SHORT = 64 * 1024
"""A chunk shorter than this was all there was (a request, an answer): wait for the next."""
_BUDGET = 4 * 1024 * 1024
"""What one direction moves per turn of the event loop before the other connections' turn."""


async def _splice(
    src: asyncio.StreamReader,
    src_t: asyncio.Transport,
    dst: asyncio.StreamWriter,
    dst_t: asyncio.Transport,
    moved: Moved,
) -> None:
    """One direction in the kernel: socket → pipe → socket (splice(2)), never through Python.

    The source transport stops reading (the relay drives its socket from now on); what its
    StreamReader already holds goes first, through dst's transport, and the splicing starts once
    that transport's buffer is empty. The transports keep their sockets: closing and aborting stay
    theirs (an abort still ends both sides at once, see _Lost)."""
    src_t.pause_reading()
    buffered: bytearray = src._buffer  # type: ignore[attr-defined]
    if buffered:  # read before the relay began (sniffing, or while connecting upstream)
        dst.write(bytes(buffered))
        moved(len(buffered))
        buffered.clear()
    exc = src.exception()
    if exc is not None:
        raise exc
    if src.at_eof():
        return
    while dst_t.get_write_buffer_size() and not dst_t.is_closing():
        await asyncio.sleep(0.005)  # the transport's bytes go before the spliced ones
    if src_t.is_closing() or dst_t.is_closing():
        raise ConnectionResetError("the connection was closed")
    loop = asyncio.get_running_loop()
    assert isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)  # as its transports are
    pump = _Pump(loop, src_t, dst_t, moved)
    try:
        pump.move()
        await pump.done
    finally:
        pump.stop()


class _Pump:
    """Moves one direction's bytes from the event loop's readiness callbacks (no task wakes per
    chunk or per message): splice from the source into a pipe until the source has nothing, from
    the pipe into the destination until it takes no more, and watch whichever socket it waits on.

    The transports' own descriptors are watched: meanwhile the source transport does not read and
    the destination's buffer is empty, so the transport itself watches neither. `done` ends with
    the source's end (None) or the error."""

    def __init__(
        self,
        loop: asyncio.selector_events.BaseSelectorEventLoop,
        src_t: asyncio.Transport,
        dst_t: asyncio.Transport,
        moved: Moved,
    ):
        self.loop, self.transports, self.moved = loop, (src_t, dst_t), moved
        self.s = src_t.get_extra_info("socket").fileno()
        self.d = dst_t.get_extra_info("socket").fileno()
        self.pipe: tuple[int, int] | None = None
        self.held = 0  # bytes in the pipe
        self.short = False
        self.watching: tuple[int, bool] | None = None  # (descriptor, for writing)
        self.done: asyncio.Future[None] = loop.create_future()
        for t in self.transports:
            p = t.get_protocol()
            if not isinstance(p, _Lost):
                p = _Lost(p)
                t.set_protocol(p)
            p.pumps.add(self)

    def move(self) -> None:
        if self.done.done():
            return
        if self.transports[0].is_closing() or self.transports[1].is_closing():
            self._end(ConnectionResetError("the connection was closed"))  # aborted, detached
            return
        budget = _BUDGET
        try:
            while True:
                if self.held:
                    assert self.pipe is not None
                    try:
                        self.held -= os.splice(self.pipe[0], self.d, self.held, flags=os.SPLICE_F_NONBLOCK)
                    except BlockingIOError:
                        self._watch(self.d, writing=True)
                        return
                    self.moved(0)
                    if self.held:
                        continue
                    if self.short or budget <= 0:  # (the watch is level-triggered: more → at once)
                        self._give_back()
                        self._watch(self.s, writing=False)
                        return
                if self.pipe is None:
                    self.pipe = _PIPES.pop() if _PIPES else _new_pipe()
                try:
                    n = os.splice(self.s, self.pipe[1], _CHUNK, flags=os.SPLICE_F_NONBLOCK)
                except BlockingIOError:
                    self._give_back()
                    self._watch(self.s, writing=False)
                    return
                if not n:
                    self._end(None)
                    return
                self.moved(n)
                self.held, self.short = n, n < _SHORT
                budget -= n
        except Exception as e:  # noqa: BLE001 - OSError mostly (a reset); the relay's task raises it
            self._end(e)

    def lost(self) -> None:
        """A transport lost its connection (called before it closes its descriptor)."""
        self._end(ConnectionResetError("the connection was closed"))

    def stop(self) -> None:
        self._unwatch()
        self._give_back()
        for t in self.transports:
            p = t.get_protocol()
            if isinstance(p, _Lost):
                p.pumps.discard(self)

    def _end(self, exc: Exception | None) -> None:
        self.stop()
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

    def _give_back(self) -> None:
        if self.pipe is not None:
            if self.held or len(_PIPES) >= _PIPES_KEPT:  # bytes left in it are of no use to anyone
                os.close(self.pipe[0])
                os.close(self.pipe[1])
            else:
                _PIPES.append(self.pipe)
            self.pipe, self.held = None, 0

    def _watch(self, fd: int, writing: bool) -> None:
        if self.watching != (fd, writing):
            self._unwatch()
            if writing:
                self.loop._add_writer(fd, self.move)  # type: ignore[attr-defined]
            else:
                self.loop._add_reader(fd, self.move)  # type: ignore[attr-defined]
            self.watching = (fd, writing)

    def _unwatch(self) -> None:
        if self.watching is not None:
            fd, writing = self.watching
            self.watching = None
            if writing:
                self.loop._remove_writer(fd)  # type: ignore[attr-defined]
            else:
                self.loop._remove_reader(fd)  # type: ignore[attr-defined]


def _new_pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # 64 KiB if the kernel refuses: slower, not wrong
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _CHUNK)
    return r, w


class _Lost(asyncio.Protocol):
    """A stream's protocol, wrapped while a _Pump drives its socket: every event is passed on,
    and a lost connection first stops the pumps, so that they drop their watch of the descriptor
    before the transport closes it (its number may be reused at once) and their relay ends."""

    def __init__(self, inner: asyncio.BaseProtocol):
        self.inner = inner
        self.pumps: set[_Pump] = set()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[attr-defined]

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        for p in list(self.pumps):
            p.lost()
        self.inner.connection_lost(exc)

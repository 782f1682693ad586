"""Connections into a sandbox's port as core.worker_api.PortStream, and the tunnel's line reader.

`SocketPort` holds a connected socket and makes streams of it on first use; until then `detach`
hands the socket itself over (the control plane passes it to the ingress router's process, so the
bytes of a preview never cross the API's event loop). Made by the worker's edge (its end of a
socketpair the gateway process relays), by the control plane's end of a worker's port tunnel
(controlplane.remote_worker) and by atoll.testing.FakeWorker. `StreamPort` is the same over an
asyncio stream pair (a terminal's tunnel). `read_line` reads a tunnel's hello or answer without
taking a byte past its newline (the bytes after it are the sandbox's). Imports no process package.
"""

from __future__ import annotations

import asyncio
import socket


class StreamPort:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._r, self._w = reader, writer

    async def read(self, n: int) -> bytes:
        return await self._r.read(n)

    async def write(self, data: bytes) -> None:
        self._w.write(data)
        await self._w.drain()

    def close(self) -> None:
        self._w.transport.abort()

    @property
    def closed(self) -> bool:
        return self._w.transport.is_closing() or self._r.at_eof()

    def detach(self) -> socket.socket | None:
        return None  # a stream pair keeps its socket


class SocketPort:
    """A connection into a sandbox's port over a connected stream socket."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None
        self._opening: asyncio.Future | None = None

    async def _streams(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._w is None:
            if self._opening is None:  # one transport per socket, however many tasks ask at once
                if self._sock is None:
                    raise ConnectionResetError("the connection was handed over or closed")
                sock, self._sock = self._sock, None
                self._opening = asyncio.ensure_future(asyncio.open_connection(sock=sock, limit=256 * 1024))
            self._r, self._w = await asyncio.shield(self._opening)
        assert self._r is not None
        return self._r, self._w

    async def read(self, n: int) -> bytes:
        r, _ = await self._streams()
        return await r.read(n)

    async def write(self, data: bytes) -> None:
        _, w = await self._streams()
        w.write(data)
        await w.drain()

    def close(self) -> None:
        if self._w is not None:
            self._w.transport.abort()
        elif self._opening is not None:
            self._opening.add_done_callback(_abort_when_open)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def closed(self) -> bool:
        if self._w is not None:
            return self._w.transport.is_closing() or (self._r is not None and self._r.at_eof())
        return self._sock is None and self._opening is None

    def detach(self) -> socket.socket | None:
        """The socket itself, for another process to serve (None once streams were made)."""
        sock, self._sock = self._sock, None
        return sock


def _abort_when_open(opening: asyncio.Future) -> None:
    """A SocketPort closed while its streams were being made: end them once they are."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result()[1].transport.abort()


async def read_line(sock: socket.socket, limit: int = 2048) -> bytes | None:
    """One line from a non-blocking socket, newline included, without taking a byte past it;
    None if the peer closed first. Raises ValueError past `limit` bytes without a newline."""
    loop = asyncio.get_running_loop()
    seen = -1
    while True:
        try:
            data = sock.recv(limit, socket.MSG_PEEK)
        except BlockingIOError:
            await _readable(loop, sock)
            continue
        if not data:
            return None
        end = data.find(b"\n")
        if end >= 0:
            return sock.recv(end + 1)
        if len(data) >= limit:
            raise ValueError(f"no line in the first {limit} bytes")
        if len(data) == seen:
            await asyncio.sleep(0.01)  # a partial line: the rest has not come yet
        seen = len(data)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        loop.remove_reader(fd)

"""The worker's port tunnel: the control plane's ingress router reaches a sandbox's port through it.

A plain TCP listener beside the worker's HTTP API (same host, a port of its own, reported as
WorkerInfo.tunnel_port). A connection opens with one line,
`ATOLL-TUNNEL <protocol> <token> <sandbox_id> <port>\\n` (the token of the worker's current
registration); the worker answers `OK\\n` and relays bytes both ways with a connection into the
sandbox (Node.open_port, tracked by the egress gateway like the sandbox's other traffic), or
(hello `ATOLL-PTY <protocol> <token> <sandbox_id> <pty_id>`) with a terminal's frame stream
(Node.attach_pty, core.ptyframes), or
`ERR <code> <message>\\n` and closes (within HELLO_TIMEOUT_S; at most MAX_UNAUTHENTICATED
connections may wait to present a token at once). HTTP through uvicorn cannot hand over a raw socket, which is
why this is its own listener. Called by worker.main; its client is controlplane.remote_worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import typing

from atoll.core import errors
from atoll.core import worker_api as api

log = logging.getLogger(__name__)
HELLO = "ATOLL-TUNNEL"
HELLO_PTY = "ATOLL-PTY"
_READ = 256 * 1024
HELLO_TIMEOUT_S = 3.0
"""The first line must come this fast (the server sends it with the connect)."""
MAX_UNAUTHENTICATED = 64
"""Connections that have not presented a valid token yet, at once; past it new ones are closed
(a flood without the token must not use up the worker's descriptors)."""
MAX_OPEN = 4096
"""Relayed tunnel connections at once."""


class Tunnel:
    def __init__(self, node: typing.Any, token: typing.Callable[[], bytes | None]):
        self.node = node
        self.token = token
        self.server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._pending = 0

    async def start(self, host: str) -> int:
        self.server = await asyncio.start_server(self._accepted, host, 0, limit=_READ, backlog=1024)
        return self.server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= MAX_UNAUTHENTICATED or len(self._tasks) >= MAX_OPEN:
            writer.transport.abort()
            return
        t = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream: api.PortStream | None = None
        self._pending += 1
        authenticated = False
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            except (TimeoutError, ValueError):
                return
            parts = line.decode("ascii", "replace").split()
            token = self.token()
            if len(parts) != 5 or parts[0] not in (HELLO, HELLO_PTY):
                await _refuse(writer, "invalid_request", "not a tunnel request")
                return
            if parts[1] != str(api.PROTOCOL_VERSION):
                await _refuse(
                    writer, "incompatible_protocol", f"this worker speaks protocol {api.PROTOCOL_VERSION}"
                )
                return
            if token is None or not hmac.compare_digest(parts[2].encode(), token):
                await _refuse(writer, "unauthorized", "wrong or missing worker token")
                return
            authenticated = True
            self._pending -= 1
            if parts[0] == HELLO_PTY:
                try:
                    stream = await self.node.attach_pty(parts[3], parts[4])
                except errors.AtollError as e:
                    await _refuse(writer, e.code, e.message)
                    return
                writer.write(b"OK\n")
                await writer.drain()
                await _relay(reader, writer, stream)
                return
            if not parts[4].isdigit():
                await _refuse(writer, "invalid_request", f"port {parts[4]!r} is not a number")
                return
            try:
                stream = await self.node.open_port(parts[3], int(parts[4]))
            except ConnectionRefusedError as e:
                await _refuse(writer, "refused", str(e) or f"nothing listens on port {parts[4]}")
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                    await _refuse(
                        writer, "worker_unavailable", f"the worker is out of resources ({e.strerror})"
                    )
                else:
                    await _refuse(writer, "refused", f"port {parts[4]} did not answer ({e})")
                return
            except errors.AtollError as e:
                await _refuse(writer, e.code, e.message)
                return
            writer.write(b"OK\n")
            await writer.drain()
            await _relay(reader, writer, stream)
        except (OSError, ConnectionError):
            pass
        finally:
            if not authenticated:
                self._pending -= 1
            if stream is not None:
                stream.close()
            writer.transport.abort()


async def _refuse(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    writer.write(f"ERR {code} {message}".replace("\n", " ").encode()[:2000] + b"\n")
    with contextlib.suppress(OSError, ConnectionError):
        await writer.drain()


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: api.PortStream) -> None:
    async def inward() -> None:
        while True:
            data = await reader.read(_READ)
            if not data:
                return
            await stream.write(data)

    async def outward() -> None:
        while True:
            data = await stream.read(_READ)
            if not data:
                return
            writer.write(data)
            await writer.drain()

    tasks = [asyncio.ensure_future(inward()), asyncio.ensure_future(outward())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

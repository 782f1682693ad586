"""The worker's port tunnel: the ingress router reaches a sandbox's port through it.

A plain TCP listener beside the worker's HTTP API (same host, a port of its own, reported as
WorkerInfo.tunnel_port). A connection opens with one line,
`ATOLL-TUNNEL <protocol> <token> <sandbox_id> <port>\\n` (the token of the worker's current
registration); the worker has its egress gateway process connect into the sandbox's port and
relay the connection itself (Node.relay_port: the gateway answers `OK\\n` and moves the bytes in
the kernel; the worker's event loop never sees them), or (hello `ATOLL-PTY <protocol> <token>
<sandbox_id> <pty_id>`) answers `OK\\n` and relays a terminal's frame stream (Node.attach_pty,
guest.agent.ptyframes); anything wrong gets `ERR <code> <message>\\n` and the connection closes.
The edge (`atoll edge`) holds no token: its `ATOLL-PTY` hello carries `grant:<grant>` in the token's
place, a grant for that sandbox the server minted with this worker's current token (core.grants);
a grant opens terminals, and of the ports only those of core.grants.GRANT_PORTS (the code
interpreter service's, for the E2B edge) with an `ATOLL-TUNNEL` hello.

Strangers cost nothing until they speak: the listener uses TCP_DEFER_ACCEPT (a connection that
sends no byte is never accepted, the kernel drops it), the hello must be whole within
HELLO_TIMEOUT_S, and connections that have not presented a token are bounded per source address
and in all — past a bound the oldest waiting one is dropped, never the new one, so a flood of
silent or slow connections cannot keep the control plane's own (which send their hello with the
connect) from being served. Authenticated tunnels are never counted against strangers.
HTTP through uvicorn cannot hand over a raw socket, which is why this is its own listener.
Called by worker.main and atoll.up; its client is controlplane.remote_worker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hmac
import logging
import socket
import time
import typing

from atoll.core import errors, grants
from atoll.core import worker_api as api
from atoll.shared import portstream, relay

log = logging.getLogger(__name__)
HELLO = "ATOLL-TUNNEL"
HELLO_PTY = "ATOLL-PTY"
GRANT_PREFIX = "grant:"
"""An `ATOLL-PTY` hello's token field that is a grant (the edge's) rather than the tunnel token."""
_READ = 256 * 1024
MAX_HELLO = 2048
HELLO_TIMEOUT_S = 3.0
"""The first line must come this fast (the server sends it with the connect)."""
MAX_UNAUTHENTICATED = 512
"""Connections waiting to present a token, in all; past it the oldest waiting is dropped."""
MAX_UNAUTHENTICATED_PER_SOURCE = 64
"""The same, per source address."""
MAX_OPEN = 4096
"""Terminal tunnels relayed here at once (port tunnels are relayed by the gateway process)."""


class _Waiting:
    __slots__ = ("sock", "source", "since", "task")

    def __init__(self, sock: socket.socket, source: str):
        self.sock, self.source, self.since = sock, source, time.monotonic()
        self.task: asyncio.Task | None = None


class Tunnel:
    def __init__(
        self,
        node: typing.Any,
        token: typing.Callable[[], bytes | None],
        grant_key: typing.Callable[[], bytes | None] | None = None,
    ):
        self.node = node
        self.token = token
        self.grant_key = grant_key
        """The registration's token itself, which grants are checked with (None: no grants)."""
        self.sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._waiting: collections.OrderedDict[int, _Waiting] = collections.OrderedDict()
        self._per_source: collections.Counter[str] = collections.Counter()
        self.dropped = 0
        """Waiting connections dropped to make room (a flood shows here)."""

    async def start(self, host: str) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # a connection that sends nothing is not accepted at all (the kernel drops it later)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, int(HELLO_TIMEOUT_S))
        sock.bind((host, 0))
        sock.listen(1024)
        sock.setblocking(False)
        self.sock = sock
        self._accepting = asyncio.ensure_future(self._accept_loop())
        return sock.getsockname()[1]

    async def aclose(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(BaseException):
                await self._accepting
        if self.sock is not None:
            self.sock.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self.sock)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._drop_oldest(None)
                    await asyncio.sleep(0.05)
                continue
            conn.setblocking(False)
            source = addr[0] if isinstance(addr, tuple) else ""
            if self._per_source[source] >= MAX_UNAUTHENTICATED_PER_SOURCE:
                self._drop_oldest(source)
            if len(self._waiting) >= MAX_UNAUTHENTICATED:
                self._drop_oldest(None)
            w = _Waiting(conn, source)
            self._waiting[id(w)] = w
            self._per_source[source] += 1
            w.task = asyncio.ensure_future(self._serve(w))
            self._tasks.add(w.task)
            w.task.add_done_callback(self._tasks.discard)
            # sock_accept does not yield while the backlog holds more: let the connections
            # accepted so far read their hello (the control plane's is already there) before
            # a flood of strangers pushes them out, and let the worker's API run
            await asyncio.sleep(0)

    def _drop_oldest(self, source: str | None) -> None:
        for key, w in self._waiting.items():
            if source is None or w.source == source:
                self.dropped += 1
                if w.task is not None:
                    w.task.cancel()
                self._unwait(key)
                return

    def _unwait(self, key: int) -> None:
        w = self._waiting.pop(key, None)
        if w is not None:
            self._per_source[w.source] -= 1
            if self._per_source[w.source] <= 0:
                del self._per_source[w.source]

    async def _serve(self, w: _Waiting) -> None:
        sock = w.sock
        try:
            try:
                line = await asyncio.wait_for(portstream.read_line(sock, MAX_HELLO), HELLO_TIMEOUT_S)
            except (TimeoutError, ValueError, OSError):
                return
            if line is None:
                return
            parts = line.decode("ascii", "replace").split()
            token = self.token()
            if len(parts) != 5 or parts[0] not in (HELLO, HELLO_PTY):
                await _refuse(sock, "invalid_request", "not a tunnel request")
                return
            if parts[1] != str(api.PROTOCOL_VERSION):
                await _refuse(
                    sock, "incompatible_protocol", f"this worker speaks protocol {api.PROTOCOL_VERSION}"
                )
                return
            if parts[2].startswith(GRANT_PREFIX) and self.grant_key is not None:
                what = "pty" if parts[0] == HELLO_PTY else "ports"
                try:  # the edge's: one sandbox's terminals, or a port of GRANT_PORTS
                    grants.verify(
                        self.grant_key(),
                        parts[2][len(GRANT_PREFIX) :],
                        f"/sandboxes/{parts[3]}/{what}/{parts[4]}",
                        time.time(),
                    )
                except errors.AtollError as e:
                    await _refuse(sock, "unauthorized", e.message)
                    return
            elif token is None or not hmac.compare_digest(parts[2].encode(), token):
                await _refuse(sock, "unauthorized", "wrong or missing worker token")
                return
            self._unwait(id(w))  # authenticated: no longer a stranger that floods could push out
            if parts[0] == HELLO_PTY:
                await self._pty(sock, parts[3], parts[4])
            else:
                await self._port(sock, parts[3], parts[4])
        except (OSError, ConnectionError):
            pass
        finally:
            self._unwait(id(w))
            sock.close()

    async def _port(self, sock: socket.socket, sid: str, port: str) -> None:
        if not port.isdigit():
            await _refuse(sock, "invalid_request", f"port {port!r} is not a number")
            return
        try:
            await self.node.relay_port(sid, int(port), sock, b"OK\n")
        except ConnectionRefusedError as e:
            await _refuse(sock, "refused", e.strerror or str(e) or f"nothing listens on port {port}")
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN):
                await _refuse(
                    sock, "worker_unavailable", f"the worker is out of resources or busy ({e.strerror or e})"
                )
            else:
                await _refuse(sock, "refused", f"port {port} did not answer ({e.strerror or e})")
        except errors.AtollError as e:
            await _refuse(sock, e.code, e.message)

    async def _pty(self, sock: socket.socket, sid: str, pty_id: str) -> None:
        if len(self._tasks) > MAX_OPEN:
            await _refuse(sock, "worker_unavailable", "too many terminal tunnels are open; retry")
            return
        try:
            stream = await self.node.attach_pty(sid, pty_id)
        except errors.AtollError as e:
            await _refuse(sock, e.code, e.message)
            return
        reader, writer = await asyncio.open_connection(sock=sock.dup(), limit=_READ)
        try:
            writer.write(b"OK\n")
            await writer.drain()
            await _relay(reader, writer, stream)
        finally:
            stream.close()
            writer.transport.abort()


async def _refuse(sock: socket.socket, code: str, message: str) -> None:
    line = f"ERR {code} {message}".replace("\n", " ").encode()[:2000] + b"\n"
    with contextlib.suppress(OSError, ConnectionError, TimeoutError):
        await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(sock, line), 2)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: api.PortStream) -> None:
    async def write_out(data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    await relay.first_ends(
        relay.pump(reader.read, stream.write, _READ), relay.pump(stream.read, write_out, _READ)
    )

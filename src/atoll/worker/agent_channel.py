"""The worker's HTTP channel to one sandbox's guest agent, opened inside that sandbox's host-side netns.

Sockets are created on a dedicated thread that enters the host-side namespace with setns(2) and
leaves again (a socket keeps the namespace it was born in), then run on the event loop through an
httpcore connection pool, so requests are kept-alive and cost ~0.5 ms.

Every socket has SO_LINGER 0 and TCP_NODELAY: when the worker closes a connection it sends an RST,
so no TIME_WAIT endpoint ever lands inside the sandbox (this runsc cannot checkpoint one). Before a
disk checkpoint the worker calls `abort_all()`.
Called by worker.service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import socket
import struct
import typing

import anyio
import httpcore
import httpx
from httpcore._backends.anyio import AnyIOStream

from atoll.worker import netns

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_ns_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-netns")
_LINGER0 = struct.pack("ii", 1, 0)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _socket_in_netns(ns_path: str) -> socket.socket:
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(ns_path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


class _NetnsBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, ns_path: str, tracker: set[socket.socket]):
        self._ns_path = ns_path
        self._tracker = tracker

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(_ns_thread, _socket_in_netns, self._ns_path)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout or 5)
        except (OSError, TimeoutError) as e:
            sock.close()
            raise httpcore.ConnectError(f"connect to the guest agent failed: {e!r}") from e
        except BaseException:
            sock.close()
            raise
        self._tracker.add(sock)
        stream = await anyio.abc.SocketStream.from_socket(sock)
        return AnyIOStream(stream)

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):  # pragma: no cover
        raise NotImplementedError

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


class AgentChannel:
    """An httpx.AsyncClient bound to one sandbox's guest agent."""

    def __init__(self, ns_name: str, ip: str, port: int):
        self._sockets: set[socket.socket] = set()
        self._ns_path = netns.path(netns.host_side(ns_name))
        self._base_url = f"http://{ip}:{port}"
        self.client = self._make_client()

    def _make_client(self) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport()
        # httpx exposes no network-backend hook; swap in a pool that opens sockets in the netns.
        transport._pool = httpcore.AsyncConnectionPool(
            network_backend=_NetnsBackend(self._ns_path, self._sockets),
            max_connections=64,
            keepalive_expiry=None,
        )
        return httpx.AsyncClient(
            transport=transport, base_url=self._base_url, timeout=httpx.Timeout(30, read=None)
        )

    async def request(self, method: str, url: str, **kw: typing.Any) -> httpx.Response:
        return await self.client.request(method, url, **kw)

    def stream(self, method: str, url: str, **kw: typing.Any):
        return self.client.stream(method, url, **kw)

    async def abort_all(self) -> None:
        """Reset every connection to the agent (RST, no TIME_WAIT inside the sandbox)."""
        old, self.client = self.client, self._make_client()
        await old.aclose()
        for s in list(self._sockets):
            try:
                s.close()
            except OSError:
                pass
        self._sockets.clear()

    async def aclose(self) -> None:
        await self.client.aclose()
        for s in list(self._sockets):
            try:
                s.close()
            except OSError:
                pass
        self._sockets.clear()

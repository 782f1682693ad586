"""A connection into a sandbox's port over a plain asyncio stream pair (core.worker_api.PortStream).

Used where nothing more than the stream is needed: the control plane's end of a worker's port
tunnel (controlplane.remote_worker) and atoll.testing.FakeWorker's loopback connections. The
worker's own connections into a sandbox are gateway.egress.Inbound (tracked as activity). Imports
no process package.
"""

from __future__ import annotations

import asyncio


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

"""worker.tunnel: the port tunnel's handshake, its bounds and its relay, over a FakeWorker (loopback only)."""

from __future__ import annotations

import asyncio

from atoll.core import worker_api as api
from atoll.testing import FakeWorker
from atoll.worker import tunnel as tunnel_mod


async def _echo_server():
    async def handle(r, w):
        while data := await r.read(1000):
            w.write(data.upper())
            await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _hello(port: int, line: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(line.encode())
    return r, w, await asyncio.wait_for(r.readline(), 5)


async def test_the_tunnel_checks_its_caller_and_relays():
    fake = FakeWorker()
    spec = api.SandboxSpec(
        sandbox_id="sb-aaaaaaaaaaaaaaaa", template="base", memory_mb=512, cpus=1, disk_mb=0
    )
    await fake.create(spec)
    srv, echo_port = await _echo_server()
    fake.ports[(spec.sandbox_id, 8080)] = ("127.0.0.1", echo_port)
    t = tunnel_mod.Tunnel(fake, lambda: b"tok")
    port = await t.start("127.0.0.1")
    v = api.PROTOCOL_VERSION
    try:
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} wrong {spec.sandbox_id} 8080\n")
        assert line.startswith(b"ERR unauthorized")
        w.close()
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} tok {spec.sandbox_id} 9\n")
        assert line.startswith(b"ERR refused")
        w.close()
        _, w, line = await _hello(port, f"ATOLL-TUNNEL 1 tok {spec.sandbox_id} 8080\n")
        assert line.startswith(b"ERR incompatible_protocol")
        w.close()
        r, w, line = await _hello(port, f"ATOLL-TUNNEL {v} tok {spec.sandbox_id} 8080\n")
        assert line == b"OK\n"
        w.write(b"ping")
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"PING"
        w.close()
        # connections that never present a token are bounded and dropped after the hello deadline
        idle = [
            await asyncio.open_connection("127.0.0.1", port) for _ in range(tunnel_mod.MAX_UNAUTHENTICATED)
        ]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r.read(100), 5) == b""  # over the bound: closed at once
        w.close()
        for ir, _ in idle:
            assert await asyncio.wait_for(ir.read(100), tunnel_mod.HELLO_TIMEOUT_S + 3) == b""
        for _, iw in idle:
            iw.close()
        r, w, line = await _hello(port, f"ATOLL-TUNNEL {v} tok {spec.sandbox_id} 8080\n")
        assert line == b"OK\n"  # room again
        w.close()
    finally:
        await t.aclose()
        srv.close()
        await srv.wait_closed()

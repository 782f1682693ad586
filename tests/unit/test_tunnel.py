"""worker.tunnel: the port tunnel's handshake, its bounds against strangers, and its relay, over a
FakeWorker (loopback only). The real worker hands an authenticated connection to its gateway
process (Node.relay_port); here a stand-in relays it in process to an echo server."""

from __future__ import annotations

import asyncio
import socket
import time

from atoll.core import errors, grants
from atoll.core import worker_api as api
from atoll.testing import FakeWorker
from atoll.worker.service import tunnel as tunnel_mod

SID = "sb-aaaaaaaaaaaaaaaa"


class Node:
    """What the tunnel asks of a worker: relay_port (here: in process) and attach_pty."""

    def __init__(self, fake: FakeWorker):
        self.fake = fake
        self.tasks: set[asyncio.Task] = set()

    async def attach_pty(self, sid: str, pty_id: str):
        return await self.fake.attach_pty(sid, pty_id)

    async def relay_port(self, sid: str, port: int, client: socket.socket, greeting: bytes) -> None:
        address = self.fake.ports.get((sid, port))
        if address is None:
            raise ConnectionRefusedError(f"nothing listens on port {port}")
        if sid not in self.fake.runtimes:
            raise errors.SandboxNotFound(f"no sandbox {sid}")
        up_r, up_w = await asyncio.open_connection(*address)
        c_r, c_w = await asyncio.open_connection(sock=client.dup())
        c_w.write(greeting)

        async def pipe(r, w):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            w.close()

        for coro in (pipe(c_r, up_w), pipe(up_r, c_w)):
            t = asyncio.ensure_future(coro)
            self.tasks.add(t)


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


async def _started():
    fake = FakeWorker()
    await fake.create(api.SandboxSpec(sandbox_id=SID, template="base", memory_mb=512, cpus=1, disk_mb=0))
    srv, echo_port = await _echo_server()
    fake.ports[(SID, 8080)] = ("127.0.0.1", echo_port)
    node = Node(fake)
    t = tunnel_mod.Tunnel(node, lambda: b"tok")
    port = await t.start("127.0.0.1")
    return t, port, srv, node


async def _stop(t, srv, node) -> None:
    await t.aclose()
    for task in node.tasks:
        task.cancel()
    srv.close()
    await srv.wait_closed()


async def test_the_tunnel_checks_its_caller_and_relays():
    t, port, srv, node = await _started()
    v = api.PROTOCOL_VERSION
    try:
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} wrong {SID} 8080\n")
        assert line.startswith(b"ERR unauthorized")
        w.close()
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} tok {SID} 9\n")
        assert line.startswith(b"ERR refused")
        w.close()
        _, w, line = await _hello(port, f"ATOLL-TUNNEL 1 tok {SID} 8080\n")
        assert line.startswith(b"ERR incompatible_protocol")
        w.close()
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} tok {SID} http\n")
        assert line.startswith(b"ERR invalid_request")
        w.close()
        # the hello and the first bytes after it in one segment: those are the sandbox's
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"ATOLL-TUNNEL {v} tok {SID} 8080\nping".encode())
        assert await asyncio.wait_for(r.readline(), 5) == b"OK\n"
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"PING"
        w.close()
    finally:
        await _stop(t, srv, node)


async def test_strangers_cannot_keep_the_control_plane_out():
    """Silent connections are never accepted (TCP_DEFER_ACCEPT); connections that send a byte
    and stall are bounded per source, the oldest pushed out first; a real hello always gets in."""
    t, port, srv, node = await _started()
    v = api.PROTOCOL_VERSION
    silent = [
        socket.create_connection(("127.0.0.1", port)) for _ in range(tunnel_mod.MAX_UNAUTHENTICATED + 50)
    ]
    stalled = []
    try:
        for _ in range(tunnel_mod.MAX_UNAUTHENTICATED_PER_SOURCE + 20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"A")
            stalled.append(s)
        r, w, line = await _hello(port, f"ATOLL-TUNNEL {v} tok {SID} 8080\n")
        assert line == b"OK\n"
        w.close()
        for _ in range(100):
            if t.dropped >= 20:
                break
            await asyncio.sleep(0.02)
        assert t.dropped >= 20  # the oldest stalled ones made room, not the new ones
        assert len(t._waiting) <= tunnel_mod.MAX_UNAUTHENTICATED_PER_SOURCE
        # and the rest run out of time (silent ones the kernel hands over after the defer period
        # get their HELLO_TIMEOUT_S too)
        for _ in range(int((2 * tunnel_mod.HELLO_TIMEOUT_S + 4) / 0.1)):
            if not t._waiting:
                break
            await asyncio.sleep(0.1)
        assert not t._waiting
    finally:
        for s in silent + stalled:
            s.close()
        await _stop(t, srv, node)


async def test_a_refused_tunnel_token_is_a_retryable_503_and_lets_the_worker_go():
    """The worker registered again (a new token) since the server called it: its tunnel answers
    `ERR unauthorized`. The server's client gets 503 worker_unavailable (never a 401: its own key is
    fine), and the registry is told the token is refused, as for the HTTP API's 401."""
    import pytest

    from atoll.controlplane.remote_worker import RemoteWorker
    from atoll.core import wire

    t, port, srv, node = await _started()
    t.token = lambda: wire.tunnel_token("the-new-token").encode()
    refused: list[str] = []
    rw = RemoteWorker(
        "http://127.0.0.1:1", "the-old-token", "w1", tunnel_port=port, on_refused=refused.append
    )
    try:
        with pytest.raises(errors.Unavailable) as e:
            await rw.open_port(SID, 8080)
        assert e.value.code == "worker_unavailable" and "no longer accepts" in e.value.message
        assert len(refused) == 1
    finally:
        await rw.aclose()
        await _stop(t, srv, node)


async def test_a_grant_opens_a_terminal_of_its_sandbox_and_nothing_else():
    """The edge's hello: `grant:<grant>` in the token's place opens that sandbox's terminals only."""
    fake = FakeWorker()
    await fake.create(api.SandboxSpec(sandbox_id=SID, template="base", memory_mb=512, cpus=1, disk_mb=0))
    pty = await fake.open_pty(SID, api.PtySpec(cols=80, rows=24, cmd=["/bin/cat"]))
    node = Node(fake)
    t = tunnel_mod.Tunnel(node, lambda: b"tok", grant_key=lambda: b"registration-token")
    port = await t.start("127.0.0.1")
    v = api.PROTOCOL_VERSION
    good, _ = grants.mint("registration-token", SID, time.time())
    other, _ = grants.mint("registration-token", "sb-bbbbbbbbbbbbbbbb", time.time())
    stale, _ = grants.mint("an-earlier-token", SID, time.time())
    try:
        _, w, line = await _hello(port, f"ATOLL-PTY {v} grant:{good} {SID} {pty.pty_id}\n")
        assert line == b"OK\n", line
        w.close()
        for grant, why in ((other, b"for sandbox sb-bbbb"), (stale, b"current token")):
            _, w, line = await _hello(port, f"ATOLL-PTY {v} grant:{grant} {SID} {pty.pty_id}\n")
            assert line.startswith(b"ERR unauthorized") and why in line, line
            w.close()
        # a grant opens no port but the code interpreter's (GRANT_PORTS; nothing listens there)
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} grant:{good} {SID} 8080\n")
        assert line.startswith(b"ERR unauthorized"), line
        w.close()
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} grant:{other} {SID} {grants.GRANT_PORTS[0]}\n")
        assert line.startswith(b"ERR unauthorized") and b"for sandbox sb-bbbb" in line, line
        w.close()
        _, w, line = await _hello(port, f"ATOLL-TUNNEL {v} grant:{good} {SID} {grants.GRANT_PORTS[0]}\n")
        assert not line.startswith(b"ERR unauthorized"), line
        w.close()
    finally:
        await t.aclose()
        fake.ptys.kill(SID, pty.pty_id)

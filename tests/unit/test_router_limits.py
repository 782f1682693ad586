"""The ingress router's connection limits, in process on loopback: per client, in all, and behind
a trusted reverse proxy (ATOLL_TRUSTED_PROXIES). A fake backend grants every request and connects
to a local HTTP server standing in for the sandbox's port."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl

import pytest

from atoll.core import pki
from atoll.ingress import router as router_mod
from atoll.ingress.router import _forwarded_client
from atoll.shared import tlsstream
from tests.unit.router_fakes import Backend

SID = "sb-" + "a" * 16


@pytest.fixture
async def setup(monkeypatch):
    monkeypatch.setattr(router_mod, "MAX_PER_PEER", 4)
    monkeypatch.setattr(router_mod, "MAX_CONNECTIONS", 8)
    root, key = pki.new_root_ca("router test")
    cert, leaf_key = pki.issue_server(root, key, ["localhost"], ip_addresses=["127.0.0.1"])
    server_ctx = tlsstream.server_context(cert + leaf_key)
    client_ctx = ssl.create_default_context(cadata=root.decode())

    async def web(reader, writer):
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    upstream = await asyncio.start_server(web, "127.0.0.1", 0)
    routers: list[router_mod.Router] = []
    opened: list[asyncio.StreamWriter] = []

    async def start(trusted=()):
        r = router_mod.Router(
            Backend(upstream.sockets[0].getsockname()[1]),
            server_ctx,
            "atoll.localhost",
            [ipaddress.ip_network(t) for t in trusted],
        )
        await r.start("127.0.0.1", 0)
        routers.append(r)
        return r, r.server.sockets[0].getsockname()[1]

    async def connect(port):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx, server_hostname="localhost"
        )
        opened.append(writer)
        return reader, writer

    yield start, connect
    for w in opened:
        w.transport.abort()
    for r in routers:
        await r.aclose()
    upstream.close()


async def ask(reader, writer, headers: str = "") -> bytes:
    writer.write(
        f"GET / HTTP/1.1\r\nHost: x\r\nAtoll-Sandbox-Id: {SID}\r\nAtoll-Sandbox-Port: 8080\r\n{headers}\r\n".encode()
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    await reader.readexactly(2)
    return head.split(b"\r\n")[0]


async def closed(reader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 2) == b""
    except (ConnectionError, ssl.SSLError):
        return True


async def test_a_client_over_its_limit_ends_its_own_oldest_idle_connection_not_the_new_one(setup):
    start, connect = setup
    router, port = await start()
    conns = [await connect(port) for _ in range(4)]
    for r, w in conns:
        assert await ask(r, w) == b"HTTP/1.1 200 OK"  # all four served, now idle
    r5, w5 = await connect(port)
    assert await ask(r5, w5) == b"HTTP/1.1 200 OK"
    assert await closed(conns[0][0]) and router.stats.evicted == 1
    assert await ask(*conns[1]) == b"HTTP/1.1 200 OK"  # the others go on


async def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_limit(setup):
    start, connect = setup
    router, port = await start(trusted=("127.0.0.1/32",))
    # one proxy address, two clients: 4 connections each is within both limits
    for client in ("203.0.113.7", "198.51.100.9"):
        for _ in range(4):
            r, w = await connect(port)
            assert await ask(r, w, f"X-Forwarded-For: {client}\r\n") == b"HTTP/1.1 200 OK"
    assert router.stats.evicted == 0
    # a fifth of the first client pushes out that client's oldest, not the other client's
    r, w = await connect(port)
    assert await ask(r, w, "X-Forwarded-For: 10.9.9.9, 203.0.113.7\r\n") == b"HTTP/1.1 200 OK"
    assert router.stats.evicted == 1


async def test_without_trust_a_forwarded_header_changes_nothing(setup):
    start, connect = setup
    router, port = await start()
    conns = []
    for i in range(5):
        r, w = await connect(port)
        assert await ask(r, w, f"X-Forwarded-For: 192.0.2.{i}\r\n") == b"HTTP/1.1 200 OK"
        conns.append((r, w))
    assert router.stats.evicted == 1  # all five counted against 127.0.0.1


def test_the_forwarded_client_is_the_rightmost_untrusted_address():
    trusted = {"10.0.0.1", "10.0.0.2"}.__contains__
    assert _forwarded_client([(b"X-Forwarded-For", b"1.2.3.4, 10.0.0.2")], trusted) == "1.2.3.4"
    assert _forwarded_client([(b"x-forwarded-for", b"6.6.6.6, 1.2.3.4")], trusted) == "1.2.3.4"
    # a client's own Forwarded, passed through by a proxy that appends to X-Forwarded-For, is ignored
    headers = [(b"X-Forwarded-For", b"203.0.113.9"), (b"Forwarded", b"for=198.51.100.7")]
    assert _forwarded_client(headers, trusted) == "203.0.113.9"
    assert _forwarded_client([(b"Forwarded", b"for=192.0.2.60:8080")], trusted) is None
    assert _forwarded_client([(b"X-Forwarded-For", b"unknown")], trusted) is None
    assert _forwarded_client([], trusted) is None

"""The ingress router's routes for the `e2b` SDKs' E2B_DOMAIN mode, in process on loopback: a fake
edge records what reaches E2B's port, a fake backend stands in for previews. `api.{domain}` goes to
the edge as a control call; `49983-{sid}` / `49999-{sid}` go there with the sandbox and port of the
host as `E2b-Sandbox-Id` / `E2b-Sandbox-Port`, whatever the client sent; other ports stay
previews; without E2B's API the hosts are what they were."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl

import pytest

from atoll.core import pki, preview
from atoll.ingress import router as router_mod
from atoll.shared import tlsstream
from tests.unit.router_fakes import Backend

SID = "sb-" + "a" * 16
OTHER = "sb-" + "b" * 16
DOMAIN = "atoll.localhost"


def _server(name: str, seen: list):
    """An HTTP/1.1 stand-in that answers each request with its own head as JSON."""

    async def web(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = [tuple(x.strip() for x in ln.split(":", 1)) for ln in lines[1:] if ln]
                length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
                body = await reader.readexactly(length) if length else b""
                got = {"who": name, "line": lines[0], "headers": headers, "body": body.decode()}
                seen.append(got)
                out = json.dumps(got).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(out) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return web


@pytest.fixture
async def setup():
    root, key = pki.new_root_ca("router e2b test")
    cert, leaf_key = pki.issue_server(root, key, [f"*.{DOMAIN}", "localhost"], ip_addresses=["127.0.0.1"])
    server_ctx = tlsstream.server_context(cert + leaf_key)
    client_ctx = ssl.create_default_context(cadata=root.decode())
    seen: list[dict] = []
    sandbox = await asyncio.start_server(_server("sandbox", seen), "127.0.0.1", 0)
    edge = await asyncio.start_server(_server("edge", seen), "127.0.0.1", 0)
    edge_port = edge.sockets[0].getsockname()[1]
    routers: list[router_mod.Router] = []
    opened: list[asyncio.StreamWriter] = []

    async def start(e2b: router_mod.E2BEdge | None = router_mod.E2BEdge("127.0.0.1", edge_port)):
        backend = Backend(sandbox.sockets[0].getsockname()[1])
        r = router_mod.Router(backend, server_ctx, DOMAIN, e2b=e2b)
        await r.start("127.0.0.1", 0)
        routers.append(r)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", r.server.sockets[0].getsockname()[1], ssl=client_ctx, server_hostname="localhost"
        )
        opened.append(writer)
        return backend, reader, writer

    yield start, seen, edge_port
    for w in opened:
        w.transport.abort()
    for r in routers:
        await r.aclose()
    sandbox.close()
    edge.close()


async def ask(reader, writer, host: str, headers: str = "", method: str = "GET", body: bytes = b""):
    head = f"{method} /health?x=1 HTTP/1.1\r\nHost: {host}\r\n{headers}"
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    writer.write((head + "\r\n").encode() + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = raw.decode("latin-1").split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
    content = await reader.readexactly(int(hdrs["content-length"]))
    return int(lines[0].split()[1]), hdrs, content


def _values(got: dict, name: str) -> list[str]:
    return [v for k, v in got["headers"] if k.lower() == name]


async def test_envd_hosts_reach_the_edge_with_the_hosts_sandbox_and_port_never_the_clients(setup):
    start, seen, _ = setup
    _, reader, writer = await start()
    forged = f"E2b-Sandbox-Id: {OTHER}\r\ne2b-sandbox-port: 8080\r\nAtoll-Sandbox-Id: {OTHER}\r\n"
    forged += "Atoll-Sandbox-Port: 8080\r\nX-Access-Token: tok\r\n"
    status, _, body = await ask(reader, writer, f"49983-{SID}.{DOMAIN}:8443", forged)
    got = json.loads(body)
    assert status == 200 and got["who"] == "edge" and got["line"] == "GET /health?x=1 HTTP/1.1", got
    assert _values(got, "e2b-sandbox-id") == [SID] and _values(got, "e2b-sandbox-port") == ["49983"], got
    assert _values(got, "atoll-sandbox-id") == [] and _values(got, "x-access-token") == ["tok"], got
    assert _values(got, "x-forwarded-proto") == ["https"]
    # the same kept client connection: the interpreter's port, a POST with a body
    status, _, body = await ask(
        reader,
        writer,
        f"49999-{SID}.{DOMAIN}",
        "X-Access-Token: tok\r\n",
        method="POST",
        body=b'{"code":"1"}',
    )
    got = json.loads(body)
    assert status == 200 and got["who"] == "edge" and got["body"] == '{"code":"1"}', got
    assert _values(got, "e2b-sandbox-id") == [SID] and _values(got, "e2b-sandbox-port") == ["49999"], got


async def test_the_api_host_is_a_control_call_without_sandbox_headers(setup):
    start, seen, _ = setup
    backend, reader, writer = await start()
    status, _, body = await ask(
        reader, writer, f"api.{DOMAIN}:8443", f"X-API-KEY: k\r\nE2b-Sandbox-Id: {SID}\r\n"
    )
    got = json.loads(body)
    assert status == 200 and got["who"] == "edge", got
    assert _values(got, "e2b-sandbox-id") == [] and _values(got, "x-api-key") == ["k"], got
    assert backend.targets == []  # no preview was asked for


async def test_other_ports_stay_previews(setup):
    start, seen, _ = setup
    backend, reader, writer = await start()
    status, _, body = await ask(reader, writer, f"8080-{SID}.{DOMAIN}", f"E2b-Sandbox-Id: {OTHER}\r\n")
    got = json.loads(body)
    assert status == 200 and got["who"] == "sandbox", got
    assert backend.targets == [preview.Target(SID, 8080)]
    # the guest agent's port is no preview, with E2B's API or without
    status, _, body = await ask(reader, writer, f"49998-{SID}.{DOMAIN}")
    assert status == 200 and json.loads(body)["who"] == "sandbox"


async def test_refusals_on_e2b_hosts_are_e2b_json(setup):
    start, seen, edge_port = setup
    _, reader, writer = await start()
    status, hdrs, body = await ask(reader, writer, f"49983-nope.{DOMAIN}")
    assert status == 400 and hdrs["content-type"] == "application/json"
    assert json.loads(body)["code"] == 400 and "not a sandbox id" in json.loads(body)["message"]
    # refused before the host is routed (a header twice, Content-Length with Transfer-Encoding):
    # E2B's JSON on E2B's hosts, the plain page on a preview's
    for host in (f"api.{DOMAIN}", f"49983-{SID}.{DOMAIN}", f"49999-nope.{DOMAIN}", f"8080-{SID}.{DOMAIN}"):
        _, r3, w3 = await start()
        status, hdrs, body = await ask(r3, w3, host, "Atoll-Access-Token: a\r\nAtoll-Access-Token: b\r\n")
        assert status == 400 and "given more than once" in body.decode(), (host, body)
        if host.startswith("8080-"):
            assert hdrs["content-type"].startswith("text/plain"), body
        else:
            assert hdrs["content-type"] == "application/json", (host, body)
            assert json.loads(body)["code"] == 400, body
    _, r4, w4 = await start()
    status, hdrs, body = await ask(
        r4, w4, f"api.{DOMAIN}", "Transfer-Encoding: chunked\r\n", method="POST", body=b"2\r\n{}\r\n0\r\n\r\n"
    )
    assert status == 400 and hdrs["content-type"] == "application/json", body
    assert "Content-Length and Transfer-Encoding" in json.loads(body)["message"]
    # the edge not listening: 502 in E2B's shape (the SDKs parse it), the connection goes on
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    dead = free.getsockname()[1]
    free.close()
    _, reader2, writer2 = await start(router_mod.E2BEdge("127.0.0.1", dead))
    status, hdrs, body = await ask(reader2, writer2, f"api.{DOMAIN}")
    assert status == 502 and json.loads(body)["code"] == 502 and "E2B API" in json.loads(body)["message"]
    assert seen == []


async def test_the_interpreters_host_needs_the_access_token(setup):
    """The edge takes 2.11.5's token-less `/contexts` by sandbox id on its loopback port; from the
    router, which anyone who has seen a sandbox id can reach, the token is required: refused here,
    in E2B's shape, and the edge never asked (it would wake a paused sandbox and start a process)."""
    start, seen, _ = setup
    _, reader, writer = await start()
    for headers in ("", "X-Access-Token: \r\n"):
        status, hdrs, body = await ask(reader, writer, f"49999-{SID}.{DOMAIN}", headers)
        assert status == 401 and hdrs["content-type"] == "application/json", body
        assert "X-Access-Token" in json.loads(body)["message"]
    assert seen == []
    status, _, body = await ask(reader, writer, f"49999-{SID}.{DOMAIN}", "X-Access-Token: tok\r\n")
    assert status == 200 and json.loads(body)["who"] == "edge"


async def test_without_e2bs_api_the_hosts_are_what_they_were(setup):
    start, seen, _ = setup
    backend, reader, writer = await start(e2b=None)
    status, _, body = await ask(reader, writer, f"49983-{SID}.{DOMAIN}")
    assert status == 200 and json.loads(body)["who"] == "sandbox"  # a preview of port 49983
    status, _, body = await ask(reader, writer, f"api.{DOMAIN}")
    assert status == 400 and b"is not {port}-{sandbox_id}" in body
    status, _, body = await ask(reader, writer, f"49999-{SID}.{DOMAIN}")
    assert status == 400 and b"guest agent" in body


def test_e2b_target_parses_only_e2bs_hosts():
    assert preview.e2b_target(f"api.{DOMAIN}:443", DOMAIN) == preview.E2BTarget()
    assert preview.e2b_target(f"49983-{SID}.{DOMAIN}.", DOMAIN) == preview.E2BTarget(SID, 49983)
    assert preview.e2b_target(f"49999-{SID}.ATOLL.localhost", DOMAIN) == preview.E2BTarget(SID, 49999)
    for host in (f"8080-{SID}.{DOMAIN}", f"api.x.{DOMAIN}", "api.example.com", f"[::1]:{DOMAIN}", DOMAIN):
        assert preview.e2b_target(host, DOMAIN) is None, host
    with pytest.raises(preview.BadTarget):
        preview.e2b_target(f"49983-sb-x.y.{DOMAIN}", DOMAIN)


def test_the_edges_domain_setting():
    """ATOLL_E2B_DOMAIN as the E2B edge reads it (the server hands it the settled value, or `off`)."""
    from atoll.edge import service

    def domain(raw: str | None):
        env = {} if raw is None else {"ATOLL_E2B_DOMAIN": raw}
        return service.e2b_settings("http://127.0.0.1:9", None, env).domain

    assert domain(None) is None and domain("off") is None and domain("") is None
    assert domain("atoll.localhost:7081") == "atoll.localhost:7081"
    with pytest.raises(SystemExit, match="ATOLL_E2B_DOMAIN"):
        domain("https://atoll.localhost")

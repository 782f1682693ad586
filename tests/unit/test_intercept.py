"""Secret substitution in the egress gateway (gateway.intercept, shared.tlsstream, core.pki), on
loopback only: a real HTTPS upstream for `api.test`, an interceptor that reads the ClientHello and
then calls `intercept_tls`, and a client that trusts only the installation's root CA."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
from collections.abc import Awaitable, Callable

import h11
import pytest
from cryptography import x509
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID

from atoll.core import pki
from atoll.gateway import httprelay, intercept, placeholders, sniff
from atoll.shared import tlsstream

PH_KEY = "atoll_ph_" + "3f9a" * 8
PH_WILD = "atoll_ph_" + "b" * 32
PH_OTHER = "atoll_ph_" + "c" * 32
BINDINGS = (
    placeholders.Binding(PH_KEY, "sk-live-REAL-KEY", ("api.test",)),
    placeholders.Binding(PH_WILD, "wild-value", ("*.test",)),
    placeholders.Binding(PH_OTHER, "other-value", ("other.example",)),
)
TIMEOUT = 5.0


# ---- certificates -------------------------------------------------------------------------------
class CA:
    def __init__(self):
        self.root, self.root_key = pki.new_root_ca("atoll test root")
        self.inter, self.inter_key = pki.issue_intermediate(
            self.root, self.root_key, "atoll test intermediate"
        )
        self.leafs = intercept.LeafContexts(self.inter, self.inter_key)
        # the real upstream's own CA (what "the internet" uses), and a CA nobody trusts
        self.up_root, self.up_key = pki.new_root_ca("upstream root")
        self.rogue_root, self.rogue_key = pki.new_root_ca("rogue root")


@pytest.fixture(scope="module")
def ca() -> CA:
    return CA()


@pytest.fixture(scope="module")
def upstream_ctx(ca, tmp_path_factory) -> ssl.SSLContext:
    path = tmp_path_factory.mktemp("ca") / "upstream-root.pem"
    path.write_bytes(ca.up_root)
    return intercept.upstream_context(str(path))


def server_ctx(ca_cert: bytes, ca_key: bytes, names: list[str], tmp_path, ips=()) -> ssl.SSLContext:
    cert, key = pki.issue_server(ca_cert, ca_key, names, ip_addresses=list(ips))
    (tmp_path / "srv.pem").write_bytes(cert + key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "srv.pem")
    return ctx


def client_ctx(ca: CA, alpn=("http/1.1",)) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca.root.decode())  # trusts only the installation's root
    ctx.set_alpn_protocols(list(alpn))
    return ctx


# ---- servers the tests start (all closed by the `net` fixture) ------------------------------------
class Net:
    def __init__(self):
        self.servers: list[asyncio.AbstractServer] = []
        self.tasks: set[asyncio.Task] = set()
        self.errors: list[BaseException] = []
        self.touched = 0

    async def serve(self, handler, ssl_ctx=None, strict=False) -> int:
        """Start a loopback server; `strict`: any exception of the handler fails the test."""

        async def wrapped(reader, writer):
            task = asyncio.current_task()
            self.tasks.add(task)
            try:
                await handler(reader, writer)
            except (OSError, ssl.SSLError, h11.ProtocolError, asyncio.IncompleteReadError) as e:
                if strict:
                    self.errors.append(e)
            except Exception as e:  # noqa: BLE001 - recorded, asserted at teardown
                self.errors.append(e)
            finally:
                writer.transport.abort()
                self.tasks.discard(task)

        server = await asyncio.start_server(wrapped, "127.0.0.1", 0, ssl=ssl_ctx)
        self.servers.append(server)
        return server.sockets[0].getsockname()[1]

    def touch(self) -> None:
        self.touched += 1

    async def aclose(self) -> None:
        for s in self.servers:
            s.close()
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=TIMEOUT)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for s in self.servers:
            await s.wait_closed()


@pytest.fixture
async def net():
    n = Net()
    try:
        yield n
    finally:
        await n.aclose()
    assert not n.errors, n.errors


class Upstream:
    """An HTTP/1.1 server (h11) that records what it receives. Paths: /stream (a response in
    pieces, one per token put in `proceed`), /upgrade (101, then uppercases raw bytes back),
    /close (closes without answering); anything else answers 200 with the request body echoed."""

    def __init__(self):
        self.seen: list[dict] = []
        self.connections = 0
        self.proceed: asyncio.Queue[None] = asyncio.Queue()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn_no = self.connections
        conn = h11.Connection(h11.SERVER)

        async def next_event():
            while True:
                event = conn.next_event()
                if event is not h11.NEED_DATA:
                    return event
                conn.receive_data(await reader.read(65536))

        async def send(*events):
            writer.write(b"".join(conn.send(e) for e in events))
            await writer.drain()

        while True:
            request = await next_event()
            if not isinstance(request, h11.Request):
                return
            record = {
                "conn": conn_no,
                "target": request.target.decode(),
                "raw_headers": [(n.decode(), v.decode()) for n, v in request.headers.raw_items()],
                "headers": {n.decode(): v.decode() for n, v in request.headers},
            }
            self.seen.append(record)
            path = record["target"].split("?")[0]
            if path == "/close":
                return
            if record["headers"].get("expect") == "100-continue":
                await send(h11.InformationalResponse(status_code=100, headers=[]))
            body = b""
            while not isinstance(event := await next_event(), h11.EndOfMessage):
                body += event.data
            record["body"] = body
            if path == "/upgrade":
                await self._upgraded(conn, reader, writer, record)
                return
            if path == "/stream":
                await send(h11.Response(status_code=200, headers=[("content-type", "text/plain")]))
                for i in range(3):
                    await send(h11.Data(data=b"piece%d;" % i))
                    await self.proceed.get()
                await send(h11.EndOfMessage())
            else:
                answer = b"ok:" + body
                await send(
                    h11.Response(status_code=200, headers=[("Content-Length", str(len(answer)))]),
                    h11.Data(data=answer),
                    h11.EndOfMessage(),
                )
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _upgraded(self, conn, reader, writer, record) -> None:
        head = conn.send(
            h11.InformationalResponse(
                status_code=101, headers=[("Upgrade", "echo"), ("Connection", "Upgrade")]
            )
        )
        writer.write(head + b"hello;")  # raw bytes right behind the 101, in the same segment
        data, closed = conn.trailing_data
        record["raw"] = b""
        while True:
            record["raw"] += data
            if data:
                writer.write(data.upper())
                await writer.drain()
            if closed:
                return
            data = await reader.read(65536)
            closed = not data
            if closed:  # the client's end, passed on: answer what came, then end cleanly
                writer.write(b"bye;")
                writer.close()
                await writer.wait_closed()
                return


# ---- the interceptor ------------------------------------------------------------------------------
def fixed(name: str):
    """The secrets decision of a connection for `name` whose address is the name's own (the
    address rule itself is tested in test_placeholders.py)."""

    async def decision() -> placeholders.Decision:
        return placeholders.Decision(placeholders.bindings_for(name, BINDINGS))

    return decision


async def start_tls_gateway(net: Net, ca: CA, up_port: int, upstream_ctx: ssl.SSLContext) -> int:
    """An interceptor the way egress.py will use it: read the ClientHello, then intercept_tls."""

    async def handle(reader, writer):
        head = b""
        while not (sniff.looks_tls(head) and sniff.tls_record_complete(head)):
            chunk = await reader.read(65536)
            if not chunk:
                return
            head += chunk
        assert sniff.client_hello_sni(head) == "api.test"
        await intercept.intercept_tls(
            reader,
            writer,
            head,
            "api.test",
            "127.0.0.1",
            up_port,
            leaf_ctx=ca.leafs.context_for("api.test"),
            upstream_ctx=upstream_ctx,
            local_addr=None,
            secrets=fixed("api.test"),
            touch=net.touch,
        )

    return await net.serve(handle, strict=True)


async def start_plain_gateway(net: Net, up_port: int) -> int:
    async def handle(reader, writer):
        head = await reader.read(65536)
        up_r, up_w = await asyncio.open_connection("127.0.0.1", up_port)
        try:
            await httprelay.relay(
                tlsstream.PlainStream(reader, writer, initial=head),
                tlsstream.PlainStream(up_r, up_w),
                fixed("api.test"),
                net.touch,
            )
        finally:
            up_w.transport.abort()

    return await net.serve(handle, strict=True)


@pytest.fixture
async def https(net, ca, upstream_ctx, tmp_path):
    """(upstream, connect): a real HTTPS upstream for api.test behind an intercepting gateway."""
    upstream = Upstream()
    up_port = await net.serve(upstream.handle, server_ctx(ca.up_root, ca.up_key, ["api.test"], tmp_path))
    port = await start_tls_gateway(net, ca, up_port, upstream_ctx)
    clients = []

    async def connect(alpn=("http/1.1",)) -> Client:
        r, w = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx(ca, alpn), server_hostname="api.test"
        )
        clients.append(w)
        return Client(r, w)

    yield upstream, connect
    for w in clients:
        w.transport.abort()


@pytest.fixture
async def plain(net):
    upstream = Upstream()
    up_port = await net.serve(upstream.handle)
    port = await start_plain_gateway(net, up_port)
    clients = []

    async def connect() -> Client:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        clients.append(w)
        return Client(r, w)

    yield upstream, connect
    for w in clients:
        w.transport.abort()


class Client:
    """The sandbox's side: h11 as a client, or raw bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self, *events) -> None:
        self.writer.write(b"".join(self.conn.send(e) for e in events))
        await self.writer.drain()

    async def event(self):
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await asyncio.wait_for(self.reader.read(65536), TIMEOUT))

    async def response(self) -> tuple[h11.Response, bytes]:
        while not isinstance(response := await self.event(), h11.Response):
            assert isinstance(response, h11.InformationalResponse)
        body = b""
        while not isinstance(event := await self.event(), h11.EndOfMessage):
            body += event.data
        return response, body

    async def get(self, target: str, headers=()) -> tuple[h11.Response, bytes]:
        await self.send(h11.Request(method="GET", target=target, headers=[("Host", "api.test"), *headers]))
        await self.send(h11.EndOfMessage())
        response = await self.response()
        self.conn.start_next_cycle()
        return response

    async def raw_answer(self, data: bytes) -> tuple[int, bytes]:
        """Send raw bytes, read to the end: (status, body)."""
        self.writer.write(data)
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        received = b""
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while chunk := await asyncio.wait_for(self.reader.read(65536), TIMEOUT):
                received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), body


async def eventually(check: Callable[[], bool | Awaitable[bool]]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 5 s")


# ---- pure helpers ---------------------------------------------------------------------------------
def test_host_matching_and_bindings_for_a_name():
    assert placeholders.host_matches("api.example.com", "API.example.com.")
    assert not placeholders.host_matches("api.example.com", "example.com")
    assert placeholders.host_matches("*.example.com", "a.b.example.com")
    assert not placeholders.host_matches("*.example.com", "example.com")
    assert not placeholders.host_matches("*.example.com", "badexample.com")
    assert placeholders.bindings_for("api.test", BINDINGS) == BINDINGS[:2]
    assert placeholders.bindings_for("x.test", BINDINGS) == BINDINGS[1:2]
    assert placeholders.bindings_for("other.example", BINDINGS) == BINDINGS[2:]
    assert placeholders.bindings_for("test", BINDINGS) == ()


def test_substitute_replaces_only_the_given_placeholders_once():
    data = f"a={PH_KEY}&b={PH_OTHER}&c={PH_KEY}".encode()
    assert (
        placeholders.substitute(data, BINDINGS[:1])
        == f"a=sk-live-REAL-KEY&b={PH_OTHER}&c=sk-live-REAL-KEY".encode()
    )
    tricky = placeholders.Binding("atoll_ph_x", "atoll_ph_y", ("a",))
    other = placeholders.Binding("atoll_ph_y", "never", ("a",))
    assert placeholders.substitute(b"atoll_ph_x", (tricky, other)) == b"atoll_ph_y"
    assert placeholders.substitute(b"nothing here", BINDINGS) == b"nothing here"
    assert "sk-live" not in repr(BINDINGS[0])  # a binding in a log line does not show its value


# ---- certificates -------------------------------------------------------------------------------
def test_root_intermediate_and_leaf_form_a_valid_chain(ca):
    root = x509.load_pem_x509_certificate(ca.root)
    inter = x509.load_pem_x509_certificate(ca.inter)
    cert_pem, _ = pki.issue_server(
        ca.inter, ca.inter_key, ["api.test", "*.atoll.localhost"], ip_addresses=["127.0.0.1"]
    )
    leaf = x509.load_pem_x509_certificate(cert_pem)
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 1
    assert inter.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 0
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["api.test", "*.atoll.localhost"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    now = datetime.datetime.now(datetime.UTC)
    assert leaf.not_valid_before_utc <= now - datetime.timedelta(minutes=59)
    assert (
        leaf.serial_number
        != x509.load_pem_x509_certificate(
            pki.issue_server(ca.inter, ca.inter_key, ["api.test"])[0]
        ).serial_number
    )
    assert len(pki.fingerprint(cert_pem)) == 64 and pki.fingerprint(cert_pem) != pki.fingerprint(ca.root)
    # RFC 5280 path validation (cryptography's verifier is strict about extensions)
    store = verification.Store([root])
    for name in ("api.test", "x.atoll.localhost"):
        verifier = verification.PolicyBuilder().store(store).build_server_verifier(x509.DNSName(name))
        verifier.verify(leaf, [inter])
    with pytest.raises(verification.VerificationError):
        verification.PolicyBuilder().store(store).build_server_verifier(
            x509.DNSName("atoll.localhost")
        ).verify(leaf, [inter])


def _memory_handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str) -> ssl.SSLObject:
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    s = server.wrap_bio(s_in, s_out, server_side=True)
    c = client.wrap_bio(c_in, c_out, server_hostname=hostname)
    for _ in range(10):
        done = 0
        for obj in (c, s):
            try:
                obj.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == 2:
            return c
    raise AssertionError("no handshake")


def test_leaf_contexts_present_a_chain_that_ssl_verifies(ca):
    c = _memory_handshake(ca.leafs.context_for("API.test"), client_ctx(ca), "api.test")
    assert c.selected_alpn_protocol() == "http/1.1"
    assert ("DNS", "api.test") in c.getpeercert()["subjectAltName"]
    wild = intercept.LeafContexts(ca.inter, ca.inter_key, chain_pem=ca.inter + ca.root)
    _memory_handshake(wild.context_for("x.atoll.localhost"), client_ctx(ca), "x.atoll.localhost")
    _memory_handshake(wild.context_for("127.0.0.1"), client_ctx(ca), "127.0.0.1")
    with pytest.raises(ssl.SSLCertVerificationError):
        _memory_handshake(ca.leafs.context_for("api.test"), client_ctx(ca), "other.test")


def test_leaf_contexts_are_cached_least_recently_used(ca):
    leafs = intercept.LeafContexts(ca.inter, ca.inter_key, max_cached=2)
    a = leafs.context_for("a.test")
    assert leafs.context_for("a.test") is a
    b = leafs.context_for("b.test")
    leafs.context_for("a.test")
    leafs.context_for("c.test")  # drops b, the least recently used
    assert leafs.context_for("a.test") is a
    assert leafs.context_for("b.test") is not b


# ---- HTTPS interception ---------------------------------------------------------------------------
async def test_placeholders_in_headers_and_query_reach_upstream_as_values(https, net):
    upstream, connect = https
    client = await connect(alpn=("h2", "http/1.1"))
    assert client.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
    headers = [("Authorization", f"Bearer {PH_KEY}"), ("X-Other", PH_OTHER), ("X-Wild", f"w={PH_WILD}")]
    response, body = await client.get(f"/v1/echo?key={PH_KEY}&other={PH_OTHER}", headers)
    assert response.status_code == 200 and body == b"ok:"
    seen = upstream.seen[0]
    assert seen["target"] == f"/v1/echo?key=sk-live-REAL-KEY&other={PH_OTHER}"
    assert seen["raw_headers"] == [
        ("Host", "api.test"),
        ("Authorization", "Bearer sk-live-REAL-KEY"),
        ("X-Other", PH_OTHER),  # its binding is for another host: untouched
        ("X-Wild", "w=wild-value"),
    ]
    assert net.touched > 0


async def test_keep_alive_substitutes_every_request_on_one_connection(https):
    upstream, connect = https
    client = await connect()
    for i in range(2):
        response, _ = await client.get(f"/n{i}", [("X-Api-Key", PH_KEY)])
        assert response.status_code == 200
    assert [s["headers"]["x-api-key"] for s in upstream.seen] == ["sk-live-REAL-KEY"] * 2
    assert [s["conn"] for s in upstream.seen] == [1, 1]


async def test_a_chunked_request_body_passes_unchanged(https):
    upstream, connect = https
    client = await connect()
    request = h11.Request(
        method="POST",
        target="/upload",
        headers=[("Host", "api.test"), ("Transfer-Encoding", "chunked"), ("X-Api-Key", PH_KEY)],
    )
    parts = [b"abc", PH_KEY.encode(), b"x" * 100_000]
    await client.send(request, *(h11.Data(data=p) for p in parts), h11.EndOfMessage())
    response, body = await client.response()
    assert response.status_code == 200
    assert upstream.seen[0]["headers"]["transfer-encoding"] == "chunked"
    assert upstream.seen[0]["body"] == b"".join(parts)  # a placeholder in a body stays as it is
    assert upstream.seen[0]["headers"]["x-api-key"] == "sk-live-REAL-KEY"


async def test_a_streamed_response_arrives_piece_by_piece(https):
    upstream, connect = https
    client = await connect()
    await client.send(h11.Request(method="GET", target="/stream", headers=[("Host", "api.test")]))
    await client.send(h11.EndOfMessage())
    assert isinstance(await client.event(), h11.Response)
    for i in range(3):
        # the upstream sends the next piece only once this one arrived: a buffering relay hangs
        event = await client.event()
        assert isinstance(event, h11.Data) and event.data == b"piece%d;" % i
        upstream.proceed.put_nowait(None)
    assert isinstance(await client.event(), h11.EndOfMessage)


async def test_expect_100_continue_is_relayed_before_the_body(plain):
    upstream, connect = plain
    client = await connect()
    await client.send(
        h11.Request(
            method="PUT",
            target=f"/put?k={PH_KEY}",
            headers=[("Host", "api.test"), ("Expect", "100-continue"), ("Content-Length", "4")],
        )
    )
    informational = await client.event()  # the client waits for it before it sends the body
    assert isinstance(informational, h11.InformationalResponse) and informational.status_code == 100
    await client.send(h11.Data(data=b"data"), h11.EndOfMessage())
    response, body = await client.response()
    assert (response.status_code, body) == (200, b"ok:data")
    assert upstream.seen[0]["target"] == "/put?k=sk-live-REAL-KEY"


async def test_an_upgrade_switches_to_raw_bytes_both_ways(https):
    upstream, connect = https
    client = await connect()
    client.writer.write(
        b"GET /upgrade HTTP/1.1\r\nHost: api.test\r\nUpgrade: echo\r\nConnection: Upgrade\r\n"
        + f"X-Api-Key: {PH_KEY}\r\n\r\nearly;".encode()  # bytes right behind the request, too
    )
    head = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    assert head.startswith(b"HTTP/1.1 101 ")
    assert await asyncio.wait_for(client.reader.readexactly(len(b"hello;EARLY;")), TIMEOUT) == b"hello;EARLY;"
    client.writer.write(b"ping " + PH_KEY.encode())
    echoed = await asyncio.wait_for(client.reader.readexactly(5 + len(PH_KEY)), TIMEOUT)
    assert echoed == b"PING " + PH_KEY.upper().encode()  # raw bytes: no substitution after the switch
    assert upstream.seen[0]["headers"]["x-api-key"] == "sk-live-REAL-KEY"


async def test_after_an_upgrade_each_sides_end_is_passed_on(plain):
    upstream, connect = plain
    client = await connect()
    client.writer.write(
        b"GET /upgrade HTTP/1.1\r\nHost: api.test\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n"
    )
    client.writer.write(b"ping;")
    client.writer.write_eof()  # half-closed: the upstream sees the end, and its answer still comes
    received = await asyncio.wait_for(client.reader.read(), TIMEOUT)
    assert received.startswith(b"HTTP/1.1 101 ")
    assert received.endswith(b"\r\n\r\nhello;PING;bye;")
    assert upstream.seen[0]["raw"] == b"ping;"


async def test_after_an_upgrade_a_close_notify_ends_both_sides(net, ca, upstream_ctx, tmp_path):
    upstream = Upstream()
    up_port = await net.serve(upstream.handle, server_ctx(ca.up_root, ca.up_key, ["api.test"], tmp_path))
    port = await start_tls_gateway(net, ca, up_port, upstream_ctx)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        # the client side as a TLSStream too, so it can half-close (close_notify) and read on
        client = tlsstream.TLSStream(r, w, client_ctx(ca), server_side=False, server_hostname="api.test")
        await client.handshake()
        await client.write(
            b"GET /upgrade HTTP/1.1\r\nHost: api.test\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n"
        )
        await client.write(b"ping;")
        await client.write_eof()
        received = b""
        while data := await asyncio.wait_for(client.read(), TIMEOUT):
            received += data
    finally:
        w.transport.abort()
    # an asyncio TLS server ends at once on close_notify (no half-close): so only the ends are sure
    assert received.startswith(b"HTTP/1.1 101 ")
    assert b"\r\n\r\nhello;" in received  # and the read above ended: the end came through
    assert upstream.seen[0]["raw"] == b"ping;"


async def test_a_broken_chunked_body_gets_400_and_ends(https):
    upstream, connect = https
    client = await connect()
    status, body = await client.raw_answer(
        b"POST /up HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnot a chunk\r\n"
    )
    assert status == 400 and body.startswith(b"atoll egress gateway:")
    await eventually(lambda: len(upstream.seen) == 1)


async def test_tlsstream_takes_bytes_already_read_and_ends_at_either_eof(net, ca, tmp_path):
    got: list[bytes] = []
    server = ca.leafs.context_for("api.test")

    async def handle(reader, writer):
        first = await reader.read(5)  # part of the ClientHello, read before the TLS object exists
        stream = tlsstream.TLSStream(reader, writer, server, server_side=True, initial=first)
        await stream.handshake()
        while data := await stream.read():
            got.append(data)
        got.append(b"<eof>")

    port = await net.serve(handle, strict=True)
    for clean in (True, False):
        got.clear()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        ctx = ssl.create_default_context(cadata=ca.root.decode())
        client = tlsstream.TLSStream(r, w, ctx, server_side=False, server_hostname="api.test")
        try:
            await client.handshake()
            await client.write(b"hello")
            if clean:
                await client.write_eof()  # close_notify
            else:
                w.write_eof()  # a TCP FIN without close_notify (ragged): an end too
            await eventually(lambda: got[-1:] == [b"<eof>"])
            assert b"".join(got) == b"hello<eof>"
        finally:
            client.abort()


async def test_an_oversized_request_head_gets_431(https):
    upstream, connect = https
    client = await connect()
    status, body = await client.raw_answer(
        b"GET / HTTP/1.1\r\nHost: api.test\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
    )
    assert status == 431 and body.startswith(b"atoll egress gateway:")
    assert upstream.seen == []


async def test_a_garbage_request_gets_400(https):
    upstream, connect = https
    client = await connect()
    status, body = await client.raw_answer(b"\x00\x01 not http at all\r\n\r\n")
    assert status == 400 and body.startswith(b"atoll egress gateway:")
    assert upstream.seen == []


async def test_an_upstream_certificate_from_another_ca_gets_502(net, ca, upstream_ctx, tmp_path):
    upstream = Upstream()
    rogue = server_ctx(ca.rogue_root, ca.rogue_key, ["api.test"], tmp_path)
    up_port = await net.serve(upstream.handle, rogue)
    port = await start_tls_gateway(net, ca, up_port, upstream_ctx)
    r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx(ca), server_hostname="api.test")
    try:
        status, body = await Client(r, w).raw_answer(b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
    finally:
        w.transport.abort()
    assert status == 502
    assert (
        b"the certificate of api.test (127.0.0.1:" in body
        and b"unable to get local issuer certificate" in body
    )
    assert upstream.seen == []


# ---- plain HTTP relay -----------------------------------------------------------------------------
async def test_plain_relay_substitutes_and_keeps_alive(plain, net):
    upstream, connect = plain
    client = await connect()
    for _ in range(2):
        response, _ = await client.get(f"/q?key={PH_KEY}", [("Authorization", f"Bearer {PH_KEY}")])
        assert response.status_code == 200
    assert [s["target"] for s in upstream.seen] == ["/q?key=sk-live-REAL-KEY"] * 2
    assert [s["headers"]["authorization"] for s in upstream.seen] == ["Bearer sk-live-REAL-KEY"] * 2
    assert [s["conn"] for s in upstream.seen] == [1, 1]
    assert net.touched > 0


async def test_plain_relay_ends_quietly_when_the_upstream_closes_mid_exchange(plain, net):
    upstream, connect = plain
    client = await connect()
    client.writer.write(b"GET /close HTTP/1.1\r\nHost: api.test\r\n\r\n")
    assert await asyncio.wait_for(client.reader.read(), TIMEOUT) == b""  # ended, no answer
    await eventually(lambda: not net.tasks)  # both the upstream and the relay returned


async def test_plain_relay_ends_when_the_client_closes(plain, net):
    _, connect = plain
    client = await connect()
    response, _ = await client.get("/a")
    assert response.status_code == 200
    client.writer.close()
    await eventually(lambda: not net.tasks)


async def test_a_request_for_another_host_on_an_intercepted_connection_is_refused(https):
    upstream, connect = https
    client = await connect()
    response, _ = await client.get("/first", [("X-Key", PH_KEY)])
    assert response.status_code == 200
    # the same connection (SNI api.test), another Host: never sent, never substituted
    status, body = await client.raw_answer(
        f"GET /second HTTP/1.1\r\nHost: evil.test\r\nX-Key: {PH_KEY}\r\n\r\n".encode()
    )
    assert status == 403 and b"opened for 'api.test'" in body and b"REAL" not in body
    assert [s["target"] for s in upstream.seen] == ["/first"]


async def test_content_length_and_transfer_encoding_together_are_refused(https):
    upstream, connect = https
    client = await connect()
    status, body = await client.raw_answer(
        b"POST /sm HTTP/1.1\r\nHost: api.test\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n"
    )
    assert status == 400 and b"Content-Length and Transfer-Encoding" in body
    assert upstream.seen == []

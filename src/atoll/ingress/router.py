"""The ingress router: preview URLs over TLS, routed to the port of a sandbox, waking it first.

Listens on ATOLL_INGRESS_PORT (TLS only; a certificate from the installation's CA unless the
operator supplies one; a ClientHello without SNI is accepted). Each request on a kept-alive
connection is routed on its own (core.preview: the `{port}-{sid}.{domain}` host name, or the
Atoll-Sandbox-Id / Atoll-Sandbox-Port headers), authorized (the port is public, or the request
carries the sandbox's token or a valid signed URL or cookie) and sent over a connection into the
sandbox that the backend opens — after resuming the sandbox if it is in standby; concurrent
requests share that one resume (controlplane.lifecycle). Connections into a sandbox are kept
between requests of the same client connection and reopened when the sandbox's side went away
(a disk checkpoint resets idle ones). Bodies stream both ways; a `101 Switching Protocols`
(WebSocket) turns the connection into a byte relay. Errors are plain-text answers that say what
failed, never a traceback.
With E2B's API served (`E2BEdge`), the hosts of the `e2b` SDKs' E2B_DOMAIN mode are no previews
(core.preview.e2b_target): `api.{domain}` is relayed to the E2B edge as a control call, and
`49983-{sid}.{domain}` / `49999-{sid}.{domain}` as envd / code-interpreter calls with the
`E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers taken from the host (any the client sent are
replaced). The edge checks E2B's proofs (X-API-KEY, X-Access-Token) itself; refusals on these hosts
are E2B's JSON error bodies (`{"code", "message"}`), which the SDKs parse.
Called by controlplane.main (start-up) with a controlplane.previews.Backend; uses h11 and
shared.tlsstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
import json
import logging
import socket
import ssl
import time
import typing

import h11

from atoll.core import errors, preview
from atoll.core import worker_api as api
from atoll.shared import portstream, relay, tlsstream

log = logging.getLogger(__name__)
MAX_HEAD = 64 * 1024
READ = 256 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0
"""A client connection with no request for this long is closed."""
HEAD_TIMEOUT_S = 30.0
"""A request head must be complete this long after its first byte (a slow client holds no
connection for ever)."""
MAX_CONNECTIONS = 4096
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_BATCH = 32
MAX_PER_PEER = 512
"""Connections one client address may hold at once (a slow client cannot take every slot)."""
READY_FRESH_S = 0.5
"""On a switched connection (WebSocket), the sandbox is asked to be ready at most this often."""
RETRY_BODY = 64 * 1024
"""A request whose body fits this is sent again once on a fresh connection into the sandbox
when a kept one turns out to be gone (a disk checkpoint reset it) before any answer came."""
_DROP = {preview.TOKEN_HEADER.encode(), preview.ID_HEADER.encode(), preview.PORT_HEADER.encode()}
_FORWARDED = {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded"}
"""A client's own forwarding headers are dropped: the sandbox gets the router's, and only them."""
_E2B_DROP = {b"e2b-sandbox-id", b"e2b-sandbox-port"} | _DROP
"""On E2B's hosts the sandbox and port come from the host name: a client's own headers for them
(the SDKs always send them) are replaced, and atoll's preview headers mean nothing there."""
EDGE_CONNECT_TIMEOUT_S = 10.0
EDGE_KEEP_S = 2.0
"""A connection to the E2B edge idle this long is not used again (uvicorn there ends idle ones
after 5 s; a POST sent just as it does could not be sent again)."""


Upstream = api.PortStream
"""A connection into a sandbox's port (the worker's side of it), as WorkerAPI.open_port gives it."""


@dataclasses.dataclass(frozen=True)
class Grant:
    """An authorized request: which proof it used (for the cookie a signed URL earns)."""

    via: str  # public | token | signed | cookie
    cookie: str | None = None
    max_age: int = 0


@dataclasses.dataclass(frozen=True)
class E2BEdge:
    """Where E2B's API (the edge child, ATOLL_E2B_PORT) listens, as the router reaches it."""

    host: str
    port: int
    tls: bool = False
    """The edge serves https (it does when the API does, with the API's certificate)."""


@dataclasses.dataclass(frozen=True)
class _Route:
    """Where one request goes: a sandbox's port (a preview) or the E2B edge."""

    key: typing.Hashable
    """Requests with the same key may share a kept connection."""
    what: str
    """What answers, for error pages: "port 8080 in sandbox sb-…", "atoll's E2B API"."""
    connect: typing.Callable[[], typing.Awaitable[Upstream]]
    ready: typing.Callable[[], typing.Awaitable[None]] | None = None
    """Asked before bytes of a switched connection go in (a preview's sandbox may have slept)."""
    json_errors: bool = False
    """Refusals in E2B's shape, `{"code": status, "message": ...}`."""
    keep_s: float | None = None
    """A kept connection idle longer than this is replaced by a new one (None: kept for ever)."""


class Backend(typing.Protocol):
    async def admit(
        self,
        target: preview.Target,
        token: str | None,
        expires: str | None,
        sig: str | None,
        cookie: str | None,
    ) -> Grant:
        """Authorize the request (a public port, the token, a signed URL or its cookie), then make
        the sandbox run (resume it from standby). Raises AtollError (the refusal)."""
        ...

    async def ready(self, target: preview.Target) -> None: ...
    async def connect(self, target: preview.Target) -> Upstream: ...


class _Refusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


_STATUS = {
    errors.SandboxNotFound: 404,
    errors.NotFound: 404,
    errors.Unauthorized: 401,
    errors.PermissionDenied: 403,
    errors.Conflict: 409,
    errors.Unavailable: 503,
}


def _status_of(e: errors.AtollError) -> int:
    for cls, status in _STATUS.items():
        if isinstance(e, cls):
            return status
    return 502


@dataclasses.dataclass
class Stats:
    requests: int = 0
    refused: int = 0
    evicted: int = 0
    """Connections ended to make room for new ones (idle or half-sent first)."""


class _Held:
    """One client connection: whom it counts against and what it is doing (for eviction)."""

    __slots__ = ("key", "state", "since", "task")

    def __init__(self, key: str):
        self.key = key
        self.state = "new"  # new (TLS handshake) | idle (between requests) | head (one arriving) | busy
        self.since = time.monotonic()
        self.task: asyncio.Task | None = None

    def set(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()

    @property
    def evictable(self) -> bool:
        return self.state != "busy"


class Router:
    def __init__(
        self,
        backend: Backend,
        ctx: ssl.SSLContext,
        domain: str,
        trusted_proxies: typing.Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
        e2b: E2BEdge | None = None,
    ):
        self.backend = backend
        self.ctx = ctx
        self.domain = domain
        self.trusted = tuple(trusted_proxies)
        self.e2b = e2b
        self._e2b_tls: ssl.SSLContext | None = None
        if e2b is not None and e2b.tls:
            # the edge's socket is bound by this installation's server for its whole life, on
            # its own address: nothing else can answer there, and the API's certificate may be an
            # operator's that names no loopback address
            ctx_e = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx_e.check_hostname, ctx_e.verify_mode = False, ssl.CERT_NONE
            self._e2b_tls = ctx_e
        self.server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()
        self._held: dict[int, _Held] = {}
        self._per_peer: dict[str, int] = {}
        self.stats = Stats()

    async def start(
        self, host: str | None = None, port: int | None = None, sock: socket.socket | None = None
    ) -> None:
        if sock is not None:
            # accepted in batches of ACCEPT_BATCH per loop turn (asyncio accepts up to `backlog` at
            # once: a flood of connections would hold the loop), the kernel's queue kept long
            self.server = await asyncio.start_server(
                self._accepted, sock=sock, limit=READ, backlog=ACCEPT_BATCH
            )
            sock.listen(1024)
        else:
            self.server = await asyncio.start_server(self._accepted, host, port, limit=READ, backlog=1024)

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    async def connect_e2b(self) -> Upstream:
        """A connection to the E2B edge (plain, or TLS when it serves https)."""
        assert self.e2b is not None
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.e2b.host, self.e2b.port, ssl=self._e2b_tls, limit=READ),
            EDGE_CONNECT_TIMEOUT_S,
        )
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return portstream.StreamPort(reader, writer)

    def is_trusted(self, ip: str) -> bool:
        if not self.trusted or not ip:
            return False
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(addr in n for n in self.trusted)

    def _evict(self, key: str | None) -> bool:
        """Make room: end the connection (of client `key`, or of anyone) that waits the longest
        without a request in flight — idle between requests, a head half sent, a handshake.
        False when every candidate is busy."""
        victims = [h for h in self._held.values() if h.evictable and (key is None or h.key == key)]
        if not victims:
            return False
        victim = min(victims, key=lambda h: h.since)
        self.stats.evicted += 1
        if victim.task is not None:
            victim.task.cancel()
        self._count(victim, -1)
        victim.key = ""
        return True

    def _count(self, held: _Held, delta: int) -> None:
        if not held.key:
            return
        left = self._per_peer.get(held.key, 0) + delta
        if left > 0:
            self._per_peer[held.key] = left
        else:
            self._per_peer.pop(held.key, None)

    def rekey(self, held: _Held, key: str) -> bool:
        """The connection's client is `key` (told by a trusted proxy): count it there. False when
        that client holds MAX_PER_PEER connections already and none can give way."""
        if held.key == key:
            return True
        if self._per_peer.get(key, 0) >= MAX_PER_PEER and not self._evict(key):
            return False
        self._count(held, -1)
        held.key = key
        self._count(held, 1)
        return True

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        ip = peer[0] if isinstance(peer, tuple) else ""
        # behind a trusted proxy every client shares its address: counted per forwarded client
        # once the first request says who it is (Session.run), against the proxy until then
        key = ("proxy " + ip) if self.is_trusted(ip) else ip
        if len(self._conns) >= MAX_CONNECTIONS and not self._evict(None):
            writer.transport.abort()
            return
        if not self.is_trusted(ip) and self._per_peer.get(key, 0) >= MAX_PER_PEER and not self._evict(key):
            writer.transport.abort()
            return
        held = _Held(key)
        self._count(held, 1)
        task = asyncio.ensure_future(self._serve(reader, writer, held))
        held.task = task
        self._held[id(task)] = held
        self._conns.add(task)

        def done(t: asyncio.Task) -> None:
            self._conns.discard(t)
            h = self._held.pop(id(t), None)
            if h is not None:
                self._count(h, -1)

        task.add_done_callback(done)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: _Held) -> None:
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client: typing.Any = None
        try:
            first = await asyncio.wait_for(reader.read(READ), HANDSHAKE_TIMEOUT_S)
            if not first:
                return
            if first[0] != 0x16:  # not a TLS handshake record
                writer.write(
                    _page(
                        400, "atoll ingress: this port speaks TLS only; use https:// (the preview URL)", True
                    )
                )
                with contextlib.suppress(OSError, ConnectionError):
                    await writer.drain()
                return
            client = tlsstream.TLSStream(reader, writer, self.ctx, server_side=True, initial=first)
            await client.handshake(HANDSHAKE_TIMEOUT_S)
            await _Session(self, client, writer.get_extra_info("peername"), held).run()
        except (OSError, ConnectionError, ssl.SSLError, TimeoutError, asyncio.IncompleteReadError) as e:
            log.debug("ingress connection ended: %r", e, exc_info=True)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one client must never end the router
            log.exception("ingress connection failed")
        finally:
            writer.transport.abort() if client is None else client.abort()


_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def _page(status: int, text: str, close: bool = False, json_errors: bool = False) -> bytes:
    body = (text.rstrip("\n") + "\n").encode()
    ctype = "text/plain; charset=utf-8"
    if json_errors:
        body, ctype = json.dumps({"code": status, "message": text}).encode(), "application/json"
    reason = _REASONS.get(status, "Error")
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
    head += "x-atoll-ingress: refused\r\n"
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + body


class _Session:
    """One client connection: its requests one after another, and the connection into the sandbox
    they go to (kept while they go to the same sandbox and port)."""

    def __init__(self, router: Router, client: typing.Any, peer: typing.Any, held: _Held | None = None):
        self.r = router
        self.client = client
        self.peer = peer[0] if isinstance(peer, tuple) else ""
        self.held = held or _Held(self.peer)
        self.via_proxy = router.is_trusted(self.peer)
        self.client_ip = self.peer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.up: Upstream | None = None
        self.up_conn: h11.Connection | None = None
        self.up_route: _Route | None = None
        self.up_idle_since = 0.0

    async def run(self) -> None:
        try:
            while True:
                ev = await self._next_request()
                if isinstance(ev, h11.ConnectionClosed) or ev is None:
                    return
                if not isinstance(ev, h11.Request):
                    return
                keep = await self._exchange(ev)
                if (
                    not keep
                    or self.conn.our_state is h11.MUST_CLOSE
                    or self.conn.their_state is h11.MUST_CLOSE
                ):
                    return
                try:
                    self.conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return
        except h11.RemoteProtocolError as e:
            status = 431 if "exceeded" in str(e) or "too long" in str(e).lower() else 400
            with contextlib.suppress(Exception):
                await self.client.write(_page(status, f"atoll ingress: malformed request: {e}", True))
        finally:
            if self.up is not None:
                self.up.close()

    async def _next_request(self):
        """The next request head: waited for up to IDLE_TIMEOUT_S, then whole within HEAD_TIMEOUT_S."""
        deadline: float | None = None
        self.held.set("idle")
        while True:
            ev = self.conn.next_event()
            if ev is not h11.NEED_DATA:
                self.held.set("busy")
                return None if ev is h11.PAUSED else ev
            timeout = IDLE_TIMEOUT_S if deadline is None else deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError("the request head did not come whole in time")
            data = await asyncio.wait_for(self.client.read(READ), timeout)
            if deadline is None:
                deadline = time.monotonic() + HEAD_TIMEOUT_S
                self.held.set("head")
            self.conn.receive_data(data)

    async def _next(self, conn: h11.Connection, stream: typing.Any, timeout: float | None = None):
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                data = await (asyncio.wait_for(stream.read(READ), timeout) if timeout else stream.read(READ))
                conn.receive_data(data)
                continue
            if ev is h11.PAUSED:
                return None
            return ev

    async def _refuse(self, status: int, text: str, json_errors: bool = False) -> bool:
        """Answer with an error page (through h11, so the connection can go on); the request's
        body is read and dropped, up to 1 MiB (past that the connection is closed). On E2B's
        hosts (`json_errors`) the body is E2B's `{"code", "message"}`."""
        self.r.stats.refused += 1
        close = False
        n = 0
        while self.conn.their_state is h11.SEND_BODY:
            ev = await self._next(self.conn, self.client, 10)
            if isinstance(ev, h11.Data):
                n += len(ev.data)
                if n > 1024 * 1024:
                    close = True
                    break
            elif not isinstance(ev, h11.EndOfMessage):
                close = True
                break
        body = (text.rstrip("\n") + "\n").encode()
        ctype = b"text/plain; charset=utf-8"
        if json_errors:
            body, ctype = json.dumps({"code": status, "message": text}).encode(), b"application/json"
        headers = [
            (b"content-type", ctype),
            (b"content-length", str(len(body)).encode()),
            (b"x-atoll-ingress", b"refused"),
        ]
        if close:
            headers.append((b"connection", b"close"))
        if self.conn.our_state is not h11.SEND_RESPONSE:
            await self.client.write(_page(status, text, True, json_errors))
            return False
        data = self.conn.send(
            h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, "Error"))
        )
        data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        await self.client.write(data)
        return not close and self.conn.our_state is h11.DONE

    def _on_e2b_host(self, get: typing.Callable[[str], str | None]) -> bool:
        """Whether the request is for one of E2B's hosts (its API's, or a sandbox's envd or
        interpreter, well formed or not) while E2B's API is served."""
        if self.r.e2b is None:
            return False
        try:
            return preview.e2b_target(get("host") or "", self.r.domain) is not None
        except preview.BadTarget:
            return True

    async def _exchange(self, req: h11.Request) -> bool:
        self.r.stats.requests += 1
        headers = req.headers.raw_items()
        get = _getter(req.headers)
        e2b_json = self._on_e2b_host(get)  # refusals on E2B's hosts are E2B's JSON, which its SDKs parse
        # h11 bounds a head only while it is incomplete: one that came whole in a read is measured here
        if len(req.target) + sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEAD:
            await self._refuse(431, f"atoll ingress: the request head is over {MAX_HEAD} bytes", e2b_json)
            return False
        if self.via_proxy:
            client = _forwarded_client(req.headers.raw_items(), self.r.is_trusted)
            if client is not None:
                self.client_ip = client
                if not self.r.rekey(self.held, client):
                    await self._refuse(
                        429,
                        f"atoll ingress: client {client} holds {MAX_PER_PEER} connections already",
                        e2b_json,
                    )
                    return False
        names = [k.lower() for k, _ in headers]
        for h in (preview.ID_HEADER, preview.PORT_HEADER, preview.TOKEN_HEADER, "host"):
            if names.count(h.encode()) > 1:
                return await self._refuse(
                    400, f"atoll ingress: the header {h!r} is given more than once", e2b_json
                )
        if b"transfer-encoding" in names and b"content-length" in names:
            await self._refuse(
                400, "atoll ingress: the request has both Content-Length and Transfer-Encoding", e2b_json
            )
            return False
        if self.r.e2b is not None:
            try:
                e2b = preview.e2b_target(get("host") or "", self.r.domain)
            except preview.BadTarget as e:
                return await self._refuse(400, f"atoll ingress: {e}", json_errors=True)
            if e2b is not None:
                return await self._to_e2b(req, headers, e2b)
        try:
            target = preview.header_target(
                get(preview.ID_HEADER), get(preview.PORT_HEADER)
            ) or preview.host_target(get("host") or "", self.r.domain)
        except preview.BadTarget as e:
            return await self._refuse(400, f"atoll ingress: {e}")
        if target is None:
            return await self._refuse(
                404,
                f"atoll ingress: no sandbox named: use https://{{port}}-{{sandbox_id}}.{self.r.domain} or the "
                "headers Atoll-Sandbox-Id and Atoll-Sandbox-Port",
            )
        path, expires, sig = preview.split_signed(req.target.decode("latin-1"))
        try:
            # authorized, and the sandbox running (resumed if it was in standby): one question
            grant = await self.r.backend.admit(
                target, get(preview.TOKEN_HEADER), expires, sig, _cookie(get("cookie"))
            )
        except errors.AtollError as e:
            return await self._refuse(_status_of(e), f"atoll ingress: {e.message}")
        out = []
        for k, v in headers:
            low = k.lower()
            if low in _DROP or low in _FORWARDED:  # routing and proof stay here; forwarding is ours
                continue
            if low == b"cookie":
                v = _without_our_cookie(v)
                if not v:
                    continue
            out.append((k, v))
        if get("host") is None:  # an HTTP/1.0 request may have none; HTTP/1.1 needs one
            out.append((b"host", f"{target.port}-{target.sandbox_id}.{self.r.domain}".encode()))
        out += [(b"x-forwarded-proto", b"https")]
        if self.client_ip:
            out += [(b"x-forwarded-for", self.client_ip.encode())]
        fwd = h11.Request(method=req.method, target=path.encode("latin-1"), headers=out, http_version="1.1")
        extra = []
        if grant.cookie:
            extra.append(
                (
                    b"set-cookie",
                    f"{preview.COOKIE}={grant.cookie}; Max-Age={grant.max_age}; Path=/; Secure; "
                    "HttpOnly; SameSite=Lax".encode(),
                )
            )
        backend = self.r.backend
        route = _Route(
            key=target,
            what=f"port {target.port} in sandbox {target.sandbox_id}",
            connect=lambda: backend.connect(target),
            ready=lambda: backend.ready(target),
        )
        return await self._forward(route, fwd, extra)

    async def _to_e2b(self, req: h11.Request, headers: list, e2b: preview.E2BTarget) -> bool:
        """A request on one of E2B's hosts, relayed to the E2B edge: the sandbox and port named by
        the host, as the headers the edge reads (E2B_SANDBOX_URL mode's), whatever the client sent."""
        out = [(k, v) for k, v in headers if k.lower() not in _E2B_DROP and k.lower() not in _FORWARDED]
        if not any(k.lower() == b"host" for k, _ in out):
            name = "api" if e2b.sandbox_id is None else f"{e2b.port}-{e2b.sandbox_id}"
            out.append((b"host", f"{name}.{self.r.domain}".encode()))
        if e2b.port == preview.E2B_INTERPRETER_PORT and not any(
            k.lower() == b"x-access-token" and v for k, v in headers
        ):
            # the edge takes a token-less `/contexts` call (2.11.5 sends none) by sandbox id, which
            # is fit for its loopback port only: from this outward-facing router, which anyone who
            # has seen a sandbox id (a preview URL names it) can reach, the token is required
            return await self._refuse(
                401,
                f"atoll ingress: the code interpreter of sandbox {e2b.sandbox_id} needs the sandbox's "
                "X-Access-Token (envdAccessToken of its create or connect answer) on this host",
                json_errors=True,
            )
        if e2b.sandbox_id is not None:
            out += [
                (b"e2b-sandbox-id", e2b.sandbox_id.encode()),
                (b"e2b-sandbox-port", str(e2b.port).encode()),
            ]
        out += [(b"x-forwarded-proto", b"https")]
        if self.client_ip:
            out += [(b"x-forwarded-for", self.client_ip.encode())]
        fwd = h11.Request(method=req.method, target=req.target, headers=out, http_version="1.1")
        route = _Route(
            key="e2b",
            what="atoll's E2B API",
            connect=self.r.connect_e2b,
            json_errors=True,
            keep_s=EDGE_KEEP_S,
        )
        return await self._forward(route, fwd, [])

    async def _upstream(self, route: _Route, fresh: bool) -> tuple[Upstream, h11.Connection]:
        kept = self.up_route is not None and self.up_route.key == route.key
        if route.keep_s is not None and time.monotonic() - self.up_idle_since > route.keep_s:
            kept = False
        if not fresh and self.up is not None and kept and not self.up.closed:
            assert self.up_conn is not None
            if self.up_conn.our_state is h11.IDLE and self.up_conn.their_state is h11.IDLE:
                return self.up, self.up_conn
        if self.up is not None:
            self.up.close()
            self.up = None
        self.up = await route.connect()
        self.up_conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.up_route = route
        return self.up, self.up_conn

    async def _forward(self, route: _Route, fwd: h11.Request, extra: list) -> bool:
        # A request without a body is sent again once on a fresh connection when the kept one
        # into the sandbox turns out to be gone before any answer (a disk checkpoint reset it).
        ended = False
        if _bodiless(fwd):
            ev = self.conn.next_event()
            ended = isinstance(ev, h11.EndOfMessage)
        for attempt in (0, 1):
            retryable = attempt == 0 and ended
            try:
                up, up_conn = await self._upstream(route, fresh=attempt == 1)
            except errors.AtollError as e:
                return await self._refuse(_status_of(e), f"atoll ingress: {e.message}", route.json_errors)
            except (OSError, ConnectionError, TimeoutError) as e:
                if isinstance(e, OSError) and e.errno in _EXHAUSTED:
                    return await self._refuse(
                        503, f"atoll ingress: out of resources ({e.strerror}); retry", route.json_errors
                    )
                return await self._refuse(
                    502, f"atoll ingress: nothing answers on {route.what} ({e!r})", route.json_errors
                )
            pump: asyncio.Future | None = None
            try:
                data = up_conn.send(fwd)
                if ended:
                    data += up_conn.send(h11.EndOfMessage())
                try:
                    await up.write(data)
                except (OSError, ConnectionError):
                    if retryable:
                        continue
                    raise
                if not ended:
                    pump = asyncio.ensure_future(self._pump_body(up, up_conn))
                try:
                    return await self._relay_response(up, up_conn, pump, extra, retryable)
                finally:
                    if pump is not None and not pump.done():
                        pump.cancel()
                        with contextlib.suppress(BaseException):
                            await pump
            except _Retry:
                continue
            except (OSError, ConnectionError, h11.ProtocolError) as e:
                log.info("ingress: %s broke an answer: %r", route.what, e)
                if self.up is not None:
                    self.up.close()
                    self.up = None
                with contextlib.suppress(Exception):
                    if self.conn.our_state is h11.SEND_RESPONSE:
                        await self.client.write(
                            _page(
                                502,
                                f"atoll ingress: {route.what} broke the answer ({e})",
                                True,
                                route.json_errors,
                            )
                        )
                return False
        return False

    async def _pump_body(self, up: Upstream, up_conn: h11.Connection) -> None:
        """The client's request body to the sandbox, as it arrives."""
        while self.conn.their_state is h11.SEND_BODY:
            ev = await self._next(self.conn, self.client)
            if isinstance(ev, h11.Data | h11.EndOfMessage):
                await up.write(up_conn.send(ev))
            else:
                return

    async def _relay_response(
        self, up: Upstream, up_conn: h11.Connection, pump: asyncio.Future | None, extra: list, retryable: bool
    ) -> bool:
        got_any = False
        while True:
            try:
                ev = await self._next(up_conn, up)
            except (OSError, ConnectionError) as e:
                if retryable and not got_any:
                    raise _Retry() from e
                raise
            if isinstance(ev, h11.ConnectionClosed) or ev is None:
                if retryable and not got_any:
                    raise _Retry()
                raise ConnectionError("the sandbox's port closed the connection before answering")
            got_any = True
            if isinstance(ev, h11.InformationalResponse):
                ev = h11.InformationalResponse(
                    status_code=ev.status_code, headers=ev.headers.raw_items(), reason=ev.reason
                )
                await self.client.write(self.conn.send(ev))
                if ev.status_code == 101:
                    return await self._switch(up, up_conn)
                continue
            if isinstance(ev, h11.Response):
                # always a new event: h11 sends only HTTP/1.1 (a program's HTTP/1.0 answer, such
                # as python -m http.server's, is framed again for the client)
                headers = [(k, v) for k, v in ev.headers.raw_items() if k.lower() != b"connection"]
                ev = h11.Response(status_code=ev.status_code, headers=[*headers, *extra], reason=ev.reason)
                await self.client.write(self.conn.send(ev))
            elif isinstance(ev, h11.Data):
                await self.client.write(self.conn.send(ev))
            elif isinstance(ev, h11.EndOfMessage):
                await self.client.write(self.conn.send(ev))
                if pump is not None:
                    if not pump.done():  # answered before the whole body came: end the connection
                        return False
                    await pump
                if up_conn.our_state is h11.DONE and up_conn.their_state is h11.DONE:
                    up_conn.start_next_cycle()
                    self.up_idle_since = time.monotonic()
                else:
                    up.close()
                    self.up = None
                return True

    async def _switch(self, up: Upstream, up_conn: h11.Connection) -> bool:
        """After a 101: bytes both ways until either side ends. What the client sends wakes the
        sandbox first if it went to standby meanwhile (a quiet WebSocket lets the idle policy
        freeze it)."""
        route = self.up_route
        assert route is not None

        asked = 0.0

        async def inward(data: bytes) -> None:
            nonlocal asked
            # a sandbox ready this recently is not asked about again (one question per message
            # would cost a round trip to the control plane each)
            if route.ready is not None and time.monotonic() - asked > READY_FRESH_S:
                await route.ready()
                asked = time.monotonic()
            await up.write(data)

        client_rest = self.conn.trailing_data[0]
        up_rest = up_conn.trailing_data[0]
        if client_rest:
            await up.write(client_rest)
        if up_rest:
            await self.client.write(up_rest)

        await relay.first_ends(
            relay.pump(self.client.read, inward, READ), relay.pump(up.read, self.client.write, READ)
        )
        return False


class _Retry(Exception):
    """The kept connection into the sandbox was gone before it answered."""


def _bodiless(req: h11.Request) -> bool:
    for k, v in req.headers:
        if k == b"transfer-encoding" or (k == b"content-length" and v.strip() != b"0"):
            return False
    return True


def _forwarded_client(
    headers: list[tuple[bytes, bytes]], trusted: typing.Callable[[str], bool]
) -> str | None:
    """The client a trusted proxy forwards for: the right-most address of X-Forwarded-For that is
    not itself a trusted proxy (a proxy appends the address it saw; what the client sent stands to
    its left); None without one. `Forwarded` is not read: a proxy that appends to X-Forwarded-For
    passes a client's own `Forwarded` through, which would let the client pick its identity."""
    chain: list[str] = []
    for k, v in headers:
        if k.lower() == b"x-forwarded-for":
            chain += [p.strip() for p in v.decode("latin-1").split(",")]
    for candidate in reversed(chain):
        try:
            ipaddress.ip_address(candidate)
        except ValueError:
            return None  # a name or garbage: no trustworthy client beyond this point
        if not trusted(candidate):
            return candidate
    return None


def _getter(headers) -> typing.Callable[[str], str | None]:
    def get(name: str) -> str | None:
        key = name.encode()
        for k, v in headers:
            if k == key:
                return v.decode("latin-1")
        return None

    return get


def _without_our_cookie(value: bytes) -> bytes:
    parts = [p for p in value.split(b";") if p.strip().split(b"=", 1)[0] != preview.COOKIE.encode()]
    return b";".join(parts).strip()


def _cookie(header: str | None) -> str | None:
    if not header:
        return None
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k == preview.COOKIE:
            return v
    return None

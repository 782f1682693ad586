"""Secret substitution in the egress gateway: an HTTP/1.1 relay that replaces placeholders.

A sandbox holds only a placeholder for each secret (`atoll_ph_` and 32 hex digits) in its
environment. On a connection to one of a secret's hosts, the gateway parses each request (h11),
replaces the placeholders of the bindings for that host in the request target and in every header
value, and sends it upstream; bodies (chunked or Content-Length) stream through unchanged, and so
does the response, 1xx responses included. A kept-alive connection carries many exchanges; a
`101 Switching Protocols` (WebSocket) turns it into a raw byte relay. Header names come out as the
client wrote them, in the same order; nothing is removed (a response whose end the upstream marks
by closing gets `Connection: close` added, so the client does not reuse the connection).

For HTTPS the gateway is a man in the middle: it presents a leaf for the name (`LeafContexts`,
issued by the installation's CA, which sandboxes trust) and verifies the real upstream with the
default CAs (`upstream_context`); a failed verification is answered with a 502 inside the
intercepted TLS. Only HTTP/1.1 is offered (ALPN), so clients never speak h2 to the relay.
Secret values never appear in logs or in the gateway's own answers.
Called by gateway.egress (intercept_tls, relay, bindings_for); uses gateway.tlsstream and core.pki.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import ipaddress
import logging
import re
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import h11
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from atoll.core import netpolicy, pki
from atoll.gateway import tlsstream

log = logging.getLogger(__name__)
MAX_HEAD = 64 * 1024
"""A request or response head (request line or status line and headers) may be this long."""
LEAF_DAYS = 30
LEAF_REISSUE_S = 7 * 86400.0
"""A cached leaf is replaced after this long, well before it expires (LEAF_DAYS)."""
ANSWER_WAIT_S = 2.0
DISCARD_MAX = 64 * 1024
"""After the gateway's own answer, what the client still sends is read and dropped (at most
this much, for at most ANSWER_WAIT_S), so it reads the answer before the connection ends."""
_READ = 65536
_HEAD_SLICE = 4096
_CHUNK_LIMIT = 1024 * 1024
_NONE, _UPSTREAM, _GATEWAY = "nobody", "upstream", "gateway"
_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
}


def _source(
    bindings: Iterable[Binding] | Callable[[], tuple[Binding, ...]],
) -> Callable[[], tuple[Binding, ...]]:
    if callable(bindings):
        return bindings
    fixed = tuple(bindings)
    return lambda: fixed


def _host_of(request: h11.Request) -> str | None:
    """The request's Host, normalized like the policy's names (no port, lower case, no final dot)."""
    for k, v in request.headers.raw_items():
        if k.lower() == b"host":
            text = v.decode("latin-1").strip()
            if text.startswith("["):
                return text.split("]")[0] + "]"
            return netpolicy.normalize_name(text.rsplit(":", 1)[0] if ":" in text else text)
    return None


class Stream(Protocol):
    """What the relay reads and writes: a tlsstream.TLSStream or tlsstream.PlainStream."""

    async def read(self, n: int = ...) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...

    def abort(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Binding:
    """One secret as the gateway applies it: `placeholder` (what the sandbox sees) becomes `value`
    on connections to `hosts` (lower-case names; `*.example.com` = any name below example.com)."""

    placeholder: str
    value: str = dataclasses.field(repr=False)  # never in a log line
    hosts: tuple[str, ...]


def host_matches(pattern: str, name: str) -> bool:
    """Whether `name` is `pattern` (case-insensitive), or below it for a `*.` pattern."""
    pattern, name = pattern.lower().rstrip("."), name.lower().rstrip(".")
    if pattern.startswith("*."):
        suffix = pattern[1:]
        return len(name) > len(suffix) and name.endswith(suffix)
    return pattern == name


def bindings_for(name: str, bindings: Iterable[Binding]) -> tuple[Binding, ...]:
    """The bindings that apply to a connection to `name`."""
    return tuple(b for b in bindings if any(host_matches(h, name) for h in b.hosts))


def substitute(data: bytes, bindings: Iterable[Binding]) -> bytes:
    """`data` with every binding's placeholder replaced by its value (one pass: a value that
    contains a placeholder is not replaced again)."""
    table = {b.placeholder.encode(): b.value.encode() for b in bindings if b.placeholder}
    if not table or not any(p in data for p in table):
        return data
    pattern = re.compile(b"|".join(re.escape(p) for p in sorted(table, key=len, reverse=True)))
    return pattern.sub(lambda m: table[m.group(0)], data)


# ---- the relay ----------------------------------------------------------------------------------
async def relay(
    client: Stream,
    upstream: Stream,
    bindings: Iterable[Binding] | Callable[[], tuple[Binding, ...]],
    touch: Callable[[], None],
    *,
    name: str = "",
    flight: Callable[[bool], None] | None = None,
) -> None:
    """Relay HTTP/1.1 exchanges from `client` to `upstream` until either side ends, substituting
    `bindings` (already those of this connection's name). With `name` (the name the connection was
    decided and opened for: its SNI, or its first request's Host), every request must carry that
    Host: another is answered 403 and never reaches the upstream (it was checked for `name` only,
    and so are the bindings). `flight(True)` when a request starts, `flight(False)` when its
    response ended: the caller's measure of "a request in flight". Returns when the connection
    is over; the caller closes both streams. Raises nothing but cancellation."""
    try:
        await _Relay(client, upstream, _source(bindings), touch, name, flight).run()
    except asyncio.CancelledError:
        raise
    except (OSError, ssl.SSLError, h11.ProtocolError, TimeoutError, EOFError) as e:
        # no message: an h11 error may quote a header, and headers carry secrets now
        log.debug("intercepted connection ended: %s", type(e).__name__)
    except Exception as e:  # noqa: BLE001 - what a sandbox sends must not end the gateway's task badly
        log.error("intercepted connection failed: %s", type(e).__name__)
        log.debug("intercepted connection failed", exc_info=True)


class _Relay:
    def __init__(
        self,
        client: Stream,
        upstream: Stream,
        bindings: Callable[[], tuple[Binding, ...]],
        touch: Callable[[], None],
        name: str = "",
        flight: Callable[[bool], None] | None = None,
    ):
        self.client, self.upstream, self.touch = client, upstream, touch
        self.current = bindings  # read for each request: a secret replaced or deleted applies at once
        self.name = name
        self.flight = flight or (lambda _on: None)
        self.cconn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)  # faces the client
        self.uconn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)  # faces upstream
        self.pending = {id(self.cconn): b"", id(self.uconn): b""}  # read, not yet given to h11
        self.answer = _NONE  # who answers the client in this exchange: nobody yet, upstream or gateway

    async def run(self) -> None:
        while True:
            request = await self._next_request()
            if request is None:
                return
            outcome = await self._exchange(request)
            if outcome == "switched":
                await self._raw()
                return
            states = (
                self.cconn.our_state,
                self.cconn.their_state,
                self.uconn.our_state,
                self.uconn.their_state,
            )
            if outcome != "done" or any(s is not h11.DONE for s in states):
                return
            self.cconn.start_next_cycle()
            self.uconn.start_next_cycle()

    async def _next_request(self) -> h11.Request | None:
        self.answer = _NONE
        while True:
            try:
                event = self.cconn.next_event()
            except h11.RemoteProtocolError as e:
                if e.error_status_hint == 431:
                    text = f"the request head is longer than {MAX_HEAD} bytes"
                else:
                    text = f"malformed HTTP/1.1 request ({e})"
                await self._refuse(e.error_status_hint, text)
                return None
            if event is h11.NEED_DATA:
                await self._receive(self.client, self.cconn)
                continue
            return event if isinstance(event, h11.Request) else None

    async def _exchange(self, request: h11.Request) -> str:
        """One request and its response: "done", "switched" (to raw bytes) or "ended"."""
        self.flight(True)
        try:
            return await self._exchange_in_flight(request)
        finally:
            self.flight(False)

    async def _exchange_in_flight(self, request: h11.Request) -> str:
        names = {k.lower() for k, _ in request.headers.raw_items()}
        if b"transfer-encoding" in names and b"content-length" in names:
            # two framings: the upstream might read the other one (request smuggling)
            await self._refuse(400, "the request has both Content-Length and Transfer-Encoding")
            return "ended"
        if request.method == b"CONNECT":
            await self._refuse(405, "CONNECT is not relayed: the gateway is not a proxy (connect directly)")
            return "ended"
        if not (request.target.startswith(b"/") or request.target == b"*"):
            # absolute-form names its own authority, which a server must prefer to Host (RFC 9112
            # 3.2.2): a request that names another site than the one checked must not pass
            await self._refuse(
                400, "the request target must be a path (origin-form); the gateway is not a proxy"
            )
            return "ended"
        if self.name:
            host = _host_of(request)
            if host != self.name:
                await self._refuse(
                    403,
                    f"this connection was opened for {self.name!r}; a request for {host!r} needs a "
                    "connection of its own (the policy and the secrets were checked for the first name)",
                )
                return "ended"
        bindings = self.current()
        target = substitute(request.target, bindings)
        headers = [(n, substitute(v, bindings)) for n, v in request.headers.raw_items()]
        try:
            head = self.uconn.send(h11.Request(method=request.method, target=target, headers=headers))
        except h11.LocalProtocolError as e:
            changed = target != request.target or headers != list(request.headers.raw_items())
            why = "a secret's value is not valid where its placeholder is" if changed else str(e)
            await self._refuse(400, f"the request cannot be forwarded as HTTP/1.1 ({why})")
            return "ended"
        await self.upstream.write(head)
        self.touch()
        body = asyncio.ensure_future(self._request_body())
        response = asyncio.ensure_future(self._response(request.method))
        try:
            # concurrently: a client may wait for `100 Continue` before it sends the body, and an
            # upstream may answer before the body is all there
            done, _ = await asyncio.wait({body, response}, return_when=asyncio.FIRST_COMPLETED)
            if body in done and not body.result():
                return "ended"
            outcome = await response
            if outcome == "done" and not body.done() and self.uconn.their_state is not h11.DONE:
                return "ended"  # answered early and closing: the rest of the body has nowhere to go
            if outcome != "ended" and not await body:
                return "ended"
            return outcome
        finally:
            for t in (body, response):
                t.cancel()
            await asyncio.gather(body, response, return_exceptions=True)

    async def _request_body(self) -> bool:
        """Stream the request body upstream; False when the client broke off (or sent bad HTTP)."""
        while True:
            try:
                event = self.cconn.next_event()
            except h11.RemoteProtocolError as e:
                await self._refuse(e.error_status_hint, f"malformed HTTP/1.1 request body ({e})")
                return False
            if event is h11.NEED_DATA:
                await self._receive(self.client, self.cconn)
            elif isinstance(event, h11.Data):
                await self.upstream.write(self.uconn.send(h11.Data(data=event.data)))
            elif isinstance(event, h11.EndOfMessage):
                trailers = event.headers.raw_items()
                await self.upstream.write(self.uconn.send(h11.EndOfMessage(headers=trailers)))
                return True
            else:
                return False

    async def _response(self, method: bytes) -> str:
        """Stream the response (1xx first) to the client: "done", "switched" or "ended"."""
        while True:
            try:
                event = self.uconn.next_event()
            except h11.RemoteProtocolError:
                return "ended"
            if event is h11.NEED_DATA:
                await self._receive(self.upstream, self.uconn)
                continue
            if event is h11.PAUSED:
                return "switched" if self.uconn.their_state is h11.SWITCHED_PROTOCOL else "ended"
            if self.answer is _GATEWAY:
                return "ended"  # the gateway answered the client itself (a bad request body)
            if isinstance(event, h11.InformationalResponse):
                out = self.cconn.send(
                    h11.InformationalResponse(
                        status_code=event.status_code, headers=event.headers.raw_items(), reason=event.reason
                    )
                )
            elif isinstance(event, h11.Response):
                headers = event.headers.raw_items()
                if _upstream_closes(event, method) and b"close" not in _tokens(event.headers, b"connection"):
                    headers.append((b"Connection", b"close"))
                out = self.cconn.send(
                    h11.Response(status_code=event.status_code, headers=headers, reason=event.reason)
                )
            elif isinstance(event, h11.Data):
                out = self.cconn.send(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                out = self.cconn.send(h11.EndOfMessage(headers=event.headers.raw_items()))
            else:
                return "ended"
            self.answer = _UPSTREAM
            await self.client.write(out)
            if isinstance(event, h11.EndOfMessage):
                return "done"

    async def _receive(self, stream: Stream, conn: h11.Connection) -> None:
        pending = self.pending[id(conn)]
        if not pending:
            pending = await stream.read(_READ)
            if not pending:
                conn.receive_data(b"")
                return
            self.touch()
        # h11 bounds a head only while it is incomplete: given a whole 70 KiB head at once it
        # would take it, so a head is given in slices (and stops at MAX_HEAD + _HEAD_SLICE)
        head_expected = conn.their_state in (h11.IDLE, h11.SEND_RESPONSE)
        piece = pending[:_HEAD_SLICE] if head_expected else pending
        self.pending[id(conn)] = pending[len(piece) :]
        conn.receive_data(piece)

    async def _refuse(self, status: int, text: str) -> None:
        """Answer the client with an error of the gateway's own, unless its answer has begun."""
        if self.answer is not _NONE:
            return
        self.answer = _GATEWAY
        await _answer(self.client, status, f"atoll egress gateway: {text}\n")

    async def _raw(self) -> None:
        """After a protocol switch: bytes both ways, each side's end passed on to the other."""
        cdata, cclosed = self.cconn.trailing_data
        udata, uclosed = self.uconn.trailing_data
        cdata += self.pending[id(self.cconn)]
        udata += self.pending[id(self.uconn)]
        await _both(
            self._pipe(self.client, self.upstream, cdata, cclosed),
            self._pipe(self.upstream, self.client, udata, uclosed),
        )

    async def _pipe(self, src: Stream, dst: Stream, first: bytes, closed: bool) -> None:
        if first:
            self.touch()
            await dst.write(first)
        while not closed and (data := await src.read(_READ)):
            self.touch()
            await dst.write(data)
        await dst.write_eof()


def _tokens(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> set[bytes]:
    return {t.strip().lower() for n, v in headers if n == name for t in v.split(b",")}


def _upstream_closes(response: h11.Response, method: bytes) -> bool:
    """Whether the upstream ends the connection after this response (so the client must too)."""
    if b"close" in _tokens(response.headers, b"connection") or response.http_version < b"1.1":
        return True
    status = response.status_code
    if method in (b"HEAD", b"CONNECT") or status in (204, 304) or status < 200:
        return False
    names = {n for n, _ in response.headers}
    return b"content-length" not in names and b"transfer-encoding" not in names


async def _both(*coros) -> None:
    """Run coroutines together; the first to fail cancels the rest and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _answer(stream: Stream, status: int, text: str) -> None:
    """The gateway's own answer (plain text, `Connection: close`), best effort."""
    body = text.encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
        f"x-atoll-egress: {'refused' if status < 500 else 'error'}\r\n\r\n"
    )
    with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
        await asyncio.wait_for(stream.write(head.encode() + body), ANSWER_WAIT_S)
        if isinstance(stream, tlsstream.TLSStream):
            # close_notify: a client reading to the end has it. (No FIN on plain TCP: a sandbox
            # closing at the same moment would be left in TIME_WAIT, see gateway.egress.)
            await asyncio.wait_for(stream.write_eof(), ANSWER_WAIT_S)
        await asyncio.wait_for(_discard(stream), ANSWER_WAIT_S)


async def _discard(stream: Stream) -> None:
    n = 0
    while n < DISCARD_MAX:
        data = await stream.read(_READ)
        if not data:
            return
        n += len(data)


# ---- HTTPS interception -------------------------------------------------------------------------
async def intercept_tls(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    head: bytes,
    name: str,
    ip: str,
    port: int,
    *,
    leaf_ctx: ssl.SSLContext,
    upstream_ctx: ssl.SSLContext,
    local_addr: tuple[str, int] | str | None,
    bindings: Iterable[Binding] | Callable[[], tuple[Binding, ...]],
    touch: Callable[[], None],
    connect_timeout: float = 10.0,
    flight: Callable[[bool], None] | None = None,
) -> None:
    """Terminate the sandbox's TLS (`head`: its ClientHello, already read) with `leaf_ctx`, open
    verified TLS to `name` at ip:port, and relay with substitution. The caller owns `writer` and
    ends it afterwards; the upstream connection is closed here. Raises nothing but cancellation."""
    client = tlsstream.TLSStream(reader, writer, leaf_ctx, server_side=True, initial=head)
    where = f"{name} ({ip}:{port})"
    up_w: asyncio.StreamWriter | None = None
    upstream: tlsstream.TLSStream | None = None
    cancelled = False
    try:
        try:
            await client.handshake(connect_timeout)
        except (OSError, ssl.SSLError, TimeoutError) as e:
            log.debug("intercepted TLS handshake with the sandbox failed for %s: %r", where, e)
            return
        touch()
        if client.selected_alpn_protocol() not in (None, "http/1.1"):
            return
        if isinstance(local_addr, str):
            local_addr = (local_addr, 0)
        try:
            up_r, up_writer = await asyncio.wait_for(
                asyncio.open_connection(ip, port, local_addr=local_addr, limit=_CHUNK_LIMIT), connect_timeout
            )
            up_w = up_writer
        except (OSError, TimeoutError) as e:
            await _answer(
                client, 502, f"atoll egress gateway: {where} did not accept the connection ({e!r})\n"
            )
            return
        upstream = tlsstream.TLSStream(up_r, up_writer, upstream_ctx, server_side=False, server_hostname=name)
        try:
            await upstream.handshake(connect_timeout)
        except ssl.SSLCertVerificationError as e:
            log.info(
                "intercepted connection to %s: the upstream certificate failed verification: %s", where, e
            )
            await _answer(
                client,
                502,
                f"atoll egress gateway: the certificate of {where} failed verification "
                f"({e.verify_message or e}, code {e.verify_code}); the request was not sent.\n",
            )
            return
        except (OSError, ssl.SSLError, TimeoutError) as e:
            await _answer(
                client, 502, f"atoll egress gateway: the TLS handshake with {where} failed ({e!r})\n"
            )
            return
        touch()
        await relay(client, upstream, bindings, touch, name=name, flight=flight)
    except asyncio.CancelledError:
        cancelled = True
        raise
    finally:
        if up_w is not None:
            if cancelled:
                up_w.transport.abort()
            else:
                if upstream is not None:
                    with contextlib.suppress(OSError, TimeoutError):
                        await asyncio.wait_for(upstream.write_eof(), 1.0)
                up_w.close()
        if not cancelled:
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(client.write_eof(), 1.0)


class LeafContexts:
    """Server TLS contexts presenting a leaf for one name each, issued by a CA (an intermediate:
    pass its parent chain as `chain_pem`), made on first use and cached (least recently used
    dropped past `max_cached`, reissued after LEAF_REISSUE_S)."""

    def __init__(self, ca_cert_pem: bytes, ca_key_pem: bytes, chain_pem: bytes = b"", max_cached: int = 1000):
        self._ca_cert, self._ca_key = ca_cert_pem, ca_key_pem
        self._chain = _chain_after_leaf(ca_cert_pem, chain_pem)
        self._max = max(1, max_cached)
        self._cache: collections.OrderedDict[str, tuple[float, ssl.SSLContext]] = collections.OrderedDict()

    def context_for(self, name: str) -> ssl.SSLContext:
        name = name.lower().rstrip(".")
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is not None and now - hit[0] < LEAF_REISSUE_S:
            self._cache.move_to_end(name)
            return hit[1]
        ctx = self._make(name)
        self._cache[name] = (now, ctx)
        self._cache.move_to_end(name)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return ctx

    def _make(self, name: str) -> ssl.SSLContext:
        try:
            ipaddress.ip_address(name)
            dns, ips = [], [name]
        except ValueError:
            dns, ips = [name], []
        cert, key = pki.issue_server(self._ca_cert, self._ca_key, dns, days=LEAF_DAYS, ip_addresses=ips)
        return tlsstream.server_context(cert + self._chain + key)


def _chain_after_leaf(ca_cert_pem: bytes, chain_pem: bytes) -> bytes:
    """The certificates sent after a leaf: its issuer unless that is a root (self-signed), then
    `chain_pem`'s, each once (a chain_pem that already starts with the issuer is fine)."""
    issuer = x509.load_pem_x509_certificate(ca_cert_pem)
    certs = [] if issuer.issuer == issuer.subject else [issuer]
    certs += x509.load_pem_x509_certificates(chain_pem) if chain_pem.strip() else []
    out: list[bytes] = []
    for c in certs:
        pem = c.public_bytes(serialization.Encoding.PEM)
        if pem not in out:
            out.append(pem)
    return b"".join(out)


def upstream_context(extra_ca_file: str | None) -> ssl.SSLContext:
    """The client context towards real upstreams: the system's CAs (plus `extra_ca_file`),
    hostname checked, HTTP/1.1 only."""
    ctx = ssl.create_default_context()
    if extra_ca_file:
        ctx.load_verify_locations(cafile=extra_ca_file)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx

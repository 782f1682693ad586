"""The TCP side of the egress gateway: decide each connection a sandbox opens, relay the allowed.

Every connection arrives on the sandbox's own listener (made by the worker inside its host-side
namespace), so the listener says which sandbox it is, although every sandbox has the same address.
The original destination comes from conntrack (SO_ORIGINAL_DST, nftables redirected it). Decision
(core.netpolicy): by address first (no bytes read, so any protocol works for an IP/CIDR entry);
otherwise by the name in the first bytes (TLS SNI, HTTP Host), which must be allowed and resolve to
that very address. Refused: HTTP gets a 403 naming the rule and how to allow it, anything else a
reset. Allowed: connect out from the worker's namespace (from ATOLL_EGRESS_SOURCE when set), send
the bytes read so far, relay both ways.

The sandbox's side of every connection is ended with an RST (SO_LINGER 0), never left half-open:
this runsc cannot checkpoint a sandbox with a TCP endpoint in CLOSE_WAIT or TIME_WAIT. Before a
disk checkpoint the worker calls `quiesce`: idle connections (no byte for IDLE_S) are reset the
same way, so an idle keep-alive connection does not pin the sandbox in RAM; bytes moving count as
activity (`busy`, `last_io`). Bytes are counted on the sandbox's side of each connection from the
kernel's TCP_INFO (received: out of the sandbox; acknowledged: into it), for every path alike —
spliced, relayed request by request, intercepted (there the TLS bytes) and previews (`stats`).
Called by worker.node (attach, detach, set_policy, stats); uses gateway.sniff and gateway.names.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import ipaddress
import logging
import socket
import struct
import termios
import time

from atoll.core import netpolicy
from atoll.gateway import fairshare, httprelay, intercept, placeholders, sniff, splice
from atoll.gateway import names as names_mod
from atoll.shared import tlsstream

log = logging.getLogger(__name__)
SO_ORIGINAL_DST = 80
_LINGER0 = struct.pack("ii", 1, 0)
FIRST_BYTES_TIMEOUT_S = 10.0
CLOSE_FIRST_S = 0.05
"""How long a sandbox may take to close first after the upstream finished (see _to_sandbox)."""
LOG_REFUSALS = 20
"""Refusals logged one by one per sandbox per 10 s; the rest are counted in one line."""
DISCARD_MAX = 64 * 1024
"""What a refused client may still send is read and dropped up to this much."""
_NEVER = tuple(
    ipaddress.IPv4Network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "10.99.0.0/30")
)
MAX_CONNECTIONS = 256
"""Connections one sandbox may have through the gateway at once (each holds two descriptors)."""
IDLE_S = 1.0
"""A connection that moved no byte for this long is idle: no request or response in flight (an
HTTP keep-alive connection between requests, a client that went quiet)."""
CONNECT_TIMEOUT_S = 10.0
REQUEST_WAIT_S = 300.0
"""On a connection the gateway sees only as bytes (TLS it does not intercept, raw TCP), the last
bytes having gone toward the answering side means a request waits for its answer — for at most
this long (an HTTP/2 client's last WINDOW_UPDATE must not pin a sandbox in RAM for ever)."""
ANSWER_MIN = 1024
"""Less than this back since the last request bytes is no answer yet: TLS 1.3 session tickets a
server sends after the handshake (a few hundred bytes) may come after the client's request."""
_CHUNK = 1024 * 1024
_WRITE_BUFFER = 1024 * 1024


@dataclasses.dataclass
class Counters:
    allowed: int = 0
    refused: int = 0
    dns_answered: int = 0
    dns_refused: int = 0
    intercepted: int = 0
    bytes_out: int = 0
    """TCP payload bytes the sandbox sent over its connections (egress and preview answers)."""
    bytes_in: int = 0
    """TCP payload bytes that reached the sandbox (acknowledged by it)."""


_TCP_BYTES = struct.Struct("=QQ")
"""tcp_info's tcpi_bytes_acked and tcpi_bytes_received, at offset 120 (Linux ≥ 4.2)."""


def _tcp_bytes(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """(bytes the peer acknowledged, bytes received) on the writer's socket; (0, 0) once closed."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return 0, 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
    except (OSError, ValueError):
        return 0, 0
    if len(info) < 136:
        return 0, 0
    return _TCP_BYTES.unpack_from(info, 120)


@dataclasses.dataclass(eq=False)
class _Conn:
    """One relayed connection: its two sides and when a byte last moved."""

    sandbox_side: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    last_io: float = dataclasses.field(default_factory=time.monotonic)
    sandbox_closed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    in_flight: bool = False
    """A request relayed request by request (plain HTTP, intercepted HTTPS) awaits its answer."""
    last_req: float = 0.0
    """When bytes last went toward the side that answers (the upstream; for a connection into the
    sandbox, the sandbox)."""
    answered: int = 0
    """Bytes that came back from it since bytes last went toward it."""
    min_answer: int = 0
    """Fewer bytes back than this is no answer yet (ANSWER_MIN for egress, whose TLS the gateway
    cannot read; 1 for a connection into the sandbox, which carries plain HTTP from the router)."""
    counters: Counters | None = None
    """The sandbox's counters, which get its bytes when its sandbox side is reset (`fold`)."""
    folded: bool = False

    def fold(self) -> None:
        """Add its bytes to the sandbox's counters, once, before its socket closes."""
        if self.folded or self.counters is None:
            return
        self.folded = True
        into, out = _tcp_bytes(self.sandbox_side)
        self.counters.bytes_in += into
        self.counters.bytes_out += out

    def busy(self, now: float, idle_s: float) -> bool:
        """In use: a request in flight — known (request by request), or guessed from bytes (the
        last went toward the answering side and nothing came back since: it is thinking) — or
        bytes moved within idle_s."""
        if self.in_flight or now - self.last_io < idle_s:
            return True
        waiting = self.last_req > 0 and self.answered < (self.min_answer or ANSWER_MIN)
        return waiting and now - self.last_req < REQUEST_WAIT_S

    def abort(self) -> None:
        if self.upstream is not None:
            self.upstream.transport.abort()
        _reset(self.sandbox_side, self)


@dataclasses.dataclass
class _Attached:
    sid: str
    policy: netpolicy.Policy
    server: asyncio.AbstractServer | None = None
    dns: asyncio.DatagramTransport | None = None
    conns: set[asyncio.Task] = dataclasses.field(default_factory=set)
    inbound: set[asyncio.Task] = dataclasses.field(default_factory=set)
    """Relays of connections into the sandbox's port (previews), apart from its egress."""
    relayed: set[_Conn] = dataclasses.field(default_factory=set)
    deciding: set[_Conn] = dataclasses.field(default_factory=set)
    """Accepted, not decided yet (waiting for the first bytes)."""
    log_window: float = 0.0
    logged: int = 0
    counters: Counters = dataclasses.field(default_factory=Counters)
    last_io: float = 0.0
    bindings: tuple[placeholders.Binding, ...] = ()
    """The sandbox's secrets (gateway.placeholders decides where they apply)."""
    bucket: fairshare.Bucket | None = None
    """Its fair share of the gateway's parsing (gateway.fairshare)."""


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")


def _reset(writer: asyncio.StreamWriter, conn: _Conn | None = None) -> None:
    if conn is not None:
        conn.fold()
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
    writer.transport.abort()


class Gateway:
    def __init__(
        self,
        names: names_mod.Names,
        egress_source: str | None = None,
        own_ip: str = "",
        upstream_ca_file: str | None = None,
    ):
        self.names = names
        self.egress_source = egress_source
        self.leaves: intercept.LeafContexts | None = None
        """Signs the leaves of intercepted HTTPS (set_authority); None until the control plane
        gave the worker its CA."""
        self.upstream_ctx = intercept.upstream_context(upstream_ca_file)
        self.own_ip = own_ip  # the listener's address: a connection straight to it is refused
        self._att: dict[str, _Attached] = {}
        self.shares = fairshare.Shares()
        self._warned: dict[str, float] = {}
        self._host_addrs: tuple[float, frozenset[str]] = (0.0, frozenset())

    # ---- attach / detach ----------------------------------------------------------------------
    async def attach(
        self,
        sid: str,
        listener: socket.socket,
        udp: socket.socket | None,
        policy: netpolicy.Policy,
        bindings: tuple[placeholders.Binding, ...] = (),
    ) -> None:
        """Serve a sandbox: `listener` (a bound TCP socket in its host-side namespace) and `udp`
        (its DNS socket there). Attaching again replaces the previous attachment."""
        await self.detach(sid)
        att = _Attached(sid, policy, bindings=bindings, bucket=self.shares.bucket())
        self._att[sid] = att
        listener.setblocking(False)
        att.server = await asyncio.start_server(
            lambda r, w: self._accepted(att, r, w), sock=listener, limit=_CHUNK, backlog=MAX_CONNECTIONS
        )
        if udp is not None:
            from atoll.gateway import dns  # noqa: PLC0415 - the resolver side, only with a socket

            udp.setblocking(False)
            att.dns, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: dns.Resolver(att, self.names), sock=udp
            )

    def attached(self, sid: str) -> bool:
        return sid in self._att

    def sandboxes(self) -> list[str]:
        return list(self._att)

    def set_authority(self, cert_pem: bytes, key_pem: bytes, chain_pem: bytes = b"") -> None:
        self.leaves = intercept.LeafContexts(cert_pem, key_pem, chain_pem)

    def set_bindings(self, sid: str, bindings: tuple[placeholders.Binding, ...]) -> None:
        """The sandbox's secrets from now on (connections already intercepted keep theirs)."""
        att = self._att.get(sid)
        if att is not None:
            att.bindings = bindings

    def set_policy(self, sid: str, policy: netpolicy.Policy) -> None:
        """Applies to connections and DNS questions from now on (open connections stay)."""
        att = self._att.get(sid)
        if att is not None:
            att.policy = policy

    def busy(self, sid: str, idle_s: float = IDLE_S) -> int:
        """Connections of the sandbox that moved a byte within `idle_s` (in use, so activity)."""
        att = self._att.get(sid)
        if att is None:
            return 0
        now = time.monotonic()
        return sum(1 for c in att.relayed if c.busy(now, idle_s))

    def last_io(self, sid: str) -> float:
        """When a byte of the sandbox's last moved through the gateway (monotonic; 0 = never)."""
        att = self._att.get(sid)
        return att.last_io if att is not None else 0.0

    def quiesce(self, sid: str, idle_s: float = IDLE_S) -> tuple[int, int]:
        """Before a disk checkpoint: reset the sandbox's idle connections (an RST on its side, so
        its endpoint closes at once and the checkpoint can save it; its program then reads
        ECONNRESET, as after a NAT timeout). Returns (in use and left open, reset)."""
        att = self._att.get(sid)
        if att is None:
            return 0, 0
        now, busy, reset = time.monotonic(), 0, 0
        for c in list(att.deciding):  # a connection that sent nothing yet is not in use
            c.abort()
            reset += 1
        att.deciding.clear()
        for c in list(att.relayed):
            if c.busy(now, idle_s):
                busy += 1
            else:
                c.abort()
                att.relayed.discard(c)
                reset += 1
        return busy, reset

    async def relay_inbound(
        self,
        sid: str,
        sock: socket.socket,
        client: socket.socket,
        address: tuple[str, int],
        greeting: bytes = b"",
        timeout: float = 5.0,
    ) -> None:
        """Connect `sock` (a TCP socket made in the sandbox's host-side namespace) to `address`
        in the sandbox, then relay `client` (a connected stream socket: the port tunnel's
        connection from the ingress router, or one end of a socketpair) to it both ways in the
        kernel, `greeting` first to the client. Returns once connected (the relay goes on in a
        task of the sandbox's); raises OSError (refused, timed out) with both sockets closed.
        Tracked like its egress: bytes moving are the sandbox's activity, and a disk
        checkpoint's quiesce resets it when idle."""
        att = self._att.get(sid)
        if att is None or len(att.inbound) >= MAX_CONNECTIONS:
            sock.close()
            client.close()
            if att is None:
                raise ConnectionRefusedError(f"sandbox {sid} has no network attached on this worker")
            raise ConnectionRefusedError(f"sandbox {sid} has too many connections open")
        sock.setblocking(False)
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
        except BaseException:
            sock.close()
            client.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock, limit=_CHUNK)
        c_reader, c_writer = await asyncio.open_connection(sock=client, limit=_CHUNK)
        conn = _Conn(writer, upstream=c_writer, min_answer=1, counters=att.counters)
        att.relayed.add(conn)
        att.last_io = conn.last_io
        if greeting:
            c_writer.write(greeting)
        task = asyncio.ensure_future(self._inbound(att, conn, reader, writer, c_reader, c_writer))
        att.inbound.add(task)
        task.add_done_callback(att.inbound.discard)

    async def _inbound(
        self,
        att: _Attached,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        c_reader: asyncio.StreamReader,
        c_writer: asyncio.StreamWriter,
    ) -> None:
        """Bytes both ways until the client ends (then the sandbox's side gets an RST once what
        was written reached it) or the sandbox closes (passed on to the client as its end)."""
        for w in (writer, c_writer):
            w.transport.set_write_buffer_limits(high=_WRITE_BUFFER)

        async def outward() -> None:
            await splice.copy(reader, c_writer, lambda n: _moved(conn, att, False, n))
            if c_writer.can_write_eof() and not c_writer.transport.is_closing():
                c_writer.write_eof()
            await asyncio.Event().wait()  # the client's end decides

        cancelled = False
        out = asyncio.ensure_future(outward())
        try:
            await splice.copy(c_reader, writer, lambda n: _moved(conn, att, True, n))
        except (OSError, ConnectionError):
            pass
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            out.cancel()
            await asyncio.gather(out, return_exceptions=True)
            att.relayed.discard(conn)
            c_writer.transport.abort()
            if cancelled:
                _reset(writer, conn)
            else:
                await _flush_then_reset(writer, conn)

    def stats(self, sid: str) -> Counters:
        """Its counters: connections ended, plus the bytes of those still open."""
        att = self._att.get(sid)
        if att is None:
            return Counters()
        out = dataclasses.replace(att.counters)
        for c in {*att.relayed, *att.deciding}:
            if not c.folded:
                into, sent = _tcp_bytes(c.sandbox_side)
                out.bytes_in += into
                out.bytes_out += sent
        return out

    async def detach(self, sid: str) -> None:
        """Stop serving a sandbox and reset its connections. Must come before its namespaces are
        deleted: a socket keeps its namespace alive."""
        att = self._att.pop(sid, None)
        if att is None:
            return
        if att.server is not None:
            att.server.close()
        if att.dns is not None:
            att.dns.close()
        for c in list(att.relayed):  # reset at once (the tasks below end after)
            c.abort()
        tasks = [*att.conns, *att.inbound]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if att.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(att.server.wait_closed(), 2)

    async def aclose(self) -> None:
        for sid in list(self._att):
            await self.detach(sid)

    # ---- one connection ---------------------------------------------------------------------------
    def _accepted(self, att: _Attached, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(att.conns) >= MAX_CONNECTIONS:
            # one sandbox must not use up the worker's descriptors: the others' egress goes on
            att.counters.refused += 1
            if self._warned.get(att.sid, 0.0) < time.monotonic() - 10:
                self._warned[att.sid] = time.monotonic()
                log.warning(
                    "egress refused: the sandbox has %d connections open, the most it may",
                    MAX_CONNECTIONS,
                    extra={"sandbox_id": att.sid},
                )
            _reset(writer)
            return
        task = asyncio.ensure_future(self._serve(att, reader, writer))
        att.conns.add(task)
        task.add_done_callback(att.conns.discard)

    async def _serve(
        self, att: _Attached, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        up_w: asyncio.StreamWriter | None = None
        cancelled = False
        conn = _Conn(writer, counters=att.counters)
        att.last_io = conn.last_io
        att.deciding.add(conn)
        try:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ip, port = original_destination(sock)
            head, proto, name = b"", "", None
            never = self.never_reachable(ip)
            if never:
                decision = netpolicy.Decision(False, never)
            else:
                decision = att.policy.decide_address(ip, port)
            if not decision.allowed:
                try:
                    head, proto, name = await asyncio.wait_for(_first_bytes(reader), FIRST_BYTES_TIMEOUT_S)
                except TimeoutError:
                    proto = ""
                except sniff.Malformed as e:
                    decision = netpolicy.Decision(False, f"malformed request: {e}")
                    proto = "bad-http" if e.http else "bad"
                if name is not None and _is_ip(name):
                    name = None  # an address for a name: the address decision stands
                if name is not None and not never:
                    norm = netpolicy.normalize_name(name)
                    if norm is None:
                        decision = netpolicy.Decision(False, f"{name!r} is not a valid host name")
                    else:
                        resolved = (
                            await self.names.resolve(norm) if att.policy.may_resolve(norm) else frozenset()
                        )
                        decision = att.policy.decide_name(norm, ip, port, resolved)
                        name = norm
            att.deciding.discard(conn)
            # names come from the sandbox: shown with repr() in logs (no forged lines)
            target = f"{name!r} ({ip}:{port})" if name else f"{ip}:{port}"
            if not decision.allowed:
                att.counters.refused += 1
                self._log_refusal(att, target, decision.rule)
                if proto == "http":
                    await _refuse_http(att.sid, writer, reader, name, ip, port, decision.rule)
                elif proto == "bad-http":
                    too_long = "longer than" in decision.rule
                    await _answer(
                        writer, reader, 431 if too_long else 400, f"atoll egress gateway: {decision.rule}\n"
                    )
                return
            local = (self.egress_source, 0) if self.egress_source else None
            # plain HTTP always goes request by request (each one's Host is checked: a request for
            # another name needs a connection of its own); TLS only to a secret's hosts, at an
            # address the name resolves to (gateway.placeholders)
            if proto == "http" or (proto == "tls" and name and await self._secret_tls(att, name, ip, port)):
                await self._intercept(att, conn, reader, writer, head, proto, name or "", ip, port, local)
                return
            if not head and (att.bindings or att.policy.denies_names()):
                # allowed by its address, but a name in its first bytes may still be denied or be
                # a secret's host: learn it while a server that speaks first is already heard
                await self._address_then_name(att, conn, reader, writer, ip, port, local)
                return
            up = await self._connect(att, target, ip, port, local)
            if up is None:
                return
            up_r, up_w = up
            att.counters.allowed += 1
            log.debug("egress allowed: %s, %s", target, decision.rule, extra={"sandbox_id": att.sid})
            if head:
                up_w.write(head)
            conn.upstream = up_w
            att.relayed.add(conn)
            for w in (writer, up_w):  # deeper buffers: reads and writes overlap (~1.6x the throughput)
                w.transport.set_write_buffer_limits(high=_WRITE_BUFFER)
            await asyncio.gather(_to_upstream(reader, up_w, conn, att), _to_sandbox(up_r, writer, conn, att))
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            cancelled = True  # detached: reset at once, below
            raise
        except Exception:  # noqa: BLE001 - whatever a sandbox sends must not end the gateway's task badly
            log.exception("egress connection failed", extra={"sandbox_id": att.sid})
        finally:
            att.deciding.discard(conn)
            att.relayed.discard(conn)
            if up_w is not None:
                up_w.transport.abort()
            if cancelled:
                _reset(writer, conn)
            else:
                await _flush_then_reset(writer, conn)

    async def _connect(
        self,
        att: _Attached,
        target: str,
        ip: str,
        port: int,
        local: tuple[str, int] | None,
        answer: tuple[asyncio.StreamWriter, asyncio.StreamReader] | None = None,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The upstream connection (from ATOLL_EGRESS_SOURCE when set), or None when it is refused:
        counted, logged and — with `answer`, the sandbox's side of an HTTP exchange — a 502."""
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(ip, port, local_addr=local, limit=_CHUNK), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as e:
            att.counters.refused += 1
            self._log_refusal(att, target, f"the destination did not accept the connection ({e!r})")
            if answer is not None:
                writer, reader = answer
                await _answer(
                    writer,
                    reader,
                    502,
                    f"atoll egress gateway: {target} did not accept the connection ({e!r})\n",
                )
            return None

    async def _address_then_name(
        self,
        att: _Attached,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ip: str,
        port: int,
        local: tuple[str, int] | None,
    ) -> None:
        """A connection its address allows, in a sandbox whose deny_out names domains or which has
        secrets: the upstream is connected and its bytes flow at once (SSH, SMTP speak first),
        while the client's first bytes are read for a name (SNI, Host). A denied name is refused
        before any client byte leaves; a secret's host is intercepted (nothing was exchanged yet);
        anything else is relayed as bytes, the address having allowed it."""
        up = await self._connect(att, f"{ip}:{port}", ip, port, local)
        if up is None:
            return
        up_r, up_w = up
        conn.upstream = up_w
        att.relayed.add(conn)
        down = asyncio.ensure_future(_to_sandbox(up_r, writer, conn, att))
        handed_over = False
        try:
            try:
                head, proto, name = await _first_bytes(reader)
            except sniff.Malformed as e:
                head, proto, name = e.data, "", None  # not what it claims: bytes, as the address allows
            if name is not None and _is_ip(name):
                name = None
            norm = netpolicy.normalize_name(name) if name else None
            target = f"{norm!r} ({ip}:{port})" if norm else f"{ip}:{port}"
            if norm is not None:
                decision = att.policy.decide_named_address(norm, ip, port)
                if not decision.allowed:
                    down.cancel()
                    up_w.transport.abort()
                    att.counters.refused += 1
                    self._log_refusal(att, target, decision.rule)
                    if proto == "http":
                        await _refuse_http(att.sid, writer, reader, norm, ip, port, decision.rule)
                    return
                relayed = proto == "http" and bool(placeholders.bindings_for(norm, att.bindings))
                if proto == "tls" and att.bindings:
                    relayed = await self._secret_tls(att, norm, ip, port)
                if relayed and conn.answered == 0 and not down.done():
                    down.cancel()
                    await asyncio.gather(down, return_exceptions=True)
                    up_w.transport.abort()
                    conn.upstream = None
                    handed_over = True
                    await self._intercept(att, conn, reader, writer, head, proto, norm, ip, port, local)
                    return
            att.counters.allowed += 1
            if head:
                up_w.write(head)
                _moved(conn, att, True, len(head))
            for w in (writer, up_w):
                w.transport.set_write_buffer_limits(high=_WRITE_BUFFER)
            await asyncio.gather(_to_upstream(reader, up_w, conn, att), down)
        finally:
            if not down.done():
                down.cancel()
            if not handed_over:
                up_w.transport.abort()

    async def _secret_tls(self, att: _Attached, name: str, ip: str, port: int) -> bool:
        """Whether HTTPS to `name` at `ip` is intercepted: it is a secret's host and `ip` an
        address it resolves to (else it passes through untouched, and a secret's name at another
        address counts as refused)."""
        if not att.bindings:
            return False
        decision = await placeholders.decide(att.bindings, name, ip, plain=False, resolve=self.names.resolve)
        if decision.refused:
            self._refused_secret(att, f"{name!r} ({ip}:{port})", decision.why)
        return bool(decision.apply)

    def _refused_secret(self, att: _Attached, target: str, why: str) -> None:
        att.counters.refused += 1
        self._log_refusal(att, target, f"a secret's placeholder was not replaced: {why}")

    async def _intercept(
        self,
        att: _Attached,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        head: bytes,
        proto: str,
        name: str,
        ip: str,
        port: int,
        local: tuple[str, int] | None,
    ) -> None:
        """Plain HTTP, and HTTPS to a secret's host: relayed request by request (gateway.httprelay),
        each request's Host checked against the connection's name, the secrets decided anew for
        each request (gateway.placeholders). HTTPS is terminated with a leaf from the
        installation's CA, which the sandbox trusts, and re-encrypted upstream. A request in
        flight keeps the connection busy (no reset before a checkpoint, however long the
        upstream takes to answer)."""
        target = f"{name!r} ({ip}:{port})"

        def touch() -> None:
            conn.last_io = att.last_io = time.monotonic()

        def flight(on: bool) -> None:
            conn.in_flight = on
            touch()

        async def secrets() -> placeholders.Decision:
            if not name or not att.bindings:
                return placeholders.NONE
            return await placeholders.decide(
                att.bindings, name, ip, plain=proto != "tls", resolve=self.names.resolve
            )

        def refused(why: str) -> None:
            self._refused_secret(att, target, why)

        if proto == "tls" and self.leaves is None:
            att.counters.refused += 1
            self._log_refusal(att, target, "the worker has no CA yet to intercept HTTPS to a secret's host")
            return
        att.counters.allowed += 1
        att.relayed.add(conn)
        if proto == "tls":
            assert self.leaves is not None
            att.counters.intercepted += 1
            log.debug("egress intercepted: %s", target, extra={"sandbox_id": att.sid})
            await intercept.intercept_tls(
                reader,
                writer,
                head,
                name,
                ip,
                port,
                leaf_ctx=self.leaves.context_for(name),
                upstream_ctx=self.upstream_ctx,
                local_addr=local,
                secrets=secrets,
                touch=touch,
                flight=flight,
                bucket=att.bucket,
                refused=refused,
            )
            return
        up = await self._connect(att, target, ip, port, local, answer=(writer, reader))
        if up is None:
            return
        up_r, up_w = up
        conn.upstream = up_w
        try:
            await httprelay.relay(
                tlsstream.PlainStream(reader, writer, initial=head),
                tlsstream.PlainStream(up_r, up_w),
                secrets,
                touch,
                name=name,
                flight=flight,
                bucket=att.bucket,
                refused=refused,
            )
        finally:
            up_w.transport.abort()
        await _end_gently(reader, writer)

    def _log_refusal(self, att: _Attached, target: str, rule: str) -> None:
        """At most LOG_REFUSALS lines per sandbox per 10 s (a sandbox must not flood the log)."""
        now = time.monotonic()
        if now - att.log_window >= 10:
            if att.logged > LOG_REFUSALS:
                log.info(
                    "egress refused %d more connection(s) in 10 s (not logged one by one)",
                    att.logged - LOG_REFUSALS,
                    extra={"sandbox_id": att.sid},
                )
            att.log_window, att.logged = now, 0
        att.logged += 1
        if att.logged <= LOG_REFUSALS:
            log.info("egress refused: %s, %s", target, rule, extra={"sandbox_id": att.sid, "reason": rule})

    def never_reachable(self, ip: str) -> str | None:
        """Destinations no policy opens: the host itself (any of its addresses), loopback,
        link-local (cloud metadata), multicast and reserved ranges, the sandboxes' own /30."""
        addr = ipaddress.IPv4Address(ip)
        if any(addr in n for n in _NEVER):
            return f"{ip} is never reachable from a sandbox (loopback, link-local/metadata, reserved or atoll's own)"
        if ip in self.host_addresses():
            return f"{ip} is an address of the sandbox's host, which is never reachable from a sandbox"
        return None

    def host_addresses(self) -> frozenset[str]:
        now = time.monotonic()
        if now - self._host_addrs[0] > 10:
            self._host_addrs = (now, _local_addresses())
        return self._host_addrs[1]


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


async def _first_bytes(reader: asyncio.StreamReader) -> tuple[bytes, str, str | None]:
    """Read until the first bytes say what they are: (bytes, "tls"|"http"|"", name or None)."""
    data = b""
    while True:
        chunk = await reader.read(sniff.MAX_HEAD - len(data))
        if not chunk:
            return data, "", None
        data += chunk
        if sniff.looks_tls(data):
            if sniff.tls_record_complete(data) or len(data) >= sniff.MAX_HEAD:
                return data, "tls", sniff.client_hello_sni(data)
        elif sniff.looks_http(data) or (len(data) < 8 and data.isalpha()):
            try:
                host = sniff.http_host(data)
            except sniff.Malformed as e:
                e.http, e.data = True, data
                raise
            if host is not None:
                return data, "http", host
        else:
            return data, "", None
        if len(data) >= sniff.MAX_HEAD:
            e = sniff.Malformed(f"no complete request head in the first {sniff.MAX_HEAD} bytes")
            e.data = data
            raise e


def _moved(conn: _Conn, att: _Attached, req: bool, n: int = 0) -> None:
    """Bytes moved (`n` when known): activity, and what the in-use guess of _Conn.busy reads."""
    now = time.monotonic()
    conn.last_io = att.last_io = now
    if req:
        if n:
            conn.last_req, conn.answered = now, 0
    else:
        conn.answered += n


async def _to_upstream(
    src: asyncio.StreamReader, up: asyncio.StreamWriter, conn: _Conn, att: _Attached
) -> None:
    try:
        await splice.copy(src, up, lambda n: _moved(conn, att, True, n))
        conn.sandbox_closed.set()
        if up.can_write_eof():
            up.write_eof()
    except (OSError, ConnectionError):
        up.transport.abort()


async def _to_sandbox(
    up: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Conn, att: _Attached
) -> None:
    try:
        await splice.copy(up, dst, lambda n: _moved(conn, att, False, n))
        # The upstream is done. A FIN to a sandbox that closes at the same moment puts its endpoint
        # in TIME_WAIT, which this runsc cannot checkpoint (and the gate cannot see): so give it a
        # moment to close first (an HTTP client that read its Content-Length does), and then
        # answer with an RST; only a sandbox still reading gets a FIN (then the TIME_WAIT is ours).
        try:
            await asyncio.wait_for(conn.sandbox_closed.wait(), CLOSE_FIRST_S)
        except TimeoutError:
            if dst.can_write_eof():
                dst.write_eof()
    except (OSError, ConnectionError):
        dst.transport.abort()


END_WAIT_S = 10.0
"""After a FIN, how long the sandbox may take to read what is left and close its side."""


async def _end_gently(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The relay is over but the sandbox has not closed (an answer delimited by the upstream's
    close, say): let it close first (CLOSE_FIRST_S), else send a FIN and wait for its close — an
    RST now would drop what it has not read yet (the caller's RST comes after either)."""
    if reader.at_eof() or writer.transport.is_closing():
        return
    with contextlib.suppress(OSError, ConnectionError):
        try:
            await asyncio.wait_for(_discard(reader, DISCARD_MAX), CLOSE_FIRST_S)
            return
        except TimeoutError:
            pass
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_discard(reader, DISCARD_MAX), END_WAIT_S)


async def _flush_then_reset(writer: asyncio.StreamWriter, conn: _Conn, within: float = 2.0) -> None:
    """End the sandbox's side with an RST once what was written reached it (an RST drops what
    the kernel still holds unsent)."""
    sock = writer.get_extra_info("socket")
    deadline = time.monotonic() + within
    with contextlib.suppress(OSError, ValueError):
        while sock is not None and time.monotonic() < deadline:
            if writer.transport.get_write_buffer_size() == 0 and _unsent(sock) == 0:
                break
            await asyncio.sleep(0.01)
    _reset(writer, conn)


def _unsent(sock: socket.socket) -> int:
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))  # SIOCOUTQ
    return struct.unpack("i", buf)[0]


def _local_addresses() -> frozenset[str]:
    """Every IPv4 address of this host's (the worker's) namespace, from the kernel's FIB."""
    out: set[str] = set()
    try:
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    for prev, line in zip(lines, lines[1:], strict=False):
        if "/32 host LOCAL" in line:
            parts = prev.split()
            if parts and parts[-1].count(".") == 3:
                out.add(parts[-1])
    return frozenset(out)


async def _answer(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, status: int, body: str) -> None:
    reason = {
        400: "Bad Request",
        403: "Forbidden",
        502: "Bad Gateway",
        431: "Request Header Fields Too Large",
    }.get(status, "Error")
    data = body.encode()
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(data)}\r\nconnection: close\r\nx-atoll-egress: refused\r\n\r\n".encode()
        + data
    )
    with contextlib.suppress(OSError, ConnectionError, TimeoutError):
        await writer.drain()
        # let the client read it and close first (then the reset loses nothing); what it still
        # sends is read and dropped, at most DISCARD_MAX bytes
        await asyncio.wait_for(_discard(reader, DISCARD_MAX), 2.0)


async def _discard(reader: asyncio.StreamReader, limit: int) -> None:
    n = 0
    while n < limit:
        chunk = await reader.read(min(65536, limit - n))
        if not chunk:
            return
        n += len(chunk)


async def _refuse_http(
    sid: str,
    writer: asyncio.StreamWriter,
    reader: asyncio.StreamReader,
    name: str | None,
    ip: str,
    port: int,
    rule: str,
) -> None:
    if "never reachable" in rule:
        hint = "No policy can allow it."
    elif name is not None and "does not resolve" in rule:
        hint = f"{name!r} is allowed, but only to the addresses it resolves to for atoll."
    elif name is not None:
        hint = f"To allow it, add {name!r} (or {ip!r} for this address only) to allow_out"
        hint += f": PUT /v1/sandboxes/{sid}/network or sandbox.set_network(allow_out=[...])."
    else:
        hint = f"To allow it, add {ip!r} (or {ip + ':' + str(port)!r}) to allow_out"
        hint += f": PUT /v1/sandboxes/{sid}/network or sandbox.set_network(allow_out=[...])."
    where = f"{name} ({ip}:{port})" if name else f"{ip}:{port}"
    await _answer(
        writer,
        reader,
        403,
        f"atoll egress gateway: the connection to {where} is refused by this sandbox's network "
        f"policy ({rule}).\n{hint}\n",
    )

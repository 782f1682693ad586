"""A small HTTP/1.1 client over asyncio streams and h11, with kept-alive connections.

The worker's channel to each guest agent (worker.agent_channel: sockets made inside a sandbox's
host-side netns) and the control plane's channel to each worker (controlplane.remote_worker) are
both this. h11 is the sans-IO HTTP/1.1 library httpcore builds on; going without httpx's pool and
anyio layers takes ~1 ms off every call (measured on the exec path), which is why it exists.
Requests go out with one write when small (a small request is one segment), bodies are streamed
both ways in chunks, answers read whole are bounded (`AnswerTooLarge`), and a GET on a kept-alive
connection that turns out dead is retried once on a fresh one. Sockets have TCP_NODELAY. A channel may be TLS (the control plane's to an https:// worker),
with a check of the peer's certificate on every new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import select
import socket
import ssl
import typing
import urllib.parse

import h11

_READ = 256 * 1024
_UPLOAD_CHUNK = 1024 * 1024
# Answers read whole (listings, process tables, errors) are capped; exec answers and files are
# relayed chunk by chunk (`stream`) and never held whole.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
DRAIN_S = 2.0
DRAIN_BYTES = 64 * 1024
"""A stream its caller marked `finished` is read to its end in the background within these bounds
(the line after a command's exit, the chunked terminator), and its connection is then kept for
the next call instead of being closed (a new connection costs a connect and the peer an accept:
~0.5 ms of the E2B edge's envd `Start`)."""


class ChannelError(Exception):
    """The peer could not be reached or broke the protocol (connect, timeout, reset, bad HTTP)."""


class ConnectFailed(ChannelError):
    """No connection could be made (refused, unreachable, timed out): the peer is not there."""


class AnswerTooLarge(ChannelError):
    """An answer read whole was larger than the limit (e.g. a listing of a huge directory)."""


class Response:
    """What the peer answered: status, headers, and the body (read whole or streamed)."""

    def __init__(
        self,
        status_code: int,
        headers: dict[str, str],
        body: typing.AsyncIterator[bytes] | None = None,
        abort: typing.Callable[[], None] | None = None,
    ):
        self.status_code = status_code
        self.headers = headers
        self._body_iter = body
        self._abort = abort
        self.content = b""
        self.done = False

    def finished(self) -> None:
        """The caller has what it needs and what is left is only the answer's end (say the line
        after a command's exit): leaving the stream early then keeps the connection (DRAIN_S)
        instead of closing it, which is what a stream left early means otherwise (the peer sees
        the caller gone)."""
        self.done = True

    def abort(self) -> None:
        """Close the connection the body comes on: a read waiting on it ends with ChannelError
        (the edge's watchdog ends a call to a frozen worker so)."""
        if self._abort is not None:
            self._abort()

    async def aread(self, limit: int = MAX_ANSWER_BYTES) -> bytes:
        """Read the whole body, bounded (a guest agent, for one, is untrusted)."""
        if self._body_iter is not None:
            parts, n = [], 0
            async for c in self._body_iter:
                n += len(c)
                if n > limit:
                    raise AnswerTooLarge(f"the peer's answer exceeds {limit} bytes; refusing to buffer it")
                parts.append(c)
            self.content = b"".join(parts)
            self._body_iter = None
        return self.content

    async def close_body(self) -> None:
        """Close what reads the body (a `wrap_body` wrapper too) when the answer is left: not left
        to the garbage collector, whose asyncio hook costs a loop wake-up and a task each. One
        still being read elsewhere (`already running`) ends with its reader."""
        body, self._body_iter = self._body_iter, None
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):
                await aclose()

    def wrap_body(
        self, wrap: typing.Callable[[typing.AsyncIterator[bytes]], typing.AsyncIterator[bytes]]
    ) -> None:
        """Route the body still to be read through `wrap` (the worker adds a liveness watch)."""
        if self._body_iter is not None:
            self._body_iter = wrap(self._body_iter)

    async def aiter_raw(self) -> typing.AsyncIterator[bytes]:
        if self._body_iter is None:
            if self.content:
                yield self.content
            return
        async for chunk in self._body_iter:
            yield chunk
        self._body_iter = None

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> typing.Any:
        return jsonlib.loads(self.content)


class _Conn:
    def __init__(self, sock: socket.socket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.sock = sock
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.aborted = False  # by abort_now: its request must end, not be sent again

    async def send(self, *events: typing.Any) -> None:
        """Send h11 events with one write: a small request goes out as one segment, so the agent
        (every recv costs ~70 us in gVisor, a wake-up more) reads head and body at once."""
        data = b"".join(self.h11.send(ev) or b"" for ev in events)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def next_event(self) -> typing.Any:
        while True:
            ev = self.h11.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            data = await self.reader.read(_READ)
            if not data:
                raise ChannelError("the peer closed the connection")
            self.h11.receive_data(data)

    def stale(self) -> bool:
        """An idle connection with something to read has been closed (or broken) by the peer."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable) or self.reader.at_eof() or self.writer.transport.is_closing()

    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.writer.transport.abort()  # with SO_LINGER 0 (agent channels): an RST, no TIME_WAIT
        with contextlib.suppress(OSError):
            self.sock.close()


class Channel:
    """HTTP/1.1 client bound to one peer (`host:port`), its connections kept alive and reused.
    `make_socket` makes a non-blocking TCP socket (subclasses make it elsewhere, e.g. in a netns).
    With `tls`, every connection is TLS (the context checks the chain and `ip`, the host name, as
    it is configured to) and `check_peer` is then given the peer's certificate (DER, None if it
    sent none) before a request goes out: raising ValueError refuses the peer (ConnectFailed)."""

    def __init__(
        self,
        ip: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        check_peer: typing.Callable[[bytes | None], None] | None = None,
    ):
        self._addr = (ip, port)
        self._host = f"{ip}:{port}"
        self._tls = tls
        self._check_peer = check_peer
        self._idle: list[_Conn] = []
        self._open: set[_Conn] = set()
        self._draining: set[asyncio.Task] = set()

    async def make_socket(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._addr[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        return sock

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        sock = await self.make_socket()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, self._addr), 5)
            if self._tls is None:
                reader, writer = await asyncio.open_connection(sock=sock, limit=_READ)
            else:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        sock=sock, limit=_READ, ssl=self._tls, server_hostname=self._addr[0]
                    ),
                    5,
                )
        except (OSError, TimeoutError) as e:  # ssl.SSLError (a refused certificate) is an OSError
            sock.close()
            raise ConnectFailed(f"connect to {self._host} failed: {e!r}") from e
        except BaseException:
            sock.close()
            raise
        if self._tls is not None and self._check_peer is not None:
            tls_object = writer.get_extra_info("ssl_object")
            try:
                self._check_peer(tls_object.getpeercert(binary_form=True) if tls_object else None)
            except ValueError as e:
                writer.transport.abort()
                sock.close()
                raise ConnectFailed(f"{self._host} refused: {e}") from e
        conn = _Conn(sock, reader, writer)
        self._open.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        if conn.reusable():
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.close()
            self._open.discard(conn)

    def _discard(self, conn: _Conn) -> None:
        conn.close()
        self._open.discard(conn)

    def _drain(self, conn: _Conn) -> None:
        """Read a finished stream's answer to its end, then keep the connection (`Response.finished`):
        at once when what was read holds the end, else in the background within DRAIN_S and
        DRAIN_BYTES; anything else (more than that, another event, an error) closes it."""
        try:
            while True:
                ev = conn.h11.next_event()
                if ev is h11.NEED_DATA:
                    break
                if isinstance(ev, h11.EndOfMessage):
                    self._release(conn)
                    return
                if not isinstance(ev, h11.Data) or len(ev.data) > DRAIN_BYTES:
                    self._discard(conn)
                    return
        except h11.ProtocolError:
            self._discard(conn)
            return
        task = asyncio.ensure_future(self._drain_later(conn))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain_later(self, conn: _Conn) -> None:
        n = 0
        try:
            async with asyncio.timeout(DRAIN_S):
                while conn in self._open:
                    ev = await conn.next_event()
                    if isinstance(ev, h11.Data) and n + len(ev.data) <= DRAIN_BYTES:
                        n += len(ev.data)
                        continue
                    if isinstance(ev, h11.EndOfMessage) and conn in self._open and not conn.aborted:
                        self._release(conn)
                        return
                    break
        except (TimeoutError, OSError, h11.ProtocolError, ChannelError):
            pass
        self._discard(conn)

    async def _start(
        self,
        method: str,
        url: str,
        params: dict[str, str | bytes] | None,
        json: typing.Any,
        content: bytes | typing.AsyncIterator[bytes] | None,
        headers: dict[str, str] | None,
    ) -> tuple[_Conn, h11.Response]:
        target = url + ("?" + urllib.parse.urlencode(params) if params else "")
        hdrs = [("Host", self._host)] + [(k, v) for k, v in (headers or {}).items()]
        names = {k.lower() for k, _ in hdrs}
        body: bytes | None = None
        if json is not None:
            body = jsonlib.dumps(json).encode()
            hdrs.append(("Content-Type", "application/json"))
        elif isinstance(content, (bytes, bytearray)):
            body = bytes(content)
        if body is not None:
            hdrs.append(("Content-Length", str(len(body))))
        elif content is not None and "content-length" not in names:
            hdrs.append(("Transfer-Encoding", "chunked"))
        elif content is None and method in ("POST", "PUT"):
            hdrs.append(("Content-Length", "0"))
        conn = None
        while self._idle and conn is None:
            conn = self._idle.pop()
            if conn.stale():  # the peer closed it while it sat idle (a keep-alive timeout, say)
                self._discard(conn)
                conn = None
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        try:
            request = h11.Request(method=method, target=target, headers=hdrs)
            if body is not None and len(body) <= _UPLOAD_CHUNK:
                await conn.send(request, *([h11.Data(data=body)] if body else []), h11.EndOfMessage())
            elif content is None and body is None:
                await conn.send(request, h11.EndOfMessage())
            else:
                await conn.send(request)
                if body is not None:
                    for i in range(0, len(body), _UPLOAD_CHUNK):
                        await conn.send(h11.Data(data=body[i : i + _UPLOAD_CHUNK]))
                else:
                    async for chunk in content:  # type: ignore[union-attr]
                        for i in range(0, len(chunk), _UPLOAD_CHUNK):
                            await conn.send(h11.Data(data=chunk[i : i + _UPLOAD_CHUNK]))
                await conn.send(h11.EndOfMessage())
            while True:
                ev = await conn.next_event()
                if isinstance(ev, h11.Response):
                    return conn, ev
                if isinstance(ev, h11.InformationalResponse):
                    continue
                raise ChannelError(f"unexpected answer from the peer: {ev!r}")
        except (OSError, h11.ProtocolError, ChannelError) as e:
            self._discard(conn)
            if (
                reused
                and not conn.aborted
                and method == "GET"
                and isinstance(e, (ConnectionError, ChannelError))
            ):
                # A kept-alive connection may have died: retry an idempotent request once, fresh.
                return await self._start(method, url, params, json, content, headers)
            raise ChannelError(f"request {method} {url} to the peer failed: {e!r}") from e
        except BaseException:
            self._discard(conn)
            raise

    async def _body(self, conn: _Conn) -> typing.AsyncIterator[bytes]:
        try:
            while True:
                ev = await conn.next_event()
                if isinstance(ev, h11.Data):
                    yield bytes(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    self._release(conn)
                    return
                else:
                    raise ChannelError(f"unexpected event in the peer's answer: {ev!r}")
        except (OSError, h11.ProtocolError) as e:
            self._discard(conn)
            raise ChannelError(f"reading the peer's answer failed: {e!r}") from e
        except GeneratorExit:
            raise  # left early: `stream` keeps (a finished answer) or closes the connection
        except BaseException:
            if conn in self._open and conn not in self._idle:
                self._discard(conn)
            raise

    async def request(
        self, method: str, url: str, *, timeout: float | None = 30, **kw: typing.Any
    ) -> Response:
        """Send a request (same keywords as `stream`) and read the whole answer, all within `timeout`
        (None = unbounded)."""
        try:
            async with asyncio.timeout(timeout), self.stream(method, url, timeout=None, **kw) as resp:
                await resp.aread()
                return resp
        except TimeoutError:
            raise ChannelError(f"the peer did not answer {method} {url} within {timeout}s") from None

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        params: dict[str, str | bytes] | None = None,
        json: typing.Any = None,
        content: bytes | typing.AsyncIterator[bytes] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = 30,
    ) -> typing.AsyncIterator[Response]:
        """Send a request; yield the answer with its body still to be streamed (`aiter_raw`)."""
        try:
            async with asyncio.timeout(timeout):
                conn, head = await self._start(method, url, params, json, content, headers)
        except TimeoutError:
            raise ChannelError(f"the peer did not answer {method} {url} within {timeout}s") from None
        body = self._body(conn)
        resp = Response(head.status_code, _headers(head), body, abort=lambda: self._discard(conn))
        try:
            yield resp
        finally:
            await resp.close_body()
            await body.aclose()
            if conn in self._open and conn not in self._idle:
                if resp.done and not conn.aborted and conn.h11.our_state is h11.DONE:
                    self._drain(conn)  # only the answer's end is left: keep the connection
                else:
                    self._discard(conn)  # the caller stopped early: drop the half-read connection

    def abort_now(self) -> None:
        """Reset every connection (a call waiting on one ends with ChannelError); with SO_LINGER 0
        sockets (agent channels) each is an RST, so no TIME_WAIT lands inside a sandbox."""
        for task in list(self._draining):
            task.cancel()
        for conn in list(self._open):
            conn.aborted = True
            conn.close()
        self._open.clear()
        self._idle.clear()

    async def abort_all(self) -> None:
        self.abort_now()

    async def aclose(self) -> None:
        await self.abort_all()


def _headers(resp: h11.Response) -> dict[str, str]:
    return {k.decode().lower(): v.decode(errors="replace") for k, v in resp.headers}

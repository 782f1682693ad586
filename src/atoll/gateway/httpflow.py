"""HTTP/1.1 messages as events, parsed by llhttp (httptools): the egress gateway's fast parser.

A `Reader` turns one direction of a connection into events: a `Head` (request or status line and
headers, exactly as sent: names keep their case and order), body `Data` (de-chunked, and joined
per read — a thousand 1-byte chunks in one read are one event), `End` (with trailers), or
`Switched` (after an upgrade: the bytes that follow are not HTTP). llhttp parses in C, so the
per-chunk cost that made the pure-Python parser (h11) a lever for a sandbox to stall the gateway is
gone; what parsing remains is measured and charged to the sandbox (gateway.fairshare).

`encode_head` and `Framer` write messages back out: heads as given, bodies framed as they came
(chunked stays chunked, re-chunked per event; a length stays a length; a response delimited by the
upstream's close stays so). Limits: a head over MAX_HEAD bytes is refused (431), as are requests
with both Content-Length and Transfer-Encoding (llhttp refuses them too) — what a request smuggler
would need. Called by gateway.httprelay.
"""

from __future__ import annotations

import collections
import dataclasses
import typing

import httptools

from atoll.gateway import fairshare

MAX_HEAD = 64 * 1024
READ = 65536


class Malformed(Exception):
    """What came is not HTTP/1.1 the gateway relays: `status` is the answer it deserves."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status, self.text = status, text


@dataclasses.dataclass
class Head:
    headers: list[tuple[bytes, bytes]]
    version: str = "1.1"
    method: bytes = b""
    target: bytes = b""
    status: int = 0
    reason: bytes = b""
    chunked: bool = False
    length: int | None = None
    upgrade: bool = False

    def values(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name]

    def tokens(self, name: bytes) -> set[bytes]:
        return {t.strip().lower() for v in self.values(name) for t in v.split(b",")}


@dataclasses.dataclass
class Data:
    data: bytes


@dataclasses.dataclass
class End:
    trailers: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)
    keep_alive: bool = True


@dataclasses.dataclass
class Switched:
    rest: bytes


Event = Head | Data | End | Switched


class Stream(typing.Protocol):
    async def read(self, n: int = ...) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...

    def abort(self) -> None: ...


class _Closed(Exception):
    pass


class Reader:
    """Events of one direction (`response=False`: a client's requests)."""

    def __init__(
        self,
        stream: Stream,
        *,
        response: bool,
        bucket: fairshare.Bucket | None = None,
        touch: typing.Callable[[], None] = lambda: None,
    ):
        self.stream = stream
        self.response = response
        self.bucket = bucket
        self.touch = touch
        self.events: collections.deque[Event] = collections.deque()
        self.eof = False
        self.head_only = False
        """The next response answers a HEAD request: it ends with its head."""
        self.switched = False
        self._error: Malformed | None = None
        self._new_parser()

    def _new_parser(self) -> None:
        self.parser = (
            httptools.HttpResponseParser(self) if self.response else httptools.HttpRequestParser(self)
        )
        self._in_head = False
        self._head_bytes = 0
        self._head_fed = 0
        """Bytes fed while a head was incomplete (a header's value grows inside httptools)."""
        self._body: list[bytes] = []
        self._message_open = False
        self._cur: Head | None = None
        self._url = b""
        self._reason = b""
        self._trailers: list[tuple[bytes, bytes]] = []

    # ---- llhttp's callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_head, self._message_open = True, True
        self._head_bytes, self._head_fed, self._url, self._reason = 0, 0, b"", b""
        self._cur = Head(headers=[])
        self._trailers = []

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._grow(len(url))

    def on_status(self, reason: bytes) -> None:
        self._reason += reason
        self._grow(len(reason))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)
        if self._in_head:
            assert self._cur is not None
            self._cur.headers.append((name, value))
        else:
            self._trailers.append((name, value))

    def on_headers_complete(self) -> None:
        head = self._cur
        assert head is not None
        self._in_head, self._head_fed = False, 0
        head.version = self.parser.get_http_version()
        head.upgrade = self.parser.should_upgrade()
        te = head.tokens(b"transfer-encoding")
        cl = head.values(b"content-length")
        if te and cl:
            raise Malformed(400, "the message has both Content-Length and Transfer-Encoding")
        head.chunked = b"chunked" in te
        if cl:
            try:
                head.length = int(cl[0])
            except ValueError:
                raise Malformed(400, "the Content-Length is not a number") from None
        if self.response:
            head.status = self.parser.get_status_code()  # type: ignore[union-attr]
            head.reason = self._reason
        else:
            head.method = self.parser.get_method()  # type: ignore[union-attr]
            head.target = self._url
        self.events.append(head)
        if self.response and self.head_only and head.status >= 200:
            # llhttp cannot be told that a response to HEAD has no body: stop it here
            raise _HeadOnly()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._flush_body()
        self._message_open = False
        self.events.append(End(self._trailers, self.parser.should_keep_alive()))

    # ---- reading ----------------------------------------------------------------------------------
    def _grow(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD:
            raise Malformed(431, f"the head is longer than {MAX_HEAD} bytes")

    def _flush_body(self) -> None:
        if self._body:
            self.events.append(Data(b"".join(self._body)))
            self._body = []

    async def next(self) -> Event | None:
        """The next event; None at the end of the stream between messages. Raises Malformed,
        ConnectionError (the stream ended inside a message), OSError."""
        while not self.events:
            if self._error is not None:
                raise self._error
            if self.eof or self.switched:
                return None
            if self.bucket is not None:
                await self.bucket.wait()
            data = await self.stream.read(READ)
            if not data:
                self.eof = True
                self._at_eof()
                continue
            self.touch()
            try:
                self.feed(data)
            except Malformed as e:
                if not self.events:
                    raise
                self._error = e  # what parsed before the error goes first (a streaming parser's order)
        return self.events.popleft()

    def feed(self, data: bytes) -> None:
        with fairshare.Meter(self.bucket):
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                self._flush_body()
                self.switched = True
                self.events.append(Switched(data[int(e.args[0]) :]))
                return
            except httptools.HttpParserCallbackError as e:
                cause = e.__context__
                if isinstance(cause, _HeadOnly):
                    self.head_only = False
                    self.events.append(End([], True))
                    self._new_parser()
                    return
                if isinstance(cause, Malformed):
                    raise cause from None
                raise Malformed(400, f"malformed HTTP/1.1 ({type(cause).__name__})") from None
            except httptools.HttpParserError as e:
                text = _reason(e)
                if "Content-Length" in text and "Transfer-Encoding" in text:  # llhttp's own check
                    raise Malformed(
                        400, "the message has both Content-Length and Transfer-Encoding"
                    ) from None
                raise Malformed(400, f"malformed HTTP/1.1 ({text})") from None
            self._flush_body()
            if self._in_head:
                self._head_fed += len(data)
                if self._head_fed > MAX_HEAD:
                    raise Malformed(431, f"the head is longer than {MAX_HEAD} bytes")

    def _at_eof(self) -> None:
        if not self._message_open:
            return
        head = self._cur
        if (
            self.response
            and not self._in_head
            and head is not None
            and not head.chunked
            and head.length is None
        ):
            self._flush_body()  # a body delimited by the close: it is complete
            self._message_open = False
            self.events.append(End([], False))
            return
        raise ConnectionResetError("the connection ended inside a message")


class _HeadOnly(Exception):
    pass


def _reason(e: Exception) -> str:
    text = str(e)
    return text[:120] if text else type(e).__name__


def upstream_closes(head: Head, method: bytes) -> bool:
    """Whether the response's end is the upstream's close (no length, not chunked, has a body)."""
    if head.status < 200 or head.status in (204, 304) or method == b"HEAD":
        return False
    return not head.chunked and head.length is None


def encode_head(head: Head, extra: typing.Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    if head.status:
        line = b"HTTP/%s %d %s\r\n" % (head.version.encode(), head.status, head.reason)
    else:
        line = b"%s %s HTTP/%s\r\n" % (head.method, head.target, head.version.encode())
    return line + b"".join(k + b": " + v + b"\r\n" for k, v in (*head.headers, *extra)) + b"\r\n"


class Framer:
    """A body written out as it came in (chunked, or raw for a length or a close)."""

    def __init__(self, chunked: bool):
        self.chunked = chunked

    def data(self, data: bytes) -> bytes:
        if not data:
            return b""
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    def end(self, trailers: typing.Sequence[tuple[bytes, bytes]] = ()) -> bytes:
        if not self.chunked:
            return b""
        return b"0\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in trailers) + b"\r\n"

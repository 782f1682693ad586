"""The egress gateway's HTTP/1.1 relay: request by request, each one checked, placeholders replaced.

Plain HTTP always goes through here (each request's Host must be the name the connection was
decided for: a request for another name needs a connection of its own), and so does HTTPS to a
secret's host once the gateway terminated it (gateway.intercept). For each request: CONNECT,
absolute-form targets and two framings are refused with the gateway's own answer; the secrets that
apply are decided now (gateway.placeholders: the one rule) and their placeholders replaced in the
target and in header values (a value that would break the head — CR, LF, NUL — is refused, so a
secret cannot inject headers); the body streams through as it comes, the response too (1xx
first). A `101 Switching Protocols` turns the connection into bytes both ways. A request in flight
keeps the connection busy (`flight`), so no checkpoint resets it under a slow answer.

Parsing is llhttp's (gateway.httpflow), measured and charged to the sandbox's fair share
(gateway.fairshare): a sandbox that makes the gateway parse more than its share is slowed.
Secret values never appear in logs or in the gateway's own answers.
Called by gateway.egress (plain HTTP) and gateway.intercept (HTTPS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import typing

from atoll.core import netpolicy
from atoll.gateway import fairshare, httpflow, placeholders

log = logging.getLogger(__name__)
ANSWER_WAIT_S = 2.0
DISCARD_MAX = 64 * 1024
"""After the gateway's own answer, what the client still sends is read and dropped (at most
this much, for at most ANSWER_WAIT_S), so it reads the answer before the connection ends."""
_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
}
_NONE, _UPSTREAM, _GATEWAY = "nobody", "upstream", "gateway"

SecretsFor = typing.Callable[[], typing.Awaitable[placeholders.Decision]]
"""The secrets decision for the next request (asked anew for each: a secret replaced, deleted or
a name that now resolves elsewhere applies at once)."""


class Stream(httpflow.Stream, typing.Protocol):
    pass


def _host_of(head: httpflow.Head) -> str | None:
    """The request's Host, normalized like the policy's names (no port, lower case, no final dot)."""
    hosts = head.values(b"host")
    if not hosts:
        return None
    text = hosts[0].decode("latin-1").strip()
    if text.startswith("["):
        return text.split("]")[0] + "]"
    return netpolicy.normalize_name(text.rsplit(":", 1)[0] if ":" in text else text)


def _fits_head(value: bytes) -> bool:
    return b"\r" not in value and b"\n" not in value and b"\x00" not in value


def _fits_target(target: bytes) -> bool:
    return all(32 < c < 127 for c in target)


async def relay(
    client: Stream,
    upstream: Stream,
    secrets: SecretsFor,
    touch: typing.Callable[[], None],
    *,
    name: str = "",
    flight: typing.Callable[[bool], None] | None = None,
    bucket: fairshare.Bucket | None = None,
    refused: typing.Callable[[str], None] | None = None,
) -> None:
    """Relay HTTP/1.1 exchanges from `client` to `upstream` until either side ends. With `name`
    (the name the connection was decided and opened for), every request must carry that Host;
    another is answered 403 and never reaches the upstream. `refused(why)` is called for each
    request that carried a placeholder the rule did not let through. Returns when the connection
    is over; the caller closes both streams. Raises nothing but cancellation."""
    try:
        await _Relay(client, upstream, secrets, touch, name, flight, bucket, refused).run()
    except asyncio.CancelledError:
        raise
    except (OSError, ssl.SSLError, TimeoutError, EOFError, httpflow.Malformed) as e:
        # no message: a parser's error may quote a header, and headers carry secrets now
        log.debug("relayed connection ended: %s", type(e).__name__)
    except Exception as e:  # noqa: BLE001 - what a sandbox sends must not end the gateway's task badly
        log.error("relayed connection failed: %s", type(e).__name__)
        log.debug("relayed connection failed", exc_info=True)


class _Relay:
    def __init__(
        self,
        client: Stream,
        upstream: Stream,
        secrets: SecretsFor,
        touch: typing.Callable[[], None],
        name: str,
        flight: typing.Callable[[bool], None] | None,
        bucket: fairshare.Bucket | None,
        refused: typing.Callable[[str], None] | None,
    ):
        self.client, self.upstream, self.touch = client, upstream, touch
        self.secrets = secrets
        self.name = name
        self.flight = flight or (lambda _on: None)
        self.refused = refused or (lambda _why: None)
        self.requests = httpflow.Reader(client, response=False, bucket=bucket, touch=touch)
        self.responses = httpflow.Reader(upstream, response=True, bucket=bucket, touch=touch)
        self.answer = _NONE  # who answers the client in this exchange: nobody yet, upstream or gateway
        self.reuse = True  # the request's side allows another exchange on the connection
        self.upstream_rest = b""

    async def run(self) -> None:
        while True:
            self.answer = _NONE
            try:
                ev = await self.requests.next()
            except httpflow.Malformed as e:
                await self._refuse(e.status, e.text)
                return
            if not isinstance(ev, httpflow.Head):
                return
            self.reuse = not ev.upgrade
            self.flight(True)
            try:
                outcome = await self._exchange(ev)
            finally:
                self.flight(False)
            if outcome == "switched":
                await self._raw()
                return
            if outcome != "done":
                return

    async def _exchange(self, req: httpflow.Head) -> str:
        """One request and its response: "done" (the connection may carry another), "switched"
        (to raw bytes) or "ended"."""
        if req.method == b"CONNECT":
            await self._refuse(405, "CONNECT is not relayed: the gateway is not a proxy (connect directly)")
            return "ended"
        if not (req.target.startswith(b"/") or req.target == b"*"):
            # absolute-form names its own authority, which a server must prefer to Host (RFC 9112
            # 3.2.2): a request that names another site than the one checked must not pass
            await self._refuse(
                400, "the request target must be a path (origin-form); the gateway is not a proxy"
            )
            return "ended"
        if len(req.values(b"host")) > 1:
            await self._refuse(400, "the request has more than one Host header")
            return "ended"
        if self.name:
            host = _host_of(req)
            if host != self.name:
                await self._refuse(
                    403,
                    f"this connection was opened for {self.name!r}; a request for {host!r} needs a "
                    "connection of its own (the policy and the secrets were checked for the first name)",
                )
                return "ended"
        decision = await self.secrets()
        target = placeholders.substitute(req.target, decision.apply)
        headers = [(k, placeholders.substitute(v, decision.apply)) for k, v in req.headers]
        if not _fits_target(target) or not all(_fits_head(v) for _, v in headers):
            await self._refuse(
                400, "the request cannot be forwarded: a secret's value is not valid where its placeholder is"
            )
            return "ended"
        if decision.refused and (
            placeholders.carries(req.target, decision.refused)
            or any(placeholders.carries(v, decision.refused) for _, v in req.headers)
        ):
            self.refused(decision.why)
        out = httpflow.Head(headers=headers, version=req.version, method=req.method, target=target)
        await self.upstream.write(httpflow.encode_head(out))
        self.touch()
        self.responses.head_only = req.method == b"HEAD"
        body = asyncio.ensure_future(self._request_body(req))
        response = asyncio.ensure_future(self._response(req))
        try:
            # concurrently: a client may wait for `100 Continue` before it sends the body, and an
            # upstream may answer before the body is all there
            done, _ = await asyncio.wait({body, response}, return_when=asyncio.FIRST_COMPLETED)
            if body in done and not body.result():
                return "ended"
            outcome = await response
            if outcome == "done" and not body.done():
                return "ended"  # answered before the body was all there: it has nowhere to go
            if outcome != "ended" and not await body:
                return "ended"
            return outcome
        finally:
            for t in (body, response):
                t.cancel()
            await asyncio.gather(body, response, return_exceptions=True)

    async def _request_body(self, req: httpflow.Head) -> bool:
        """Stream the request body upstream; False when the client broke off (or sent bad HTTP)."""
        framer = httpflow.Framer(req.chunked)
        while True:
            try:
                ev = await self.requests.next()
            except httpflow.Malformed as e:
                await self._refuse(e.status, f"malformed request body: {e.text}")
                return False
            if isinstance(ev, httpflow.Data):
                await self.upstream.write(framer.data(ev.data))
            elif isinstance(ev, httpflow.End):
                end = framer.end(ev.trailers)
                if end:
                    await self.upstream.write(end)
                self.reuse = self.reuse and ev.keep_alive
                return True
            else:
                return False

    async def _response(self, req: httpflow.Head) -> str:
        """Stream the response (1xx first) to the client: "done", "switched" or "ended"."""
        framer: httpflow.Framer | None = None
        switching = closes = False
        while True:
            try:
                ev = await self.responses.next()
            except httpflow.Malformed:
                return "ended"
            if ev is None:
                return "ended"
            if self.answer is _GATEWAY:
                return "ended"  # the gateway answered the client itself (a bad request body)
            if isinstance(ev, httpflow.Head):
                extra: list[tuple[bytes, bytes]] = []
                if ev.status == 101:
                    switching = True
                elif ev.status >= 200:
                    closes = httpflow.upstream_closes(ev, req.method) or (req.upgrade and ev.status != 101)
                    if closes and b"close" not in ev.tokens(b"connection"):
                        extra.append((b"Connection", b"close"))
                    framer = httpflow.Framer(ev.chunked and req.method != b"HEAD")
                self.answer = _UPSTREAM
                await self.client.write(httpflow.encode_head(ev, extra))
            elif isinstance(ev, httpflow.Data):
                if framer is not None:
                    await self.client.write(framer.data(ev.data))
            elif isinstance(ev, httpflow.End):
                if framer is None:  # the end of a 1xx (a 101's comes before the switch)
                    continue
                tail = framer.end(ev.trailers)
                if tail:
                    await self.client.write(tail)
                return "done" if self.reuse and ev.keep_alive and not closes else "ended"
            elif isinstance(ev, httpflow.Switched):
                self.upstream_rest = ev.rest
                return "switched" if switching else "ended"

    async def _refuse(self, status: int, text: str) -> None:
        """Answer the client with an error of the gateway's own, unless its answer has begun."""
        if self.answer is not _NONE:
            return
        self.answer = _GATEWAY
        await answer(self.client, status, f"atoll egress gateway: {text}\n")

    async def _raw(self) -> None:
        """After a protocol switch: bytes both ways, each side's end passed on to the other."""
        crest = b""
        while self.requests.events:  # the request's own Switched: what the client sent after it
            ev = self.requests.events.popleft()
            if isinstance(ev, httpflow.Switched):
                crest += ev.rest
        if not self.requests.switched:
            return  # the client never asked to switch
        await _both(
            self._pipe(self.client, self.upstream, crest),
            self._pipe(self.upstream, self.client, self.upstream_rest),
        )

    async def _pipe(self, src: Stream, dst: Stream, first: bytes) -> None:
        if first:
            self.touch()
            await dst.write(first)
        while data := await src.read(httpflow.READ):
            self.touch()
            await dst.write(data)
        await dst.write_eof()


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


async def answer(stream: Stream, status: int, text: str) -> None:
    """The gateway's own answer (plain text, `Connection: close`), best effort."""
    body = text.encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
        f"x-atoll-egress: {'refused' if status < 500 else 'error'}\r\n\r\n"
    )
    with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
        await asyncio.wait_for(stream.write(head.encode() + body), ANSWER_WAIT_S)
        if getattr(stream, "tls", False):
            # close_notify: a client reading to the end has it. (No FIN on plain TCP: a sandbox
            # closing at the same moment would be left in TIME_WAIT, see gateway.egress.)
            await asyncio.wait_for(stream.write_eof(), ANSWER_WAIT_S)
        await asyncio.wait_for(_discard(stream), ANSWER_WAIT_S)


async def _discard(stream: Stream) -> None:
    n = 0
    while n < DISCARD_MAX:
        data = await stream.read(httpflow.READ)
        if not data:
            return
        n += len(data)

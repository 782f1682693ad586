"""Byte streams the egress gateway's interception reads and writes: TLS over an asyncio stream pair
(`TLSStream`), and the same interface over plain TCP (`PlainStream`).

TLS runs through `ssl.MemoryBIO` and `SSLContext.wrap_bio` rather than `loop.start_tls`, because
the gateway has already read the sandbox's ClientHello (to decide the connection by its SNI) before
it decides to intercept: those bytes are fed to the TLS object first (`initial`). One task may read
while another writes (the relay does both); OpenSSL's output is flushed to the writer right after
each call, with no await in between, so records stay in order.
Called by gateway.intercept.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import tempfile
import typing

_READ = 65536


class TLSStream:
    """TLS over (reader, writer), either side. `initial`: bytes already read from `reader`.
    `meter` (a context manager factory, gateway.fairshare.Meter) measures each decryption."""

    tls = True

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ctx: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        initial: bytes = b"",
        meter: typing.Callable[[], typing.ContextManager] = contextlib.nullcontext,
    ):
        self.reader, self.writer = reader, writer
        self._meter = meter
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        if initial:
            self._in.write(initial)
        self._ssl = ctx.wrap_bio(
            self._in,
            self._out,
            server_side=server_side,
            server_hostname=None if server_side else server_hostname,
        )
        self._eof_sent = False

    async def handshake(self, timeout: float = 10.0) -> None:
        """Raises ssl.SSLError (incl. SSLCertVerificationError), ConnectionError, TimeoutError."""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    self._ssl.do_handshake()
                except ssl.SSLWantReadError:
                    await self._flush()
                    if not await self._fill():
                        raise ConnectionResetError(
                            "the peer closed the connection during the TLS handshake"
                        ) from None
                    continue
                except ssl.SSLError:
                    with contextlib.suppress(OSError, ConnectionError):
                        await self._flush()  # the alert, so the peer learns why
                    raise
                await self._flush()
                return

    async def read(self, n: int = _READ) -> bytes:
        """Up to `n` bytes; b"" at the end (close_notify, or the peer's TCP EOF without one)."""
        while True:
            try:
                with self._meter():
                    data = self._ssl.read(n)
            except ssl.SSLWantReadError:
                self._flush_nowait()
                if self._in.eof:
                    return b""
                if not await self._fill():
                    self._in.write_eof()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            self._flush_nowait()  # a read may answer the peer (a key update)
            return data

    async def write(self, data: bytes) -> None:
        if data:
            self._ssl.write(data)
            await self._flush()

    async def write_eof(self) -> None:
        """Send close_notify (once, best effort); reading may go on."""
        if self._eof_sent:
            return
        self._eof_sent = True
        with contextlib.suppress(ssl.SSLError, OSError, ConnectionError, ValueError):
            try:
                self._ssl.unwrap()
            except ssl.SSLWantReadError:
                pass  # sent; the peer's own close_notify is read by read()
            await self._flush()

    def selected_alpn_protocol(self) -> str | None:
        return self._ssl.selected_alpn_protocol()

    def getpeercert(self) -> dict | None:
        return self._ssl.getpeercert()

    def abort(self) -> None:
        self.writer.transport.abort()

    # ---- helpers ------------------------------------------------------------------------------
    async def _fill(self) -> bool:
        data = await self.reader.read(_READ)
        if not data:
            return False
        self._in.write(data)
        return True

    def _flush_nowait(self) -> None:
        out = self._out.read()
        if out:
            self.writer.write(out)

    async def _flush(self) -> None:
        self._flush_nowait()
        await self.writer.drain()


class PlainStream:
    """The TLSStream interface over plain TCP; `initial` (bytes already read) comes out first."""

    tls = False

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, initial: bytes = b""):
        self.reader, self.writer = reader, writer
        self._initial = initial

    async def handshake(self, timeout: float = 10.0) -> None:
        """Nothing to do (so callers can treat both streams alike)."""

    async def read(self, n: int = _READ) -> bytes:
        if self._initial:
            data, self._initial = self._initial[:n], self._initial[n:]
            return data
        return await self.reader.read(n)

    async def write(self, data: bytes) -> None:
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def write_eof(self) -> None:
        with contextlib.suppress(OSError, ConnectionError, RuntimeError):
            if self.writer.can_write_eof() and not self.writer.transport.is_closing():
                self.writer.write_eof()

    def selected_alpn_protocol(self) -> str | None:
        return None

    def abort(self) -> None:
        self.writer.transport.abort()


def server_context(pem: bytes) -> ssl.SSLContext:
    """A server TLS context (TLS 1.2 or later, ALPN http/1.1) from one PEM holding the certificate,
    its chain and the key. The ssl module loads keys from files only: one 0600 file (mkstemp),
    gone right after. Called by gateway.intercept (leaves) and controlplane.main (the router)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    fd, path = tempfile.mkstemp(prefix="atoll-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ctx

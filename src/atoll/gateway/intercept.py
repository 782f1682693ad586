"""HTTPS to a secret's host: the egress gateway as a man in the middle, only where it must be.

A connection whose TLS SNI names a secret's host, to an address that name resolves to
(gateway.placeholders decides), is terminated here: the gateway presents a leaf for the name
(`LeafContexts`, issued by the installation's CA, which sandboxes trust), opens verified TLS to the
real upstream with the default CAs (`upstream_context`; a failed verification is answered with a
502 inside the intercepted TLS, and nothing is sent), and relays request by request with the
placeholders replaced (gateway.httprelay). Only HTTP/1.1 is offered (ALPN), so clients never speak
h2 to the relay. Secret values never appear in logs or in the gateway's own answers.
Called by gateway.egress (intercept_tls, LeafContexts, upstream_context); uses shared.tlsstream,
gateway.httprelay and core.pki.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import ssl
import time
from collections.abc import Callable

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from atoll.core import pki
from atoll.gateway import fairshare, httprelay
from atoll.shared import tlsstream

log = logging.getLogger(__name__)
LEAF_DAYS = 30
LEAF_REISSUE_S = 7 * 86400.0
"""A cached leaf is replaced after this long, well before it expires (LEAF_DAYS)."""
_CHUNK_LIMIT = 1024 * 1024


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
    secrets: httprelay.SecretsFor,
    touch: Callable[[], None],
    connect_timeout: float = 10.0,
    flight: Callable[[bool], None] | None = None,
    bucket: fairshare.Bucket | None = None,
    refused: Callable[[str], None] | None = None,
) -> None:
    """Terminate the sandbox's TLS (`head`: its ClientHello, already read) with `leaf_ctx`, open
    verified TLS to `name` at ip:port, and relay with substitution. The caller owns `writer` and
    ends it afterwards; the upstream connection is closed here. Raises nothing but cancellation."""
    client = tlsstream.TLSStream(
        reader, writer, leaf_ctx, server_side=True, initial=head, meter=lambda: fairshare.Meter(bucket)
    )
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
            await httprelay.answer(
                client, 502, f"atoll egress gateway: {where} did not accept the connection ({e!r})\n"
            )
            return
        upstream = tlsstream.TLSStream(
            up_r,
            up_writer,
            upstream_ctx,
            server_side=False,
            server_hostname=name,
            meter=lambda: fairshare.Meter(bucket),
        )
        try:
            await upstream.handshake(connect_timeout)
        except ssl.SSLCertVerificationError as e:
            log.info(
                "intercepted connection to %s: the upstream certificate failed verification: %s", where, e
            )
            await httprelay.answer(
                client,
                502,
                f"atoll egress gateway: the certificate of {where} failed verification "
                f"({e.verify_message or e}, code {e.verify_code}); the request was not sent.\n",
            )
            return
        except (OSError, ssl.SSLError, TimeoutError) as e:
            await httprelay.answer(
                client, 502, f"atoll egress gateway: the TLS handshake with {where} failed ({e!r})\n"
            )
            return
        touch()
        await httprelay.relay(
            client, upstream, secrets, touch, name=name, flight=flight, bucket=bucket, refused=refused
        )
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

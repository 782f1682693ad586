"""Read the name a connection carries from its first bytes: the SNI of a TLS ClientHello, or the
Host header of an HTTP/1.x request. Pure parsing; called by gateway.egress."""

from __future__ import annotations

import re

MAX_HEAD = 16 * 1024
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""Bytes read before deciding (a TLS ClientHello or an HTTP request head must fit)."""


class Malformed(ValueError):
    """The first bytes claim a protocol (TLS, HTTP) but break it; `http` when they are HTTP."""

    http = False
    data = b""
    """The bytes read when it was found out."""


def looks_tls(data: bytes) -> bool:
    return len(data) >= 1 and data[0] == 0x16


def looks_http(data: bytes) -> bool:
    head = data[:8].upper()
    return any(
        head.startswith(m)
        for m in (
            b"GET ",
            b"POST ",
            b"PUT ",
            b"HEAD ",
            b"DELETE ",
            b"PATCH ",
            b"OPTIONS ",
            b"CONNECT ",
            b"TRACE ",
        )
    )


def tls_record_complete(data: bytes) -> bool:
    return len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[3:5], "big")


def client_hello_sni(data: bytes) -> str | None:
    """The server name of a complete first TLS record holding a ClientHello; None when it names
    none. Raises Malformed for anything that is not a well-formed ClientHello."""
    try:
        if data[0] != 0x16 or data[1] != 0x03:
            raise Malformed("not a TLS handshake record")
        rec_len = int.from_bytes(data[3:5], "big")
        body = data[5 : 5 + rec_len]
        if len(body) < rec_len or body[0] != 0x01:
            raise Malformed("the first handshake message is not a ClientHello")
        hs_len = int.from_bytes(body[1:4], "big")
        if hs_len + 4 > len(body):
            raise Malformed("the ClientHello spans several records")
        p = 4 + 2 + 32  # type+len, version, random
        p += 1 + body[p]  # session id
        p += 2 + int.from_bytes(body[p : p + 2], "big")  # cipher suites
        p += 1 + body[p]  # compression methods
        if p == 4 + hs_len:
            return None  # no extensions
        end = p + 2 + int.from_bytes(body[p : p + 2], "big")
        if end > 4 + hs_len:
            raise Malformed("extensions run past the ClientHello")
        p += 2
        while p + 4 <= end:
            etype = int.from_bytes(body[p : p + 2], "big")
            elen = int.from_bytes(body[p + 2 : p + 4], "big")
            ext = body[p + 4 : p + 4 + elen]
            if len(ext) != elen:
                raise Malformed("an extension runs past the ClientHello")
            if etype == 0:  # server_name
                q = 2
                while q + 3 <= len(ext):
                    ntype, nlen = ext[q], int.from_bytes(ext[q + 1 : q + 3], "big")
                    name = ext[q + 3 : q + 3 + nlen]
                    if ntype == 0:
                        try:
                            return name.decode("ascii")
                        except UnicodeDecodeError:
                            raise Malformed("the server name is not ASCII") from None
                    q += 3 + nlen
                return None
            p += 4 + elen
        return None
    except IndexError:
        raise Malformed("the ClientHello is truncated") from None


def http_host(data: bytes) -> str | None:
    """The Host of an HTTP/1.x request head (without its port); None while the head is incomplete.
    Raises Malformed when the head is complete but has no usable Host, or too long."""
    end = data.find(b"\r\n\r\n")
    if end < 0 and b"\n\n" in data:
        raise Malformed("the request head has a bare LF (lines must end with CRLF)")
    if end < 0:
        if len(data) >= MAX_HEAD:
            raise Malformed(f"the request head is longer than {MAX_HEAD} bytes")
        return None
    head = data[:end]
    if b"\n" in head.replace(b"\r\n", b"") or b"\r" in head.replace(b"\r\n", b""):
        raise Malformed("the request head has a bare LF or CR (lines must end with CRLF)")
    lines = head.split(b"\r\n")
    for ln in lines[1:]:
        if ln[:1] in (b" ", b"\t"):
            raise Malformed("the request head folds a header over lines (obsolete, refused)")
        name, sep, _ = ln.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            raise Malformed(f"the request head has a malformed header line {ln[:60]!r}")
    hosts = [ln.split(b":", 1)[1].strip() for ln in lines[1:] if ln.lower().startswith(b"host:")]
    if len(hosts) != 1:
        raise Malformed(
            "the request has no Host header" if not hosts else "the request has several Host headers"
        )
    try:
        host = hosts[0].decode("ascii")
    except UnicodeDecodeError:
        raise Malformed("the Host header is not ASCII") from None
    if host.startswith("["):
        return host.split("]")[0] + "]"
    return host.rsplit(":", 1)[0] if ":" in host else host

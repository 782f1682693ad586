"""The egress gateway's first-bytes parsing (gateway.sniff): TLS SNI and a strict HTTP Host."""

from __future__ import annotations

import ssl

import pytest
from hypothesis import given
from hypothesis import strategies as st

from atoll.gateway import sniff


def client_hello(server_name: str | None) -> bytes:
    """A real ClientHello, as Python's ssl module writes it."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_sni_of_a_real_client_hello():
    hello = client_hello("allowed.atoll.test")
    assert sniff.looks_tls(hello) and sniff.tls_record_complete(hello)
    assert sniff.client_hello_sni(hello) == "allowed.atoll.test"
    assert sniff.client_hello_sni(client_hello(None)) is None


@pytest.mark.parametrize(
    "bad",
    [b"\x16\x03\x01\x00\x10\x01\x00\x00\x0c" + b"\x00" * 12, b"\x16\x03\x01\x00\x02\x02\x00", b"\x16\x03"],
)
def test_a_broken_client_hello_is_malformed(bad):
    with pytest.raises(sniff.Malformed):
        sniff.client_hello_sni(bad)


@given(st.binary(max_size=300))
def test_any_bytes_are_parsed_or_malformed(data):
    for fn in (sniff.client_hello_sni, sniff.http_host):
        try:
            fn(b"\x16\x03" + data if fn is sniff.client_hello_sni else b"GET / HTTP/1.1\r\n" + data)
        except sniff.Malformed:
            pass


def test_http_host():
    assert sniff.http_host(b"GET / HTTP/1.1\r\nHost: a.test:8080\r\n\r\n") == "a.test"
    assert sniff.http_host(b"GET / HTTP/1.1\r\nHost: a.test\r\n") is None  # not complete yet
    for bad in (
        b"GET / HTTP/1.1\nHost: a.test\n\n",
        b"GET / HTTP/1.1\r\nHost : b.test\r\nHost: a.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: y\r\n Host: b.test\r\nHost: a.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: y\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * sniff.MAX_HEAD,
    ):
        with pytest.raises(sniff.Malformed):
            sniff.http_host(bad)

"""The server's side of the TLS link to a worker, with real certificates from the installation CA
(controlplane.authority) and real TLS handshakes on loopback: a worker presenting its own
certificate is served; one presenting another worker's certificate and key, or a certificate from
another CA, is refused before a request (and its token) goes out."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from atoll.controlplane.authority import Authority
from atoll.controlplane.remote_worker import RemoteWorker
from atoll.core import errors, pki
from atoll.shared import http11


def _worker_context(tmp_path, authority_or_ca, name: str) -> ssl.SSLContext:
    """A worker's serving context: its key and the certificate the CA signed for 127.0.0.1."""
    key, csr = pki.new_worker_request(name)
    if isinstance(authority_or_ca, Authority):
        cert = authority_or_ca.sign_worker(csr, name, "https://127.0.0.1:1")
    else:
        root, root_key = authority_or_ca
        cert = pki.issue_worker(root, root_key, csr, name, "127.0.0.1")
    (tmp_path / f"{name}.key").write_bytes(key)
    (tmp_path / f"{name}.crt").write_bytes(cert)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / f"{name}.crt", tmp_path / f"{name}.key")
    return ctx


async def _serve(ctx: ssl.SSLContext, seen: list[bytes]) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nAtoll-Protocol: 0\r\n\r\nok")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0, ssl=ctx)


async def test_the_server_accepts_its_worker_and_refuses_another_workers_certificate(tmp_path):
    authority = Authority.open(str(tmp_path / "home"))
    client = authority.worker_client_context()
    seen: list[bytes] = []
    # worker b's certificate and key, presented where the server expects worker a
    server = await _serve(_worker_context(tmp_path, authority, "b"), seen)
    port = server.sockets[0].getsockname()[1]
    try:
        as_b = http11.Channel(
            "127.0.0.1", port, tls=client, check_peer=lambda der: pki.check_worker_certificate(der, "b")
        )
        r = await as_b.request("GET", "/v1/worker/info", headers={"Authorization": "Bearer wkt_b"})
        assert r.status_code == 200 and r.content == b"ok"
        await as_b.aclose()
        assert len(seen) == 1 and b"wkt_b" in seen[0]

        as_a = http11.Channel(
            "127.0.0.1", port, tls=client, check_peer=lambda der: pki.check_worker_certificate(der, "a")
        )
        with pytest.raises(http11.ConnectFailed, match="names 'b', not worker 'a'"):
            await as_a.request("GET", "/v1/worker/info", headers={"Authorization": "Bearer wkt_a"})
        remote = RemoteWorker(f"https://127.0.0.1:{port}", "wkt_a", "a", tls=client)
        with pytest.raises(errors.Unavailable, match="cannot be reached"):
            await remote.inventory()
        await remote.aclose()
        await asyncio.sleep(0.05)
        assert len(seen) == 1, "a request (and its token) went to a worker that is not the one meant"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_certificate_from_another_ca_is_refused_in_the_handshake(tmp_path):
    authority = Authority.open(str(tmp_path / "home"))
    other = pki.new_root_ca("another installation")
    seen: list[bytes] = []
    server = await _serve(_worker_context(tmp_path, other, "a"), seen)
    port = server.sockets[0].getsockname()[1]
    try:
        ch = http11.Channel(
            "127.0.0.1",
            port,
            tls=authority.worker_client_context(),
            check_peer=lambda der: pki.check_worker_certificate(der, "a"),
        )
        with pytest.raises(http11.ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
            await ch.request("GET", "/v1/worker/info")
        assert seen == []
    finally:
        server.close()
        await server.wait_closed()

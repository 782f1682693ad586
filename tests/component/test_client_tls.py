"""The client side of TLS: the SDK (sync and async, calls and terminal WebSockets) and the CLI
against the control plane in process, served over HTTPS by uvicorn on loopback with a certificate
from the installation CA (controlplane.authority, a throwaway one per test). With the CA
(`ca_file=`, ATOLL_CA_FILE, `--ca-file`) they work; without it, or with another installation's,
they stop with `certificate_error` and the way to fix it; a CA file that cannot be used is
`bad_ca_file`, naming it."""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn

import atoll
from atoll import errors
from atoll._client import _base
from atoll.controlplane.authority import Authority
from atoll.core import pki
from atoll.testing import FakeAtoll
from tests.component.conftest import KEY

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def tls(tmp_path, monkeypatch):
    """FakeAtoll served over HTTPS at `tls.url`; `tls.ca` the installation CA's file, as GET
    /v1/ca.crt answers it; `tls.other_ca` another installation's."""
    monkeypatch.delenv("ATOLL_CA_FILE", raising=False)
    home = str(tmp_path / "home")
    authority = Authority.open(home)
    async with FakeAtoll(tmp_path / "cp", api_key=KEY, authority=authority) as f:
        cert_file, key_file = authority.api_cert_files(home, ["127.0.0.1"])
        config = uvicorn.Config(
            f.app,
            host="127.0.0.1",
            port=0,
            log_config=None,
            lifespan="off",
            ws="websockets-sansio",
            ssl_certfile=cert_file,
            ssl_keyfile=key_file,
        )
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve())
        try:
            while not server.started:
                assert not task.done(), "uvicorn did not start"
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            f.url = f"https://127.0.0.1:{port}"
            answer = await f.http.get("/v1/ca.crt")  # in process: no TLS needed to fetch it
            assert answer.status_code == 200, answer.text
            f.ca = tmp_path / "ca.crt"
            f.ca.write_text(answer.text)
            f.other_ca = tmp_path / "other-ca.crt"
            f.other_ca.write_bytes(pki.new_root_ca("another installation")[0])
            yield f
        finally:
            server.should_exit = True
            await task
            f.worker.ptys.close_all()


# ---------------------------------------------------------------- SDK


async def test_async_client_with_the_installation_ca_works_and_without_it_names_the_fix(tls):
    async with atoll.AsyncClient(tls.url, KEY, ca_file=tls.ca) as client:
        assert client.ca_file == str(tls.ca)
        assert (await client.health())["status"] == "ok"
        sandbox = await client.sandboxes.create(idle_timeout_s=0)
        assert (await client.sandboxes.get(sandbox.id)).state == "running"
        assert (await client.ca_certificate()) == tls.ca.read_text()

    async with atoll.AsyncClient(tls.url, KEY) as client:
        assert client.ca_file is None
        with pytest.raises(errors.CertificateError) as e:
            await client.health()
    err = e.value
    assert isinstance(err, errors.APIConnectionError) and err.code == "certificate_error"
    assert not err.retryable
    assert tls.url in err.message and "/v1/ca.crt" in err.message
    assert "--ca-file" in err.message and "ATOLL_CA_FILE" in err.message and "ca_file=" in err.message

    async with atoll.AsyncClient(tls.url, KEY, ca_file=tls.other_ca) as client:
        with pytest.raises(errors.CertificateError) as e:
            await client.sandboxes.list()
    assert str(tls.other_ca) in e.value.message and "installation CA" in e.value.message


def _sync_calls(url: str, ca: Path) -> tuple[str, str]:
    with atoll.Client(url, KEY, ca_file=str(ca)) as client:
        ok = client.health()["status"]
    with atoll.Client(url, KEY) as client:
        try:
            client.health()
        except errors.CertificateError as e:
            return ok, e.code
    return ok, "no error"


async def test_sync_client_honours_ca_file(tls):
    assert await asyncio.to_thread(_sync_calls, tls.url, tls.ca) == ("ok", "certificate_error")


async def test_atoll_ca_file_is_the_default(tls, monkeypatch):
    monkeypatch.setenv("ATOLL_CA_FILE", str(tls.ca))
    async with atoll.AsyncClient(tls.url, KEY) as client:
        assert client.ca_file == str(tls.ca)
        assert (await client.health())["status"] == "ok"
    # the argument wins over the variable
    async with atoll.AsyncClient(tls.url, KEY, ca_file=tls.other_ca) as client:
        with pytest.raises(errors.CertificateError):
            await client.health()
    monkeypatch.setenv("ATOLL_CA_FILE", str(tls.other_ca))
    async with atoll.AsyncClient(tls.url, KEY) as client:
        with pytest.raises(errors.CertificateError, match=r"from \$ATOLL_CA_FILE"):
            await client.health()


async def test_a_terminal_websocket_checks_the_server_against_the_ca_file(tls):
    async with atoll.AsyncClient(tls.url, KEY, ca_file=tls.ca) as client:
        sandbox = await client.sandboxes.create(idle_timeout_s=0)
        async with await sandbox.pty() as term:  # wss:// with the installation CA
            out = bytearray()
            await term.send("hi\r")
            while b"you said: hi" not in out:
                out += await term.read(timeout=10)
    # calls through the in-process transport (no TLS), the terminal over wss:// with another CA
    async with atoll.AsyncClient(tls.url, KEY, ca_file=tls.other_ca, transport=tls.transport) as client:
        sandbox = await client.sandboxes.connect(sandbox.id)
        with pytest.raises(errors.CertificateError) as e:
            await sandbox.pty()
    assert e.value.message.startswith("the TLS certificate of the atoll server at wss://127.0.0.1:")
    assert str(tls.other_ca) in e.value.message


def _sync_terminal(url: str, ca: Path, sid: str) -> str:
    with atoll.Client(url, KEY, ca_file=str(ca)) as client:
        sandbox = client.sandboxes.connect(sid)
        with sandbox.pty() as term:
            out = bytearray()
            term.send("hi\r")
            while b"you said: hi" not in out:
                out += term.read(timeout=10)
            return term._ws.socket.version()


async def test_the_sync_terminal_speaks_tls_1_2_with_the_ca_file_and_refuses_another(tls):
    """websockets' sync client reads on a thread of its own while the caller's writes the upgrade
    request; under TLS 1.3 the session tickets that arrive then lost the request about once in
    330 connections (_base.ws_ssl_sync): its context is capped at TLS 1.2 and trusts the same CA."""
    async with atoll.AsyncClient(tls.url, KEY, ca_file=tls.ca) as client:
        sid = (await client.sandboxes.create(idle_timeout_s=0)).id
    assert await asyncio.to_thread(_sync_terminal, tls.url, tls.ca, sid) == "TLSv1.2"
    with pytest.raises(errors.CertificateError):
        await asyncio.to_thread(_sync_terminal, tls.url, tls.other_ca, sid)
    # the client's own context (its HTTP calls) is not changed
    verify = _base.tls_verify(tls.url, str(tls.ca))
    assert _base.ws_ssl_sync("wss://x", verify).maximum_version == ssl.TLSVersion.TLSv1_2
    assert verify.maximum_version != ssl.TLSVersion.TLSv1_2
    assert _base.ws_ssl_sync("ws://x", verify) is None


@pytest.mark.parametrize("kind", ["missing", "directory", "text", "key", "broken", "empty"])
def test_a_ca_file_that_cannot_be_used_is_bad_ca_file(tmp_path, kind, monkeypatch):
    monkeypatch.delenv("ATOLL_CA_FILE", raising=False)
    path = tmp_path / "ca.crt"
    if kind == "directory":
        path.mkdir()
    elif kind == "text":
        path.write_text("not a certificate\n")
    elif kind == "key":
        _, key = pki.new_root_ca("x")
        path.write_bytes(key)
    elif kind == "broken":
        path.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    elif kind == "empty":
        path.write_bytes(b"")
    for make in (atoll.Client, atoll.AsyncClient):
        with pytest.raises(errors.BadCAFile) as e:
            make("https://127.0.0.1:1", KEY, ca_file=path)
        assert e.value.code == "bad_ca_file" and isinstance(e.value, errors.APIConnectionError)
        assert repr(str(path)) in e.value.message and "from ca_file=" in e.value.message
        assert "/v1/ca.crt" in e.value.message
    monkeypatch.setenv("ATOLL_CA_FILE", str(path))
    with pytest.raises(errors.BadCAFile, match=r"from \$ATOLL_CA_FILE"):
        atoll.Client("http://127.0.0.1:1", KEY)


def test_a_certificate_failure_is_not_retried():
    calls = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        failure = ssl.SSLCertVerificationError(1, "certificate verify failed")
        failure.verify_message = "self-signed certificate in certificate chain"
        raise httpx.ConnectError("certificate verify failed") from failure

    with atoll.Client("https://atoll.test", KEY, retries=3, transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(errors.CertificateError, match="self-signed certificate in certificate chain"):
            client.health()
    assert len(calls) == 1
    assert _base.certificate_failure(httpx.ConnectError("refused")) is None


# ---------------------------------------------------------------- CLI


async def _atoll(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
    base["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + base.get("PYTHONPATH", "")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "atoll",
        *args,
        env={**base, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_cli_ca_file_option_and_env(tls):
    conn = ["--url", tls.url, "--api-key", KEY]
    async with atoll.AsyncClient(tls.url, KEY, ca_file=tls.ca) as client:
        sid = (await client.sandboxes.create(idle_timeout_s=0)).id

    code, out, err = await _atoll("sandbox", "list", *conn, "--ca-file", str(tls.ca))
    assert (code, err) == (0, "") and sid in out
    code, out, err = await _atoll("--ca-file", str(tls.ca), "workers", *conn, "--json")
    assert code == 0 and '"name"' in out, err
    code, out, err = await _atoll("sandbox", "get", sid, *conn, env={"ATOLL_CA_FILE": str(tls.ca)})
    assert code == 0 and sid in out, err
    # `atoll worker drain` talks to the server too: it lists the workers (no such one here)
    code, out, err = await _atoll("worker", "drain", "nope", *conn, "--ca-file", str(tls.ca))
    assert code == 1 and err.startswith("error: worker_not_found:"), err

    for args in (
        ("sandbox", "list", *conn),
        ("workers", *conn),
        ("worker", "drain", "nope", *conn),
        ("template", "list", *conn),
    ):
        code, out, err = await _atoll(*args)
        assert code == 1 and out == "", (args, out, err)
        assert err.startswith(
            f"error: certificate_error: the TLS certificate of the atoll server at {tls.url}"
        )
        assert "--ca-file" in err and "ATOLL_CA_FILE" in err and "Traceback" not in err

    missing = str(tls.ca) + ".missing"
    code, out, err = await _atoll("sandbox", "list", *conn, "--ca-file", missing)
    assert code == 1 and err.startswith(f"error: bad_ca_file: the CA file {missing!r}"), err
    assert "Traceback" not in err
    code, out, err = await _atoll("workers", *conn, env={"ATOLL_CA_FILE": missing})
    assert code == 1 and err.startswith("error: bad_ca_file:") and "$ATOLL_CA_FILE" in err, err

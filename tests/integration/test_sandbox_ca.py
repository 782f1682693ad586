"""ATOLL_SANDBOX_CA_FILE: a private CA every sandbox trusts, like the installation CA.

A test host (atoll.testing.testnet) serves HTTPS on :8443 with a certificate for ca.atoll.test
that a test CA signs. A sandbox allowed to reach it verifies that certificate with curl and with
Python only when the worker's ATOLL_SANDBOX_CA_FILE names the test CA: through the CA variables,
and through the system bundle for a program that ignores them. Without it, both refuse the
certificate — so the check can fail.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from atoll.core import pki
from atoll.testing import LocalAtoll
from atoll.testing.testnet import TestHost
from tests.conftest import TEMPLATE_CACHE, _skip_unless_root

pytestmark = pytest.mark.integration

SERVER = r"""
import http.server, ssl, sys, threading
a, d = sys.argv[1], sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"private-ok"
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(d + "/srv.crt", d + "/srv.key")
s = http.server.ThreadingHTTPServer((a, 8443), H)
s.socket = ctx.wrap_socket(s.socket, server_side=True)
threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""
URL = "https://ca.atoll.test:8443/"
CURL = f'curl -sS -o /dev/null -w "%{{http_code}}" {URL}'
PYTHON = f"python3 -c \"import urllib.request; print(urllib.request.urlopen('{URL}', timeout=20).read().decode())\""
NO_VARS = "env -u CURL_CA_BUNDLE -u SSL_CERT_FILE -u REQUESTS_CA_BUNDLE "


@pytest.fixture(scope="module")
def host():
    _skip_unless_root()
    ca, ca_key = pki.new_root_ca("atoll test private CA")
    cert, key = pki.issue_server(ca, ca_key, ["ca.atoll.test"])
    th = TestHost(SERVER, ["{a}", "{dir}"])
    os.makedirs(th.dir, exist_ok=True)
    # the CA file as operators keep it sometimes: the key beside the certificate (never copied)
    for name, data in (("srv.crt", cert + ca), ("srv.key", key), ("ca.crt", ca), ("ca+key.pem", ca + ca_key)):
        with open(th.path(name), "wb") as f:
            f.write(data)
    with th:
        th.hosts = th.hosts_file([f"{th.a} ca.atoll.test"])
        yield th


def _sandbox_runs(host, tmp_path, extra_env: dict[str, str], commands: list[str]) -> list[dict]:
    la = LocalAtoll(
        home=tmp_path / "home",
        env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE, "ATOLL_EXTRA_HOSTS": host.hosts, **extra_env},
    )
    la.start(timeout=600)
    try:
        with httpx.Client(base_url=la.url, headers=la.headers(), timeout=120) as api:
            r = api.post(
                "/v1/sandboxes", json={"idle_timeout_s": 0, "network": {"allow_out": ["ca.atoll.test"]}}
            )
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            try:
                results = []
                for cmd in commands:
                    e = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_s": 60})
                    assert e.status_code == 200, e.text
                    results.append(e.json())
                return results
            finally:
                api.delete(f"/v1/sandboxes/{sid}")
    finally:
        la.stop(reap=True)


def test_a_sandbox_verifies_a_private_host_only_with_atoll_sandbox_ca_file(host, tmp_path):
    curl, python, system_store, key_files = _sandbox_runs(
        host,
        tmp_path / "with",
        {"ATOLL_SANDBOX_CA_FILE": host.path("ca+key.pem")},
        [CURL, PYTHON, NO_VARS + CURL, "grep -l 'PRIVATE KEY' /etc/atoll/* /etc/ssl/certs/* || true"],
    )
    assert (curl["exit_code"], curl["stdout"]) == (0, "200"), curl
    assert python["exit_code"] == 0 and python["stdout"].strip() == "private-ok", python
    assert (system_store["exit_code"], system_store["stdout"]) == (0, "200"), system_store
    assert key_files["stdout"].strip() == "", key_files  # the key beside the CA stayed on the host

    curl, python = _sandbox_runs(host, tmp_path / "without", {}, [CURL, PYTHON])
    assert curl["exit_code"] == 60 and "certificate" in curl["stderr"], curl  # CURLE_PEER_FAILED_VERIFICATION
    assert python["exit_code"] != 0 and "CERTIFICATE_VERIFY_FAILED" in python["stderr"], python


def _until(what, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(0.2)
    return got


def test_a_pool_member_made_before_the_ca_file_changed_is_replaced_not_claimed(host, tmp_path):
    """A restart with another ATOLL_SANDBOX_CA_FILE: the `base` pool member frozen before it trusts
    the old certificates (the tester's report: behind a TLS-inspecting proxy, pip failed in
    claimed sandboxes and worked in restored ones). It is replaced, never handed out: the next
    default create claims a member made trusting the new CA, and verifies the private host."""
    before = tmp_path / "before.pem"
    before.write_bytes(pki.new_root_ca("atoll test CA of the first start")[0])
    marker = before.read_text().splitlines()[1]  # a base64 line of that certificate
    la = LocalAtoll(
        home=tmp_path / "home",
        env={
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_EXTRA_HOSTS": host.hosts,
            "ATOLL_DEFAULT_POOL": "1",
            "ATOLL_SANDBOX_CA_FILE": str(before),
        },
    )

    def members():
        """the pool's one member, ready"""
        with httpx.Client(base_url=la.url, headers=la.headers(), timeout=60) as api:
            pool = api.get("/v1/templates/base/pool").json()
        sids = os.listdir(os.path.join(la.home, "sandboxes"))
        return sids if pool["ready"] == 1 and len(sids) == 1 else None

    la.start(timeout=600)
    try:
        [old] = _until(members)
        la.stop(reap=False)
        la.env["ATOLL_SANDBOX_CA_FILE"] = host.path("ca.crt")
        la.start(timeout=600)

        def replaced():
            """a pool member other than the one made before the restart, ready"""
            return [m for m in members() or [] if m != old]

        [new] = _until(replaced)
        with httpx.Client(base_url=la.url, headers=la.headers(), timeout=120) as api:
            r = api.post(
                "/v1/sandboxes", json={"idle_timeout_s": 0, "network": {"allow_out": ["ca.atoll.test"]}}
            )
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            assert sid == new  # claimed from the pool: the member made trusting the new CA
            python, old_ca = (
                api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_s": 60}).json()
                for cmd in (PYTHON, f"grep -c '{marker}' /etc/atoll/ca-bundle.crt || true")
            )
            assert python["exit_code"] == 0 and python["stdout"].strip() == "private-ok", python
            assert old_ca["stdout"].strip() == "0", old_ca  # the first start's CA is gone
        log = open(la.log_path).read()
        assert "or trust other CA certificates than a new sandbox; replacing them" in log
        assert "is not handed out" not in log  # never offered to a create
    finally:
        if la.proc is None:  # reaped with a server running
            la.start(timeout=600)
        la.stop(reap=True)

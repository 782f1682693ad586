"""Secrets and preview URLs with real sandboxes: the gateway's substitution and the ingress router.

Upstreams run in a test host namespace (atoll.testing.testnet): HTTPS on :8443 with a certificate
for api.atoll.test / other.atoll.test from a test CA (the worker trusts it through
ATOLL_UPSTREAM_CA_FILE; sandboxes do not), plain HTTP on :8080. Each records what it received, so
the tests check substitution where it happens — upstream — and that the sandbox never holds the
value. Previews go to programs inside sandboxes through the ingress router, over TLS with the
installation's CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import ssl
import time

import httpx
import pytest

from atoll.core import pki
from atoll.testing import LocalAtoll
from atoll.testing.testnet import TestHost
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration

VALUE = "sk-live-" + "7Qz9" * 6
UPSTREAM = r"""
import http.server, json, socket, ssl, sys, threading
a, b, d = sys.argv[1], sys.argv[2], sys.argv[3]
lock = threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path.startswith("/slow"):
            import time; time.sleep(4)
        if self.path.startswith("/unframed"):  # no length: the close ends the answer
            self.send_response(200); self.send_header("Connection", "close"); self.end_headers()
            self.wfile.write(b"u" * 300000); self.close_connection = True; return
        seen = {"host": self.server.server_address[0], "port": self.server.server_address[1],
                "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
        with lock, open(d + "/seen.log", "a") as f:
            f.write(json.dumps(seen) + "\n")
        body = b"ok"
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(d + "/up.crt", d + "/up.key")
def sink(ip):  # :9090 reads and drops whatever comes (the flood's upstream)
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((ip, 9090)); ls.listen(256)
    def drain(c):
        try:
            while c.recv(1 << 20):
                pass
        except OSError:
            pass
        c.close()
    while True:
        threading.Thread(target=drain, args=(ls.accept()[0],), daemon=True).start()
for ip in (a, b):
    threading.Thread(target=sink, args=(ip,), daemon=True).start()
    s = http.server.ThreadingHTTPServer((ip, 8080), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    t = http.server.ThreadingHTTPServer((ip, 8443), H)
    t.socket = ctx.wrap_socket(t.socket, server_side=True)
    threading.Thread(target=t.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture(scope="module")
def host():
    ca, ca_key = pki.new_root_ca("atoll test upstream CA")
    cert, key = pki.issue_server(ca, ca_key, ["api.atoll.test", "other.atoll.test"])
    th = TestHost(UPSTREAM, ["{a}", "{b}", "{dir}"])
    os.makedirs(th.dir, exist_ok=True)
    for name, data in (("up.crt", cert + ca), ("up.key", key), ("ca.crt", ca)):
        with open(th.path(name), "wb") as f:
            f.write(data)
    with th:
        th.hosts = th.hosts_file([f"{th.a} api.atoll.test", f"{th.b} other.atoll.test"])
        th.ca = ca
        yield th


@pytest.fixture(scope="module")
def la(host, tmp_path_factory):
    atoll = LocalAtoll(
        home=tmp_path_factory.mktemp("atoll-secrets") / "home",
        env={
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_EXTRA_HOSTS": host.hosts,
            "ATOLL_UPSTREAM_CA_FILE": host.path("ca.crt"),
        },
    )
    atoll.start(timeout=600)
    try:
        yield atoll
    finally:
        atoll.stop(reap=True)


@pytest.fixture(scope="module")
def api(la):
    with httpx.Client(base_url=la.url, headers=la.headers(), timeout=120) as c:
        yield c


@pytest.fixture
def make(api):
    made: list[str] = []

    def _make(**body):
        r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, **body})
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
        return r.json()

    yield _make
    for sid in made:
        api.delete(f"/v1/sandboxes/{sid}")


@pytest.fixture
def secret(api):
    names: list[str] = []

    def _secret(name, value=VALUE, hosts=("api.atoll.test",), allow_http=False):
        body = {"name": name, "value": value, "hosts": list(hosts), "allow_http": allow_http}
        r = api.post("/v1/secrets", json=body)
        assert r.status_code == 201, r.text
        names.append(name)
        return r.json()

    yield _secret
    for n in names:
        api.delete(f"/v1/secrets/{n}")


def sh(api, sid: str, cmd: str, timeout: float = 30) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_s": timeout})
    assert r.status_code == 200, r.text
    return r.json()


def seen(host) -> list[dict]:
    try:
        with open(host.path("seen.log")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def last_seen(host, path_part: str) -> dict:
    for rec in reversed(seen(host)):
        if path_part in rec["path"]:
            return rec
    raise AssertionError(f"the upstream saw no request for {path_part!r}: {seen(host)[-3:]}")


NET = {"allow_out": ["api.atoll.test", "other.atoll.test"]}


# ---- secrets -----------------------------------------------------------------------------------
def test_a_secret_reaches_its_host_over_https_and_the_sandbox_sees_only_a_placeholder(
    api, host, make, secret
):
    secret("tok1")
    sb = make(network=NET, secrets={"TOKEN": "tok1"})
    assert sb["secrets"] == {"TOKEN": "tok1"} and VALUE not in json.dumps(sb)
    out = sh(api, sb["id"], "echo $TOKEN")
    placeholder = out["stdout"].strip()
    assert re.fullmatch(r"atoll_ph_[0-9a-f]{32}", placeholder), out
    # curl trusts the installation's CA through the system bundle; python through SSL_CERT_FILE
    out = sh(
        api,
        sb["id"],
        'curl -sS -o /dev/null -w "%{http_code}" -H "Authorization: Bearer $TOKEN" '
        '"https://api.atoll.test:8443/curl?key=$TOKEN&x=1"',
    )
    assert out["stdout"] == "200", out
    rec = last_seen(host, "/curl")
    assert rec["headers"]["authorization"] == f"Bearer {VALUE}"
    assert rec["path"] == f"/curl?key={VALUE}&x=1"
    # the template's own trust store has the CA too (a program that ignores the variables)
    out = sh(
        api,
        sb["id"],
        'env -u CURL_CA_BUNDLE -u SSL_CERT_FILE -u REQUESTS_CA_BUNDLE curl -sS -o /dev/null -w "%{http_code}" '
        '-H "X-Key: $TOKEN" https://api.atoll.test:8443/system-store',
    )
    assert out["stdout"] == "200", out
    code = (
        "import os, urllib.request as u; r = u.Request('https://api.atoll.test:8443/py', "
        "headers={'X-Api-Key': os.environ['TOKEN']}); print(u.urlopen(r, timeout=10).status)"
    )
    out = sh(api, sb["id"], f'python3 -c "{code}"')
    assert out["stdout"].strip() == "200", out
    assert last_seen(host, "/py")["headers"]["x-api-key"] == VALUE
    # the value is nowhere in the sandbox: not in its env, files it can read, or any API answer
    out = sh(
        api,
        sb["id"],
        f"grep -rl {VALUE} /etc /tmp /root /proc/self/environ 2>/dev/null; env | grep -c {VALUE}",
    )
    assert out["stdout"].strip() == "0", out
    assert VALUE not in api.get(f"/v1/sandboxes/{sb['id']}").text
    assert VALUE not in api.get("/v1/secrets").text and VALUE not in api.get("/v1/secrets/tok1").text


def test_a_placeholder_sent_to_another_host_stays_a_placeholder(api, host, make, secret):
    secret("tok2")
    sb = make(network=NET, secrets={"TOKEN": "tok2"})
    placeholder = sh(api, sb["id"], "echo $TOKEN")["stdout"].strip()
    out = sh(
        api,
        sb["id"],
        'curl -sS -o /dev/null -w "%{http_code}" -H "X-Key: $TOKEN" http://other.atoll.test:8080/other?k=$TOKEN',
    )
    assert out["stdout"] == "200", out
    rec = last_seen(host, "/other")
    assert rec["headers"]["x-key"] == placeholder and rec["path"] == f"/other?k={placeholder}"
    # other HTTPS is not intercepted: the sandbox sees the upstream's own certificate (which it
    # does not trust), not one from the installation's CA
    out = sh(
        api,
        sb["id"],
        "curl -sS https://other.atoll.test:8443/x 2>&1; echo; curl -sk -o /dev/null -w %{http_code} https://other.atoll.test:8443/k",
    )
    assert "certificate" in out["stdout"].lower() and out["stdout"].endswith("200"), out
    assert last_seen(host, "/k")["headers"].get("x-key") is None


def test_plain_http_is_substituted_and_rotation_and_deletion_apply_live(api, host, make, secret):
    secret("tok3", allow_http=True)
    sb = make(network=NET, secrets={"TOKEN": "tok3"})
    placeholder = sh(api, sb["id"], "echo $TOKEN")["stdout"].strip()
    req = 'curl -sS -o /dev/null -H "X-Key: $TOKEN" http://api.atoll.test:8080/{}'
    sh(api, sb["id"], req.format("v1"))
    assert last_seen(host, "/v1")["headers"]["x-key"] == VALUE
    r = api.put(
        "/v1/secrets/tok3", json={"value": "rotated-value-2", "hosts": ["api.atoll.test"], "allow_http": True}
    )
    assert r.status_code == 200 and "rotated" not in r.text
    sh(api, sb["id"], req.format("v2"))
    assert last_seen(host, "/v2")["headers"]["x-key"] == "rotated-value-2"
    assert api.delete("/v1/secrets/tok3").status_code == 204
    sh(api, sb["id"], req.format("v3"))
    assert last_seen(host, "/v3")["headers"]["x-key"] == placeholder


def test_plain_http_gets_a_secret_only_when_the_secret_allows_it(api, host, make, secret):
    """Plain HTTP carries the value in clear text: by default only HTTPS requests get it (issue
    17, a change of behaviour); `allow_http` opts in, and a replace applies to live sandboxes."""
    assert secret("tok10")["allow_http"] is False
    sb = make(network=NET, secrets={"TOKEN": "tok10"})
    placeholder = sh(api, sb["id"], "echo $TOKEN")["stdout"].strip()
    sh(api, sb["id"], 'curl -s -o /dev/null -H "X-Key: $TOKEN" "http://api.atoll.test:8080/no-http?k=$TOKEN"')
    rec = last_seen(host, "/no-http")
    assert rec["headers"]["x-key"] == placeholder and rec["path"] == f"/no-http?k={placeholder}"
    sh(api, sb["id"], 'curl -s -o /dev/null -H "X-Key: $TOKEN" https://api.atoll.test:8443/yes-https')
    assert last_seen(host, "/yes-https")["headers"]["x-key"] == VALUE
    r = api.put("/v1/secrets/tok10", json={"value": VALUE, "hosts": ["api.atoll.test"], "allow_http": True})
    assert r.status_code == 200 and r.json()["allow_http"] is True
    assert api.get("/v1/secrets/tok10").json()["allow_http"] is True
    sh(api, sb["id"], 'curl -s -o /dev/null -H "X-Key: $TOKEN" http://api.atoll.test:8080/now-http')
    assert last_seen(host, "/now-http")["headers"]["x-key"] == VALUE
    r = api.post(
        "/v1/secrets", json={"name": "tok11", "value": "v", "hosts": ["a.example"], "allow_http": "yes"}
    )
    assert r.status_code == 400 and "allow_http" in r.text


def test_a_secret_goes_only_to_addresses_its_host_resolves_to(api, host, make, secret):
    """Issue 17 #1: with the destination allowed by address (the test host's /29 here, as `*`
    would), a Host header or a TLS SNI naming the secret's host is not enough: the connection
    must go to an address that name resolves to (api.atoll.test is host.a; host.b is another
    machine). Otherwise the placeholder passes unchanged, over HTTP and HTTPS, and the refusal is
    counted."""
    secret("tok9", allow_http=True)
    net = host.a.rsplit(".", 1)[0] + ".0/29"
    sb = make(network={"allow_out": [net, "api.atoll.test"]}, secrets={"TOKEN": "tok9"})
    sid, b = sb["id"], host.b
    placeholder = sh(api, sid, "echo $TOKEN")["stdout"].strip()
    out = sh(
        api,
        sid,
        f'curl -s -o /dev/null -w %{{http_code}} -H "Host: api.atoll.test" -H "Authorization: Bearer $TOKEN" '
        f'"http://{b}:8080/wrong-addr?k=$TOKEN"',
    )
    assert out["stdout"] == "200", out
    rec = last_seen(host, "/wrong-addr")
    assert rec["host"] == b and rec["headers"]["authorization"] == f"Bearer {placeholder}", rec
    assert rec["path"] == f"/wrong-addr?k={placeholder}"
    # HTTPS with SNI api.atoll.test to b: not intercepted at all (the sandbox meets b's own
    # certificate, which it does not trust: -k), so nothing in it can be replaced
    out = sh(
        api,
        sid,
        f'curl -sk -o /dev/null -w %{{http_code}} --resolve api.atoll.test:8443:{b} -H "X-Key: $TOKEN" '
        '"https://api.atoll.test:8443/wrong-sni?k=$TOKEN"',
    )
    assert out["stdout"] == "200", out
    rec = last_seen(host, "/wrong-sni")
    assert rec["host"] == b and rec["headers"]["x-key"] == placeholder and rec["path"].endswith(placeholder)
    out = sh(
        api,
        sid,
        f'curl -s --resolve api.atoll.test:8443:{b} -H "X-Key: $TOKEN" https://api.atoll.test:8443/x',
    )
    assert VALUE not in out["stdout"]
    # to the name's own address the same requests get the value
    sh(api, sid, 'curl -s -o /dev/null -H "X-Key: $TOKEN" http://api.atoll.test:8080/right-addr')
    assert last_seen(host, "/right-addr")["headers"]["x-key"] == VALUE
    sh(api, sid, 'curl -s -o /dev/null -H "X-Key: $TOKEN" https://api.atoll.test:8443/right-sni')
    rec = last_seen(host, "/right-sni")
    assert rec["host"] == host.a and rec["headers"]["x-key"] == VALUE
    deadline = time.monotonic() + 30  # the worker reports usage every few seconds
    while time.monotonic() < deadline:
        egress = api.get(f"/v1/sandboxes/{sid}").json()["egress"]
        if egress["refused"] >= 2:
            break
        time.sleep(0.5)
    assert egress["refused"] >= 2, egress


def test_an_answer_ended_by_the_upstreams_close_reaches_the_sandbox_whole(api, make):
    """Plain HTTP is relayed request by request; an answer without a length ends with the
    upstream's close, which the sandbox must see as an end (a FIN), not a reset that drops what it
    has not read yet."""
    sb = make(network=NET)
    out = sh(
        api,
        sb["id"],
        "curl -s -o /tmp/u -w '%{size_download}' http://api.atoll.test:8080/unframed; echo \" rc=$?\"",
    )
    assert out["stdout"].strip() == "300000 rc=0", out
    code = "import urllib.request as u; print(len(u.urlopen('http://api.atoll.test:8080/unframed', timeout=10).read()))"
    assert sh(api, sb["id"], f'python3 -c "{code}"')["stdout"].strip() == "300000"


def test_secret_bad_input_gets_clear_errors(api, secret):
    secret("dup")
    r = api.post("/v1/secrets", json={"name": "dup", "value": "x", "hosts": ["a.example"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "secret_exists"
    for body, needle in (
        ({"name": "bad name", "value": "v", "hosts": ["a.example"]}, "bad name"),
        ({"name": "n1", "value": "a\r\nX-Evil: 1", "hosts": ["a.example"]}, "control character"),
        ({"name": "n1", "value": "v", "hosts": ["10.0.0.1"]}, "10.0.0.1"),
        ({"name": "n1", "value": "v", "hosts": []}, "hosts"),
        ({"name": "n1", "value": "", "hosts": ["a.example"]}, "value"),
    ):
        r = api.post("/v1/secrets", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = api.post("/v1/sandboxes", json={"secrets": {"TOKEN": "nope"}})
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"]
    r = api.post("/v1/sandboxes", json={"env": {"TOKEN": "x"}, "secrets": {"TOKEN": "dup"}})
    assert r.status_code == 400 and "both env and secrets" in r.json()["error"]["message"]
    assert api.delete("/v1/secrets/never").status_code == 404
    names = [s["name"] for s in api.get("/v1/secrets").json()["items"]]
    assert "dup" in names and "n1" not in names


# ---- previews ----------------------------------------------------------------------------------
WEB = r"""
import http.server, socketserver, sys, threading, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path.startswith("/stream"):
            self.send_response(200); self.send_header("transfer-encoding", "chunked"); self.end_headers()
            for i in range(3):
                part = f"part{i};".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part)); self.wfile.flush(); time.sleep(0.3)
            self.wfile.write(b"0\r\n\r\n"); return
        if self.path == "/headers":
            import json
            body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
            self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
            self.wfile.write(body); return
        if self.headers.get("Upgrade") == "echo":
            self.send_response(101); self.send_header("Upgrade", "echo"); self.send_header("Connection", "Upgrade")
            self.end_headers(); self.wfile.flush()
            while True:
                data = self.connection.recv(1000)
                if not data: return
                self.connection.sendall(data.upper())
        body = f"hello {self.path} token={self.headers.get('Atoll-Access-Token')}".encode()
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"""


def serve_web(api, sid: str, port: int = 8080) -> None:
    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/web.py"}, content=WEB.encode())
    assert r.status_code in (200, 201, 204), r.text
    r = api.post(
        f"/v1/sandboxes/{sid}/exec", json={"cmd": ["python3", "/srv/web.py", str(port)], "background": True}
    )
    assert r.status_code in (200, 201), r.text
    for _ in range(50):
        if (
            sh(
                api,
                sid,
                f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\" && echo up",
            )["stdout"].strip()
            == "up"
        ):
            return
        time.sleep(0.1)
    raise AssertionError("the web server in the sandbox did not start")


def ctx_for(la) -> ssl.SSLContext:
    home = la.home if hasattr(la, "home") else None
    ctx = ssl.create_default_context(cafile=os.path.join(str(home), "ca", "root.crt"))
    return ctx


def get(la, headers: dict, target: str = "/", host: str | None = None, timeout: float = 30) -> httpx.Response:
    """One request to the ingress router (TLS verified with the installation's CA; SNI = `host`
    or none)."""
    ctx = ctx_for(la)
    url = f"https://{host or '127.0.0.1'}:{la.ingress_port}{target}"
    transport = httpx.HTTPTransport(verify=ctx)
    with httpx.Client(transport=transport, timeout=timeout) as c:
        if host:
            # resolve the preview name to loopback ourselves: no DNS is asked
            return c.get(
                f"https://127.0.0.1:{la.ingress_port}{target}",
                headers={**headers, "Host": host},
                extensions={"sni_hostname": host},
            )
        return c.get(url, headers=headers)


def test_preview_private_by_default_token_signed_url_and_public(api, la, make):
    a, b = make(), make()
    serve_web(api, a["id"])
    pv = api.get(f"/v1/sandboxes/{a['id']}/preview/8080").json()
    assert pv["url"] == f"https://8080-{a['id']}.atoll.localhost:{la.ingress_port}/" and pv["public"] is False
    route = {"Atoll-Sandbox-Id": a["id"], "Atoll-Sandbox-Port": "8080"}
    r = get(la, route, "/x")
    assert r.status_code == 401 and "Atoll-Access-Token" in r.text
    r = get(la, {**route, "Atoll-Access-Token": pv["token"]}, "/x")
    assert r.status_code == 200 and r.text == "hello /x token=None"  # the token is not passed on
    # by host name, with SNI, as a browser with wildcard DNS would
    host = f"8080-{a['id']}.atoll.localhost"
    r = get(la, {"Atoll-Access-Token": pv["token"]}, "/by-name", host=host)
    assert r.status_code == 200 and r.text.startswith("hello /by-name"), r.text
    # another sandbox's token does not open this one
    other = api.get(f"/v1/sandboxes/{b['id']}/preview/8080").json()["token"]
    r = get(la, {**route, "Atoll-Access-Token": other}, "/x")
    assert r.status_code == 403
    # a signed URL works without a header and sets a cookie; an expired one is refused
    signed = pv["signed_url"].split(str(la.ingress_port), 1)[1].replace("/?", "/s?")
    r = get(la, route, signed)
    assert r.status_code == 200 and r.text == "hello /s token=None"
    assert "atoll_preview=" in r.headers.get("set-cookie", "")
    cookie = r.headers["set-cookie"].split(";")[0]
    assert get(la, {**route, "Cookie": cookie}, "/c").status_code == 200
    exp = int(time.time()) - 10
    bad = re.sub(r"atoll_expires=\d+", f"atoll_expires={exp}", signed)
    r = get(la, route, bad)
    assert r.status_code == 403 and "expired" in r.text
    # a public port needs nothing; it can be made private again
    r = api.put(f"/v1/sandboxes/{a['id']}/preview/8080", json={"public": True})
    assert r.status_code == 200 and r.json()["public"] is True
    assert get(la, route, "/p").status_code == 200
    api.put(f"/v1/sandboxes/{a['id']}/preview/8080", json={"public": False})
    assert get(la, route, "/p").status_code == 401
    # nothing listens: a clear 502; no such sandbox: 404; bad input: 400
    r = get(la, {"Atoll-Sandbox-Id": a["id"], "Atoll-Sandbox-Port": "9", "Atoll-Access-Token": pv["token"]})
    assert r.status_code == 502 and "port 9" in r.text
    assert get(la, {"Atoll-Sandbox-Id": "sb-0000000000000000", "Atoll-Sandbox-Port": "80"}).status_code == 404
    assert get(la, {"Atoll-Sandbox-Id": a["id"], "Atoll-Sandbox-Port": "99999"}).status_code == 400
    assert api.get(f"/v1/sandboxes/{a['id']}/preview/0").status_code == 400


def test_streaming_and_websocket_upgrade_pass_through(api, la, make):
    a = make()
    serve_web(api, a["id"])
    token = api.get(f"/v1/sandboxes/{a['id']}/preview/8080").json()["token"]
    headers = {"Atoll-Sandbox-Id": a["id"], "Atoll-Sandbox-Port": "8080", "Atoll-Access-Token": token}
    with httpx.Client(verify=ctx_for(la), timeout=30) as c:
        with c.stream("GET", f"https://127.0.0.1:{la.ingress_port}/stream", headers=headers) as r:
            t0, arrivals = time.monotonic(), []
            for chunk in r.iter_raw():
                arrivals.append((time.monotonic() - t0, chunk))
        assert b"".join(c for _, c in arrivals) == b"part0;part1;part2;"
        assert arrivals[0][0] < 0.25 and arrivals[-1][0] > 0.5, arrivals  # the first part came early

    async def upgrade():
        r, w = await asyncio.open_connection(
            "127.0.0.1", la.ingress_port, ssl=ctx_for(la), server_hostname=None
        )
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        w.write(f"GET /ws HTTP/1.1\r\nHost: x\r\n{head}Upgrade: echo\r\nConnection: Upgrade\r\n\r\n".encode())
        status = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        w.write(b"ping")
        echo = await asyncio.wait_for(r.readexactly(4), 10)
        w.close()
        return status, echo

    status, echo = asyncio.run(upgrade())
    assert status.startswith(b"HTTP/1.1 101") and echo == b"PING"


def _metric(api, verb: str) -> float:
    text = api.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("atoll_lifecycle_duration_seconds_count") and f'verb="{verb}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_burst_to_a_sandbox_in_standby_shares_one_resume(api, la, make, tier):
    a = make()
    serve_web(api, a["id"])
    token = api.get(f"/v1/sandboxes/{a['id']}/preview/8080").json()["token"]
    headers = {"Atoll-Sandbox-Id": a["id"], "Atoll-Sandbox-Port": "8080", "Atoll-Access-Token": token}
    r = api.post(f"/v1/sandboxes/{a['id']}/pause", json={"tier": tier})
    assert r.status_code == 200 and r.json()["standby_tier"] == tier, r.text
    before = _metric(api, f"resume_{tier}")

    async def burst():
        async with httpx.AsyncClient(verify=ctx_for(la), timeout=60) as c:
            return await asyncio.gather(
                *(c.get(f"https://127.0.0.1:{la.ingress_port}/b{i}", headers=headers) for i in range(20))
            )

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 20, [r.text for r in answers if r.status_code != 200]
    assert all(r.text.startswith(f"hello /b{i}") for i, r in enumerate(answers))
    assert _metric(api, f"resume_{tier}") - before == 1
    assert api.get(f"/v1/sandboxes/{a['id']}").json()["state"] == "running"


def test_an_idle_kept_preview_connection_does_not_pin_the_sandbox_in_memory(api, la, make):
    a = make()
    serve_web(api, a["id"])
    token = api.get(f"/v1/sandboxes/{a['id']}/preview/8080").json()["token"]
    headers = {"Atoll-Sandbox-Id": a["id"], "Atoll-Sandbox-Port": "8080", "Atoll-Access-Token": token}
    with httpx.Client(verify=ctx_for(la), timeout=60) as c:
        url = f"https://127.0.0.1:{la.ingress_port}"
        assert c.get(url + "/one", headers=headers).status_code == 200  # kept alive by httpx
        time.sleep(1.5)  # idle: no request or response in flight
        r = api.post(f"/v1/sandboxes/{a['id']}/pause", json={"tier": "disk"})
        assert r.status_code == 200 and r.json()["standby_tier"] == "disk", r.text
        # the same client connection goes on: the router reconnects after the resume
        r = c.get(url + "/two", headers=headers)
        assert r.status_code == 200 and r.text.startswith("hello /two"), r.text


def test_the_router_speaks_tls_only_and_refuses_garbage(la):
    s = socket.create_connection(("127.0.0.1", la.ingress_port), timeout=5)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"TLS only" in s.recv(1000)
    s.close()
    s = socket.create_connection(("127.0.0.1", la.ingress_port), timeout=5)
    s.sendall(b"\x16\x03\x01\x00\x05hello-not-a-client-hello")
    s.settimeout(5)
    try:
        data = s.recv(1000)
    except (ConnectionResetError, TimeoutError):
        data = b""
    s.close()
    assert b"HTTP" not in data
    r = get(la, {"X-Big": "a" * 70000})
    assert r.status_code == 431


def test_refusals_are_counted_per_sandbox(api, make):
    sb = make(network={"allow_out": ["api.atoll.test"]})
    sh(
        api,
        sb["id"],
        "curl -s -m 5 -o /dev/null http://other.atoll.test:8080/ ; curl -s -m 5 -o /dev/null http://api.atoll.test:8080/ok; true",
    )
    deadline = time.monotonic() + 30  # the worker reports usage every few seconds
    while time.monotonic() < deadline:
        egress = api.get(f"/v1/sandboxes/{sb['id']}").json()["egress"]
        if egress["allowed"] >= 1 and egress["dns_refused"] >= 1:
            break
        time.sleep(0.5)
    assert egress["allowed"] >= 1 and egress["dns_refused"] >= 1, egress


KEPT = r"""
import os, socket, sys
s = socket.create_connection(("api.atoll.test", 8080), timeout=10)
ph = os.environ["TOKEN"]
def ask(host, path):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nX-Key: {ph}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    n = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
    while len(body) < n:
        body += s.recv(65536)
    print(head.split(b"\r\n")[0].decode(), body[:n].decode().strip())
ask("api.atoll.test", "/kept-first")
ask("other.atoll.test", "/kept-second")
"""


def test_every_request_on_a_kept_connection_is_checked_for_its_host(api, host, make, secret):
    """A second request with another Host on a kept-alive connection never reaches the address
    (it was checked for the first name) and gets no secret."""
    secret("tok4", allow_http=True)
    sb = make(network=NET, secrets={"TOKEN": "tok4"})
    r = api.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "/root/kept.py"}, content=KEPT.encode())
    assert r.status_code == 204
    out = sh(api, sb["id"], "python3 /root/kept.py")
    lines = out["stdout"].strip().splitlines()
    assert lines[0].startswith("HTTP/1.1 200") and lines[1].startswith("HTTP/1.1 403"), out
    assert "opened for 'api.atoll.test'" in lines[1]
    assert last_seen(host, "/kept-first")["headers"]["x-key"] == VALUE
    assert not [r for r in seen(host) if "/kept-second" in r["path"]]
    # over HTTPS too: SNI api.atoll.test with Host other.atoll.test
    out = sh(
        api,
        sb["id"],
        'curl -s -H "Host: other.atoll.test" -H "X-Key: $TOKEN" https://api.atoll.test:8443/sni-host',
    )
    assert "opened for 'api.atoll.test'" in out["stdout"], out
    assert not [r for r in seen(host) if "/sni-host" in r["path"]]


@pytest.mark.parametrize("url", ["http://api.atoll.test:8080/slow", "https://other.atoll.test:8443/slow"])
def test_a_request_waiting_for_its_answer_keeps_the_sandbox_in_memory(api, host, make, url):
    """Plain HTTP is followed request by request; TLS the gateway does not intercept is seen as
    bytes: the last went to the upstream and nothing came back, so a request waits."""
    sb = make(network=NET)
    r = api.post(
        f"/v1/sandboxes/{sb['id']}/exec",
        json={
            "cmd": f"curl -sk -o /root/slow.out -w %{{http_code}} {url} > /root/slow.code",
            "background": True,
        },
    )
    assert r.status_code in (200, 201), r.text
    time.sleep(1.8)  # no byte moves while the upstream thinks: the request is in flight all the same
    r = api.post(f"/v1/sandboxes/{sb['id']}/pause", json={"tier": "disk"})
    assert r.status_code == 200, r.text
    assert r.json()["standby_tier"] == "memory" and r.json()["standby_reason"], r.json()
    time.sleep(3)
    for _ in range(50):
        code = sh(api, sb["id"], "cat /root/slow.code 2>/dev/null")["stdout"]
        if code:
            break
        time.sleep(0.2)
    assert code == "200"


def test_the_guest_agents_port_is_never_a_preview(api, la, make):
    a = make()
    for call in (
        lambda: api.get(f"/v1/sandboxes/{a['id']}/preview/49999"),
        lambda: api.put(f"/v1/sandboxes/{a['id']}/preview/49999", json={"public": True}),
    ):
        r = call()
        assert r.status_code == 400 and "guest agent" in r.text, r.text
    token = api.get(f"/v1/sandboxes/{a['id']}/preview/8080").json()["token"]
    r = get(
        la, {"Atoll-Sandbox-Id": a["id"], "Atoll-Sandbox-Port": "49999", "Atoll-Access-Token": token}, "/exec"
    )
    assert r.status_code == 400 and "guest agent" in r.text
    # with E2B's API served (LocalAtoll's default) the host 49999-{id}.{domain} is E2B's code
    # interpreter (E2B_DOMAIN mode), relayed to the E2B edge only with an X-Access-Token (the router
    # refuses it without one); the guest agent's routes are not there either way
    host = f"49999-{a['id']}.atoll.localhost"
    r = get(la, {"Atoll-Access-Token": token}, "/exec", host=host)
    assert r.status_code == 401 and "X-Access-Token" in r.json()["message"], r.text
    r = get(la, {"Atoll-Access-Token": token, "X-Access-Token": "x"}, "/exec", host=host)
    assert r.status_code == 404 and r.json()["code"] == 404 and "E2B" in r.json()["message"], r.text
    assert api.put(f"/v1/sandboxes/{a['id']}/preview/8080", json={"public": "yes"}).status_code == 400


def test_secrets_cannot_take_variables_programs_rely_on(api, secret):
    secret("tok5")
    for var in ("PATH", "SSL_CERT_FILE", "ATOLL_X"):
        r = api.post("/v1/sandboxes", json={"secrets": {var: "tok5"}})
        assert r.status_code == 400 and var in r.json()["error"]["message"], r.text


def test_the_router_refuses_ambiguous_requests(api, la, make):
    a = make()
    serve_web(api, a["id"])
    token = api.get(f"/v1/sandboxes/{a['id']}/preview/8080").json()["token"]

    async def raw(data: bytes) -> bytes:
        r, w = await asyncio.open_connection(
            "127.0.0.1", la.ingress_port, ssl=ctx_for(la), server_hostname=None
        )
        w.write(data)
        out = await asyncio.wait_for(r.read(4000), 10)
        w.close()
        return out

    base = f"Atoll-Sandbox-Port: 8080\r\nAtoll-Access-Token: {token}\r\n"
    twice = f"GET / HTTP/1.1\r\nHost: x\r\nAtoll-Sandbox-Id: {a['id']}\r\nAtoll-Sandbox-Id: sb-other\r\n{base}\r\n"
    assert b"400" in asyncio.run(raw(twice.encode())).split(b"\r\n")[0]
    smuggle = (
        f"POST / HTTP/1.1\r\nHost: x\r\nAtoll-Sandbox-Id: {a['id']}\r\n{base}Content-Length: 5\r\n"
        "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    assert b"400" in asyncio.run(raw(smuggle.encode())).split(b"\r\n")[0]


def test_an_address_entry_does_not_switch_off_name_denials_or_secrets(api, host, make, secret):
    """allow_out by address (as `*` would for a public host) still reads the name: deny_out
    names refuse, a secret's host is intercepted."""
    net = host.a.rsplit(".", 1)[0] + ".0/29"
    sb = make(network={"allow_out": [net], "deny_out": ["api.atoll.test"]})
    a = host.a
    out = sh(
        api, sb["id"], f"curl -s --resolve api.atoll.test:8080:{a} http://api.atoll.test:8080/denied-by-name"
    )
    assert "deny_out api.atoll.test" in out["stdout"], out
    out = sh(
        api,
        sb["id"],
        f"curl -sk --resolve api.atoll.test:8443:{a} https://api.atoll.test:8443/denied-tls; echo rc=$?",
    )
    assert "rc=0" not in out["stdout"], out
    assert not [r for r in seen(host) if "denied" in r["path"]]
    # without a name the address decides, as before
    out = sh(api, sb["id"], f"curl -s -o /dev/null -w %{{http_code}} http://{a}:8080/by-address")
    assert out["stdout"] == "200", out
    secret("tok6")
    sb2 = make(network={"allow_out": [net, "api.atoll.test"]}, secrets={"TOKEN": "tok6"})
    sh(api, sb2["id"], 'curl -s -o /dev/null -H "X-Key: $TOKEN" https://api.atoll.test:8443/addr-secret')
    assert last_seen(host, "/addr-secret")["headers"]["x-key"] == VALUE


ROTATE = r"""
import os, socket, ssl, sys, time
ctx = ssl.create_default_context()
s = ctx.wrap_socket(socket.create_connection(("api.atoll.test", 8443), timeout=10), server_hostname="api.atoll.test")
ph = os.environ["TOKEN"]
def ask(path):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: api.atoll.test\r\nX-Key: {ph}\r\n\r\n".encode())
    data = b""
    while not data.endswith(b"ok"):
        data += s.recv(65536)
ask("/rot-1")
open("/root/rot.ready", "w").close()
while not os.path.exists("/root/rot.go"):
    time.sleep(0.05)
ask("/rot-2")
print("done")
"""


def test_a_rotated_secret_applies_to_an_open_connection(api, host, make, secret):
    secret("tok7")
    sb = make(network=NET, secrets={"TOKEN": "tok7"})
    api.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "/root/rot.py"}, content=ROTATE.encode())
    r = api.post(
        f"/v1/sandboxes/{sb['id']}/exec",
        json={"cmd": "python3 /root/rot.py > /root/rot.out 2>&1", "background": True},
    )
    assert r.status_code in (200, 201)
    for _ in range(100):
        if sh(api, sb["id"], "test -e /root/rot.ready && echo y")["stdout"].strip() == "y":
            break
        time.sleep(0.1)
    assert (
        api.put("/v1/secrets/tok7", json={"value": "new-value-7", "hosts": ["api.atoll.test"]}).status_code
        == 200
    )
    sh(api, sb["id"], "touch /root/rot.go")
    for _ in range(100):
        if "done" in sh(api, sb["id"], "cat /root/rot.out")["stdout"]:
            break
        time.sleep(0.1)
    assert last_seen(host, "/rot-1")["headers"]["x-key"] == VALUE
    assert last_seen(host, "/rot-2")["headers"]["x-key"] == "new-value-7"


def test_the_gateway_is_no_proxy(api, host, make, secret):
    secret("tok8")
    sb = make(network=NET, secrets={"TOKEN": "tok8"})
    out = sh(
        api,
        sb["id"],
        'curl -s -H "X: $TOKEN" --request-target "http://other.atoll.test/abs" http://api.atoll.test:8080/',
    )
    assert "origin-form" in out["stdout"], out
    out = sh(
        api, sb["id"], "curl -s -X CONNECT --request-target other.atoll.test:8080 http://api.atoll.test:8080/"
    )
    assert "CONNECT is not relayed" in out["stdout"], out
    assert not [r for r in seen(host) if "abs" in r["path"]]


def test_the_router_sends_its_own_forwarding_headers_and_keeps_its_cookie(api, la, make):
    a = make()
    serve_web(api, a["id"])
    pv = api.get(f"/v1/sandboxes/{a['id']}/preview/8080").json()
    headers = {
        "Atoll-Sandbox-Id": a["id"],
        "Atoll-Sandbox-Port": "8080",
        "Atoll-Access-Token": pv["token"],
        "X-Forwarded-For": "6.6.6.6",
        "Forwarded": "for=6.6.6.6",
        "Cookie": "app=1; atoll_preview=123.abc",
    }
    seen_there = json.loads(get(la, headers, "/headers").text)
    assert seen_there["x-forwarded-for"] == "127.0.0.1" and "forwarded" not in seen_there
    assert seen_there["cookie"] == "app=1" and "atoll-access-token" not in seen_there

    async def http10():
        r, w = await asyncio.open_connection(
            "127.0.0.1", la.ingress_port, ssl=ctx_for(la), server_hostname=None
        )
        w.write(
            f"GET /old HTTP/1.0\r\nAtoll-Sandbox-Id: {a['id']}\r\nAtoll-Sandbox-Port: 8080\r\n"
            f"Atoll-Access-Token: {pv['token']}\r\n\r\n".encode()
        )
        data = await asyncio.wait_for(r.read(), 10)
        w.close()
        return data

    data = asyncio.run(http10())
    assert data.startswith(b"HTTP/1.1 200") and b"hello /old" in data, data[:300]


def test_sdk_and_cli_for_secrets_and_previews(la, host):
    """The contract's names: client.secrets.create, create(secrets=, network=), sandbox.preview(port)
    → .url/.token, client.ca_certificate(); `atoll secret create|list|rm`, `atoll sandbox preview`."""
    import subprocess
    import sys as _sys

    import atoll

    env = {**os.environ, "ATOLL_URL": la.url, "ATOLL_API_KEY": la.api_key}
    cli = [os.path.join(os.path.dirname(_sys.executable), "atoll")]
    r = subprocess.run(
        cli + ["secret", "create", "clisecret", "--host", "api.atoll.test", "--allow-http"],
        input="cli-value-9\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "clisecret" in r.stdout and "plain HTTP too" in r.stdout, r.stderr
    r = subprocess.run(cli + ["secret", "list"], env=env, capture_output=True, text=True, timeout=60)
    assert "clisecret" in r.stdout and "cli-value-9" not in r.stdout
    with atoll.Client(la.url, la.api_key) as c:
        s = c.secrets.create("sdksecret", "sdk-value-9", ["api.atoll.test"])
        assert s.allow_http is False
        s = c.secrets.replace("sdksecret", "sdk-value-9", ["api.atoll.test"], allow_http=True)
        assert (
            s.name == "sdksecret" and s.hosts == ["api.atoll.test"] and "sdk-value-9" not in str(s.to_dict())
        )
        assert s.allow_http is True and c.secrets.get("sdksecret").allow_http is True
        with c.sandboxes.create(
            network=NET, secrets={"A": "clisecret", "B": "sdksecret"}, idle_timeout_s=0
        ) as sb:
            sb.exec('curl -s -o /dev/null -H "X-A: $A" -H "X-B: $B" http://api.atoll.test:8080/sdk-cli')
            rec = last_seen(host, "/sdk-cli")["headers"]
            assert rec["x-a"] == "cli-value-9" and rec["x-b"] == "sdk-value-9"
            sb.exec(
                [
                    "sh",
                    "-c",
                    "cd /root && echo sdk-preview > i.html && (python3 -m http.server 8080 >/dev/null 2>&1 &)",
                ]
            )
            pv = sb.preview(8080)
            assert pv.url.startswith(f"https://8080-{sb.id}.atoll.localhost:{la.ingress_port}") and pv.token
            ctx = ssl.create_default_context(cadata=c.ca_certificate())
            with httpx.Client(verify=ctx, timeout=30) as web:
                for _ in range(50):
                    r = web.get(f"https://127.0.0.1:{la.ingress_port}/i.html", headers=pv.headers)
                    if r.status_code == 200:
                        break
                    time.sleep(0.1)
            assert r.status_code == 200 and r.text == "sdk-preview\n"
            out = subprocess.run(
                cli + ["sandbox", "preview", sb.id, "8080", "--json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0 and json.loads(out.stdout)["token"] == pv.token, out.stderr
            out = subprocess.run(
                cli + ["sandbox", "preview", sb.id, "8080", "--public"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0 and "public:     yes" in out.stdout
        c.secrets.delete("sdksecret")
    r = subprocess.run(
        cli + ["secret", "rm", "clisecret"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    r = subprocess.run(
        cli + ["secret", "rm", "clisecret"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "secret_not_found" in r.stderr


# ---- the data plane in processes of its own (issue 17 #2) ------------------------------------------
def _helpers(la) -> dict[str, int]:
    """The atoll process's helper processes: {"gateway": pid, "ingress": pid}."""
    from bench.bench_flood import _children

    return _children(la.proc.pid)


def _cpu_s(pid: int) -> float:
    from bench.bench_flood import _cpu_s as cpu

    return cpu(pid)


@pytest.mark.stress
def test_a_flood_of_chunked_uploads_slows_its_sandbox_not_the_api_or_a_neighbour(api, la, host, make):
    """One sandbox sends 1-byte chunks on 32 connections to a host it may reach by name (so the
    gateway parses every request) — what stalled the whole process when the gateway shared the
    API's loop. Meanwhile the API answers, a neighbour's exec runs, and the neighbour's own egress
    works. The bounds are sanity bounds (the benchmark bench_flood measures): nothing waits
    seconds. The parsing happened in the gateway's process, not the API's."""
    from bench.bench_flood import FLOODER

    helpers = _helpers(la)
    assert set(helpers) == {"gateway", "ingress"}, helpers
    flooder = make(network=NET)
    neighbour = make(network=NET)
    r = api.put(
        f"/v1/sandboxes/{flooder['id']}/files", params={"path": "/root/flood.py"}, content=FLOODER.encode()
    )
    assert r.status_code == 204
    gw_cpu = _cpu_s(helpers["gateway"])
    flood = api.post(
        f"/v1/sandboxes/{flooder['id']}/exec",
        json={
            "cmd": ["python3", "/root/flood.py", "api.atoll.test:9090", "32", "8", "2048"],
            "background": True,
        },
    )
    assert flood.status_code in (200, 201), flood.text
    time.sleep(1.5)  # the connections are open and sending
    health, execs = [], []
    with httpx.Client(base_url=la.url, timeout=10) as h:
        end = time.monotonic() + 4
        while time.monotonic() < end:
            t = time.perf_counter()
            assert h.get("/healthz").status_code == 200
            health.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert sh(api, neighbour["id"], "true")["exit_code"] == 0
            execs.append(time.perf_counter() - t)
            time.sleep(0.1)
    out = sh(
        api,
        neighbour["id"],
        "curl -s -o /dev/null -w %{http_code} -m 10 http://api.atoll.test:8080/during-flood",
    )
    assert out["stdout"] == "200", out
    assert max(health) < 2.0 and max(execs) < 5.0, (max(health), max(execs))
    pid = flood.json()["pid"]
    done = api.post(f"/v1/sandboxes/{flooder['id']}/processes/{pid}/wait", json={"timeout_s": 60}).json()
    assert done["exit_code"] == 0, done
    text = api.get(f"/v1/sandboxes/{flooder['id']}/processes/{pid}/output").text
    sent = max(int(json.loads(line).get("stdout", "0").strip() or 0) for line in text.splitlines() if line)
    assert sent > 10 * 2**20, text[-2000:]  # the flood was real
    assert _cpu_s(helpers["gateway"]) - gw_cpu > 0.5  # and the gateway's process did the parsing


def test_the_gateway_process_comes_back_and_its_sandboxes_with_it(api, la, host, make, secret):
    """Killed, the egress gateway's process is started again by its worker and given every
    sandbox's sockets (born in their namespaces), policy and secrets anew."""
    secret("tok12")
    sb = make(network=NET, secrets={"TOKEN": "tok12"})
    req = 'curl -s -o /dev/null -w %{http_code} -m 10 -H "X-Key: $TOKEN" https://api.atoll.test:8443/'
    assert sh(api, sb["id"], req + "before")["stdout"] == "200"
    old = _helpers(la)["gateway"]
    os.kill(old, 9)  # a process of the atoll this module started
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = _helpers(la).get("gateway")
        if new and new != old and sh(api, sb["id"], req + "after")["stdout"] == "200":
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"egress did not come back: {la.tail()}")
    assert last_seen(host, "/after")["headers"]["x-key"] == VALUE


CHURN = r"""
import socket, time
while True:
    try:
        socket.create_connection(("api.atoll.test", 8080), timeout=2).close()
    except OSError:
        pass
    time.sleep(0.1)
"""


def test_no_disk_pause_while_the_gateway_cannot_vouch_for_the_connections(api, la, make):
    """A sandbox that opens and closes connections all the time, its gateway killed (then stopped
    with SIGSTOP): a disk pause in that moment stays in the memory tier, saying why, instead of
    letting runsc fail on endpoints the sandbox's own gate cannot see (which kills the sandbox).
    A gateway that stops answering is killed and started again."""
    sb = make(network=NET)
    r = api.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "/root/churn.py"}, content=CHURN.encode())
    assert r.status_code == 204
    r = api.post(
        f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": ["python3", "/root/churn.py"], "background": True}
    )
    assert r.status_code in (200, 201), r.text
    time.sleep(0.5)
    for how in (signal.SIGKILL, signal.SIGSTOP):
        old = _helpers(la)["gateway"]
        os.kill(old, how)  # a process of the atoll this module started
        r = api.post(f"/v1/sandboxes/{sb['id']}/pause", json={"tier": "disk"})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["standby_tier"] == "memory" and "egress gateway" in got["standby_reason"], got
        assert sh(api, sb["id"], "echo alive")["stdout"] == "alive\n"  # resumed from memory
        deadline = time.monotonic() + 40  # a stopped one is killed after two unanswered pings
        while time.monotonic() < deadline:
            new = _helpers(la).get("gateway")
            if new and new != old:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the gateway was not started again after {how!r}")
        if how == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGCONT)
    time.sleep(2.5)  # the new gateway settled: a disk pause is allowed again
    r = api.post(f"/v1/sandboxes/{sb['id']}/pause", json={"tier": "disk"})
    assert r.status_code == 200 and r.json()["state"] == "standby", r.text
    assert sh(api, sb["id"], "echo back")["stdout"] == "back\n"

"""Egress from real sandboxes through the gateway, to test hosts in a namespace this test makes.

The test host is a network namespace joined to the root namespace by a veth pair (10.250.<n>.0/29):
an HTTP server on .2 and .3 (port 8080), a TCP echo on .2:9000 and a UDP sink on .2:9999 that
records what reaches it. Names come from an ATOLL_EXTRA_HOSTS file; no query or packet goes
anywhere else (the DNS server the sandbox asks directly is TEST-NET 192.0.2.53, answered by the
gateway on the host side: nothing is routed out).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import httpx
import pytest

from atoll.testing import LocalAtoll
from atoll.testing import testnet as testnet_mod
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration

SERVER = r"""
import http.server, socket, socketserver, ssl, sys, threading
a, b, sink, cert = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: connections stay open between requests
    def do_GET(self):
        if self.path == "/big":  # 1 MiB, for the gateway's byte counters
            self.send_response(200); self.send_header("content-length", str(1 << 20)); self.end_headers()
            self.wfile.write(b"x" * (1 << 20))
            return
        if self.path == "/whoami":
            body = self.client_address[0].encode()
            self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
            self.wfile.write(body)
            return
        body = f"hello from {self.server.server_address[0]} host={self.headers.get('Host')}".encode()
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
for ip in (a, b):
    s = http.server.ThreadingHTTPServer((ip, 8080), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(self.request.recv(100).upper())
e = socketserver.ThreadingTCPServer((a, 9000), Echo)
threading.Thread(target=e.serve_forever, daemon=True).start()
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(cert)
for ip in (a, b):
    t = http.server.ThreadingHTTPServer((ip, 8443), H)
    t.socket = ctx.wrap_socket(t.socket, server_side=True)
    threading.Thread(target=t.serve_forever, daemon=True).start()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((a, 9999))
print("ready", flush=True)
while True:
    data, _ = u.recvfrom(100)
    with open(sink, "ab") as f: f.write(data + b"\n")
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def testnet(tmp_path_factory):
    n, lock = testnet_mod.claim_subnet()
    tag = secrets.token_hex(3)
    ns, root_if = f"atoll-test-{tag}", f"at{tag}"
    net = f"10.250.{n}"
    sh("ip", "netns", "add", ns)
    proc = None
    try:
        sh("ip", "link", "add", root_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{net}.1/29", "dev", root_if)
        sh("ip", "addr", "add", f"{net}.4/29", "dev", root_if)  # ATOLL_EGRESS_SOURCE
        sh("ip", "link", "set", root_if, "up")
        sh("ip", "-n", ns, "addr", "add", f"{net}.2/29", "dev", "eth0")
        sh("ip", "-n", ns, "addr", "add", f"{net}.3/29", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        d = tmp_path_factory.mktemp("testnet")
        sink = d / "udp.log"
        cert = d / "cert.pem"
        sh(
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=allowed.atoll.test",
            "-keyout",
            str(cert),
            "-out",
            str(cert),
        )
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                SERVER,
                f"{net}.2",
                f"{net}.3",
                str(sink),
                str(cert),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        hosts = d / "hosts"
        hosts.write_text(f"{net}.2 allowed.atoll.test also.atoll.test\n{net}.3 other.atoll.test\n")
        yield {"net": net, "hosts": str(hosts), "sink": sink}
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", root_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        testnet_mod.release_subnet(lock)


@pytest.fixture(scope="module")
def edge(testnet, tmp_path_factory):
    la = LocalAtoll(
        home=tmp_path_factory.mktemp("atoll-egress") / "home",
        env={
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_EXTRA_HOSTS": testnet["hosts"],
            "ATOLL_EGRESS_SOURCE": testnet["net"] + ".4",
        },
    )
    la.start(timeout=600)
    try:
        with httpx.Client(base_url=la.url, headers=la.headers(), timeout=600) as c:
            yield c
    finally:
        la.stop(reap=True)


def py(api, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["python3", "-c", code], "timeout_s": 30})
    assert r.status_code == 200, r.text
    return r.json()


GET = """
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1] if len(sys.argv) > 1 else {url!r}, timeout=5).read().decode())
except urllib.error.HTTPError as e:
    print("HTTP", e.code, e.read().decode())
except Exception as e:
    print("ERR", type(e).__name__, e)
"""


def get(api, sid, url):
    out = py(api, sid, GET.format(url=url))
    return out["stdout"].strip()


RAW = """
import socket
s = socket.create_connection(({ip!r}, {port}), timeout=5)
try:
    s.sendall({data!r})
    print(repr(s.recv(4000)))
except Exception as e:
    print("ERR", type(e).__name__, e)
"""


@pytest.fixture
def make(edge):
    made = []

    def _make(network=None, **kw):
        body = {"idle_timeout_s": 0, **kw}
        if network is not None:
            body["network"] = network
        r = edge.post("/v1/sandboxes", json=body)
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
        return r.json()

    yield _make
    for sid in made:
        edge.delete(f"/v1/sandboxes/{sid}")


def test_no_policy_no_way_out(edge, make, testnet):
    sb = make()
    assert sb["network"] == {"allow_out": [], "deny_out": []}
    out = get(edge, sb["id"], "http://allowed.atoll.test:8080/")
    assert out.startswith("ERR") and "resolution" in out.lower() or "Name or service" in out, out
    out = get(edge, sb["id"], f"http://{testnet['net']}.2:8080/")
    assert out.startswith("HTTP 403") and "default deny" in out and "allow_out" in out, out


def test_a_domain_rule_lets_that_name_out_and_nothing_else(edge, make, testnet):
    net = testnet["net"]
    sb = make({"allow_out": ["allowed.atoll.test"]})
    sid = sb["id"]
    assert (
        get(edge, sid, "http://allowed.atoll.test:8080/x")
        == f"hello from {net}.2 host=allowed.atoll.test:8080"
    )
    # the same server by address: a raw-IP connection needs an IP entry
    assert get(edge, sid, f"http://{net}.2:8080/").startswith("HTTP 403")
    # another name on the same host is not allowed, and does not even resolve
    assert get(edge, sid, "http://also.atoll.test:8080/").startswith("ERR")
    # the allowed name sent to another address is refused and never reaches it
    code = RAW.format(ip=f"{net}.3", port=8080, data=b"GET / HTTP/1.1\r\nHost: allowed.atoll.test\r\n\r\n")
    out = py(edge, sid, code)["stdout"]
    assert "403" in out and "does not resolve to" in out, out
    # a raw TCP connection with no name in it: refused with a reset
    out = py(edge, sid, RAW.format(ip=f"{net}.2", port=9000, data=b"hi"))["stdout"]
    assert "ERR" in out or out.strip() == "b''", out


def test_network_rules_ports_udp_ipv6_and_dns_elsewhere(edge, make, testnet):
    net = testnet["net"]
    sid = make({"allow_out": [f"{net}.2:9000"]})["id"]
    assert py(edge, sid, RAW.format(ip=f"{net}.2", port=9000, data=b"ping"))["stdout"].strip() == "b'PING'"
    assert get(edge, sid, f"http://{net}.2:8080/").startswith("HTTP 403")  # not that port
    before = testnet["sink"].read_bytes() if testnet["sink"].exists() else b""
    code = f"""
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(3): u.sendto(b"leak", ({net + ".2"!r}, 9999))
try:
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); s.settimeout(3)
    s.connect(("2001:db8::1", 80)); print("v6 connected")
except OSError as e:
    print("v6", type(e).__name__)
import subprocess
"""
    out = py(edge, sid, code)
    assert "v6 connected" not in out["stdout"], out
    time.sleep(1)
    after = testnet["sink"].read_bytes() if testnet["sink"].exists() else b""
    assert after == before  # no UDP reached the test host
    # DNS asked of another server is answered by the gateway: still only what the policy allows
    dns = """
import socket, struct
def ask(name, server):
    q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\\0" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
    s.sendto(q, (server, 53))
    r = s.recv(512)
    return r[3] & 0x0F, struct.unpack(">H", r[6:8])[0]
print(ask("allowed.atoll.test", "192.0.2.53"), ask("allowed.atoll.test", "10.99.0.1"))
"""
    assert py(edge, sid, dns)["stdout"].strip() == "(5, 0) (5, 0)"  # REFUSED: not in this policy
    sid2 = make({"allow_out": ["*.atoll.test"]})["id"]
    assert py(edge, sid2, dns)["stdout"].strip() == "(0, 1) (0, 1)"


def test_the_policy_changes_live_and_bad_entries_are_named(edge, make, testnet):
    sid = make()["id"]
    url = "http://allowed.atoll.test:8080/"
    assert get(edge, sid, url).startswith("ERR")
    r = edge.put(f"/v1/sandboxes/{sid}/network", json={"allow_out": ["*.atoll.test", "Allowed.Atoll.Test."]})
    assert r.status_code == 200 and r.json() == {
        "allow_out": ["*.atoll.test", "allowed.atoll.test"],
        "deny_out": [],
    }
    assert get(edge, sid, url).startswith("hello")
    assert edge.get(f"/v1/sandboxes/{sid}").json()["network"]["allow_out"] == [
        "*.atoll.test",
        "allowed.atoll.test",
    ]
    r = edge.put(
        f"/v1/sandboxes/{sid}/network",
        json={"allow_out": ["*.atoll.test"], "deny_out": ["allowed.atoll.test"]},
    )
    assert r.status_code == 200
    assert get(edge, sid, url).startswith("ERR")  # deny wins (it does not even resolve)
    for bad in (["pypi.org:99999"], ["10.0.0.1/8"], ["2001:db8::1"], [17]):
        r = edge.put(f"/v1/sandboxes/{sid}/network", json={"allow_out": bad})
        assert r.status_code == 400, r.text
        assert json.dumps(bad[0]).strip('"') in r.json()["error"]["message"], r.text
    r = edge.post("/v1/sandboxes", json={"network": {"allow_out": ["a*.b.com"]}})
    assert r.status_code == 400 and "a*.b.com" in r.json()["error"]["message"]
    r = edge.post("/v1/sandboxes", json={"network": {"allow": []}})
    assert r.status_code == 400
    # the last good policy stands
    assert edge.get(f"/v1/sandboxes/{sid}").json()["network"]["deny_out"] == ["allowed.atoll.test"]


def test_egress_after_a_disk_standby_and_to_atolls_own_ports(edge, make, testnet):
    sid = make({"allow_out": ["allowed.atoll.test"]})["id"]
    r = edge.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "disk", r.text
    assert get(edge, sid, "http://allowed.atoll.test:8080/").startswith("hello")  # resumed by the exec
    port = int(edge.base_url.port)
    for ip, p in (
        ("10.99.0.1", 15001),
        ("10.99.0.1", 49999),
        ("10.99.0.1", 53),
        (testnet["net"] + ".1", port),
    ):
        out = py(edge, sid, RAW.format(ip=ip, port=p, data=b"GET / HTTP/1.0\r\n\r\n"))["stdout"]
        assert "200 OK" not in out and "hello" not in out, (ip, p, out)
    assert os.path.exists(testnet["hosts"])


TLS = """
import socket, ssl, sys
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
try:
    s = socket.create_connection(({ip!r}, 8443), timeout=5)
    t = ctx.wrap_socket(s, server_hostname={sni!r})
    t.sendall(b"GET / HTTP/1.1\\r\\nHost: {sni}\\r\\nConnection: close\\r\\n\\r\\n")
    data = b""
    while chunk := t.recv(4000):
        data += chunk
    print(data.decode().splitlines()[-1])
except Exception as e:
    print("ERR", type(e).__name__)
"""


def test_tls_is_matched_by_sni_and_passes_through(edge, make, testnet):
    net = testnet["net"]
    sid = make({"allow_out": ["allowed.atoll.test:8443"]})["id"]
    out = py(edge, sid, TLS.format(ip=f"{net}.2", sni="allowed.atoll.test"))["stdout"].strip()
    assert out == f"hello from {net}.2 host=allowed.atoll.test", out  # end to end, untouched
    # the allowed SNI sent to another address: reset, never reaches it
    assert py(edge, sid, TLS.format(ip=f"{net}.3", sni="allowed.atoll.test"))["stdout"].startswith("ERR")
    assert py(edge, sid, TLS.format(ip=f"{net}.2", sni="other.atoll.test"))["stdout"].startswith("ERR")
    # a malformed ClientHello, and an HTTP request head that never ends: refused, clearly
    bad_hello = b"\x16\x03\x01\x00\x10\x01\x00\x00\x0c" + b"\x00" * 12
    out = py(edge, sid, RAW.format(ip=f"{net}.2", port=8443, data=bad_hello))["stdout"]
    assert "ERR" in out or out.strip() == "b''", out
    huge = b"GET / HTTP/1.1\r\nHost: allowed.atoll.test\r\nX: " + b"a" * 20000
    out = py(edge, sid, RAW.format(ip=f"{net}.2", port=8080, data=huge))["stdout"]
    assert "431" in out, out


def test_egress_leaves_from_atoll_egress_source(edge, make, testnet):
    net = testnet["net"]
    sid = make({"allow_out": ["allowed.atoll.test"]})["id"]
    assert get(edge, sid, "http://allowed.atoll.test:8080/whoami") == f"{net}.4"


KEEPALIVE = """
import http.client, time
c = http.client.HTTPConnection("allowed.atoll.test", 8080, timeout=10)
c.request("GET", "/first"); r = c.getresponse(); r.read()
open("/tmp/ka.log", "a").write(f"first {r.status}\\n")
while not __import__("os").path.exists("/tmp/go"):
    time.sleep(0.1)
try:  # the same connection, after the disk standby: reset while idle, as after a NAT timeout
    c.request("GET", "/again"); r = c.getresponse(); r.read()
    open("/tmp/ka.log", "a").write(f"kept {r.status}\\n")
except OSError as e:
    open("/tmp/ka.log", "a").write(f"reset {type(e).__name__}\\n")
c = http.client.HTTPConnection("allowed.atoll.test", 8080, timeout=10)
c.request("GET", "/new"); r = c.getresponse(); r.read()
open("/tmp/ka.log", "a").write(f"new {r.status}\\n")
"""


def test_an_idle_keepalive_connection_does_not_pin_the_sandbox_in_ram(edge, make):
    sid = make({"allow_out": ["allowed.atoll.test"]})["id"]
    edge.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/ka.py"}, content=KEEPALIVE.encode())
    r = edge.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["python3", "/tmp/ka.py"], "background": True})
    assert r.status_code == 200, r.text
    for _ in range(50):
        if "first 200" in py(edge, sid, "print(open('/tmp/ka.log').read())")["stdout"]:
            break
        time.sleep(0.1)
    time.sleep(1.5)  # the connection is open and idle now
    r = edge.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "disk", r.json()
    py(edge, sid, "open('/tmp/go', 'w')")  # resumes it
    for _ in range(100):
        log = py(edge, sid, "print(open('/tmp/ka.log').read())")["stdout"]
        if "new" in log:
            break
        time.sleep(0.1)
    # the idle connection was reset before the checkpoint; the program lives on and reconnects
    assert log.split()[:3] == ["first", "200", "reset"] and log.split()[-2:] == ["new", "200"], log


def test_requests_then_a_disk_pause_at_once(edge, make):
    """Found by validation: the gateway passed the server's close on as a FIN after the client
    inside had closed first, so the client's endpoint sat in TIME_WAIT (which the gate cannot see)
    and the checkpoint killed the sandbox. The sandbox's side now gets an RST then."""
    sid = make({"allow_out": ["allowed.atoll.test"]})["id"]
    code = """
import urllib.request
for _ in range(5):
    urllib.request.urlopen("http://allowed.atoll.test:8080/", timeout=5).read()
print("ok")
"""
    assert py(edge, sid, code)["stdout"].strip() == "ok"
    r = edge.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "standby", r.json()
    assert get(edge, sid, "http://allowed.atoll.test:8080/").startswith("hello")  # alive after it


def test_the_host_and_metadata_addresses_are_never_reachable(edge, make, testnet):
    net = testnet["net"]
    sid = make({"allow_out": [f"{net}.1", "169.254.0.0/16", f"{net}.0/29"]})["id"]
    for ip in (f"{net}.1", f"{net}.4", "169.254.169.254"):  # the host's own addresses, metadata
        out = py(edge, sid, RAW.format(ip=ip, port=8080, data=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))["stdout"]
        assert "403" in out and "never reachable" in out, (ip, out)
    assert get(edge, sid, f"http://{net}.2:8080/").startswith("hello")  # the rule itself works


def test_a_malformed_http_head_cannot_fool_the_host_check(edge, make, testnet):
    net = testnet["net"]
    sid = make({"allow_out": ["allowed.atoll.test"]})["id"]
    for data in (
        b"GET / HTTP/1.1\nHost: allowed.atoll.test\n\n",  # bare LF
        b"GET / HTTP/1.1\r\nHost : other.atoll.test\r\nHost: allowed.atoll.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: y\r\n Host: other.atoll.test\r\nHost: allowed.atoll.test\r\n\r\n",
    ):
        out = py(edge, sid, RAW.format(ip=f"{net}.2", port=8080, data=data))["stdout"]
        assert "hello" not in out, (data, out)


def test_bytes_through_the_gateway_are_metered(edge, make):
    """The gateway counts each connection's bytes on the sandbox's side (TCP_INFO): a 1 MiB
    download shows in GET /v1/usage as ingress_bytes, the request as egress_bytes."""

    def counted(sid: str) -> tuple[int, int]:
        r = edge.get("/v1/usage", params={"group_by": "sandbox"})
        assert r.status_code == 200, r.text
        u = [i for i in r.json()["items"] if i["sandbox_id"] == sid]
        return (u[0]["egress_bytes"], u[0]["ingress_bytes"]) if u else (0, 0)

    sid = make({"allow_out": ["allowed.atoll.test"]})["id"]
    code = GET.replace(".read().decode())", ".read().__len__())")
    assert py(edge, sid, code.format(url="http://allowed.atoll.test:8080/big"))["stdout"].strip() == str(
        1 << 20
    )
    deadline = time.monotonic() + 20  # the gateway reports each second, the worker every 5 s
    while counted(sid)[1] < 1 << 20 and time.monotonic() < deadline:
        time.sleep(0.5)
    out, into = counted(sid)
    assert 1 << 20 <= into <= (1 << 20) + 16_384, into  # the body, the answer's head
    assert 40 <= out <= 4096, out  # the request

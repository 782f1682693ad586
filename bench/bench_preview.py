"""Benchmark: preview URLs — what the ingress router adds to a request, and the wake from standby.

One real gVisor sandbox of an `atoll up` runs an HTTP/1.1 keep-alive server on port 8080 (100-byte
answers). Side by side in the same run, each a kept-alive `http.client` connection from this
process:

  direct      plain HTTP straight to the sandbox's port from its host-side namespace (the socket
              the worker itself would open: worker.netns.socket_in), no router;
  router      HTTPS to the ingress router (ATOLL_INGRESS_PORT) with the routing headers and the
              token, which relays to the same port through the worker.

router − direct is the router's own cost (TLS, parsing, the worker's connection). The wake section
puts the sandbox in memory-tier (and disk-tier) standby and times one request's first byte (the
status line) over a kept TLS connection to the router — and over a new connection with a kept
TLS context — until the answer starts; the router resumes the sandbox in between.

Prints one JSON document. Needs root.
"""

from __future__ import annotations

import http.client
import os
import ssl
import time

from atoll.core import ids
from atoll.worker.host import netns
from bench import common as c

WEB = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def do_GET(self):
        body = b"y" * 100
        self.send_response(200); self.send_header("content-length", "100"); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def _first_byte(conn: http.client.HTTPConnection, headers: dict) -> tuple[float, float]:
    """(ms to the first byte of the answer, ms to the whole answer) of one GET."""
    t0 = time.perf_counter()
    conn.request("GET", "/small", headers=headers)
    r = conn.getresponse()  # returns once the status line and headers are in
    t1 = time.perf_counter()
    body = r.read()
    t2 = time.perf_counter()
    assert r.status == 200 and len(body) == 100, (r.status, body[:200])
    return (t1 - t0) * 1000, (t2 - t0) * 1000


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=500, help="requests per path")
    ap.add_argument("--wakes", type=int, default=30, help="memory-tier wakes (and a third as many from disk)")
    args = ap.parse_args()
    res: dict = {}
    with c.local_atoll() as a:
        c.warm_up(a)
        sid = a.create()["id"]
        try:
            r = a.api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/web.py"}, content=WEB.encode())
            r.raise_for_status()
            a.api.post(
                f"/v1/sandboxes/{sid}/exec", json={"cmd": ["python3", "/root/web.py"], "background": True}
            ).raise_for_status()
            time.sleep(1.0)
            pv = a.api.get(f"/v1/sandboxes/{sid}/preview/8080").json()
            headers = {
                "Atoll-Sandbox-Id": sid,
                "Atoll-Sandbox-Port": "8080",
                "Atoll-Access-Token": pv["token"],
            }
            ctx = ssl.create_default_context(cafile=os.path.join(a.home, "ca", "root.crt"))
            port = a.local.ingress_port

            def router_conn() -> http.client.HTTPSConnection:
                return http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)

            sock = netns.socket_in(netns.path(netns.host_side(ids.runtime_name(a.install_id, sid))))
            sock.settimeout(30)
            sock.connect((netns.SANDBOX_IP, 8080))
            direct = http.client.HTTPConnection(netns.SANDBOX_IP, 8080, timeout=30)
            direct.sock = sock
            router = router_conn()
            lat: dict[str, list[float]] = {"direct": [], "router": []}
            for _ in range(20):  # warm both
                _first_byte(direct, {})
                _first_byte(router, headers)
            for _ in range(args.n):  # interleaved: both see the same machine state
                lat["direct"].append(_first_byte(direct, {})[1])
                lat["router"].append(_first_byte(router, headers)[1])
            direct.close()
            res["request"] = {k: c.summarize(v, keep_samples=False) for k, v in lat.items()}
            res["request"]["router_added_p50_ms"] = round(
                res["request"]["router"]["p50"] - res["request"]["direct"]["p50"], 3
            )
            wake: dict[str, list[float]] = {
                "memory_kept_conn": [],
                "memory_new_conn": [],
                "disk_kept_conn": [],
            }
            for i in range(args.wakes):
                kept = i % 2 == 0
                a.api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"}).raise_for_status()
                conn = router if kept else router_conn()
                ttfb, _ = _first_byte(conn, headers)
                wake["memory_kept_conn" if kept else "memory_new_conn"].append(ttfb)
                if not kept:
                    conn.close()
            for _ in range(max(1, args.wakes // 3)):
                _first_byte(router, headers)
                time.sleep(1.2)  # the kept connection goes idle (no request in flight)
                r = a.api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}, timeout=120)
                r.raise_for_status()
                assert r.json()["standby_tier"] == "disk", r.json()
                ttfb, _ = _first_byte(router, headers)
                wake["disk_kept_conn"].append(ttfb)
            router.close()
            res["wake_first_byte"] = {k: c.summarize(v, keep_samples=False) for k, v in wake.items()}
        finally:
            a.api.delete(f"/v1/sandboxes/{sid}")
    c.emit({"benchmark": "preview", "when": c.timestamp(), "machine": c.machine_info(), "results": res})


if __name__ == "__main__":
    main()

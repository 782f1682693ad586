"""Benchmark: the egress gateway — what it adds to an HTTP request and to a 100 MB download, beside a
direct connection in the same run, and the network set-up and tear-down of 200 sandboxes.

Traffic goes only to a test host in a network namespace this benchmark makes (10.252.<n>.0/29, an
HTTP/1.1 keep-alive server with `/small` (100 bytes) and `/big` (100 MB)), from three clients, the
same Python program each (`http.client`, one kept-alive connection):

  direct      in the root namespace, straight to the test host (no gateway);
  gateway     in a sandbox-shaped pair of namespaces (worker.netns.create: veth, default route,
              the nftables FENCE) with a native Linux stack, through a Gateway served by this
              process (atoll.gateway, the worker's code) with an IP rule for the test host;
  sandbox     inside a real gVisor sandbox of an `atoll up`, through its worker's gateway.

gateway − direct is the gateway's own cost (a redirect, one more hop over a veth, the relay);
sandbox − gateway is gVisor's network stack. The set-up section times, for 200 sandbox names, the
worker's namespace pair + FENCE (`netns.create`), the gateway's sockets and attach, and then the
detach + `netns.delete`, one at a time.

Prints one JSON document. Needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import threading
import time

from atoll.core import netpolicy
from atoll.gateway import egress
from atoll.gateway import names as names_mod
from atoll.worker.host import netns
from atoll.worker.runtimes import edge
from bench import common as c

SERVER = r"""
import http.server, sys
ip = sys.argv[1]
BIG = b"x" * (1 << 20)
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK wait
    def do_GET(self):
        if self.path == "/big":
            self.send_response(200); self.send_header("content-length", str(100 * len(BIG))); self.end_headers()
            for _ in range(100):
                self.wfile.write(BIG)
        else:
            body = b"y" * 100
            self.send_response(200); self.send_header("content-length", "100"); self.end_headers()
            self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer((ip, 8080), H).serve_forever()
"""

CLIENT = r"""
import http.client, json, sys, time
host, n, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = http.client.HTTPConnection(host, 8080, timeout=60)
c.request("GET", "/small"); c.getresponse().read()  # connect, warm
lat = []
for _ in range(n):
    t = time.perf_counter(); c.request("GET", "/small"); c.getresponse().read(); lat.append((time.perf_counter() - t) * 1000)
mbs = []
for _ in range(big):
    t = time.perf_counter(); c.request("GET", "/big"); r = c.getresponse()
    got = 0
    while chunk := r.read(1 << 20):
        got += len(chunk)
    assert got == 100 << 20, got
    mbs.append(100 / (time.perf_counter() - t))
print(json.dumps({"lat": lat, "mbs": mbs}))
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@contextlib.contextmanager
def test_host():
    tag = secrets.token_hex(3)
    ns, root_if, net = f"atoll-bench-{tag}", f"ab{tag}", f"10.252.{200 + secrets.randbelow(50)}"
    sh("ip", "netns", "add", ns)
    proc = None
    try:
        sh("ip", "link", "add", root_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{net}.1/29", "dev", root_if)
        sh("ip", "link", "set", root_if, "up")
        sh("ip", "-n", ns, "addr", "add", f"{net}.2/29", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, f"{net}.2"])
        time.sleep(0.5)
        yield f"{net}.2"
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", root_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class LoopThread:
    """An event loop in a thread, for the Gateway this benchmark serves."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.t.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.t.join(5)


def _client(argv_prefix: list[str], host: str, n: int, big: int) -> dict:
    out = subprocess.run(
        [*argv_prefix, "python3", "-c", CLIENT, host, str(n), str(big)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def through(results: dict, name: str, data: dict) -> None:
    results.setdefault(name, {"lat": [], "mbs": []})
    results[name]["lat"] += data["lat"]
    results[name]["mbs"] += data["mbs"]


def gateway_paths(host: str, rounds: int, n: int, big: int, in_sandbox) -> dict:
    lt = LoopThread()
    gw = egress.Gateway(names_mod.Names([]), own_ip=netns.HOST_IP)
    name = f"atoll-benchgw-{secrets.token_hex(4)}"
    raw: dict = {}
    try:
        lt.run(netns.create(name))
        tcp, udp = lt.run(_sockets_async(name))
        policy = netpolicy.parse({"allow_out": [host]})
        lt.run(gw.attach("sb-bench", tcp, udp, policy))
        for i in range(rounds):
            order = ["direct", "gateway", "sandbox"]
            for path in order[i % 3 :] + order[: i % 3]:
                if path == "direct":
                    through(raw, path, _client([], host, n, big))
                elif path == "gateway":
                    through(raw, path, _client(["ip", "netns", "exec", name], host, n, big))
                else:
                    through(raw, path, in_sandbox(host, n, big))
            c.log(f"round {i + 1}/{rounds} done")
    finally:
        lt.run(gw.aclose())
        lt.run(netns.delete(name))
        lt.stop()
    out = {}
    for path, d in raw.items():
        out[path] = {
            "request_small": c.summarize(d["lat"], keep_samples=False),
            "download_100MB_MBps": c.summarize(d["mbs"], unit="MB/s", keep_samples=False),
        }
    out["gateway_adds_ms_p50"] = round(
        out["gateway"]["request_small"]["p50"] - out["direct"]["request_small"]["p50"], 3
    )
    out["gateway_throughput_over_direct"] = round(
        out["gateway"]["download_100MB_MBps"]["p50"] / out["direct"]["download_100MB_MBps"]["p50"], 3
    )
    out["sandbox_throughput_over_direct"] = round(
        out["sandbox"]["download_100MB_MBps"]["p50"] / out["direct"]["download_100MB_MBps"]["p50"], 3
    )
    return out


def setup_teardown(count: int) -> dict:
    lt = LoopThread()
    gw = egress.Gateway(names_mod.Names([]), own_ip=netns.HOST_IP)
    names = [f"atoll-benchst-{secrets.token_hex(5)}" for _ in range(count)]
    up, down, made = [], [], []
    policy = netpolicy.parse({"allow_out": ["pypi.org", "*.github.com:443", "10.0.0.0/8"]})
    try:
        for i, name in enumerate(names):
            t = time.perf_counter()
            lt.run(netns.create(name))
            tcp, udp = lt.run(_sockets_async(name))
            lt.run(gw.attach(f"sb-{i}", tcp, udp, policy))
            up.append((time.perf_counter() - t) * 1000)
            made.append((i, name))
        for i, name in made:
            t = time.perf_counter()
            lt.run(gw.detach(f"sb-{i}"))
            lt.run(netns.delete(name))
            down.append((time.perf_counter() - t) * 1000)
        made.clear()
    finally:
        for i, name in made:
            with contextlib.suppress(Exception):
                lt.run(gw.detach(f"sb-{i}"))
                lt.run(netns.delete(name))
        lt.stop()
    return {
        "sandboxes": count,
        "setup_each": c.summarize(up, keep_samples=False),
        "teardown_each": c.summarize(down, keep_samples=False),
        "setup_total_s": round(sum(up) / 1000, 2),
        "teardown_total_s": round(sum(down) / 1000, 2),
    }


async def _sockets_async(name: str):
    return await asyncio.get_running_loop().run_in_executor(
        netns.ns_thread, edge._sockets, netns.path(netns.host_side(name))
    )


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=200, help="small requests per client per round")
    ap.add_argument("--big", type=int, default=2, help="100 MB downloads per client per round")
    ap.add_argument("--sandboxes", type=int, default=200)
    args = ap.parse_args()
    res: dict = {}
    with test_host() as host, c.local_atoll() as a:
        c.warm_up(a)
        sid = a.create(network={"allow_out": [host]})["id"]

        def in_sandbox(h: str, n: int, big: int) -> dict:
            r = a.api.post(
                f"/v1/sandboxes/{sid}/exec",
                json={"cmd": ["python3", "-c", CLIENT, h, str(n), str(big)], "timeout_s": 600},
                timeout=700,
            )
            r.raise_for_status()
            out = r.json()
            assert out["exit_code"] == 0, out
            return json.loads(out["stdout"].strip().splitlines()[-1])

        try:
            res["http"] = gateway_paths(host, args.rounds, args.n, args.big, in_sandbox)
        finally:
            a.delete(sid)
    res["setup_teardown"] = setup_teardown(args.sandboxes)
    c.emit({"benchmark": "egress", "when": c.timestamp(), "machine": c.machine_info(), "results": res})


if __name__ == "__main__":
    main()

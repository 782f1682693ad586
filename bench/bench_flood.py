"""Benchmark: one sandbox floods the egress gateway with chunked uploads; do the API and a
neighbour notice? (issue 17, item 2)

The flood is what stalled `atoll up` for 14 s when the gateway shared the API's event loop: from
one sandbox, 64 connections to a host its policy allows, each sending a `Transfer-Encoding:
chunked` body of 1-byte chunks (CHUNKS_PER_WRITE chunks per write, so each read the gateway makes
holds thousands of them) for FLOOD_S seconds. The host is a test host in a network namespace this
benchmark makes (10.250.<n>.0/29, atoll.testing.testnet), a sink that reads and drops bodies.

Measured side by side in the same run, the same way, without and then with the flood:
  healthz   `GET /healthz` polled every 0.1 s (one kept-alive connection), latency of each answer;
  exec      a neighbour sandbox's `exec true` in a loop, latency of each.
Reported: p50/p99/max of both, the flood's bytes sent, and the gateway process's CPU over the
phase (from /proc: it must not be the API's). Prints one JSON document. Needs root. `--quick`
floods for 5 s. Called by bench/run_all.py (section `flood`) and on its own:
    .venv/bin/python bench/bench_flood.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atoll.testing.testnet import TestHost  # noqa: E402
from bench import common as c  # noqa: E402

FLOOD_S = 15.0
CONNECTIONS = 64
CHUNKS_PER_WRITE = 2048

SINK = r"""
import socket, sys, threading
def serve(conn):
    try:
        while conn.recv(1 << 20):
            pass
    except OSError:
        pass
    finally:
        conn.close()
for ip in sys.argv[1:3]:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, 8080)); s.listen(512)
    threading.Thread(target=lambda s=s: [threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start() for _ in iter(int, 1)], daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

FLOODER = r"""
import socket, sys, threading, time
target, n, seconds, per_write = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
host, _, port = target.partition(":")
payload = b"1\r\nx\r\n" * per_write
sent = [0] * n
def one(i):
    try:
        s = socket.create_connection((host, int(port or 8080)), timeout=30)
        s.sendall(f"POST /upload/{i} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            s.sendall(payload)
            sent[i] += len(payload)
        s.close()
    except OSError as e:
        print("conn", i, "ended:", e, file=sys.stderr)
ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in ts: t.start()
for t in ts: t.join()
print(sum(sent))
"""


def _cpu_s(pid: int | None) -> float:
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _children(pid: int) -> dict[str, int]:
    """The atoll process's helper processes by role (the gateway's and the router's pid)."""
    out: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if "atoll.gateway" in cmd:
            out["gateway"] = int(entry)
        elif "atoll.ingress" in cmd:
            out["ingress"] = int(entry)
    return out


def measure(la, neighbour: str, seconds: float) -> dict:
    """Poll /healthz every 0.1 s and run `true` in the neighbour in a loop for `seconds`."""
    healthz: list[float] = []
    execs: list[float] = []
    failures: list[str] = []
    stop = time.monotonic() + seconds

    def poll() -> None:
        with httpx.Client(base_url=la.url, timeout=10) as h:
            while time.monotonic() < stop:
                t = time.perf_counter()
                try:
                    r = h.get("/healthz")
                    ok = r.status_code == 200
                except httpx.HTTPError as e:
                    ok = False
                    failures.append(f"healthz: {e!r}")
                healthz.append((time.perf_counter() - t) * 1000)
                if not ok:
                    failures.append("healthz not 200")
                time.sleep(max(0.0, 0.1 - (time.perf_counter() - t)))

    def run() -> None:
        with httpx.Client(base_url=la.url, headers=la.headers(), timeout=30) as h:
            while time.monotonic() < stop:
                t = time.perf_counter()
                try:
                    r = h.post(f"/v1/sandboxes/{neighbour}/exec", json={"cmd": ["true"]})
                    if r.status_code != 200:
                        failures.append(f"exec {r.status_code}")
                except httpx.HTTPError as e:
                    failures.append(f"exec: {e!r}")
                execs.append((time.perf_counter() - t) * 1000)
                time.sleep(0.05)

    threads = [threading.Thread(target=poll), threading.Thread(target=run)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "healthz_ms": c.summarize(healthz),
        "healthz_over_1s": sum(1 for x in healthz if x > 1000),
        "exec_ms": c.summarize(execs),
        "failures": failures[:20],
    }


NAME = "flood.atoll.test"
"""The sink's name (a hosts file of the atoll's: ATOLL_EXTRA_HOSTS): allowed by name, so every
request is parsed for its Host — the path the flood stalled."""


def run(seconds: float = FLOOD_S) -> dict:
    """A test host, then an atoll of its own that knows the host's name (run_all's shared one
    does not), the warm-up, then the two phases."""
    with TestHost(SINK, ["{a}", "{b}"]) as host:
        hosts = host.hosts_file([f"{host.a} {NAME}"])
        with c.local_atoll(env={"ATOLL_EXTRA_HOSTS": hosts}) as a:
            c.warm_up(a)
            return _run(a, host, seconds)


def _run(a: c.Atoll, host: TestHost, seconds: float) -> dict:
    la, api = a.local, a.api
    flooder = a.create(network={"allow_out": [NAME]})["id"]
    neighbour = a.create()["id"]
    try:
        r = api.put(
            f"/v1/sandboxes/{flooder}/files", params={"path": "/root/flood.py"}, content=FLOODER.encode()
        )
        assert r.status_code in (200, 201, 204), r.text
        a.exec(neighbour, ["true"])  # warm
        api_pid = la.proc.pid if la.proc else 0
        kids = _children(api_pid)
        out: dict = {"processes": {"api": api_pid, **kids}}
        c.log("without the flood")
        out["without_flood"] = measure(la, neighbour, seconds)
        cpu0 = {k: _cpu_s(p) for k, p in out["processes"].items()}
        started = time.monotonic()
        c.log(f"with the flood: {CONNECTIONS} connections, {CHUNKS_PER_WRITE} 1-byte chunks per write")
        flood = api.post(
            f"/v1/sandboxes/{flooder}/exec",
            json={
                "cmd": [
                    "python3",
                    "/root/flood.py",
                    NAME,
                    str(CONNECTIONS),
                    str(seconds),
                    str(CHUNKS_PER_WRITE),
                ],
                "background": True,
            },
        )
        assert flood.status_code in (200, 201), flood.text
        pid = flood.json()["pid"]
        time.sleep(1.0)  # the connections are open and sending
        out["with_flood"] = measure(la, neighbour, seconds - 1.0)
        done = api.post(f"/v1/sandboxes/{flooder}/processes/{pid}/wait", json={"timeout_s": 60}).json()
        elapsed = time.monotonic() - started
        cpu = {k: round(_cpu_s(p) - cpu0.get(k, 0.0), 2) for k, p in out["processes"].items()}
        lines = [
            ln for ln in api.get(f"/v1/sandboxes/{flooder}/processes/{pid}/output").text.splitlines() if ln
        ]
        sent = None
        for ln in lines:
            data = json.loads(ln).get("stdout", "")
            if data.strip().isdigit():
                sent = int(data.strip())
        out["flood_output"] = lines[-12:]
        out["flood"] = {
            "connections": CONNECTIONS,
            "chunks_per_write": CHUNKS_PER_WRITE,
            "seconds": round(elapsed, 1),
            "exit_code": done.get("exit_code"),
            "bytes_sent": sent,
            "cpu_seconds_by_process": cpu,
        }
        out["targets"] = {
            "healthz_p99_ms_max": 250,
            "healthz_over_1s_max": 0,
            "neighbour_exec_p99_ms_max": 250,
        }
        return out
    finally:
        for sid in (flooder, neighbour):
            a.delete(sid, wait=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    result = run(5.0 if args.quick else FLOOD_S)
    c.emit({"benchmark": "flood", "timestamp": c.timestamp(), "machine": c.machine_info(), "results": result})


if __name__ == "__main__":
    main()

"""Benchmark: two running atoll servers side by side (e.g. two commits), interleaved: the exec round
trip of `true` as argv and through the shell on one fresh sandbox each, and create latency.

Used for before/after claims (docs/benchmarks.md, "Hardening: what it cost"): start each version
with its own ATOLL_HOME and ATOLL_PORT (same template dir), then

    .venv/bin/python bench/bench_ab_exec.py http://127.0.0.1:7391 http://127.0.0.1:7392 --key KEY

Prints one JSON document: per server and measure, p50 / min / n in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--key", required=True)
    ap.add_argument("-n", type=int, default=60)
    ap.add_argument("--creates", type=int, default=8)
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.key}"}
    clients = {u: httpx.Client(base_url=u, headers=headers, timeout=120) for u in (args.a, args.b)}
    sids = {}
    for u, c in clients.items():
        r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        r.raise_for_status()
        sids[u] = r.json()["id"]
    res: dict[str, dict[str, list[float]]] = {
        u: {"exec_argv_true": [], "exec_sh_true": [], "create": []} for u in clients
    }
    try:
        for name, cmd in (("exec_argv_true", ["true"]), ("exec_sh_true", "true")):
            for _ in range(5):  # warm-up
                for u, c in clients.items():
                    c.post(f"/v1/sandboxes/{sids[u]}/exec", json={"cmd": cmd})
            for _ in range(args.n):
                for u, c in clients.items():
                    t0 = time.perf_counter()
                    r = c.post(f"/v1/sandboxes/{sids[u]}/exec", json={"cmd": cmd})
                    res[u][name].append((time.perf_counter() - t0) * 1000)
                    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        for _ in range(args.creates):
            for u, c in clients.items():
                t0 = time.perf_counter()
                r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                res[u]["create"].append((time.perf_counter() - t0) * 1000)
                r.raise_for_status()
                c.delete(f"/v1/sandboxes/{r.json()['id']}")
                time.sleep(2)  # let the background runsc delete finish
    finally:
        for u, c in clients.items():
            c.delete(f"/v1/sandboxes/{sids[u]}")
    out = {
        u: {
            m: {"p50": round(statistics.median(v), 2), "min": round(min(v), 2), "n": len(v)}
            for m, v in d.items()
        }
        for u, d in res.items()
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

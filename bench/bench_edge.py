"""Benchmark: an exec through `atoll edge` (straight to the worker, with a cached grant) against the
same exec through the API server (which relays it to the worker), interleaved in one run (issue 21
item 5: the data path off the control plane).

Run standalone as root (`.venv/bin/python bench/bench_edge.py [--quick] [--no-save]`). Starts an
`atoll server`, one `atoll worker` and an `atoll edge --server URL` (atoll.testing), creates one
sandbox, then after a warm-up of 20 each:

  via_api           POST /v1/sandboxes/{id}/exec {"cmd": ["true"]} on the API (p50/p95)
  via_edge          the same call on the edge, interleaved with the API's (api, edge, api, …)
  edge_over_api     p50 edge / p50 API
  grant             POST /v1/sandboxes/{id}/grant on the API: what the edge pays once a minute
                    per (key, sandbox) (its cache keeps a grant until 10 s before it expires)
  recheck           GET /v1/sandboxes/{id} on the API: what the edge pays at most every 5 s per
                    (key, sandbox) to re-check a kept grant (edge.upstream.REVALIDATE_S)

Prints one JSON document (also bench/results/edge.json unless --no-save or --quick); progress on
stderr. Traffic only on loopback and the sandbox's own veth pair.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402
import httpx  # noqa: E402

from atoll.testing import LocalCluster, LocalEdge  # noqa: E402


def _p95(s: dict) -> dict:
    xs = sorted(s.get("samples", []))
    if xs:
        s["p95"] = round(c.percentile(xs, 0.95), 3)
    return s


def _exec(client: httpx.Client, sid: str) -> float:
    with c.Timer() as t:
        r = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
    if r.status_code != 200 or r.json()["exit_code"] != 0:
        raise RuntimeError(f"exec through {client.base_url}: {r.status_code} {r.text}")
    return t.ms


def run(n: int) -> dict:
    root = tempfile.mkdtemp(prefix="atoll-bench-edge-", dir=c.BENCH_TMP)
    env = {"ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR, "ATOLL_LOG_LEVEL": "INFO", "ATOLL_LOG_FORMAT": "json"}
    cl = LocalCluster(os.path.join(root, "cluster"), workers=1, env=env)
    edge: LocalEdge | None = None
    clients: list[httpx.Client] = []
    try:
        c.log(f"starting atoll server + atoll worker + atoll edge (root {root})")
        cl.start(timeout=600)
        edge = LocalEdge(os.path.join(root, "edge"), cl.url, env=env).start()
        api = httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=120)
        via_edge = httpx.Client(base_url=edge.url, headers=cl.headers(), timeout=120)
        clients += [api, via_edge]
        r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        if r.status_code != 201:
            raise RuntimeError(f"create: {r.status_code} {r.text}")
        sid = r.json()["id"]
        xs: dict[str, list[float]] = {"api": [], "edge": [], "grant": [], "recheck": []}
        for i in range(n + 20):
            a, e = _exec(api, sid), _exec(via_edge, sid)
            if i >= 20:
                xs["api"].append(a)
                xs["edge"].append(e)
        for _ in range(max(20, n // 10)):
            with c.Timer() as t:
                g = api.post(f"/v1/sandboxes/{sid}/grant")
            if g.status_code != 200:
                raise RuntimeError(f"grant: {g.status_code} {g.text}")
            xs["grant"].append(t.ms)
            with c.Timer() as t:
                g = api.get(f"/v1/sandboxes/{sid}")
            if g.status_code != 200:
                raise RuntimeError(f"recheck: {g.status_code} {g.text}")
            xs["recheck"].append(t.ms)
        out = {
            "via_api": _p95(c.summarize(xs["api"])),
            "via_edge": _p95(c.summarize(xs["edge"])),
            "grant": _p95(c.summarize(xs["grant"])),
            "recheck": _p95(c.summarize(xs["recheck"])),
        }
        out["edge_over_api"] = c.ratio(out["via_edge"], out["via_api"])
        api.delete(f"/v1/sandboxes/{sid}")
        c.log(
            f"exec true p50: via API {out['via_api']['p50']:.2f} ms, via edge {out['via_edge']['p50']:.2f} ms "
            f"({out['edge_over_api']:.2f}x); grant p50 {out['grant']['p50']:.2f} ms, "
            f"recheck p50 {out['recheck']['p50']:.2f} ms"
        )
        return out
    finally:
        for cli in clients:
            cli.close()
        if edge is not None:
            edge.terminate()
        cl.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 execs each (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/edge.json")
    args = ap.parse_args()
    doc = {
        "benchmark": "edge",
        "timestamp": c.timestamp(),
        "machine": c.machine_info(),
        "results": run(20 if args.quick else 300),
        "quick": args.quick,
    }
    c.emit(doc)
    if not (args.quick or args.no_save):
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "edge.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

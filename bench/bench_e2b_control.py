"""Benchmark: E2B's control API (ATOLL_E2B_PORT, served by the edge child of `atoll up`, which
forwards each call to the API over loopback) against the same call on atoll's own API,
interleaved in one run (issue 22).

Run standalone as root (`.venv/bin/python bench/bench_e2b_control.py [--quick] [--no-save]`).
Starts `atoll up` (atoll.testing), then, after a warm-up, interleaved native/E2B pairs of:

  create      POST /v1/sandboxes {timeout_s: 300, on_timeout: delete}  /  POST /v2/sandboxes
  get         GET /v1/sandboxes/{id}  /  GET /sandboxes/{id}
  list        GET /v1/sandboxes  /  GET /v2/sandboxes (a handful of sandboxes)
  delete      DELETE /v1/sandboxes/{id}  /  DELETE /sandboxes/{id}

with plain httpx clients (p50/p95 in ms) and the ratio E2B / native of each p50. Prints one JSON
document (also bench/results/e2b_control.json unless --no-save or --quick); progress on stderr.
Traffic only on loopback.
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

from atoll.testing import LocalAtoll  # noqa: E402


def _timed(fn, *args) -> tuple[float, httpx.Response]:
    with c.Timer() as t:
        r = fn(*args)
    if r.status_code >= 300:
        raise RuntimeError(f"{r.request.method} {r.request.url}: {r.status_code} {r.text}")
    return t.ms, r


def run(creates: int, reads: int) -> dict:
    root = tempfile.mkdtemp(prefix="atoll-bench-e2b-", dir=c.BENCH_TMP)
    env = {"ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR, "ATOLL_LOG_LEVEL": "INFO", "ATOLL_LOG_FORMAT": "json"}
    la = LocalAtoll(os.path.join(root, "home"), env=env)
    clients: list[httpx.Client] = []
    try:
        c.log(f"starting atoll up (root {root})")
        la.start(timeout=600)
        api = httpx.Client(base_url=la.url, headers=la.headers(), timeout=120)
        e2b = httpx.Client(base_url=la.e2b_url, headers={"X-API-KEY": la.api_key}, timeout=120)
        clients += [api, e2b]
        xs: dict[str, list[float]] = {
            f"{k}_{v}": [] for k in ("native", "e2b") for v in ("create", "get", "list", "delete")
        }
        native = {
            "create": lambda: api.post("/v1/sandboxes", json={"timeout_s": 300, "on_timeout": "delete"}),
            "get": lambda sid: api.get(f"/v1/sandboxes/{sid}"),
            "list": lambda: api.get("/v1/sandboxes"),
            "delete": lambda sid: api.delete(f"/v1/sandboxes/{sid}"),
            "id": lambda r: r.json()["id"],
        }
        e2b_calls = {
            "create": lambda: e2b.post(
                "/v2/sandboxes", json={"templateID": "base", "metadata": {}, "envVars": {}}
            ),
            "get": lambda sid: e2b.get(f"/sandboxes/{sid}"),
            "list": lambda: e2b.get("/v2/sandboxes"),
            "delete": lambda sid: e2b.delete(f"/sandboxes/{sid}"),
            "id": lambda r: r.json()["sandboxID"],
        }
        for i in range(creates + 2):
            for name, calls in (("native", native), ("e2b", e2b_calls)):
                ms, r = _timed(calls["create"])
                sid = calls["id"](r)
                keep = i >= 2
                if keep:
                    xs[f"{name}_create"].append(ms)
                for _ in range(reads):
                    g, _r = _timed(calls["get"], sid)
                    li, _r = _timed(calls["list"])
                    if keep:
                        xs[f"{name}_get"].append(g)
                        xs[f"{name}_list"].append(li)
                d, _r = _timed(calls["delete"], sid)
                if keep:
                    xs[f"{name}_delete"].append(d)
        out: dict = {k: c.summarize(v, keep_samples=False) for k, v in xs.items()}
        for v in ("create", "get", "list", "delete"):
            out[f"{v}_e2b_over_native"] = c.ratio(out[f"e2b_{v}"], out[f"native_{v}"])
        c.log(
            "p50 ms native/E2B: "
            + ", ".join(
                f"{v} {out[f'native_{v}']['p50']:.1f}/{out[f'e2b_{v}']['p50']:.1f}"
                for v in ("create", "get", "list", "delete")
            )
        )
        return out
    finally:
        for cli in clients:
            cli.close()
        la.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 creates each (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/e2b_control.json")
    args = ap.parse_args()
    doc = {
        "benchmark": "e2b_control",
        "timestamp": c.timestamp(),
        "machine": c.machine_info(),
        "results": run(3, 5) if args.quick else run(20, 10),
        "quick": args.quick,
    }
    c.emit(doc)
    if not (args.quick or args.no_save):
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "e2b_control.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (and probe): an exec through a second `atoll server` replica against one through the
first, both on one PostgreSQL database, with one `atoll worker` (issue 21: B ≤ 1.1× A).

Run standalone as root (`.venv/bin/python bench/bench_replicas.py [--quick] [--no-save]`). Starts
a private PostgreSQL cluster (atoll.testing.postgres), server A, one worker registered with A
(`--server A`), then server B on the same database (same API key and secrets key; its own home;
ATOLL_WORKER_GONE_S=0 on both, so that neither settles the other's workers' sandboxes as gone).
Creates one sandbox through A, waits (≤ 30 s) for B to list the worker `ready` (B calls the worker
A holds with the token A stored sealed in the records: controlplane.workers, borrowed workers), then:

  through_a         POST …/exec {"cmd": ["true"]} through A (p50 after a warm-up)
  through_b         the same call for the same sandbox through B: interleaved with A's when B
                    answers 200, and `b_over_a` = p50 B / p50 A; otherwise B's answer (status,
                    error code and message) — the benchmark does not pretend
  b_reads           what B answers for GET /v1/sandboxes/{id} and GET /v1/workers (the records it
                    shares with A); beside it A's GET /v1/workers and the shared `workers` rows

Prints one JSON document (also bench/results/replicas.json unless --no-save or --quick); progress
on stderr. Traffic only on loopback and the sandbox's own veth pair.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402
import httpx  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from atoll.testing import LocalCluster, LocalServer, LocalWorker, purge  # noqa: E402
from atoll.testing.postgres import PostgresCluster  # noqa: E402


def _exec(api: httpx.Client, sid: str) -> tuple[float, httpx.Response]:
    with c.Timer() as t:
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
    return t.ms, r


def _answer(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        body = {"text": r.text[:300]}
    err = body.get("error") if isinstance(body, dict) else None
    return {
        "status": r.status_code,
        **({"code": err.get("code"), "message": err.get("message")} if err else {}),
    }


def run(n: int) -> dict:
    root = tempfile.mkdtemp(prefix="atoll-bench-replicas-", dir=c.BENCH_TMP)
    pg = PostgresCluster()
    servers: list[LocalServer] = []
    worker: LocalWorker | None = None
    apis: list[httpx.Client] = []
    try:
        pg.start()
        url = pg.create_database("replicas")
        key_file = os.path.join(root, "secrets.key")
        with open(key_file, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(key_file, 0o600)
        env = {
            "ATOLL_DATABASE_URL": url,
            "ATOLL_SECRETS_KEY_FILE": key_file,
            "ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR,
            "ATOLL_WORKER_GONE_S": "0",
            "ATOLL_LOG_LEVEL": "INFO",
            "ATOLL_LOG_FORMAT": "json",
        }
        a = LocalServer(os.path.join(root, "a"), env=env)
        servers.append(a)
        c.log(f"starting server A on PostgreSQL (root {root})")
        a.start()
        worker = LocalWorker(os.path.join(root, "w0"), a.url, a.api_key, "w0", env=env).start()
        a.wait_healthy(900, lambda: None if worker.exited() is None else f"worker exited: {worker.tail()}")
        worker.wait_state("ready")
        c.log("starting server B on the same database")
        b = LocalServer(os.path.join(root, "b"), api_key=a.api_key, env=env)
        servers.append(b)
        b.start()
        api_a = httpx.Client(base_url=a.url, headers=a.headers(), timeout=120)
        api_b = httpx.Client(base_url=b.url, headers=b.headers(), timeout=120)
        apis += [api_a, api_b]
        r = api_a.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        if r.status_code != 201:
            raise RuntimeError(f"create through A: {r.status_code} {r.text}")
        sid = r.json()["id"]
        out: dict = {"sandbox": sid}
        # B borrows the worker A holds (its token, sealed in the shared records) within a look at
        # the workers other servers hold (every 5 s): wait for it to list w0 ready, at most 30 s
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            items = api_b.get("/v1/workers").json().get("items", [])
            if any(w.get("name") == "w0" and w.get("state") == "ready" for w in items):
                break
            time.sleep(0.1)
        out["b_lists_worker_ready_after_s"] = round(time.monotonic() - t0, 2)
        got = api_b.get(f"/v1/sandboxes/{sid}")
        workers_b = api_b.get("/v1/workers").json().get("items", [])
        out["b_reads"] = {
            "sandbox": {
                **_answer(got),
                **(
                    {k: got.json().get(k) for k in ("state", "worker", "worker_state")}
                    if got.status_code == 200
                    else {}
                ),
            },
            "workers": [{k: w.get(k) for k in ("name", "state", "reason")} for w in workers_b],
        }
        workers_a = api_a.get("/v1/workers").json().get("items", [])
        out["a_reads_workers"] = [{k: w.get(k) for k in ("name", "state")} for w in workers_a]
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text("SELECT name, state, url FROM workers")).all()
        finally:
            engine.dispose()
        out["workers_rows_after_b_started"] = [{"name": n, "state": st, "url": u} for n, st, u in rows]
        xs: dict[str, list[float]] = {"a": [], "b": []}
        for i in range(n + 20):
            ms, ra = _exec(api_a, sid)
            if ra.status_code != 200:
                raise RuntimeError(f"exec through A: {ra.status_code} {ra.text}")
            ms_b, rb = _exec(api_b, sid)
            if rb.status_code != 200:
                out["through_b"] = {"works": False, **_answer(rb), "after_execs_through_a": i + 1}
                break
            if i >= 20:
                xs["a"].append(ms)
                xs["b"].append(ms_b)
        else:
            out["through_b"] = {"works": True, **c.summarize(xs["b"])}
        if out["through_b"]["works"]:
            out["through_a"] = c.summarize(xs["a"])
            out["b_over_a"] = c.ratio(out["through_b"], out["through_a"])
        else:  # A alone, for the record
            solo = []
            for i in range(n + 20):
                ms, ra = _exec(api_a, sid)
                if i >= 20:
                    solo.append(ms)
            out["through_a"] = c.summarize(solo)
            out["b_over_a"] = None
        out["target_b_over_a"] = 1.1
        api_a.delete(f"/v1/sandboxes/{sid}")
        LocalCluster.wait_no_sandboxes(worker.home, ids={sid})
        c.log(f"through A p50 {out['through_a']['p50']:.2f} ms; through B: {out['through_b']}")
        return out
    finally:
        for api in apis:
            api.close()
        if worker is not None:
            worker.terminate()
        for s in servers:
            s.terminate()
        pg.stop()
        if worker is not None:
            purge(worker.home)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 execs (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/replicas.json")
    args = ap.parse_args()
    doc = {
        "benchmark": "replicas",
        "timestamp": c.timestamp(),
        "machine": c.machine_info(),
        "results": run(20 if args.quick else 200),
        "quick": args.quick,
    }
    c.emit(doc)
    if not (args.quick or args.no_save):
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "replicas.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the control plane's CPU per pooled create, and creates/s with 1, 2 and 3 workers
(issue 21), on real gVisor.

Run standalone as root (`.venv/bin/python bench/bench_workers.py [--quick] [--no-save]`) or from
bench/run_all.py (`--only workers`). Starts its own `atoll server` (ATOLL_DEFAULT_POOL=POOL) and
three `atoll worker` processes, each with its own ATOLL_HOME (atoll.testing.LocalCluster), all on
this machine. Prints one JSON document (also bench/results/workers.json unless --no-save or
--quick); progress on stderr.

  pooled_create_cpu  CPU time of the `atoll server` process (every thread: the sum of
                     /proc/<pid>/task/*/schedstat, ns) around each POST /v1/sandboxes that claims
                     a frozen member of base's pool, in bursts of POOL back to back (the pool full
                     and the keeper idle before each burst); `claim`: per create, p50/p90/p95/p99;
                     `with_refill`: the server's CPU from a burst's first create until the pool is
                     full again (the keeper's create + exec + pause of each replacement), divided
                     by the creates — what a pooled create costs the control plane in all
  creates_per_s      non-pooled creates (restored from base's template image; `disk_mb` named, so
                     the pool is not asked) by THREADS client threads, CREATES per round, with 1, 2
                     and 3 workers ready (the others cordoned: `POST /v1/workers/{id}/drain
                     {"evacuate": false}`; their processes stay up, idle), rounds interleaved
                     (1, 2, 3, 3, 2, 1, …); creates/s = CREATES / wall time of the round, median
                     of the rounds; `workers_N_over_1`: the median over rounds of N workers' rate
                     over the same round's 1 worker (the machine's other load drifts); each round's sandboxes are deleted (and their runsc deletes
                     finished) before the next
  uptime             the load average before and after (other work on this machine counts)

All processes share this machine's cores: with 2 cores, more workers add no CPU, so the promise
is that they cost nothing (3 workers ≥ 1.0× one), not that they scale. Traffic only on loopback.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402
import httpx  # noqa: E402

from atoll.testing import LocalCluster  # noqa: E402

POOL = 6
THREADS = 3


def process_cpu_ns(pid: int) -> int:
    """On-CPU time of every thread of process `pid` so far (ns; /proc/<pid>/task/*/schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class Bench:
    def __init__(self, cl: LocalCluster):
        self.cl = cl
        self.api = httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=600)
        assert cl.server.proc is not None
        self.pid = cl.server.proc.pid
        self.workers = {w["name"]: w["id"] for w in self.api.get("/v1/workers").json()["items"]}

    def pool(self) -> dict:
        return self.api.get("/v1/templates/base/pool").json()

    def wait_pool_full(self, timeout: float = 300) -> float:
        """Wait until base's pool holds POOL ready members and nothing is starting; returns when."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.pool()
            if p["ready"] >= POOL and p["starting"] == 0:
                return time.monotonic()
            time.sleep(0.05)
        raise RuntimeError(f"base's pool did not fill within {timeout} s: {self.pool()}")

    def set_ready(self, n: int) -> None:
        """Workers w0..w(n-1) ready, the others cordoned (no new sandboxes; they keep running)."""
        for i, name in enumerate(sorted(self.workers)):
            body = {"draining": False} if i < n else {"draining": True, "evacuate": False}
            r = self.api.post(f"/v1/workers/{self.workers[name]}/drain", json=body)
            if r.status_code not in (200, 202):
                raise RuntimeError(f"drain {name}: {r.status_code} {r.text}")

    def delete(self, sids: list[str]) -> None:
        for sid in sids:
            self.api.delete(f"/v1/sandboxes/{sid}")
        for w in self.cl.workers:
            LocalCluster.wait_no_sandboxes(w.home, ids=set(sids), timeout=120)

    def claimed(self) -> int:
        return self.pool()["claimed"]

    # ---- control-plane CPU per pooled create -----------------------------------------------------
    def pooled_create_cpu(self, bursts: int) -> dict:
        self.set_ready(len(self.workers))
        claim: list[float] = []
        cycle: list[float] = []
        for b in range(bursts):
            self.wait_pool_full()
            time.sleep(1.0)  # the keeper idle, the refills' runsc work settled
            before = self.claimed()
            sids = []
            t_cycle = process_cpu_ns(self.pid)
            for _ in range(POOL):
                t0 = process_cpu_ns(self.pid)
                r = self.api.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                t1 = process_cpu_ns(self.pid)
                if r.status_code != 201:
                    raise RuntimeError(f"create: {r.status_code} {r.text}")
                sids.append(r.json()["id"])
                claim.append((t1 - t0) / 1e6)
            if self.claimed() - before != POOL:
                raise RuntimeError(f"burst {b}: {self.claimed() - before} of {POOL} creates were pool claims")
            self.wait_pool_full()
            cycle.append((process_cpu_ns(self.pid) - t_cycle) / 1e6 / POOL)
            c.log(
                f"burst {b}: claim CPU p50 {statistics.median(claim[-POOL:]):.2f} ms, with refill "
                f"{cycle[-1]:.2f} ms per create"
            )
            self.delete(sids)
        claim_summary = c.summarize(claim)
        claim_summary["p95"] = round(c.percentile(sorted(claim), 0.95), 3)
        return {
            "pool": POOL,
            "workers": len(self.workers),
            "claim": claim_summary,
            "with_refill": c.summarize(cycle),
            "target_ms": 5.0,
        }

    # ---- creates/s by number of workers ----------------------------------------------------------
    def _round(self, creates: int) -> tuple[float, dict[str, int]]:
        clients = [
            httpx.Client(base_url=self.cl.url, headers=self.cl.headers(), timeout=600) for _ in range(THREADS)
        ]

        def one(i: int) -> dict:
            r = clients[i % THREADS].post(
                "/v1/sandboxes", json={"idle_timeout_s": 0, "disk_after_s": 0, "disk_mb": 4096}
            )
            if r.status_code != 201:
                raise RuntimeError(f"create: {r.status_code} {r.text}")
            return r.json()

        try:
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(THREADS) as ex:
                made = list(ex.map(one, range(creates)))
            wall = time.perf_counter() - t0
        finally:
            for cl in clients:
                cl.close()
        where: dict[str, int] = {}
        for sb in made:
            where[sb["worker"]] = where.get(sb["worker"], 0) + 1
        self.delete([sb["id"] for sb in made])
        return creates / wall, where

    def creates_per_s(self, rounds: int, creates: int) -> dict:
        rates: dict[int, list[float]] = {1: [], 2: [], 3: []}
        spread: dict[int, list[dict]] = {1: [], 2: [], 3: []}
        loads: list[str] = []
        for r in range(rounds):
            for n in (1, 2, 3) if r % 2 == 0 else (3, 2, 1):
                self.set_ready(n)
                self.wait_pool_full()  # members on cordoned workers are replaced on the ready ones
                time.sleep(1.0)
                rate, where = self._round(creates)
                rates[n].append(rate)
                spread[n].append(where)
                c.log(f"round {r}, {n} worker(s): {rate:.2f} creates/s {where}")
            loads.append(uptime())
        self.set_ready(len(self.workers))
        out: dict = {"threads": THREADS, "creates_per_round": creates, "rounds": rounds, "loadavg": loads}
        for n in (1, 2, 3):
            out[f"workers_{n}"] = {
                "creates_per_s": round(statistics.median(rates[n]), 3),
                "rounds": [round(x, 3) for x in rates[n]],
                "placed": spread[n],
            }
        # the machine's other load drifts between rounds: compare each round's 2 and 3 workers with
        # its own 1 worker (run next to it), and take the median of those ratios
        for n in (2, 3):
            per = [x / one for x, one in zip(rates[n], rates[1], strict=True)]
            out[f"workers_{n}_over_1"] = round(statistics.median(per), 3)
            out[f"workers_{n}_over_1_by_round"] = [round(x, 3) for x in per]
        out["target_workers_3_over_1"] = 1.0
        return out

    def close(self) -> None:
        self.api.close()


def run(bursts: int = 8, rounds: int = 6, creates: int = 12) -> dict:
    root = tempfile.mkdtemp(prefix="atoll-bench-workers-", dir=c.BENCH_TMP)
    env = {
        "ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR,
        "ATOLL_LOG_LEVEL": "INFO",
        "ATOLL_LOG_FORMAT": "json",
        "ATOLL_DEFAULT_POOL": str(POOL),
    }
    cl = LocalCluster(root, workers=3, env=env)
    c.log(f"starting atoll server + 3 atoll workers (root {root})")
    load_before = uptime()
    cl.start(timeout=900)
    b = Bench(cl)
    try:
        b.wait_pool_full(600)
        res = {
            "uptime_before": load_before,
            "pooled_create_cpu": b.pooled_create_cpu(bursts),
            "creates_per_s": b.creates_per_s(rounds, creates),
            "uptime_after": uptime(),
        }
        return res
    finally:
        b.close()
        cl.stop(reap=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sample counts (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/workers.json")
    args = ap.parse_args()
    kw = {"bursts": 2, "rounds": 1, "creates": 4} if args.quick else {}
    doc = {
        "benchmark": "workers",
        "timestamp": c.timestamp(),
        "machine": c.machine_info(),
        "results": run(**kw),
        "quick": args.quick,
    }
    c.emit(doc)
    if not (args.quick or args.no_save):
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "workers.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

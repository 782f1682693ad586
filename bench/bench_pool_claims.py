"""Benchmark: the control plane's CPU per pooled create with many unrelated sandboxes (issue 21).

Run standalone (`.venv/bin/python bench/bench_pool_claims.py [--quick] [--no-save]`; no root, no
runsc), or from bench/run_all.py (section `workers`, beside bench_workers). The real control plane
of `atoll.testing.FakeAtoll` over one FakeWorker, its built-in `base` pool (ATOLL_DEFAULT_POOL=P),
and N sandbox records of other tenants (running, not pooled, base template) put in its ledger's
cache — what `Pools._members` reads. Prints one JSON document (also
bench/results/pool_claims.json unless --no-save or --quick); progress on stderr.

Measured: `time.thread_time()` (the event loop's thread: the request, the claim, the keeper's pass
it wakes) around `POST /v1/sandboxes` that claims a pool member, in rounds of P claims (the pool
refilled, untimed, between rounds). Side by side, round by round on the same control plane:

  index    `Pools._members` as it is: the ledger's per-template index of pool members
  scan     `Pools._members` replaced by what it was before the index: one pass over every live
           record per claim (and per keeper pass)

The promise (docs/specification.md): control-plane CPU per pooled create ≤ 5 ms; with the index it
does not grow with the number of sandboxes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

from atoll.controlplane import db as dbm  # noqa: E402
from atoll.controlplane import pools  # noqa: E402
from atoll.controlplane.templates import BUILTIN  # noqa: E402
from atoll.core import ids  # noqa: E402
from atoll.core.lifecycle import State  # noqa: E402
from atoll.testing import FakeAtoll, FakeWorker  # noqa: E402


def scan_members(self: pools.Pools, name: str, tenant: str) -> list[dbm.SandboxRecord]:
    """`Pools._members` before the index (kept only to measure it side by side)."""
    return [
        r
        for r in self.m.live()
        if r.pooled
        and r.template == name
        and (name in BUILTIN or r.tenant_id == tenant)
        and r.state != State.DELETED
    ]


def fill(fake: FakeAtoll, n: int) -> None:
    """N unrelated records: running `base` sandboxes of 20 other tenants on the fake worker."""
    rng = random.Random(1)
    worker = fake.manager.workers.ready()[0].id
    for i in range(n):
        sid = ids.new_sandbox_id()
        fake.manager.ledger.cache[sid] = dbm.SandboxRecord(
            id=sid,
            tenant_id=f"t{i % 20}",
            worker_id=worker,
            state="running",
            standby_tier=None,
            template="base",
            memory_mb=rng.choice((256, 512, 1024)),
            cpus=0.5,
            disk_mb=1024,
            idle_timeout_s=300,
            disk_after_s=600,
            pooled=False,
        )


async def _ready(fake: FakeAtoll, want: int) -> None:
    for _ in range(3000):
        pool = (await fake.http.get("/v1/templates/base/pool")).json()
        if pool["ready"] >= want:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"the base pool did not refill to {want}: {pool}")


async def run(records: int, pool: int, rounds: int) -> dict:
    for name in ("atoll.controlplane.ledger", "atoll.controlplane.pools", "atoll.controlplane.lifecycle"):
        logging.getLogger(name).setLevel(logging.WARNING)  # the log calls stay, not their output
    indexed = pools.Pools._members
    xs: dict[str, list[float]] = {"index": [], "scan": []}
    with tempfile.TemporaryDirectory() as tmp:
        # capacity for the unrelated records and the pool (placement counts their memory)
        worker = FakeWorker("w0", memory_mb=4 * 1024 * 1024, cpus=100000)
        async with FakeAtoll(tmp, [worker], tier_policy=False, default_pool=pool) as fake:
            fill(fake, records)
            c.log(f"{len(fake.manager.ledger.cache)} records, pool {pool}, {rounds} rounds per variant")
            try:
                for i in range(rounds * 2):
                    variant = ("index", "scan")[i % 2]
                    pools.Pools._members = indexed if variant == "index" else scan_members  # type: ignore[method-assign]
                    await _ready(fake, pool)
                    await asyncio.sleep(pools.REFILL_AFTER_CLAIM_S)  # the keeper idle
                    for _ in range(pool):
                        t0 = time.thread_time()
                        r = await fake.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                        dt = (time.thread_time() - t0) * 1000
                        if r.status_code != 201:
                            raise RuntimeError(f"create: {r.status_code} {r.text}")
                        sid = r.json()["id"]
                        if ("claim", sid) not in worker.calls:
                            raise RuntimeError(f"create {sid} was not a pool claim")
                        xs[variant].append(dt)
            finally:
                pools.Pools._members = indexed  # type: ignore[method-assign]
    out = {k: c.summarize(v, keep_samples=False) for k, v in xs.items()}
    return {
        "records": records,
        "pool": pool,
        "cpu_per_pooled_create_ms": out,
        "scan_over_index_p50": c.ratio(out["scan"], out["index"]),
        "target_ms": 5.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/pool_claims.json")
    args = ap.parse_args()
    rounds = 2 if args.quick else 10
    doc = {
        "benchmark": "pool_claims",
        "timestamp": c.timestamp(),
        "machine": c.machine_info(),
        "cases": [asyncio.run(run(n, 20, rounds)) for n in (2000, 20000, 0)],
    }
    c.emit(doc)
    if not (args.quick or args.no_save):
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "pool_claims.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

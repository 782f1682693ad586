"""Benchmark: metering (controlplane.metering) against real cgroups, and what it costs.

Run standalone (`.venv/bin/python bench/bench_metering.py [--quick]`, root; starts its own `atoll
up`, writes bench/results/metering.json). Prints one JSON document; progress on stderr. Loopback
only: the sandboxes have no network policy.

  pinned     a real gVisor sandbox (cpus=1) runs a busy loop (python3) for BURN_S; cpu_seconds of
             GET /v1/usage for it, read before the loop starts and USAGE_WAIT_S after it ends (the
             worker reports usage every 5 s), against the target BURN_S ± 3.
  standby    at the same time a second sandbox is paused into the memory tier for BURN_S (then
             resumed): its cpu_seconds and standby_memory_gb_seconds / (memory_mb / 1024), i.e.
             the seconds of standby memory recorded, against ~0 and ~BURN_S.
  cost       the Meter's accrual in this process over FakeWorkers (testing.FakeAtoll): N running
             sandboxes, a UsageReport for each every 5 simulated seconds, `Meter.tick` once per
             simulated second (as in the server) with its writes every FLUSH_S; CPU time
             (time.thread_time) per simulated second = share of one core. Target ≤ 0.01 at 200.
             The third level puts 100 of the 200 in the disk tier and adds 20 volumes, their
             bytes in each report (`snapshots`, `stores`): the measured-bytes path.
             `--cost-only` writes bench/results/metering-cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

from atoll.core import worker_api as api  # noqa: E402
from atoll.core.lifecycle import Tier  # noqa: E402
from atoll.testing import FakeAtoll  # noqa: E402

BURN_S = 60.0
USAGE_WAIT_S = 7.0
MEMORY_MB = 256


def _usage(a: common.Atoll, sid: str) -> dict:
    r = a.api.get("/v1/usage", params={"group_by": "sandbox"})
    r.raise_for_status()
    for item in r.json()["items"]:
        if item["sandbox_id"] == sid:
            return item
    return {"cpu_seconds": 0.0, "standby_memory_gb_seconds": 0.0, "memory_gb_seconds": 0.0}


def _cgroup_cpu(a: common.Atoll, sid: str) -> float:
    """The cgroup's own counter (the ground truth the worker reports from)."""
    with open(f"/sys/fs/cgroup/cpuacct{a.cgroup(sid)}/cpuacct.usage") as f:
        return int(f.read()) / 1e9


def _host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def real(a: common.Atoll, burn_s: float) -> dict:
    hot = a.create(cpus=1, memory_mb=MEMORY_MB)["id"]
    idle = a.create(memory_mb=MEMORY_MB)["id"]
    try:
        time.sleep(USAGE_WAIT_S)  # a first report of each
        hot0, idle0 = _usage(a, hot), _usage(a, idle)
        cg0, host0 = _cgroup_cpu(a, hot), _host_busy()
        load0 = os.getloadavg()[0]
        code = (
            f"import time\nt = time.time()\nwhile time.time() - t < {burn_s}:\n    pass\n"
            "print(time.process_time())\n"
        )
        res: dict = {}

        def _burn() -> None:
            res.update(a.exec(hot, ["python3", "-c", code], timeout_s=burn_s + 60))

        burn = threading.Thread(target=_burn)
        r = a.api.post(f"/v1/sandboxes/{idle}/pause", json={"tier": "memory"})
        r.raise_for_status()
        t0 = time.monotonic()
        burn.start()
        common.log(f"burning {burn_s:.0f} s in {hot}; {idle} in the memory tier")
        burn.join()
        wall = time.monotonic() - t0
        cg1, host1 = _cgroup_cpu(a, hot), _host_busy()
        load1 = os.getloadavg()[0]
        time.sleep(max(0.0, burn_s - wall))
        r = a.api.post(f"/v1/sandboxes/{idle}/resume")
        r.raise_for_status()
        time.sleep(USAGE_WAIT_S)
        hot1, idle1 = _usage(a, hot), _usage(a, idle)
        gb = MEMORY_MB / 1024
        pinned = hot1["cpu_seconds"] - hot0["cpu_seconds"]
        standby_s = (idle1["standby_memory_gb_seconds"] - idle0["standby_memory_gb_seconds"]) / gb
        return {
            "pinned": {
                "burn_s": burn_s,
                "exec_wall_s": round(wall, 2),
                "cpu_seconds": round(pinned, 2),
                "target": f"{burn_s:.0f} ± 3",
                "ok": abs(pinned - burn_s) <= 3,
                "cgroup_cpuacct_s": round(cg1 - cg0, 2),
                "metered_over_cgroup": round(pinned / (cg1 - cg0), 4) if cg1 > cg0 else None,
                "guest_process_time_s": float((res.get("stdout") or "0").strip() or 0),
                "host_busy_share": round((host1[0] - host0[0]) / max(1, host1[1] - host0[1]), 3),
                "loadavg_1m_before_after": [round(load0, 2), round(load1, 2)],
            },
            "standby": {
                "seconds_in_memory_tier": burn_s,
                "cpu_seconds": round(idle1["cpu_seconds"] - idle0["cpu_seconds"], 3),
                "standby_memory_seconds": round(standby_s, 2),
                "ok": abs(standby_s - burn_s) <= 3 and idle1["cpu_seconds"] - idle0["cpu_seconds"] < 1,
            },
        }
    finally:
        a.delete(hot, wait=False)
        a.delete(idle, wait=False)


async def _cost(n: int, seconds: int, standby: int = 0, volumes: int = 0) -> dict:
    with tempfile.TemporaryDirectory(prefix="atoll-bench-meter-") as d:
        fake = FakeAtoll(d, tier_policy=False)
        clock = [time.time()]
        fake.meter.clock = lambda: clock[0]
        async with fake:
            fake.meter._task.cancel()  # ticked by hand below, as the loop would
            sids = []
            for _ in range(n):
                r = await fake.http.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 64})
                r.raise_for_status()
                sids.append(r.json()["id"])
            paused = sids[:standby]
            for sid in paused:
                r = await fake.http.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
                r.raise_for_status()
            for i in range(volumes):
                r = await fake.http.post("/v1/volumes", json={"name": f"v{i}", "size_mb": 1024})
                r.raise_for_status()
            running = sids[standby:]
            clock[0] = time.time()  # after the creates: every sandbox accrues from here
            fake.meter.tick()
            handle = next(iter(fake.manager.workers.handles.values()))
            cpu = 0.0
            ticks = 0
            for s in range(seconds):
                clock[0] += 1.0
                if s % 5 == 0:
                    ev = api.UsageReport(
                        tuple(api.Usage(sid, s * 0.01, 1 << 24, 4) for sid in running),
                        tuple(api.SnapshotUsage(sid, Tier.DISK, 100 << 20) for sid in paused),
                        tuple(api.StoreUsage("volume", f"v{i}", 10 << 20) for i in range(volumes)),
                    )
                    await fake.manager.worker_event(handle, ev)
                t0 = time.thread_time()
                fake.meter.tick()
                cpu += time.thread_time() - t0
                ticks += 1
            r = await fake.http.get("/v1/usage", params={"group_by": "tenant"})
            total = r.json()["total"]
    return {
        "sandboxes": n,
        "disk_tier": standby,
        "volumes": volumes,
        "simulated_s": seconds,
        "cpu_ms_per_tick": round(cpu / ticks * 1000, 3),
        "share_of_core": round(cpu / seconds, 5),
        "target": 0.01,
        "ok": cpu / seconds <= 0.01,
        "check_memory_gb_seconds": round(total["memory_gb_seconds"], 1),
        "expected_memory_gb_seconds": round((n - standby) * 64 / 1024 * seconds, 1),
        "check_snapshot_gb_seconds": round(total["snapshot_gb_seconds"], 2),
        "expected_snapshot_gb_seconds": round(standby * 100 / 1024 * seconds, 2),
        "check_volume_gb_seconds": round(total["volume_gb_seconds"], 2),
        "expected_volume_gb_seconds": round(volumes * 10 / 1024 * seconds, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 s burn, 20 sandboxes (a smoke test)")
    p.add_argument("--cost-only", action="store_true", help="only the FakeWorker cost part (no root)")
    args = p.parse_args()
    doc: dict = {"benchmark": "metering", "timestamp": common.timestamp(), "machine": common.machine_info()}
    levels = ((20, 0, 0),) if args.quick else ((50, 0, 0), (200, 0, 0), (200, 100, 20))
    doc["cost"] = [asyncio.run(_cost(n, 30 if args.quick else 120, sb, v)) for n, sb, v in levels]
    common.log(json.dumps(doc["cost"]))
    if not args.cost_only:
        with common.local_atoll() as a:
            common.warm_up(a)
            doc.update(real(a, 10.0 if args.quick else BURN_S))
    common.emit(doc)
    if not args.quick:
        path = os.path.join(common.RESULTS, "metering-cost.json" if args.cost_only else "metering.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()

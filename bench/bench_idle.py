"""Benchmark: what the CPU-activity check costs at many idle running sandboxes (issue 9's "≤ 1% of
one core at 200 idle sandboxes").

Run standalone (`.venv/bin/python bench/bench_idle.py [--max N] [--quick]`, root; starts its own
`atoll up`, writes bench/results/idle.json) or from bench/run_all.py via `run(atoll)`. Prints one
JSON document; progress on stderr. Loopback only: the sandboxes have no network policy.

Set-up: real gVisor sandboxes of `base` with memory_mb=64, idle_timeout_s=0 (never frozen: they
stay running, so every pass samples them), each with nothing running but its guest agent. They
are created up to each level in LEVELS (cumulatively); creation stops early if the machine's
MemAvailable falls under MIN_AVAILABLE_MB, and the document says how many there really were.

At each level, two measurements:
  check      the real `worker.node.Node._sample_cpu` — the function the worker's monitor runs every
             MONITOR_EVERY_S — called in this process every MONITOR_EVERY_S for PASSES passes over
             the worker's real runtime records (its runtime.json files, loaded read-only with the
             worker's own RuntimeStore) and the sandboxes' real cgroups (cpuacct.usage). The Node is
             a shell made without __init__ holding exactly what the function reads; its `edge`
             answers "no recent traffic, no request waiting" (in the worker those are two dict
             look-ups) and its `hub` counts events. Timed with time.thread_time() around each call
             (CPU, not wall). cost_share_of_core = CPU per pass / MONITOR_EVERY_S.
  process    the whole `atoll up` process (control plane + worker + gateway in one process; its
             runsc children not included) over WINDOW_S of idle time: utime+stime from
             /proc/<pid>/stat / wall — an upper bound that holds the monitor pass, the usage
             reports, the policy loop and everything else.
Target: check.cost_share_of_core ≤ 0.01 at 200 sandboxes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import typing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

from atoll.worker.runtimes.runtime import RuntimeStore  # noqa: E402
from atoll.worker.service import node as node_mod  # noqa: E402

LEVELS = (50, 100, 200)
PASSES = 40
WINDOW_S = 20.0
MIN_AVAILABLE_MB = 3000
MEMORY_MB = 64


class _QuietEdge:
    def last_io(self, sid: str) -> float:
        return 0.0

    def busy(self, sid: str) -> bool:
        return False


class _CountingHub:
    def __init__(self) -> None:
        self.events = 0

    def emit(self, ev: typing.Any) -> None:
        self.events += 1


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _shell(a: common.Atoll, sids: list[str]) -> typing.Any:
    """A Node holding what _sample_cpu reads: the worker's real runtime records, its installation."""
    store = RuntimeStore(a.home, a.install_id)
    for sid in sids:
        rt = store.load(sid)
        if rt is None:
            raise RuntimeError(f"no runtime.json for {sid}")
        store._cache[sid] = rt
    n = object.__new__(node_mod.Node)
    n.runtimes = store
    n.install_id = a.install_id
    n._cpu = {}
    n._activity_told = {}
    n.edge = _QuietEdge()
    n.hub = _CountingHub()
    return n


def _check(a: common.Atoll, sids: list[str], passes: int) -> dict:
    shell = _shell(a, sids)
    running = sum(1 for rt in shell.runtimes.cached() if rt.phase == node_mod.Phase.RUNNING)
    cpu_ms = []
    for _ in range(passes):
        t0 = time.thread_time()
        node_mod.Node._sample_cpu(shell, time.monotonic())
        cpu_ms.append((time.thread_time() - t0) * 1000)
        time.sleep(node_mod.MONITOR_EVERY_S)
    s = common.summarize(cpu_ms, keep_samples=False)
    return {
        "running_sampled": running,
        "cpu_ms_per_pass": s,
        "cost_share_of_core": round(s["mean"] / (node_mod.MONITOR_EVERY_S * 1000), 5),
        "activity_events": shell.hub.events,
    }


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process(a: common.Atoll, window_s: float) -> dict:
    assert a.local.proc is not None
    pid = a.local.proc.pid
    c0, t0 = _proc_cpu_s(pid), time.monotonic()
    time.sleep(window_s)
    c1, t1 = _proc_cpu_s(pid), time.monotonic()
    return {"window_s": round(t1 - t0, 2), "share_of_core": round((c1 - c0) / (t1 - t0), 5)}


def run(
    a: common.Atoll, levels: typing.Sequence[int] = LEVELS, passes: int = PASSES, window_s: float = WINDOW_S
) -> dict:
    sids: list[str] = []
    out: dict = {"memory_mb": MEMORY_MB, "monitor_every_s": node_mod.MONITOR_EVERY_S, "levels": []}
    try:
        out["levels"].append({"sandboxes": 0, "process": _process(a, window_s)})
        stopped = None
        for level in levels:
            t0 = time.monotonic()
            while len(sids) < level:
                if _available_mb() < MIN_AVAILABLE_MB:
                    stopped = f"MemAvailable under {MIN_AVAILABLE_MB} MB at {len(sids)} sandboxes"
                    break
                sids.append(a.create(memory_mb=MEMORY_MB)["id"])
            common.log(f"{len(sids)} idle sandboxes (created in {time.monotonic() - t0:.0f} s)")
            time.sleep(5)  # let the creates' work settle
            out["levels"].append(
                {
                    "sandboxes": len(sids),
                    "mem_available_mb": round(_available_mb()),
                    "check": _check(a, sids, passes),
                    "process": _process(a, window_s),
                }
            )
            common.log(json.dumps(out["levels"][-1]))
            if stopped:
                out["stopped"] = stopped
                break
    finally:
        for sid in sids:
            a.api.delete(f"/v1/sandboxes/{sid}")
        for sid in sids:
            a.wait_gone(sid, timeout=120)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max", type=int, default=LEVELS[-1], help="the largest level (default 200)")
    p.add_argument("--quick", action="store_true", help="5 sandboxes, few passes (a smoke test)")
    args = p.parse_args()
    levels = (5,) if args.quick else tuple(x for x in LEVELS if x < args.max) + (args.max,)
    with common.local_atoll() as a:
        common.warm_up(a)
        res = run(a, levels, passes=6 if args.quick else PASSES, window_s=3 if args.quick else WINDOW_S)
    doc = {
        "benchmark": "idle",
        "timestamp": common.timestamp(),
        "machine": common.machine_info(),
        "results": res,
    }
    common.emit(doc)
    if not args.quick:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "idle.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()

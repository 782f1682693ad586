"""Benchmark: pause and resume latency of both standby tiers against the sandbox's resident memory.

Run standalone (`.venv/bin/python bench/bench_standby.py`, root, starts its own `atoll up`) or from
bench/run_all.py, which calls `run(atoll)`. Prints one JSON document to stdout; progress on stderr.

For each size N in (1, 50, 200) MB a fresh sandbox (memory_mb 512, auto-standby off) starts a
background `python3` that holds N MB of random bytes (incompressible) and sleeps. Then, after one
untimed warm-up cycle per tier:
  memory tier (n=20): POST /pause {"tier": "memory"}            → timed: pause_api
                      POST /resume until it answers `running`   → timed: resume_api
                      POST /exec ["true"]                        → timed: first_exec
  disk tier (n=8):    POST /pause {"tier": "disk"}              → timed: pause_api (runsc checkpoint)
                      the image size is read from <home>/sandboxes/<id>/snapshot/checkpoint.img;
                      the old container's background `runsc delete` is awaited (untimed), as it
                      would be long done in real use
                      POST /resume (runsc restore + agent health) → timed: resume_api
                      POST /exec ["true"]                        → timed: first_exec
"resume_plus_first_exec" is the clock from sending POST /resume to receiving the exec's answer.
The memory-tier resume API call thaws the freezer cgroup and waits for the guest agent's health
answer, so `resume_api` is "API call until the agent answers a health ping". The server's own
durations of each step (from its JSON log) are reported next to the client-side ones; the difference
is HTTP + API overhead. At the end the holder process must still be running (checked via
GET …/processes), so the memory really was preserved across every cycle.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

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


def _start_hog(a: c.Atoll, sid: str, mb: int) -> int:
    r = a.exec(sid, ["python3", "-I", "-c", HOG.format(mb=mb)], background=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (
            a.api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/.bench-hog-ready"}).status_code
            == 200
        ):
            return r["pid"]
        time.sleep(0.2)
    raise RuntimeError(f"the {mb} MB holder did not get ready within 120 s")


def _hog_running(a: c.Atoll, sid: str, pid: int) -> bool:
    items = a.api.get(f"/v1/sandboxes/{sid}/processes").json().get("items", [])
    return any(p["pid"] == pid and p["running"] for p in items)


def _cycle(a: c.Atoll, sid: str, tier: str) -> dict:
    base = f"/v1/sandboxes/{sid}"
    pause_ms, sb = _post(a, base + "/pause", tier=tier)
    if sb["state"] != "standby" or sb["standby_tier"] != tier:
        raise RuntimeError(
            f"pause {tier} gave {sb['state']}/{sb['standby_tier']} ({sb.get('standby_reason')})"
        )
    image = None
    if tier == "disk":
        img = os.path.join(a.home, "sandboxes", sid, "snapshot", "checkpoint.img")
        image = os.path.getsize(img)
        a.wait_containers_at_most(sid, 0)  # the checkpointed container's background delete
        time.sleep(0.1)
    else:
        time.sleep(0.05)
    t0 = c.now_ms()
    resume_ms, sb = _post(a, base + "/resume")
    if sb["state"] != "running":
        raise RuntimeError(f"resume gave {sb['state']}")
    with c.Timer() as t:
        r = a.exec(sid, ["true"])
    total = c.now_ms() - t0
    if r["exit_code"] != 0:
        raise RuntimeError(f"true after resume exited {r['exit_code']}")
    if tier == "disk":  # let the worker drop the stale image before the next checkpoint
        snap = os.path.join(a.home, "sandboxes", sid, "snapshot")
        deadline = time.monotonic() + 30
        while os.path.exists(snap) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)
    else:
        time.sleep(0.05)
    return {"pause": pause_ms, "resume": resume_ms, "exec": t.ms, "total": total, "image": image}


def bench_size(a: c.Atoll, mb: int, n_mem: int, n_disk: int) -> dict:
    sb = a.create(memory_mb=512)
    sid = sb["id"]
    try:
        c.log(f"standby {mb} MB: filling the holder")
        pid = _start_hog(a, sid, mb)
        usage_before = a.memory_usage_mb(sid)
        out: dict = {"holder_mb": mb, "cgroup_memory_mb_before": usage_before}
        for tier, n in (("memory", n_mem), ("disk", n_disk)):
            ev = {
                "pause": f"sandbox.pause_{tier}.complete",
                "resume": f"sandbox.resume_{tier}.complete",
            }
            if tier == "disk":
                ev["checkpoint"] = "checkpoint took"
                ev["restore"] = "restore took"
            _cycle(a, sid, tier)  # warm-up, untimed
            skip = {k: len(a.server_durations(sid, p)) for k, p in ev.items()}
            rows = []
            for i in range(n):
                rows.append(_cycle(a, sid, tier))
                if tier == "disk" or (i + 1) % 10 == 0:
                    c.log(
                        f"standby {mb} MB {tier} {i + 1}/{n}: pause {rows[-1]['pause']:.1f} ms, "
                        f"resume {rows[-1]['resume']:.1f} ms, exec {rows[-1]['exec']:.1f} ms"
                    )
            res = {
                "pause_api": c.summarize([r["pause"] for r in rows]),
                "resume_api": c.summarize([r["resume"] for r in rows]),
                "first_exec": c.summarize([r["exec"] for r in rows]),
                "resume_plus_first_exec": c.summarize([r["total"] for r in rows]),
                "server": {
                    k: c.summarize(a.server_durations(sid, p)[skip[k] :], keep_samples=False)
                    for k, p in ev.items()
                },
            }
            if tier == "disk":
                sizes = [r["image"] for r in rows]
                res["image_mb"] = c.summarize([s / 2**20 for s in sizes], unit="MiB", keep_samples=False)
            out[tier] = res
        out["cgroup_memory_mb_after"] = a.memory_usage_mb(sid)
        out["holder_still_running"] = _hog_running(a, sid, pid)
        if not out["holder_still_running"]:
            raise RuntimeError(f"the {mb} MB holder (pid {pid}) did not survive the standby cycles")
        return out
    finally:
        a.delete(sid)


def run(a: c.Atoll, sizes: tuple[int, ...] = (1, 50, 200), n_mem: int = 20, n_disk: int = 8) -> dict:
    t0 = time.monotonic()
    out = {f"{mb}MB": bench_size(a, mb, n_mem, n_disk) for mb in sizes}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


if __name__ == "__main__":
    c.run_main(run, "standby")

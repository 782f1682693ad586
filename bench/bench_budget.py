"""Benchmark: 100 disk-tier sandboxes over a worker's disk budget (ATOLL_DISK_BUDGET_GB).

Run standalone (`.venv/bin/python bench/bench_budget.py [--quick] [--s3] [--no-save]`, root, ~3 min).
Prints one JSON document to stdout (also bench/results/budget.json); progress on stderr.

What it shows: the worker gets back under its budget by archiving (the longest idle first) without
touching a running sandbox, and every archived or disk-tier sandbox resumes with its state intact.

1. Calibration: a first `atoll up` without a budget measures what one sandbox of the recipe below
   takes on the worker's disk as `worker.runtimes.budget.sandbox_disk_bytes` counts it (running and
   in the disk tier). The budget is then `keepers × running + room × disk tier` (room 25 of the 100,
   `--room`), rounded up to a MiB.
2. A second `atoll up` with that ATOLL_DISK_BUDGET_GB and the archive tier in its embedded local
   directory (or, with `--s3`, a SeaweedFS S3 gateway on loopback, atoll.testing.seaweed).
3. Keepers: 3 sandboxes stay running throughout; each runs a `python3` that counts every 0.25 s and
   records the longest gap between two counts. Before and after: the guest pid (GET …/processes),
   the runtime generation (runtime.json), the sentry's host pid (`runsc state`), the counter; a
   sampler polls their state every second. A keeper that was frozen, checkpointed or restarted
   shows a gap, a new generation or host pid, or a non-running state.
4. 100 sandboxes (`memory_mb` 64, the API's least), two at a time: create, a background `python3`
   holding a random token in its memory and in a file on the root filesystem (/root/state, the
   upper image) and on /tmp (tmpfs, in the checkpoint image), then POST …/pause {"tier": "disk"}.
   A sampler sums `sandbox_disk_bytes` over the worker's sandbox directories every 0.5 s.
5. After the last pause: the time until the sum is under the budget; which sandboxes the worker
   archived (GET …/sandboxes/{id}: standby_tier) and in what order (its log lines "disk budget:
   archived …"), against the order they were paused (the longest idle first).
6. Each of the 100, those still on disk first, then the archived ones, in pause order: POST …/resume (timed per tier it was in), then one exec that sends
   the holder SIGUSR1 and reads back what its handler wrote (token from memory + its pid) and both
   files (timed: check). Any mismatch or error is a failure. Then DELETE (memory stays bounded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import typing
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

import atoll  # noqa: E402
from atoll.worker.runtimes.budget import BUDGET_EVERY_S, sandbox_disk_bytes  # noqa: E402

MEMORY_MB = 64  # the least the API allows
HOLDER = r"""
import os, signal, sys, time
tok = sys.argv[1]
mem = [tok] * 1000  # the token in the process's memory
open("/root/state", "w").write(tok)  # the root filesystem (the upper image)
open("/tmp/state", "w").write(tok)  # tmpfs (inside the checkpoint image)
def probe(*_):
    with open("/tmp/probe.tmp", "w") as f:
        f.write(f"{mem[-1]} {os.getpid()}")
    os.rename("/tmp/probe.tmp", "/tmp/probe")
signal.signal(signal.SIGUSR1, probe)
open("/tmp/ready", "w").close()
while True:
    time.sleep(3600)
"""
# one exec: signal the holder, wait (shell builtins only) for its answer, print the three states
CHECK = (
    'rm -f /tmp/probe; kill -USR1 "$1" || exit 3; i=0; '
    "while [ ! -f /tmp/probe ]; do i=$((i+1)); [ $i -gt 200000 ] && exit 4; done; "
    "cat /root/state; echo; cat /tmp/state; echo; cat /tmp/probe"
)
KEEPER = r"""
import time
n, gap, last = 0, 0.0, time.time()
while True:
    time.sleep(0.25)
    now = time.time()
    gap, last, n = max(gap, now - last), now, n + 1
    with open("/tmp/counter.tmp", "w") as f:
        f.write(f"{n} {gap:.3f} {now:.3f}")
    __import__("os").rename("/tmp/counter.tmp", "/tmp/counter")
"""


def p95(xs: list[float]) -> float | None:
    return round(c.percentile(sorted(xs), 0.95), 3) if xs else None


def _summary(xs: list[float]) -> dict:
    out = c.summarize(xs)
    out["p95"] = p95(xs)
    return out


def _read(a: c.Atoll, sid: str, path: str) -> str | None:
    r = a.api.get(f"/v1/sandboxes/{sid}/files", params={"path": path})
    return r.text if r.status_code == 200 else None


def _wait_file(a: c.Atoll, sid: str, path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _read(a, sid, path) is not None:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{sid}: {path} did not appear within {timeout} s")


BUSY_RETRIES: list[str] = []  # sandbox_busy answers that a retry got past (retryable: true)


def _pause(a: c.Atoll, sid: str, tier: str) -> tuple[float, dict]:
    for _ in range(20):
        with c.Timer() as t:
            r = a.api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": tier})
        if r.status_code == 409 and r.json()["error"]["code"] == "sandbox_busy":
            BUSY_RETRIES.append(f"{sid}: {r.json()['error']['message']}")
            time.sleep(0.1)
            continue
        break
    if r.status_code != 200:
        raise RuntimeError(f"pause {sid} to {tier}: {r.status_code} {r.text}")
    return t.ms, r.json()


def _holder(a: c.Atoll) -> dict:
    """A small sandbox with a holder process; returns {id, pid, token}."""
    sid = a.create(memory_mb=MEMORY_MB)["id"]
    tok = secrets.token_hex(8)
    pid = a.exec(sid, ["python3", "-I", "-c", HOLDER, tok], background=True)["pid"]
    _wait_file(a, sid, "/tmp/ready")
    return {"id": sid, "pid": pid, "token": tok}


def _check(a: c.Atoll, h: dict) -> str | None:
    """None if the holder answered from memory with its pid and both files hold the token, else why."""
    r = a.api.post(f"/v1/sandboxes/{h['id']}/exec", json={"cmd": ["sh", "-c", CHECK, "check", str(h["pid"])]})
    if r.status_code != 200:
        return f"exec: {r.status_code} {r.text[:300]}"
    out = r.json()
    want = f"{h['token']}\n{h['token']}\n{h['token']} {h['pid']}"
    if out.get("exit_code") != 0 or out.get("stdout") != want:
        return f"check: exit {out.get('exit_code')} stdout {out.get('stdout')!r} stderr {out.get('stderr')!r}"
    return None


def _disk_used(a: c.Atoll) -> int:
    """What the worker's budget counts: every sandbox directory's own allocated bytes."""
    root = os.path.join(a.home, "sandboxes")
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            total += sandbox_disk_bytes(os.path.join(root, name))
    return total


def calibrate() -> dict:
    """What one sandbox of the recipe takes on the worker's disk, running and in the disk tier."""
    with c.local_atoll() as a:
        c.warm_up(a)
        h = _holder(a)
        d = os.path.join(a.home, "sandboxes", h["id"])
        running = sandbox_disk_bytes(d)
        _pause(a, h["id"], "disk")
        a.wait_containers_at_most(h["id"], 1)
        disk = sandbox_disk_bytes(d)
        why = _check(a, h)  # resumes it: the recipe itself must come back intact
        if why:
            raise RuntimeError(f"calibration sandbox did not come back: {why}")
        a.delete(h["id"])
    return {"running_bytes": running, "disk_tier_bytes": disk}


# ---- samplers ------------------------------------------------------------------------------------
class Sampler:
    """Background: the worker's disk use every 0.5 s; the keepers' state every 1 s."""

    def __init__(self, a: c.Atoll, keepers: list[str]):
        self.a = a
        self.keepers = keepers
        self.t0 = time.monotonic()
        self.disk: list[tuple[float, int]] = []
        self.keeper_states: dict[str, dict[str, int]] = {k: {} for k in keepers}
        self._stop = threading.Event()
        self._api = httpx.Client(base_url=a.local.url, headers=a.local.headers(), timeout=60)
        self._threads = [
            threading.Thread(target=self._disk, daemon=True),
            threading.Thread(target=self._states, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _disk(self) -> None:
        while not self._stop.is_set():
            self.disk.append((time.monotonic() - self.t0, _disk_used(self.a)))
            self._stop.wait(0.5)

    def _states(self) -> None:
        while not self._stop.is_set():
            for k in self.keepers:
                with contextlib.suppress(httpx.HTTPError):
                    sb = self._api.get(f"/v1/sandboxes/{k}").json()
                    key = f"{sb.get('state')}/{sb.get('standby_tier')}"
                    self.keeper_states[k][key] = self.keeper_states[k].get(key, 0) + 1
            self._stop.wait(1.0)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
        self._api.close()


# ---- keepers -------------------------------------------------------------------------------------
def _keeper_facts(a: c.Atoll, k: dict) -> dict:
    sid = k["id"]
    procs = a.api.get(f"/v1/sandboxes/{sid}/processes").json().get("items", [])
    rt = a.runtime(sid)
    state = subprocess.run(
        [c.RUNSC, f"--root={a.runsc_root}", "state", a.cid(sid)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    host = json.loads(state.stdout) if state.returncode == 0 else {}
    n, gap, _ = (_read(a, sid, "/tmp/counter") or "0 0 0").split()
    sb = a.api.get(f"/v1/sandboxes/{sid}").json()
    return {
        "t": round(time.monotonic(), 3),
        "state": sb["state"],
        "phase": rt.get("phase"),
        "generation": rt.get("generation"),
        "guest_pid_running": any(p["pid"] == k["pid"] and p["running"] for p in procs),
        "sentry_host_pid": host.get("pid"),
        "runsc_status": host.get("status"),
        "counter": int(n),
        "max_gap_s": float(gap),
    }


def _start_keeper(a: c.Atoll) -> dict:
    sid = a.create(memory_mb=MEMORY_MB)["id"]
    pid = a.exec(sid, ["python3", "-I", "-c", KEEPER], background=True)["pid"]
    _wait_file(a, sid, "/tmp/counter")
    return {"id": sid, "pid": pid}


def _keeper_verdict(before: dict, after: dict) -> dict:
    elapsed = after["t"] - before["t"]
    counted = after["counter"] - before["counter"]
    untouched = (
        after["state"] == "running"
        and after["phase"] == before["phase"] == "running"
        and after["generation"] == before["generation"]
        and after["sentry_host_pid"] == before["sentry_host_pid"]
        and after["guest_pid_running"]
        and after["runsc_status"] == "running"
    )
    return {
        "before": before,
        "after": after,
        "elapsed_s": round(elapsed, 1),
        "counts": counted,
        "counts_expected_at_4_per_s": round(elapsed * 4),
        "untouched": untouched,
    }


# ---- the run -------------------------------------------------------------------------------------
def run(
    n: int = 100, keepers: int = 3, room: int = 25, s3: bool = False, budget_mb: int | None = None
) -> dict:
    t_start = time.monotonic()
    out: dict = {"sandboxes": n, "keepers": keepers, "memory_mb": MEMORY_MB}
    c.log("== calibration: one sandbox of the recipe, running and in the disk tier")
    cal = calibrate()
    out["calibration"] = cal
    if budget_mb is None:
        budget_bytes = keepers * cal["running_bytes"] + room * cal["disk_tier_bytes"]
        budget_mb = math.ceil(budget_bytes / 2**20)
    budget_bytes = budget_mb * 2**20
    out["budget"] = {
        "ATOLL_DISK_BUDGET_GB": f"{budget_mb / 1024:.6f}",
        "bytes": budget_bytes,
        "room_for_disk_tier_sandboxes": room,
        "all_disk_tier_bytes_estimate": n * cal["disk_tier_bytes"],
    }
    c.log(
        f"budget {budget_mb} MiB: one disk-tier sandbox {cal['disk_tier_bytes'] / 2**20:.1f} MiB, running {cal['running_bytes'] / 2**20:.1f} MiB"
    )
    env = {"ATOLL_DISK_BUDGET_GB": out["budget"]["ATOLL_DISK_BUDGET_GB"]}
    with contextlib.ExitStack() as stack:
        if s3:
            from atoll.testing.seaweed import SeaweedFS

            sw = stack.enter_context(SeaweedFS())
            env.update(sw.env())
            out["store"] = "seaweedfs_s3_loopback"
        else:
            out["store"] = "local_archive_dir"
        a = stack.enter_context(c.local_atoll(env=env))
        c.warm_up(a)
        out.update(_measure(a, n, keepers, budget_bytes))
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def _measure(a: c.Atoll, n: int, n_keepers: int, budget_bytes: int) -> dict:
    out: dict = {}
    c.log(f"== {n_keepers} keepers")
    keepers = [_start_keeper(a) for _ in range(n_keepers)]
    sampler = Sampler(a, [k["id"] for k in keepers])
    time.sleep(1.0)
    before = {k["id"]: _keeper_facts(a, k) for k in keepers}

    c.log(f"== {n} holders: create, hold, pause to disk (2 at a time)")
    holders: list[dict] = []
    lock = threading.Lock()
    pause_ms: list[float] = []
    pause_failures: list[str] = []

    def one(_: int) -> None:
        h = _holder(a)
        try:
            ms, sb = _pause(a, h["id"], "disk")
        except RuntimeError as e:
            with lock:
                pause_failures.append(str(e))
            return
        with lock:
            h["paused_at"] = sampler.now()
            holders.append(h)
            pause_ms.append(ms)
            if sb["standby_tier"] != "disk":
                pause_failures.append(f"{h['id']}: {sb['standby_tier']} {sb['standby_reason']}")
            if len(holders) % 10 == 0:
                c.log(f"{len(holders)} paused; disk {sampler.disk[-1][1] / 2**20:.0f} MiB")

    t_first = sampler.now()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, range(n)))
    t_last = sampler.now()
    holders.sort(key=lambda h: h["paused_at"])
    out["pausing"] = {
        "wall_s": round(t_last - t_first, 1),
        "pause_disk_api": _summary(pause_ms),
        "failures": pause_failures,
        "sandbox_busy_retries": list(BUSY_RETRIES),
    }

    c.log("== waiting until the worker is under its budget")
    deadline = time.monotonic() + 300
    under_at = None
    while time.monotonic() < deadline:
        t, used = sampler.now(), _disk_used(a)
        if used <= budget_bytes:
            under_at = t
            break
        time.sleep(0.2)
    # one more pass period: nothing else should move once under
    time.sleep(BUDGET_EVERY_S + 1)
    over = [(t, b) for t, b in sampler.disk if b > budget_bytes]
    peak = max(sampler.disk, key=lambda x: x[1])
    tiers = {h["id"]: a.api.get(f"/v1/sandboxes/{h['id']}").json()["standby_tier"] for h in holders}
    order = [h["id"] for h in holders]
    archived_log = [
        r["sandbox_id"] for r in a.server_events(prefix="disk budget: archived") if r.get("sandbox_id")
    ]
    stays = [r["msg"] for r in a.server_events(prefix="disk budget:") if "stays on disk" in r.get("msg", "")]
    archived = [sid for sid in order if tiers[sid] == "archive"]
    rank = {sid: i for i, sid in enumerate(order)}
    # pairs (archived x, still on disk y) where y was paused before x: a younger one went first
    on_disk = [sid for sid in order if tiers[sid] == "disk"]
    inversions = sum(1 for x in archived for y in on_disk if rank[y] < rank[x])
    out["budget_enforcement"] = {
        "first_over_budget_s": round(over[0][0] - t_first, 1) if over else None,
        "under_budget_after_last_pause_s": round(under_at - t_last, 1) if under_at is not None else None,
        "over_budget_s": round(under_at - over[0][0], 1) if over and under_at is not None else None,
        "under_budget_at_end": _disk_used(a) <= budget_bytes,
        "peak_bytes": peak[1],
        "peak_over_budget": round(peak[1] / budget_bytes, 3),
        "peak_at_s": round(peak[0] - t_first, 1),
        "end_bytes": _disk_used(a),
        "archived": len(archived),
        "on_disk": len(on_disk),
        "other_tiers": {sid: t for sid, t in tiers.items() if t not in ("archive", "disk")},
        "archived_log_order_equals_pause_order": archived_log == [s for s in order if s in set(archived_log)],
        "archived_are_the_longest_idle": archived == order[: len(archived)],
        "inversions": inversions,
        "stays_on_disk_lines": stays[:10],
        "passes_every_s": BUDGET_EVERY_S,
        "server_archive_ms": _summary(a.server_durations(None, "sandbox.archive.complete")),
        "upper_image_release_waits": len(a.server_events(prefix="the upper image was released")),
        # the worker's own account, one line per archive: [log time, bytes freed, bytes used after]
        "budget_log": [
            [r["ts"][11:], int(m.group(1)), int(m.group(2))]
            for r in a.server_events(prefix="disk budget: archived")
            if (m := re.search(r"(\d+) bytes freed; (\d+) of", r["msg"]))
        ],
        "disk_samples_mib": [(round(t - t_first, 1), round(b / 2**20, 1)) for t, b in sampler.disk],
    }
    c.log(
        f"under budget {out['budget_enforcement']['under_budget_after_last_pause_s']} s after the last pause; "
        f"{len(archived)} archived, {len(on_disk)} on disk, inversions {inversions}"
    )

    after = {k["id"]: _keeper_facts(a, k) for k in keepers}
    sampler.stop()
    out["keepers"] = {
        k["id"]: {
            **_keeper_verdict(before[k["id"]], after[k["id"]]),
            "states_seen": sampler.keeper_states[k["id"]],
        }
        for k in keepers
    }
    out["keepers_all_untouched"] = all(
        v["untouched"] and set(v["states_seen"]) == {"running/None"} for v in out["keepers"].values()
    )
    server_lines = {k["id"]: sorted({r["msg"][:80] for r in a.server_events(k["id"])}) for k in keepers}
    out["keeper_server_log_lines"] = server_lines

    c.log(f"== resume and check each of the {len(holders)} (disk tier first), then delete")
    n_archived_before = len(archived_log)
    resume: dict[str, list[float]] = {"disk": [], "archive": []}
    check: dict[str, list[float]] = {"disk": [], "archive": []}
    failures: list[str] = []
    # the ones still on disk first: an archived sandbox that resumes is on the worker's disk again
    # (its upper image) while the deletes behind run in the background, so resuming those first
    # pushes the worker over its budget again and the rest get archived before they are measured
    resume_order = sorted(holders, key=lambda h: (tiers[h["id"]] != "disk", h["paused_at"]))
    for i, h in enumerate(resume_order):
        tier = a.api.get(f"/v1/sandboxes/{h['id']}").json()["standby_tier"]
        with c.Timer() as t:
            r = a.api.post(f"/v1/sandboxes/{h['id']}/resume")
        if r.status_code != 200 or r.json()["state"] != "running":
            failures.append(f"{h['id']} ({tier}): resume {r.status_code} {r.text[:300]}")
        else:
            resume.setdefault(tier, []).append(t.ms)
            with c.Timer() as t:
                why = _check(a, h)
            if why:
                failures.append(f"{h['id']} ({tier}): {why}")
            else:
                check.setdefault(tier, []).append(t.ms)
        a.delete(h["id"], wait=False)
        if (i + 1) % 20 == 0:
            c.log(f"{i + 1} resumed and checked, {len(failures)} failures")
    out["resume"] = {
        "failures": failures,
        "resumed_ok": sum(len(v) for v in check.values()),
        "by_tier": {
            tier: {"resume_api": _summary(resume[tier]), "check_exec": _summary(check[tier])}
            for tier in resume
            if resume[tier]
        },
        "ratio_archive_to_disk_p50": c.ratio(_summary(resume["archive"]), _summary(resume["disk"]))
        if resume["archive"] and resume["disk"]
        else None,
        "server_unarchive_ms": _summary(a.server_durations(None, "sandbox.unarchive.complete")),
        "archived_by_budget_during_resumes": len(
            [r for r in a.server_events(prefix="disk budget: archived") if r.get("sandbox_id")]
        )
        - n_archived_before,
    }
    for k in keepers:
        a.delete(k["id"], wait=False)
    for h in holders:
        a.wait_gone(h["id"], 120)
    out["atoll_server_log_errors"] = [
        r["msg"][:300] for r in a.server_events() if r.get("level") in ("error", "critical")
    ][:20]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 sandboxes, room for 4 (smoke test, never saved)")
    ap.add_argument("--s3", action="store_true", help="archive into a SeaweedFS S3 gateway on loopback")
    ap.add_argument("--room", type=int, default=25, help="disk-tier sandboxes the budget has room for")
    ap.add_argument(
        "--budget-mb", type=int, default=None, help="the budget in MiB (default: from calibration)"
    )
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/budget.json")
    args = ap.parse_args()
    machine = c.machine_info()
    # the atoll that ran (PYTHONPATH may point at another tree, e.g. for a before/after pair)
    src = os.path.dirname(os.path.dirname(os.path.abspath(atoll.__file__)))
    machine["atoll_src"] = src
    machine["atoll_src_commit"] = c._first_line(["git", "-C", src, "rev-parse", "--short", "HEAD"])
    if args.quick:
        res = run(n=12, keepers=2, room=4, s3=args.s3, budget_mb=args.budget_mb)
    else:
        res = run(n=100, keepers=3, room=args.room, s3=args.s3, budget_mb=args.budget_mb)
    doc: dict[str, typing.Any] = {
        "benchmark": "budget",
        "timestamp": c.timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
    }
    c.emit(doc)
    if not args.no_save and not args.quick:
        os.makedirs(c.RESULTS, exist_ok=True)
        name = "budget-s3.json" if args.s3 else "budget.json"
        with open(os.path.join(c.RESULTS, name), "w") as f:
            json.dump(doc, f, indent=1)
    ok = (
        not res["resume"]["failures"]
        and res["keepers_all_untouched"]
        and res["budget_enforcement"]["under_budget_at_end"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

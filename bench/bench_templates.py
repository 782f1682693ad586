"""Benchmark: user templates — creates that claim a warm pool, creates from a template's snapshot,
bursts against a pool and its refill, and fork — against the gvisor package's cold start, in one run.

Run standalone (`.venv/bin/python bench/bench_templates.py`, root, starts its own `atoll up`, writes
bench/results/templates.json) or from bench/run_all.py (section `templates`), which calls
`run(atoll)`. Prints one JSON document to stdout; progress on stderr. Loopback only: the sandboxes
have no network policy (their gateway lets nothing out) and the peer runs with network "none".

Set-up (untimed): two user templates built with the SDK from `base` with one `run` step (a marker
file), `bench-pool` and `bench-snap` (the same step: the second build reuses the cached layer and
only boots and snapshots). `bench-pool` gets a warm pool; `bench-snap` never has one.

  create (interleaved; the order rotates each round; one untimed warm-up each):
    pooled_true     the pool is `min=max=POOL` and full (every member ready, none starting) before
                    each claim; POST /v1/sandboxes {template: bench-pool} → 201 (timed: create),
                    POST /exec ["true"] → answer (timed: create_exec). The pool's `claimed`
                    counter must have gone up by one (the create was a claim, not a restore).
                    Two per round.
    pooled_python   the same with ["python3", "-c", "pass"] as the first exec.
    (A "quiet" variant set the pool to min=0, max=POOL around the claim so that no refill would
    start; since pools shrink to their `min` (4accf24) that drained the pool instead. It is not
    needed: the keeper waits REFILL_AFTER_CLAIM_S (0.3 s) of quiet after a claim before it starts a
    refill, longer than a claim and its first python3 take, so pooled_python has no refill beside it.)
    snapshot_python POST /v1/sandboxes {template: bench-snap} (no pool: the worker restores the
                    template's snapshot) + first ["python3", "-c", "pass"].
    base_python     the same with the built-in `base` template (its template image), for reference.
    gvisor_pkg      the `gvisor` PyPI package's cold start, as in bench_peers: `gvisor.Sandbox(
                    network="none", mounts=…)` over the `base` rootfs → `sb.exec("python3", "-c",
                    "pass")` returned; closed untimed.
    Each atoll sample also times, after its clock stopped, a second exec of the same command
    (parts.second_exec_untimed: is a slow first exec a one-time cost?).
    After every sample, untimed: the sandbox is deleted and the worker's directory awaited
    (`runsc delete` is done), the pool is awaited full again, then SETTLE_S more of idle time:
    deletes and refills cost CPU on 2 cores and would land on the next create otherwise.
  burst: `bench-pool` emptied, then set to min=max=BURST; the fill 0 → BURST is timed from the PUT
    (fill: the pool's `ready` sampled every 0.1 s). Then BURST creates (no exec) as fast as possible,
    sequentially over one connection (timed from the first request to the last answer; the
    keeper's refills wait 0.3 s after a claim, so they mostly start once a burst is over); the hits
    are the `claimed` counter's growth. Then
    the refill 0 → BURST is sampled the same way while the claimed sandboxes stay (idle). Those are
    deleted (awaited), and the same burst with 4 threads (one connection each). Then the pool goes
    to 0 and everything is deleted.
  fork: a `base` sandbox (memory_mb 512) with a background python3 holding a 50 MiB bytearray of
    random bytes; one untimed warm-up, then n times POST /fork {count: 3} → 201 (timed: wall), the
    server's own "forked into 3 copies in N ms (checkpoint M ms)" next to it, an untimed exec of
    `true` in the first copy, and a check that the holder runs in every copy (GET …/processes).
    The copies are deleted and awaited, 2 × SETTLE_S idle, next. fork_runsc_floor: bench_standby's plain
    runsc checkpoint / restore of the same 50 MB holder (no atoll), the floor of one copy.

Ratios are p50 over p50 of the same run. Targets: pooled create + first `python3 -c pass` ≤ 0.2×
the package, a snapshot create + first exec ≤ 1.0×, a burst ≥ 20 creates/s, fork(3) ≤ 2 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
import typing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_api  # noqa: E402
import bench_standby  # noqa: E402
import common as c  # noqa: E402
import httpx  # noqa: E402

import atoll  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
POOLED = "bench-pool"
SNAP = "bench-snap"
MARK = "echo atoll-bench > /etc/atoll-bench-marker"
PY = ["python3", "-c", "pass"]
TRUE = ["true"]
POOL = 3
SETTLE_S = 1.0
FORK_MB = 50
HOG = (
    "import os, time; b = bytearray(os.urandom({mb} * 2**20)); "
    "open('/tmp/.bench-hog-ready', 'w').close(); time.sleep(10**6)"
)


# ---- the other work on this machine ------------------------------------------------------------
class Neighbours:
    """CPU used on this machine by processes that are not this benchmark's, between two samples.

    Ours: this process and its descendants, and every process whose command line names our atoll's
    home or a `gvisor-sandbox-` directory of the package peer (sentries are re-parented). Every other
    live process is a neighbour (another engineer's tests, their atoll, kernel threads); its CPU
    (utime + stime + reaped children) counts by its growth since the last sample, or whole when it
    is new: `cores` is that CPU over the wall time. `reaped_children_cpu_s` is what neighbours' exited
    children used, counted when they were reaped (a test run's whole CPU lands at its end), so it
    is reported apart. Processes whose parent is gone too are missed.
    """

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, *homes: str):
        self.homes = tuple(dict.fromkeys(homes))
        self.me = os.getpid()
        self.last: dict[int, tuple[str, tuple[float, float], int]] = self._read()
        self.t = time.monotonic()

    def _read(self) -> dict[int, tuple[str, tuple[float, float], int]]:
        """{pid: (command line or [name], (own CPU s, reaped children's CPU s), start time)}."""
        procs: dict[int, tuple[int, str, tuple[float, float], str, int]] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
                rest = st[st.rindex(")") + 2 :].split()
                cpu = (
                    sum(int(x) for x in rest[11:13]) / self.TICK,
                    sum(int(x) for x in rest[13:15]) / self.TICK,
                )
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                name = st[st.index("(") + 1 : st.rindex(")")]
                procs[int(d)] = (int(rest[1]), cmd, cpu, name, int(rest[19]))
        ours: set[int] = set()

        def is_ours(pid: int, depth: int = 0) -> bool:
            if pid == self.me or pid in ours:
                return True
            p = procs.get(pid)
            if p is None or depth > 50 or pid <= 1:
                return False
            if "gvisor-sandbox-" in p[1] or any(h in p[1] for h in self.homes):
                return True
            return is_ours(p[0], depth + 1)

        out = {}
        for pid, (_, cmd, cpu, name, started) in procs.items():
            if is_ours(pid):
                ours.add(pid)
            else:
                out[pid] = ((cmd or f"[{name}]")[:80], cpu, started)
        return out

    def sample(self) -> dict:
        now = self._read()
        t = time.monotonic()
        by: dict[str, float] = {}
        live = reaped = 0.0
        for pid, (cmd, cpu, started) in now.items():
            prev = self.last.get(pid)  # the same process: same pid and start time (kworkers rename)
            base = prev[1] if prev is not None and prev[2] == started else (0.0, 0.0)
            d_live, d_reaped = cpu[0] - base[0], cpu[1] - base[1]
            live += max(d_live, 0.0)
            reaped += max(d_reaped, 0.0)
            if d_live > 0:
                by[cmd] = by.get(cmd, 0.0) + d_live
        wall = t - self.t
        self.last, self.t = now, t
        top = sorted(by.items(), key=lambda kv: -kv[1])[:3]
        return {
            "wall_s": round(wall, 1),
            "cpu_s": round(live, 2),
            "cores": round(live / wall, 2) if wall else None,
            "reaped_children_cpu_s": round(reaped, 2),
            "top": [(k, round(v, 2)) for k, v in top if v >= 0.05],
        }


# ---- pools -------------------------------------------------------------------------------------
class Pool:
    """A template's warm pool through the SDK (untimed calls only)."""

    def __init__(self, sdk: atoll.Client, name: str):
        self.sdk = sdk
        self.name = name

    def get(self) -> dict:
        return self.sdk.templates.get_pool(self.name)

    def set(self, n: int) -> None:
        self.sdk.templates.set_pool(self.name, min=n, max=n)

    def claimed(self) -> int:
        return int(self.get()["claimed"])

    def wait_full(self, n: int, timeout: float = 120) -> float:
        """Wait until `n` members are ready and none is starting; seconds waited."""
        t0 = time.monotonic()
        while True:
            p = self.get()
            if p["ready"] >= n and p["starting"] == 0:
                return time.monotonic() - t0
            if p.get("last_error"):
                raise RuntimeError(f"pool {self.name}: {p['last_error']}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"pool {self.name} not full ({n}) after {timeout} s: {p}")
            time.sleep(0.05)

    def wait_empty(self, timeout: float = 120) -> None:
        """Wait until the pool has no member (after set(0) the keeper deletes them)."""
        t0 = time.monotonic()
        while True:
            p = self.get()
            if p["ready"] == 0 and p["starting"] == 0:
                return
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"pool {self.name} not empty after {timeout} s: {p}")
            time.sleep(0.1)

    def sample_fill(self, n: int, timeout: float) -> dict:
        """Sample `ready` every 0.1 s until it reaches n (or timeout): the fill's time line and rate
        (members made per second, counted from the `ready` of the first sample)."""
        t0 = time.monotonic()
        line: list[tuple[float, int]] = []
        while True:
            p = self.get()
            t = time.monotonic() - t0
            line.append((round(t, 2), p["ready"]))
            if p["ready"] >= n or t > timeout:
                break
            time.sleep(0.1)
        start = line[0][1]
        first = next((t for t, r in line if r > start), None)
        last_t, last_r = line[-1]
        made = last_r - start
        out: dict = {
            "target": n,
            "ready_at_start": start,
            "reached": last_r,
            "seconds": last_t,
            "first_new_ready_s": first,
            "per_s": round(made / last_t, 2) if last_t else None,
            "timeline": _thin(line),
        }
        if first is not None and made > 1 and last_t > first:  # steady rate, after the first one
            out["per_s_after_first"] = round((made - 1) / (last_t - first), 2)
        return out


def _thin(line: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The samples where `ready` changed (and the last one)."""
    out = [pt for i, pt in enumerate(line) if i == 0 or pt[1] != line[i - 1][1]]
    if out[-1] != line[-1]:
        out.append(line[-1])
    return out


# ---- the interleaved create loop ---------------------------------------------------------------
class Creates:
    def __init__(self, a: c.Atoll, sdk: atoll.Client, rootfs: str):
        self.a = a
        self.pool = Pool(sdk, POOLED)
        self.rootfs = rootfs
        self.parts: dict[str, dict[str, list[float]]] = {}
        self.sids: dict[str, list[str]] = {}
        self.settle_waits: list[float] = []

    def _note(self, peer: str, part: str, ms: float) -> None:
        self.parts.setdefault(peer, {}).setdefault(part, []).append(ms)

    def _settle(self) -> None:
        t0 = time.monotonic()
        self.pool.wait_full(POOL)
        time.sleep(SETTLE_S)
        self.settle_waits.append(time.monotonic() - t0)

    def _atoll(self, peer: str, template: str, cmd: list[str], pooled: bool) -> float:
        before = self.pool.claimed() if pooled else None
        t0 = c.now_ms()
        sb = self.a.create(template=template)
        t1 = c.now_ms()
        r = self.a.exec(sb["id"], cmd)
        t2 = c.now_ms()
        try:
            with c.Timer() as t:  # after the clock stopped: is a slow first exec a one-time cost?
                self.a.exec(sb["id"], cmd)
            self._note(peer, "second_exec_untimed", t.ms)
            if r["exit_code"] != 0:
                raise RuntimeError(f"{peer}: {cmd} exited {r['exit_code']}: {r['stderr'][-300:]}")
            if sb.get("template") != template:
                raise RuntimeError(f"{peer}: the sandbox is of template {sb.get('template')!r}")
            if pooled and self.pool.claimed() != before + 1:
                raise RuntimeError(f"{peer}: the create did not claim from the pool ({self.pool.get()})")
        finally:
            self.a.delete(sb["id"])
        self._note(peer, "create", t1 - t0)
        self._note(peer, "first_exec", t2 - t1)
        self._note(peer, "agent_duration_ms", r["duration_ms"])
        self.sids.setdefault(peer, []).append(sb["id"])
        self._settle()
        return t2 - t0

    def pooled_true(self) -> float:
        return self._atoll("pooled_true", POOLED, TRUE, pooled=True)

    def pooled_true_b(self) -> float:
        return self._atoll("pooled_true", POOLED, TRUE, pooled=True)

    def pooled_python(self) -> float:
        return self._atoll("pooled_python", POOLED, PY, pooled=True)

    def snapshot_python(self) -> float:
        return self._atoll("snapshot_python", SNAP, PY, pooled=False)

    def base_python(self) -> float:
        return self._atoll("base_python", "base", PY, pooled=False)

    def gvisor_pkg(self) -> float:
        t0 = c.now_ms()
        sb = c.gvisor_sandbox(self.rootfs)
        try:
            t1 = c.now_ms()
            sb.exec(*PY, timeout=60)
            t2 = c.now_ms()
        finally:
            sb.close()
        self._note("gvisor_pkg", "create", t1 - t0)
        self._note("gvisor_pkg", "first_exec", t2 - t1)
        self._settle()
        return t2 - t0


def _server_summary(a: c.Atoll, sids: list[str], verb: str) -> dict:
    xs = []
    worker = []
    for sid in sids:
        for rec in a.server_events(sid, f"sandbox.{verb}.complete"):
            xs.append(float(rec["duration_ms"]))
            if "worker_ms" in rec:
                worker.append(float(rec["worker_ms"]))
    out = {f"{verb}_ms": c.summarize(xs, keep_samples=False)}
    if worker:
        out["worker_ms"] = c.summarize(worker, keep_samples=False)
    return out


def bench_creates(a: c.Atoll, sdk: atoll.Client, rootfs: str, rounds: int, nb: Neighbours) -> dict:
    cr = Creates(a, sdk, rootfs)
    cr.pool.set(POOL)
    c.log(f"templates: pool {POOLED} min=max={POOL}, waiting until full")
    fill_s = cr.pool.wait_full(POOL, timeout=300)
    fns: dict[str, typing.Callable[[], float]] = {
        "pooled_true": cr.pooled_true,
        "pooled_python": cr.pooled_python,
        "pooled_true_b": cr.pooled_true_b,
        "snapshot_python": cr.snapshot_python,
        "base_python": cr.base_python,
        "gvisor_pkg": cr.gvisor_pkg,
    }
    names = list(fns)
    for name in names:  # one untimed warm-up each
        if name != "pooled_true_b":
            fns[name]()
    cr.parts.clear()
    cr.sids.clear()
    samples: dict[str, list[float]] = {k: [] for k in names}
    neighbours = []
    nb.sample()
    for i in range(rounds):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            samples[name].append(fns[name]())
        neighbours.append(nb.sample())
        c.log(
            f"templates round {i + 1}/{rounds}: "
            + ", ".join(f"{k} {samples[k][-1]:.0f} ms" for k in names if k != "pooled_true_b")
            + f"; other work on the machine {neighbours[-1]['cores']} cores"
        )
    samples["pooled_true"] += samples.pop("pooled_true_b")
    out: dict = {}
    for k, v in samples.items():
        out[k] = c.summarize(v)
        out[k]["parts"] = {p: c.summarize(xs) for p, xs in cr.parts[k].items()}
    for k in ("pooled_true", "pooled_python"):
        out[k]["server"] = _server_summary(a, cr.sids[k], "claim")
    for k in ("snapshot_python", "base_python"):
        out[k]["server"] = _server_summary(a, cr.sids[k], "create")
        out[k]["server"].update(bench_api.runtime_start_summary(a, cr.sids[k]))
        made = sorted(out[k]["server"]["created_by"])
        if made != ["template image"]:
            raise RuntimeError(f"{k}: creates were made by {made}, expected only 'template image'")
    g = out["gvisor_pkg"]
    out["ratios_p50"] = {
        "pooled_python/gvisor_pkg": c.ratio(out["pooled_python"], g),
        "snapshot_python/gvisor_pkg": c.ratio(out["snapshot_python"], g),
        "base_python/gvisor_pkg": c.ratio(out["base_python"], g),
        "pooled_python/snapshot_python": c.ratio(out["pooled_python"], out["snapshot_python"]),
    }
    out["pool_size"] = POOL
    out["other_work_per_round"] = neighbours
    out["pool_first_fill_s"] = round(fill_s, 2)
    out["settle"] = {
        "how": "after every sample: delete + wait for the worker's directory to go, wait for the pool "
        f"to be full again, then {SETTLE_S} s idle",
        "wait_s": c.summarize(cr.settle_waits, unit="s", keep_samples=False),
    }
    cr.pool.set(0)
    return out


# ---- bursts ------------------------------------------------------------------------------------
def _burst(a: c.Atoll, pool: Pool, n: int, threads: int) -> tuple[dict, list[str]]:
    before = pool.claimed()
    lock = threading.Lock()
    sids: list[str] = []
    lat: list[float] = []
    errors_: list[str] = []
    per_thread = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    start = threading.Barrier(threads + 1)

    def worker(k: int) -> None:
        with httpx.Client(base_url=a.local.url, headers=a.local.headers(), timeout=600) as cl:
            cl.get("/healthz")  # the connection is open before the clock starts
            start.wait()
            for _ in range(k):
                t0 = c.now_ms()
                r = cl.post(
                    "/v1/sandboxes", json={"template": POOLED, "idle_timeout_s": 0, "disk_after_s": 0}
                )
                ms = c.now_ms() - t0
                with lock:
                    if r.status_code == 201:
                        sids.append(r.json()["id"])
                        lat.append(ms)
                    else:
                        errors_.append(f"{r.status_code} {r.text[:200]}")

    ts = [threading.Thread(target=worker, args=(k,)) for k in per_thread]
    for t in ts:
        t.start()
    start.wait()
    t0 = c.now_ms()
    for t in ts:
        t.join()
    wall = c.now_ms() - t0
    hits = pool.claimed() - before
    left = pool.get()
    res = {
        "threads": threads,
        "creates": len(sids),
        "pool_hits": hits,
        "restores_without_pool": len(sids) - hits,
        "errors": errors_[:5],
        "wall_ms": round(wall, 1),
        "creates_per_s": round(len(sids) / (wall / 1000), 2) if wall else None,
        "create_latency": c.summarize(lat, keep_samples=False),
        "pool_after": {k: left[k] for k in ("ready", "starting")},
    }
    return res, sids


def _delete_all(a: c.Atoll, sids: list[str]) -> float:
    t0 = time.monotonic()
    for sid in sids:
        a.delete(sid, wait=False)
    for sid in sids:
        a.wait_gone(sid, timeout=300)
    return round(time.monotonic() - t0, 1)


def bench_burst(a: c.Atoll, sdk: atoll.Client, n: int, fill_timeout: float) -> dict:
    pool = Pool(sdk, POOLED)
    out: dict = {"pool_size": n}
    live: list[str] = []
    try:
        pool.set(0)  # the create part's members go first: the fill is timed from an empty pool
        pool.wait_empty()
        time.sleep(SETTLE_S)
        c.log(f"templates burst: filling the pool to {n}")
        pool.set(n)
        out["fill"] = pool.sample_fill(n, fill_timeout)
        pool.wait_full(n, timeout=fill_timeout)
        time.sleep(SETTLE_S * 2)
        c.log("templates burst: sequential")
        out["sequential"], sids = _burst(a, pool, n, 1)
        live += sids
        c.log(f"templates burst: sequential {out['sequential']['creates_per_s']}/s; sampling the refill")
        out["refill"] = pool.sample_fill(n, fill_timeout)
        out["refill"]["while"] = f"the {len(sids)} claimed sandboxes stayed alive (idle)"
        out["sequential"]["delete_all_s"] = _delete_all(a, sids)
        live = []
        pool.wait_full(n, timeout=fill_timeout)
        time.sleep(SETTLE_S * 2)
        c.log("templates burst: 4 threads")
        out["threads_4"], sids = _burst(a, pool, n, 4)
        live += sids
        c.log(f"templates burst: 4 threads {out['threads_4']['creates_per_s']}/s")
        pool.set(0)
        out["threads_4"]["delete_all_s"] = _delete_all(a, sids)
        live = []
    finally:
        pool.set(0)
        if live:
            _delete_all(a, live)
    return out


# ---- fork --------------------------------------------------------------------------------------
def _processes(a: c.Atoll, sid: str) -> list[dict]:
    return a.api.get(f"/v1/sandboxes/{sid}/processes").json().get("items", [])


def _start_hog(a: c.Atoll, sid: str, mb: int) -> int:
    r = a.exec(sid, ["python3", "-I", "-c", HOG.format(mb=mb)], background=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        q = a.api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/.bench-hog-ready"})
        if q.status_code == 200:
            return r["pid"]
        time.sleep(0.2)
    raise RuntimeError(f"the {mb} MB holder did not get ready within 120 s")


def _fork_once(a: c.Atoll, sid: str, pid: int, count: int) -> dict:
    with c.Timer() as t:
        r = a.api.post(f"/v1/sandboxes/{sid}/fork", json={"count": count}, timeout=600)
    if r.status_code != 201:
        raise RuntimeError(f"fork: {r.status_code} {r.text}")
    copies = [x["id"] for x in r.json()["items"]]
    try:
        if len(copies) != count:
            raise RuntimeError(f"fork({count}) answered {len(copies)} copies")
        with c.Timer() as te:
            e = a.exec(copies[0], TRUE)
        if e["exit_code"] != 0:
            raise RuntimeError(f"true in a fork copy exited {e['exit_code']}")
        alive = [any(p["pid"] == pid and p["running"] for p in _processes(a, x)) for x in [sid, *copies]]
        if not all(alive):
            raise RuntimeError(f"the holder (pid {pid}) is not running in every copy: {alive}")
        mem = [a.memory_usage_mb(x) for x in copies]
    finally:
        _delete_all(a, copies)
    time.sleep(SETTLE_S * 2)
    return {"wall": t.ms, "first_exec_copy": te.ms, "copy_cgroup_mb": mem}


def bench_fork(a: c.Atoll, n: int, count: int = 3, n_floor: int = 2) -> dict:
    sb = a.create(memory_mb=512)
    sid = sb["id"]
    try:
        pid = _start_hog(a, sid, FORK_MB)
        out: dict = {"holder_mb": FORK_MB, "count": count, "parent_cgroup_mb": a.memory_usage_mb(sid)}
        _fork_once(a, sid, pid, count)  # warm-up, untimed
        skip = len(a.server_events(sid, "forked into"))
        rows = []
        for i in range(n):
            rows.append(_fork_once(a, sid, pid, count))
            c.log(f"templates fork {i + 1}/{n}: {rows[-1]['wall']:.0f} ms")
        ev = a.server_events(sid, "forked into")[skip:]
        srv, ckpt = [], []
        for rec in ev:
            m = re.search(r"in ([0-9.]+) ms \(checkpoint ([0-9.]+) ms\)", rec["msg"])
            if m:
                srv.append(float(m.group(1)))
                ckpt.append(float(m.group(2)))
        out["fork_wall"] = c.summarize([r["wall"] for r in rows])
        out["server"] = {
            "fork_ms": c.summarize(srv, keep_samples=False),
            "checkpoint_ms": c.summarize(ckpt, keep_samples=False),
            "api": _server_summary(a, [sid], "fork"),
        }
        out["first_exec_in_copy_untimed"] = c.summarize([r["first_exec_copy"] for r in rows])
        out["copy_cgroup_mb"] = rows[-1]["copy_cgroup_mb"]
        out["holder_still_running_in_parent"] = any(
            p["pid"] == pid and p["running"] for p in _processes(a, sid)
        )
    finally:
        a.delete(sid)
    time.sleep(SETTLE_S)
    if n_floor:
        c.log("templates fork: plain runsc floor (checkpoint / restore of the same holder)")
        out["fork_runsc_floor"] = bench_standby.runsc_floor(FORK_MB, n_floor)
        out["fork_runsc_floor"]["note"] = (
            "bench_standby.runsc_floor: a holder of os.urandom bytes under plain runsc; checkpoint + one "
            "restore --detach is the floor of fork(1); fork(3) restores the parent and 3 copies at once"
        )
    return out


# ---- the whole benchmark ------------------------------------------------------------------------
def _build(sdk: atoll.Client, name: str) -> dict:
    with contextlib.suppress(atoll.errors.NotFound):
        sdk.templates.delete(name)
    with c.Timer() as t:
        tpl = sdk.templates.build(name, from_="base", run=[MARK], timeout=1800)
    if tpl.status != "ready":
        raise RuntimeError(f"template {name} ended {tpl.status}: {tpl['error']}")
    d = tpl.to_dict() if hasattr(tpl, "to_dict") else dict(tpl)
    return {
        "build_s": round(t.ms / 1000, 1),
        **{k: d.get(k) for k in ("build_id", "start_mode", "steps", "cached_steps", "size_bytes")},
    }


def run(
    a: c.Atoll,
    rounds: int = 15,
    burst: int = 40,
    n_fork: int = 5,
    n_floor: int = 2,
    fill_timeout: float = 120,
    parts: tuple[str, ...] = ("create", "burst", "fork"),
) -> dict:
    t_start = time.monotonic()
    rootfs = c.template_rootfs()
    sdk = atoll.Client(base_url=a.local.url, api_key=a.local.api_key, request_timeout=600)
    out: dict = {}
    try:
        with c.gvisor_sandbox(rootfs) as sb:  # untimed: the package runs the template's files
            if not c.gvisor_sees_template(sb, rootfs):
                raise RuntimeError("the gvisor package's sandbox does not see the template's /usr/bin")
        c.log("templates: building bench-pool and bench-snap")
        out["templates"] = {POOLED: _build(sdk, POOLED), SNAP: _build(sdk, SNAP)}
        nb = Neighbours(a.home, a.local.home)
        if "create" in parts:
            out["create"] = bench_creates(a, sdk, rootfs, rounds, nb)
        if "burst" in parts:
            t = time.monotonic()
            nb.sample()
            out["burst"] = bench_burst(a, sdk, burst, fill_timeout)
            out["burst"]["wall_s"] = round(time.monotonic() - t, 1)
            out["burst"]["other_work"] = nb.sample()
        if "fork" in parts:
            t = time.monotonic()
            nb.sample()
            out["fork"] = bench_fork(a, n_fork, n_floor=n_floor)
            out["fork"]["wall_s"] = round(time.monotonic() - t, 1)
            out["fork"]["other_work"] = nb.sample()
    finally:
        with contextlib.suppress(Exception):
            Pool(sdk, POOLED).set(0)
        _reap_templates(a, sdk)
        sdk.close()
    out["summary"] = summary(out)
    out["loadavg_at_end"] = os.getloadavg()
    out["server_log_errors"] = [
        r["msg"] for r in a.server_events() if r.get("level") in ("error", "critical")
    ][:20]
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def _reap_templates(a: c.Atoll, sdk: atoll.Client) -> None:
    """Delete the bench's templates once their sandboxes (pooled ones too) are gone."""
    for name in (POOLED, SNAP):
        deadline = time.monotonic() + 120
        while True:
            try:
                sdk.templates.delete(name)
                break
            except atoll.errors.NotFound:
                break
            except atoll.errors.AtollError as e:  # template_in_use while pooled sandboxes go
                if time.monotonic() > deadline:
                    c.log(f"templates: could not delete {name}: {e}")
                    break
                time.sleep(0.5)


TARGETS = {
    "pooled_python_over_gvisor_pkg": 0.2,
    "snapshot_python_over_gvisor_pkg": 1.0,
    "burst_creates_per_s_min": 20.0,
    "fork3_p50_ms": 2000.0,
}


def summary(out: dict) -> dict:
    s: dict = {}
    cr = out.get("create", {})
    if cr:
        r = cr["ratios_p50"]
        s["pooled_claim_create_p50_ms"] = cr["pooled_true"]["parts"]["create"]["p50"]
        s["pooled_claim_create_p90_ms"] = cr["pooled_true"]["parts"]["create"]["p90"]
        s["pooled_claim_create_exec_true_p50_ms"] = cr["pooled_true"]["p50"]
        s["pooled_claim_create_exec_true_p90_ms"] = cr["pooled_true"]["p90"]
        s["pooled_claim_n"] = cr["pooled_true"]["n"]
        s["pooled_python_p50_ms"] = cr["pooled_python"]["p50"]
        s["snapshot_python_p50_ms"] = cr["snapshot_python"]["p50"]
        s["base_python_p50_ms"] = cr["base_python"]["p50"]
        s["gvisor_pkg_python_p50_ms"] = cr["gvisor_pkg"]["p50"]
        for key, name in (
            ("pooled_python/gvisor_pkg", "pooled_python_over_gvisor_pkg"),
            ("snapshot_python/gvisor_pkg", "snapshot_python_over_gvisor_pkg"),
        ):
            s[name] = {"value": r[key], "target_max": TARGETS[name], "met": _le(r[key], TARGETS[name])}
        s["base_python_over_gvisor_pkg"] = r["base_python/gvisor_pkg"]
    b = out.get("burst", {})
    if b:
        seq = b["sequential"]["creates_per_s"]
        par = b["threads_4"]["creates_per_s"]
        best = max(x for x in (seq, par) if x is not None) if (seq or par) else None
        s["burst_creates_per_s"] = {
            "sequential": seq,
            "threads_4": par,
            "target_min": TARGETS["burst_creates_per_s_min"],
            "met": best is not None and best >= TARGETS["burst_creates_per_s_min"],
        }
        s["pool_fill_per_s"] = b["fill"].get("per_s")
        s["pool_refill_per_s"] = b["refill"].get("per_s")
    f = out.get("fork", {})
    if f:
        v = f["fork_wall"]["p50"]
        s["fork3_p50_ms"] = {
            "value": v,
            "target_max": TARGETS["fork3_p50_ms"],
            "met": _le(v, TARGETS["fork3_p50_ms"]),
        }
    return s


def _le(v: float | None, limit: float) -> bool:
    return v is not None and v <= limit


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sample counts (smoke test)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/templates.json")
    ap.add_argument("--only", default="create,burst,fork", help="comma-separated subset of create,burst,fork")
    ap.add_argument(
        "--out", default=os.path.join(RESULTS, "templates.json"), help="where to save the document"
    )
    args = ap.parse_args()
    q = args.quick
    machine = c.machine_info()
    with c.local_atoll() as a:
        c.warm_up(a)
        res = run(
            a,
            rounds=2 if q else 15,
            burst=8 if q else 40,
            n_fork=1 if q else 5,
            n_floor=1 if q else 2,
            parts=tuple(args.only.split(",")),
        )
    doc = {"benchmark": "templates", "timestamp": c.timestamp(), "machine": machine, "results": res}
    doc["quick"] = q
    c.emit(doc)
    if not args.no_save:
        path = args.out
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)
        c.log(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

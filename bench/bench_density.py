"""Benchmark: host memory per idle running sandbox (issue 18 item 6: ≤ 50 MB, measured at 40 and 200).

Run standalone (`.venv/bin/python bench/bench_density.py [--levels 40,200] [--quick]`, root; starts
its own `atoll up`, writes bench/results/density.json) or from bench/run_all.py (section `density`,
opt-in: `--only density`, ~20 min) via `run(atoll)`. Prints one JSON document; progress on stderr.
Loopback only: the sandboxes have no network policy.

Set-up: default sandboxes (`POST /v1/sandboxes {}`: `base`, 512 MB, restored from the template
image; idle_timeout_s=0 so none is frozen), created one after another up to each level (cumulative),
each running `python3 -c pass` once right after its create. Creation stops early when the host's
MemAvailable falls under MIN_AVAILABLE_MB, and the document says so and how many there were.

At each level two moments are measured:
  fresh     SETTLE_S after the last create (what a burst of creates costs right away);
  settled   once the sentries' anonymous memory has stopped falling (the same within 1% over
            STABLE_POLLS polls POLL_S apart, at least MIN_SETTLED_S after the last create, at most
            MAX_SETTLED_S): a restored sentry keeps the garbage of decoding its image (Go heap)
            until the Go runtime's forced collection (2 min after its last one) and its scavenger
            return it, 2.5-4 min after the restore (measured: 200 sandboxes made in 2 min were
            all down 4 min after the last). This is what an idle sandbox costs for as long as it
            stays idle.
Each moment is measured three ways:
  mem_available  (a) the host's view, everything included (sentry, gofer, ptrace stubs, page
                 tables, the sandbox's loop-mounted upper layer and network namespaces, atoll's
                 own processes growing): (MemAvailable before the first create - now) / sandboxes.
                 Other programs on the host move it too: the machine should be quiet. Other atoll
                 installations' cgroups (tests beside the benchmark) are tracked, and the figure
                 without their growth is reported beside it, and the growth per sandbox of the
                 /proc/meminfo fields that say where it went (anonymous, shmem: the sentries'
                 memory files, page cache, slab, kernel stacks, page tables).
  cgroup         (b) each sandbox's memory cgroup (/sys/fs/cgroup/memory/atoll-<inst>/<sid>-<gen>):
                 memory.usage_in_bytes, memory.stat rss (anonymous: the sentry's and gofer's Go
                 heaps), cache and its shmem part (the sentry's memory file: guest memory and the
                 guest's page cache), memory.kmem.usage_in_bytes.
  processes      (c) /proc/<pid>/smaps_rollup of each sandbox's host processes (the tasks of its
                 cgroup: the sentry `runsc-sandbox`, the gofer `runsc-gofer`, the ptrace stubs):
                 PSS (shared pages such as runsc's text split among all sandboxes) and RSS, anon
                 and shmem; plus atoll's own processes (`atoll up`, its gateway and ingress
                 router), whose growth is the sandboxes' share host-side.
  guest          for up to GUEST_SAMPLE sandboxes: `runsc usage -full` (the sentry's accounting of
                 guest memory by kind) and the guest's /proc/meminfo.
Before the levels, one extra sandbox is broken down (`breakdown`) and deleted: per guest process
(the agent is PID 1 of the sandbox, atoll-init PID 1 of the commands' namespace, which hides the
agent: a `runsc exec` process mounts a proc of the root PID namespace to see both) its VmRSS and
its anonymous and file-backed memory from /proc/<pid>/smaps.
Target: settled mem_available per sandbox ≤ 50 MB at 200 sandboxes.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
import typing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

LEVELS = (40, 200)
MIN_AVAILABLE_MB = 3000
SETTLE_S = 15.0
MIN_SETTLED_S = 270.0
MAX_SETTLED_S = 600.0
STABLE_POLLS = 4
POLL_S = 20.0
GUEST_SAMPLE = 3
FIRST = ["python3", "-c", "pass"]
MB = 1024 * 1024


# ---- host readings -----------------------------------------------------------------------------
def meminfo_kb() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            out[name] = int(rest.split()[0])
    return out


def available_mb() -> float:
    return meminfo_kb()["MemAvailable"] / 1024


def smaps_rollup_kb(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1])
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kind(pid: int) -> str:
    """A sandbox cgroup's task: the sentry, the gofer, or a ptrace stub (an empty command line)."""
    cmd = _cmdline(pid)
    if cmd.startswith("runsc-sandbox"):
        return "sentry"
    if cmd.startswith("runsc-gofer"):
        return "gofer"
    return "stub"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _memory_stat(cg: str) -> dict[str, int]:
    out = {}
    try:
        with open(os.path.join(cg, "memory.stat")) as f:
            for line in f:
                k, v = line.split()
                out[k] = int(v)
    except OSError:
        pass
    return out


def other_atoll_cgroups_mb(install_id: str) -> float:
    """Memory charged to other atoll installations' cgroups on this host (tests running beside the
    benchmark): what moves MemAvailable without being ours."""
    total = 0
    for d in glob.glob("/sys/fs/cgroup/memory/atoll-*"):
        if os.path.basename(d) != f"atoll-{install_id}":
            total += _read_int(os.path.join(d, "memory.usage_in_bytes")) or 0
    return total / MB


def _cgroup_dir(a: common.Atoll, sid: str) -> str:
    return "/sys/fs/cgroup/memory" + a.cgroup(sid)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d))
    return out


def _mb(kb: float) -> float:
    return round(kb / 1024, 2)


def _summary(values: list[float]) -> dict:
    return common.summarize(values, unit="MB", keep_samples=False)


# ---- one moment --------------------------------------------------------------------------------
def _sandbox_reading(a: common.Atoll, sid: str) -> dict:
    cg = _cgroup_dir(a, sid)
    stat = _memory_stat(cg)
    usage = _read_int(os.path.join(cg, "memory.usage_in_bytes"))
    kmem = _read_int(os.path.join(cg, "memory.kmem.usage_in_bytes"))
    try:
        with open(os.path.join(cg, "cgroup.procs")) as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        pids = []
    procs: dict[str, dict[str, float]] = {}
    for pid in pids:
        k = _kind(pid)
        s = smaps_rollup_kb(pid)
        agg = procs.setdefault(k, {"count": 0, "pss": 0, "rss": 0, "anon": 0, "shmem": 0, "file": 0})
        agg["count"] += 1
        agg["pss"] += s.get("Pss", 0)
        agg["rss"] += s.get("Rss", 0)
        agg["anon"] += s.get("Pss_Anon", 0)
        agg["shmem"] += s.get("Pss_Shmem", 0)
        agg["file"] += s.get("Pss_File", 0)
    return {
        "usage": (usage or 0) / MB,
        "rss": stat.get("total_rss", 0) / MB,
        "cache": stat.get("total_cache", 0) / MB,
        "shmem": stat.get("total_shmem", 0) / MB,
        "mapped_file": stat.get("total_mapped_file", 0) / MB,
        "kmem": (kmem or 0) / MB,
        "procs": procs,
    }


def _installation(a: common.Atoll) -> dict:
    """atoll's own processes: `atoll up` and its non-runsc children (gateway, ingress router)."""
    assert a.local.proc is not None
    root = a.local.proc.pid
    out = {}
    for pid in [root, *_children(root)]:
        cmd = _cmdline(pid)
        if "runsc" in cmd or not cmd:
            continue
        name = (
            "atoll_up"
            if pid == root
            else ("gateway" if "gateway" in cmd else "ingress" if "ingress" in cmd else cmd[:40])
        )
        s = smaps_rollup_kb(pid)
        out[name] = {"rss_mb": _mb(s.get("Rss", 0)), "pss_mb": _mb(s.get("Pss", 0))}
    out["total_pss_mb"] = round(sum(v["pss_mb"] for v in out.values() if isinstance(v, dict)), 2)
    return out


def _runsc_usage(a: common.Atoll, sid: str) -> dict | None:
    try:
        r = common.run_quiet(
            [common.RUNSC, f"--root={a.runsc_root}", "usage", "-full", a.cid(sid)], timeout=30, check=False
        )
        return {k: round(v / MB, 2) for k, v in json.loads(r.stdout).items()}
    except (ValueError, subprocess.TimeoutExpired, OSError):
        return None


def _guest_meminfo(a: common.Atoll, sid: str) -> dict:
    out = a.exec(sid, ["cat", "/proc/meminfo"])["stdout"]
    keep = ("MemTotal", "MemFree", "Cached", "AnonPages", "Mapped", "Shmem")
    vals = {}
    for line in out.splitlines():
        name, _, rest = line.partition(":")
        if name in keep:
            vals[name] = _mb(int(rest.split()[0]))
    if "MemTotal" in vals and "MemFree" in vals:
        vals["used"] = round(vals["MemTotal"] - vals["MemFree"], 2)
    return vals


HOST_FIELDS = ("AnonPages", "Shmem", "Cached", "Slab", "SUnreclaim", "KernelStack", "PageTables")
"""/proc/meminfo fields whose growth per sandbox says where the host's memory went."""


def measure(a: common.Atoll, sids: list[str], base: dict, last_create: float) -> dict:
    readings = [_sandbox_reading(a, sid) for sid in sids]
    info = meminfo_kb()
    avail = info["MemAvailable"] / 1024
    others = other_atoll_cgroups_mb(a.install_id)
    n = max(len(sids), 1)
    drop = base["mem_available_mb"] - avail
    others_grew = others - base["other_atoll_cgroups_mb"]
    out: dict[str, typing.Any] = {
        "seconds_since_last_create": round(time.monotonic() - last_create, 1),
        "mem_available": {
            "mb": round(avail),
            "drop_mb": round(drop),
            "per_sandbox_mb": round(drop / n, 2),
            "other_atoll_cgroups_grew_mb": round(others_grew),
            "per_sandbox_mb_without_other_atoll": round((drop - others_grew) / n, 2),
            "growth_per_sandbox_mb": {
                k: round((info[k] - base["meminfo_kb"][k]) / 1024 / n, 2) for k in HOST_FIELDS
            },
        },
        "cgroup": {
            k: _summary([r[k] for r in readings])
            for k in ("usage", "rss", "cache", "shmem", "mapped_file", "kmem")
        },
    }
    kinds = sorted({k for r in readings for k in r["procs"]})
    procs: dict[str, typing.Any] = {}
    for k in kinds:
        rows = [r["procs"].get(k, {}) for r in readings]
        procs[k] = {
            "count_per_sandbox": round(sum(x.get("count", 0) for x in rows) / n, 2),
            **{
                f"{m}_mb": _summary([_mb(x.get(m, 0)) for x in rows])
                for m in ("pss", "rss", "anon", "shmem", "file")
            },
        }
    procs["pss_total_per_sandbox_mb"] = round(
        sum(_mb(x.get("pss", 0)) for r in readings for x in r["procs"].values()) / n, 2
    )
    out["processes"] = procs
    out["installation"] = _installation(a)
    out["guest_sample"] = [
        {"sandbox": sid, "runsc_usage_mb": _runsc_usage(a, sid), "meminfo_mb": _guest_meminfo(a, sid)}
        for sid in sids[:GUEST_SAMPLE]
    ]
    return out


def _sentry_anon_mb(a: common.Atoll, sids: list[str]) -> float:
    total = 0.0
    for sid in sids:
        procs = _sandbox_reading(a, sid)["procs"]
        total += procs.get("sentry", {}).get("anon", 0)
    return total / 1024


def wait_settled(a: common.Atoll, sids: list[str], last_create: float, min_s: float, max_s: float) -> dict:
    """Poll the sentries' anonymous memory until it stops falling (and min_s passed since the last
    create), at most max_s after it."""
    trace = []
    while True:
        age = time.monotonic() - last_create
        trace.append({"s": round(age), "sentry_anon_mb": round(_sentry_anon_mb(a, sids), 1)})
        common.log(f"settling: {trace[-1]}")
        if age >= max_s:
            return {"settled": False, "trace": trace}
        window = [t["sentry_anon_mb"] for t in trace[-STABLE_POLLS:]]
        if age >= min_s and len(window) == STABLE_POLLS and min(window) >= window[0] * 0.99:
            return {"settled": True, "trace": trace}
        time.sleep(POLL_S)


# ---- the breakdown of one sandbox ---------------------------------------------------------------
# Run by `runsc exec` as root in the sandbox's root PID namespace: mount a proc of that namespace
# beside the commands' one and print, per process, its status and smaps summed by kind of mapping.
_BREAKDOWN_SH = r"""
set -e
d=$(mktemp -d)
mount -t proc proc "$d"
for p in "$d"/[0-9]*; do
  [ "$(cat $p/comm)" = sh ] && continue
  awk -v comm="$(cat $p/comm)" -v pid="${p##*/}" '
    FNR == NR { if ($1 == "VmRSS:") rss = $2; if ($1 == "Threads:") thr = $2; next }
    /^[0-9a-f]+-[0-9a-f]+ / { name = ($6 == "") ? "anon" : $6; if (name ~ /^\//) kind = "file"; else kind = name; next }
    $1 == "Rss:" { byk[kind] += $2 }
    $1 == "Anonymous:" { anon += $2 }
    END {
      printf "{\"pid\": %s, \"comm\": \"%s\", \"threads\": %s, \"vm_rss_kb\": %s, \"anonymous_kb\": %d, \"rss_kb_by_mapping\": {", pid, comm, thr, rss, anon
      sep = ""; for (k in byk) { printf "%s\"%s\": %d", sep, k, byk[k]; sep = ", " }
      print "}}"
    }' "$p/status" "$p/smaps"
done
umount "$d"; rmdir "$d"
"""


def breakdown(a: common.Atoll, settle_s: float) -> dict:
    """One sandbox made like the others, taken apart, then deleted."""
    sid = a.create()["id"]
    try:
        a.exec(sid, FIRST)
        time.sleep(settle_s)
        reading = _sandbox_reading(a, sid)
        r = common.run_quiet(
            [common.RUNSC, f"--root={a.runsc_root}", "exec", a.cid(sid), "/bin/sh", "-c", _BREAKDOWN_SH],
            timeout=60,
            check=False,
        )
        procs = []
        for line in r.stdout.decode(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    procs.append(json.loads(line))
                except ValueError:
                    pass
        return {
            "seconds_after_create": settle_s,
            "cgroup_mb": {k: round(v, 2) for k, v in reading.items() if k != "procs"},
            "host_processes": {
                k: {m: (_mb(x) if m != "count" else x) for m, x in v.items()}
                for k, v in reading["procs"].items()
            },
            "runsc_usage_mb": _runsc_usage(a, sid),
            "guest_meminfo_mb": _guest_meminfo(a, sid),
            "guest_processes": procs,
            "runsc_exec_stderr": r.stderr.decode(errors="replace")[-300:] if not procs else "",
        }
    finally:
        a.delete(sid)


# ---- the run -----------------------------------------------------------------------------------
def run(
    a: common.Atoll,
    levels: typing.Sequence[int] = LEVELS,
    settle_s: float = SETTLE_S,
    min_settled_s: float = MIN_SETTLED_S,
    max_settled_s: float = MAX_SETTLED_S,
) -> dict:
    out: dict[str, typing.Any] = {
        "memory_mb_default": True,
        "first_command": FIRST,
        "min_available_mb": MIN_AVAILABLE_MB,
        "levels": [],
    }
    common.log("breakdown of one idle sandbox")
    out["breakdown"] = breakdown(a, settle_s)
    time.sleep(3)
    info = meminfo_kb()
    base = {
        "mem_available_mb": info["MemAvailable"] / 1024,
        "other_atoll_cgroups_mb": other_atoll_cgroups_mb(a.install_id),
        "meminfo_kb": {k: info[k] for k in HOST_FIELDS},
    }
    out["base"] = {
        "mem_available_mb": round(base["mem_available_mb"]),
        "other_atoll_cgroups_mb": round(base["other_atoll_cgroups_mb"]),
        "installation": _installation(a),
    }
    sids: list[str] = []
    try:
        for level in levels:
            stopped = None
            t0 = time.monotonic()
            while len(sids) < level:
                if available_mb() < MIN_AVAILABLE_MB:
                    stopped = f"MemAvailable under {MIN_AVAILABLE_MB} MB at {len(sids)} sandboxes"
                    break
                sid = a.create()["id"]
                sids.append(sid)
                r = a.exec(sid, FIRST)
                if r["exit_code"] != 0:
                    raise RuntimeError(f"{FIRST} failed in {sid}: {r}")
            last_create = time.monotonic()
            how = [s["how"] for s in a.runtime_starts() if s["sandbox_id"] in set(sids)]
            common.log(f"{len(sids)} idle sandboxes (created in {last_create - t0:.0f} s)")
            time.sleep(settle_s)
            entry: dict[str, typing.Any] = {
                "sandboxes": len(sids),
                "created_by": {h: how.count(h) for h in sorted(set(how))},
                "create_s": round(last_create - t0, 1),
            }
            entry["fresh"] = measure(a, sids, base, last_create)
            common.log(f"fresh: {json.dumps(_short(entry['fresh']))}")
            entry["settling"] = wait_settled(a, sids, last_create, min_settled_s, max_settled_s)
            entry["settled"] = measure(a, sids, base, last_create)
            common.log(f"settled: {json.dumps(_short(entry['settled']))}")
            out["levels"].append(entry)
            if stopped:
                out["stopped"] = stopped
                common.log(stopped)
                break
    finally:
        for sid in sids:
            a.api.delete(f"/v1/sandboxes/{sid}")
        for sid in sids:
            a.wait_gone(sid, timeout=120)
    out["summary"] = summary(out)
    return out


def _short(m: dict) -> dict:
    return {
        "mem_available_per_sandbox_mb": m["mem_available"]["per_sandbox_mb"],
        "without_other_atoll_mb": m["mem_available"]["per_sandbox_mb_without_other_atoll"],
        "cgroup_usage_mean_mb": m["cgroup"]["usage"].get("mean"),
        "cgroup_rss_mean_mb": m["cgroup"]["rss"].get("mean"),
        "cgroup_shmem_mean_mb": m["cgroup"]["shmem"].get("mean"),
        "pss_per_sandbox_mb": m["processes"]["pss_total_per_sandbox_mb"],
    }


def summary(out: dict) -> dict:
    """Per level and moment, the three ways side by side (MB per sandbox)."""
    s = {}
    for lv in out["levels"]:
        for moment in ("fresh", "settled"):
            s[f"{lv['sandboxes']}_{moment}"] = _short(lv[moment])
    return s


def _interrupt(signum: int, frame: typing.Any) -> None:
    raise KeyboardInterrupt  # SIGTERM too deletes the sandboxes and stops atoll (the finally blocks)


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="sandbox counts (default 40,200)")
    p.add_argument("--quick", action="store_true", help="5 sandboxes, short waits (a smoke test)")
    p.add_argument("--no-save", action="store_true", help="do not write bench/results/density.json")
    args = p.parse_args()
    levels = (5,) if args.quick else tuple(int(x) for x in args.levels.split(","))
    kw = {"settle_s": 5.0, "min_settled_s": 20.0, "max_settled_s": 40.0} if args.quick else {}
    machine = common.machine_info()
    with common.local_atoll() as a:
        common.warm_up(a)
        res = run(a, levels, **kw)
    doc = {
        "benchmark": "density",
        "timestamp": common.timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
    }
    common.emit(doc)
    if not args.quick and not args.no_save:
        os.makedirs(common.RESULTS, exist_ok=True)
        with open(os.path.join(common.RESULTS, "density.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

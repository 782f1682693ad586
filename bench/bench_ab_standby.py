"""A/B benchmark: disk-tier resume of the foundation's test sandbox, two atoll versions interleaved.

Issue 18 asks whether the disk-tier resume of the sandbox of tests/integration/test_standby.py
(processes, files, a loopback TCP pair) grew between two commits, and where. This starts two
`atoll up` installations side by side, each from its own source tree (PYTHONPATH=<src>, the main
venv's interpreter) and its own template layer cache, and alternates rounds between them
(A B, B A, A B, ...: drift of the machine's load falls on both alike).

One round on one installation:
  - a fresh sandbox (defaults, idle policy off) gets /srv/stateful.py — the STATEFUL program of
    test_standby.py at 4cc704b: a counter, a loopback TCP echo server on 127.0.0.1:7777 with one
    client connected and kept open, an open file, all on threads (no epoll, so the checkpoint gate
    lets it go to disk) — started as a background `python3`, and a file /root/on-disk.txt;
    one ping (the client sends over the TCP pair, the answer comes back through a file) checks that
    it runs ("PING 1 kept open");
  - then two disk cycles, each: POST /pause {"tier": "disk"} (timed: pause_api) → the image size
    (<home>/sandboxes/<id>/snapshot/checkpoint.img) → the checkpointed container's background
    delete is awaited, untimed, as bench_standby does → POST /resume (timed: resume_api) → POST /exec
    ["true"] (timed: first_exec); resume_plus_first_exec is the clock from sending the resume to the
    exec's answer. After each cycle (untimed) a ping must answer "PING <k+1> kept open": the
    processes, the open file and the TCP pair survived. cycle1 is the sandbox's first disk cycle
    (restored from the template image, never checkpointed before); cycle2 is what bench_standby
    times (it runs one untimed warm-up cycle first);
  - the server's own durations for that sandbox from its JSON log: "checkpoint took", "restore
    took N ms (parts)", sandbox.pause_disk.complete and sandbox.resume_disk.complete.

Usage (root; both installations are started and stopped by this script):
  /work/main/.venv/bin/python bench/bench_ab_standby.py \
      --a old=/work/wt-old/src:/var/tmp/atoll-old-templates \
      --b new=/work/wt-new/src:/var/tmp/atoll-test-templates --rounds 8 --out result.json
Prints one JSON document to stdout (and to --out); progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_standby  # noqa: E402
import common as c  # noqa: E402

from atoll.testing import LocalAtoll  # noqa: E402

# tests/integration/test_standby.py (4cc704b), unchanged.
STATEFUL = r"""
import socket, threading, time, os
state = {"n": 0}
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 7777)); srv.listen()
def serve():
    while True:
        c, _ = srv.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()
def handle(c):
    while True:
        d = c.recv(100)
        if not d: return
        state["n"] += 1
        c.sendall(d.upper() + b" %d" % state["n"])
threading.Thread(target=serve, daemon=True).start()
cli = socket.create_connection(("127.0.0.1", 7777))
f = open("/tmp/open-file.txt", "w+")
f.write("kept open")
f.flush()
while True:
    cmd = open("/tmp/ctl").read() if os.path.exists("/tmp/ctl") else ""
    if cmd == "ping":
        os.remove("/tmp/ctl")
        cli.sendall(b"ping")
        reply = cli.recv(100).decode()
        f.seek(0)
        open("/tmp/reply.tmp", "w").write(reply + " " + f.read())
        os.rename("/tmp/reply.tmp", "/tmp/reply")
    time.sleep(0.05)
"""

# The ping of test_standby.py as one python3 command (no shell: the two versions' login profiles differ).
PING = (
    "import os, sys, time\n"
    "if os.path.exists('/tmp/reply'): os.remove('/tmp/reply')\n"
    "open('/tmp/ctl', 'w').write('ping')\n"
    "for _ in range(400):\n"
    "    if os.path.exists('/tmp/reply'):\n"
    "        print(open('/tmp/reply').read(), end=''); sys.exit(0)\n"
    "    time.sleep(0.05)\n"
    "sys.exit(1)\n"
)

EVENTS = {
    "checkpoint_took": "checkpoint took",
    "restore_took": "restore took",
    "pause_disk_complete": "sandbox.pause_disk.complete",
    "resume_disk_complete": "sandbox.resume_disk.complete",
}


def _git_rev(src: str) -> str | None:
    out = subprocess.run(
        ["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return out or None


def _ping(a: c.Atoll, sid: str) -> str:
    r = a.exec(sid, ["python3", "-c", PING])
    if r["exit_code"] != 0:
        raise RuntimeError(f"ping failed: {r}")
    return r["stdout"]


def _disk_cycle(a: c.Atoll, sid: str) -> dict:
    """One disk-tier cycle timed as bench_standby times it (pause, the old container's delete
    awaited, resume, first exec, the stale image dropped)."""
    r = bench_standby._cycle(a, sid, "disk")
    return {
        "pause_api": r["pause"],
        "resume_api": r["resume"],
        "first_exec": r["exec"],
        "resume_plus_first_exec": r["total"],
        "image_mib": r["image"] / 2**20,
    }


def _host_tasks(a: c.Atoll, sid: str) -> int | None:
    """Host tasks in the sandbox's pids cgroup (sentry threads, gofer, ptrace stubs)."""
    try:
        with open(f"/sys/fs/cgroup/pids{a.cgroup(sid)}/pids.current") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _server(a: c.Atoll, sid: str) -> dict:
    out: dict = {}
    for key, prefix in EVENTS.items():
        out[key] = a.server_durations(sid, prefix)
    out["restore_parts"] = a.server_parts(sid, "restore took")
    return out


def one_round(a: c.Atoll, label: str, keep_config: str | None = None) -> dict:
    sb = a.create()
    sid = sb["id"]
    try:
        r = a.api.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "/srv/stateful.py"}, content=STATEFUL.encode()
        )
        if r.status_code not in (200, 201, 204):
            raise RuntimeError(f"upload: {r.status_code} {r.text}")
        a.exec(sid, ["python3", "/srv/stateful.py"], background=True)
        r = a.api.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "/root/on-disk.txt"}, content=b"persisted\n"
        )
        if r.status_code not in (200, 201, 204):
            raise RuntimeError(f"upload: {r.status_code} {r.text}")
        got = _ping(a, sid)
        if got != "PING 1 kept open":
            raise RuntimeError(f"{label}: first ping answered {got!r}")
        guest_ps = None
        if keep_config:
            with contextlib.suppress(OSError):
                shutil.copy(os.path.join(a.home, "sandboxes", sid, "bundle", "config.json"), keep_config)
            # what the image holds: the guest's processes and threads (warm-up round only)
            guest_ps = a.exec(sid, ["ps", "-eLo", "pid,lwp,rss,vsz,args"])["stdout"]
        cgroup_mb = a.memory_usage_mb(sid)
        host_tasks = _host_tasks(a, sid)
        cycles = []
        for k in (1, 2):
            cycles.append(_disk_cycle(a, sid))
            got = _ping(a, sid)
            if got != f"PING {k + 1} kept open":
                raise RuntimeError(f"{label}: ping after disk cycle {k} answered {got!r}")
        f = a.api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/on-disk.txt"})
        if f.content != b"persisted\n":
            raise RuntimeError(f"{label}: /root/on-disk.txt is {f.content!r} after the cycles")
        out = {
            "sandbox_id": sid,
            "cgroup_mb_before": cgroup_mb,
            "host_tasks_before": host_tasks,
            "host_tasks_after": _host_tasks(a, sid),
            "cycles": cycles,
            "server": _server(a, sid),
        }
        if guest_ps is not None:
            out["guest_ps"] = guest_ps
        return out
    finally:
        a.delete(sid)


def _summ(xs: list[float]) -> dict:
    return c.summarize(xs, keep_samples=True)


def summarize_rounds(rows: list[dict]) -> dict:
    out: dict = {}
    for k, name in ((0, "cycle1"), (1, "cycle2")):
        cyc = [r["cycles"][k] for r in rows]
        out[name] = {
            key: c.summarize([x[key] for x in cyc], unit="MiB" if key == "image_mib" else "ms")
            for key in ("pause_api", "resume_api", "first_exec", "resume_plus_first_exec", "image_mib")
        }
        srv: dict = {}
        for key in EVENTS:
            xs = [r["server"][key][k] for r in rows if len(r["server"][key]) > k]
            srv[key] = c.summarize(xs)
        parts: dict = {}
        for r in rows:
            for part, xs in r["server"]["restore_parts"].items():
                if len(xs) > k:
                    parts.setdefault(part, []).append(xs[k])
        srv["restore_parts"] = {p: c.summarize(xs) for p, xs in parts.items()}
        # where the API call's time is spent outside the worker's restore
        http, cp = [], []
        for r in rows:
            step, took = r["server"]["resume_disk_complete"], r["server"]["restore_took"]
            if len(step) > k and len(took) > k:
                http.append(r["cycles"][k]["resume_api"] - step[k])
                cp.append(step[k] - took[k])
        srv["resume_api_minus_server_step"] = c.summarize(http)
        srv["server_step_minus_worker_restore"] = c.summarize(cp)
        out[name]["server"] = srv
    out["host_tasks_before"] = c.summarize(
        [r["host_tasks_before"] for r in rows if r["host_tasks_before"]], unit="tasks"
    )
    out["host_tasks_after"] = c.summarize(
        [r["host_tasks_after"] for r in rows if r["host_tasks_after"]], unit="tasks"
    )
    return out


# A plain runsc holder (bench_standby.runsc_floor) that also starts `extra` more processes of one
# kind: what one more guest process costs `runsc restore` on this host, without atoll.
EXTRA_KINDS = {
    "sleep": "['sleep', '1000000']",  # a small dynamically linked program (coreutils)
    "python": "[sys.executable, '-I', '-S', '-c', 'import time; time.sleep(10**6)']",
}


def procs_floor(extras: list[int], kind: str, n: int) -> dict:
    import bench_standby

    out: dict = {}
    saved = bench_standby.RAW_HOG
    try:
        for k in extras:
            bench_standby.RAW_HOG = (
                "import os, subprocess, sys, time; b = os.urandom({mb} * 2**20); "
                f"ps = [subprocess.Popen({EXTRA_KINDS[kind]}) for _ in range({k})]; "
                "time.sleep(0.5); print('ready', flush=True); time.sleep(10**6)"
            )
            c.log(f"plain runsc floor: holder + {k} {kind} processes")
            out[f"{kind}+{k}"] = bench_standby.runsc_floor(1, n)
    finally:
        bench_standby.RAW_HOG = saved
    return out


def heap_floor(sizes: list[int], n: int) -> dict:
    """The plain runsc floor with a holder of N MB of *compressible* heap (a repeated pattern, like
    an interpreter's heap and unlike bench_standby's random bytes): what guest memory costs
    `runsc restore` when the image file stays small."""
    import bench_standby

    out: dict = {}
    saved = bench_standby.RAW_HOG
    try:
        bench_standby.RAW_HOG = (
            "import time; b = bytearray(b'atoll-heap-' * ({mb} * 2**20 // 11)); "
            "print('ready', flush=True); time.sleep(10**6)"
        )
        for mb in sizes:
            c.log(f"plain runsc floor: holder with {mb} MB of compressible heap")
            out[f"heap{mb}MB"] = bench_standby.runsc_floor(mb, n)
    finally:
        bench_standby.RAW_HOG = saved
    return out


def _spec(s: str) -> tuple[str, str, str]:
    label, rest = s.split("=", 1)
    src, templates = rest.split(":", 1)
    return label, os.path.abspath(src), os.path.abspath(templates)


def start(label: str, src: str, templates: str) -> c.Atoll:
    home = tempfile.mkdtemp(prefix=f"atoll-ab-{label}-", dir=c.BENCH_TMP)
    env = {
        "PYTHONPATH": src,
        "ATOLL_TEMPLATE_DIR": templates,
        "ATOLL_LOG_LEVEL": "INFO",
        "ATOLL_LOG_FORMAT": "json",
    }
    local = LocalAtoll(home=home, env=env)
    c.log(f"{label}: starting atoll up from {src} (home {home}, templates {templates})")
    local.start(timeout=600)
    c.log(f"{label}: up, pid {local.proc.pid if local.proc else None}")
    return c.Atoll(local)


def stop(a: c.Atoll, keep_dir: str | None, label: str) -> None:
    """Delete this installation's sandboxes through its own API, then stop its process group (by
    the PID this script started). No purge with this tree's code: the installation may be another
    version's. Its server log goes to keep_dir; the home is removed when nothing is mounted there."""
    with contextlib.suppress(Exception):
        a.close()
    a.local.reap_sandboxes()
    a.local.stop(reap=False)
    if keep_dir:
        with contextlib.suppress(OSError):
            shutil.copy(a.local.log_path, os.path.join(keep_dir, f"atoll-server-{label}.log"))
    sbx = os.path.join(a.home, "sandboxes")
    left = os.listdir(sbx) if os.path.isdir(sbx) else []
    if not left and not c._has_mounts_under(a.home):
        shutil.rmtree(a.home, ignore_errors=True)
    else:
        c.log(f"{label}: left {a.home} (mounts or sandboxes remain)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", help="label=<src dir>:<template dir>")
    ap.add_argument("--b", help="label=<src dir>:<template dir>")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep-dir", default=None, help="where to copy one bundle config.json per version")
    ap.add_argument(
        "--procs-floor",
        default=None,
        help="only the plain runsc floor with these numbers of extra guest processes, e.g. 0,1,2",
    )
    ap.add_argument("--procs-kind", default="sleep", choices=sorted(EXTRA_KINDS))
    ap.add_argument("--procs-n", type=int, default=5)
    ap.add_argument(
        "--heap-floor", default=None, help="only the plain runsc floor with these MB of compressible heap"
    )
    args = ap.parse_args()
    if args.procs_floor or args.heap_floor:
        if args.heap_floor:
            results = heap_floor([int(x) for x in args.heap_floor.split(",")], args.procs_n)
        else:
            results = procs_floor(
                [int(x) for x in args.procs_floor.split(",")], args.procs_kind, args.procs_n
            )
        doc = {
            "benchmark": "ab_standby.floor",
            "timestamp": c.timestamp(),
            "machine": c.machine_info(),
            "results": results,
        }
        c.emit(doc)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
        return
    specs = [_spec(args.a), _spec(args.b)]
    installs: dict[str, c.Atoll] = {}
    doc: dict = {
        "benchmark": "ab_standby",
        "timestamp": c.timestamp(),
        "machine": c.machine_info(),
        "versions": {
            label: {"src": src, "templates": tpl, "commit": _git_rev(src)} for label, src, tpl in specs
        },
        "rounds": args.rounds,
    }
    rows: dict[str, list[dict]] = {label: [] for label, _, _ in specs}
    load: list[tuple[str, list[float]]] = []
    t_start = time.monotonic()
    try:
        for label, src, tpl in specs:
            installs[label] = start(label, src, tpl)
        for label, a in installs.items():  # warm-up (waits for the template image), untimed
            sb = a.create()
            a.exec(sb["id"], ["true"])
            a.delete(sb["id"])
            keep = os.path.join(args.keep_dir, f"config-{label}.json") if args.keep_dir else None
            doc["versions"][label]["warm_up_round"] = one_round(a, label, keep_config=keep)
            c.log(f"{label}: warm-up round done")
        labels = [label for label, _, _ in specs]
        for i in range(args.rounds):
            order = labels if i % 2 == 0 else labels[::-1]
            for label in order:
                row = one_round(installs[label], label)
                rows[label].append(row)
                cy = row["cycles"]
                c.log(
                    f"round {i + 1}/{args.rounds} {label}: resume {cy[0]['resume_api']:.0f} / "
                    f"{cy[1]['resume_api']:.0f} ms, +exec {cy[0]['resume_plus_first_exec']:.0f} / "
                    f"{cy[1]['resume_plus_first_exec']:.0f} ms, image {cy[0]['image_mib']:.1f} MiB, "
                    f"server {row['server']['restore_took']}"
                )
            load.append((time.strftime("%H:%M:%S"), list(os.getloadavg())))
    finally:
        for label, a in installs.items():
            try:
                stop(a, args.keep_dir, label)
            except Exception as e:  # noqa: BLE001 - report and go on stopping the other one
                c.log(f"stop failed: {e!r}")
    doc["results"] = {label: summarize_rounds(r) for label, r in rows.items() if r}
    doc["raw"] = rows
    doc["loadavg"] = load
    a_label, b_label = specs[0][0], specs[1][0]
    if rows[a_label] and rows[b_label]:
        ratios: dict = {}
        for cyc in ("cycle1", "cycle2"):
            ra, rb = doc["results"][a_label][cyc], doc["results"][b_label][cyc]
            ratios[cyc] = {
                key: {
                    "p50": c.ratio(rb[key], ra[key], "p50"),
                    "p90": c.ratio(rb[key], ra[key], "p90"),
                }
                for key in ("resume_api", "resume_plus_first_exec", "first_exec", "pause_api", "image_mib")
            }
        doc[f"ratio_{b_label}_over_{a_label}"] = ratios
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    c.emit(doc)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

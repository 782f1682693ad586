"""Run every atoll benchmark against one local atoll and write one combined JSON document.

Called by `make bench` (`.venv/bin/python bench/run_all.py`); needs root, runsc and the host tools
`make run` installs. Starts `atoll up` in a fresh home under /var/tmp (template layers from the
shared cache /var/tmp/atoll-test-templates, built at start-up if missing), waits for the server's
template image and does one untimed warm-up create, runs
bench_api, bench_standby, bench_peers, bench_split, bench_templates, bench_files, bench_pty,
bench_shell, bench_cli, bench_default_pool and bench_volumes in that order (bench_peers starts a second atoll with
ATOLL_TEMPLATE_SNAPSHOTS=0 for the cold-boot comparison, bench_split an `atoll server` with one
`atoll worker`, bench_default_pool a second atoll with ATOLL_DEFAULT_POOL=2; bench_templates builds
two user templates in the shared atoll, and deletes them), checks the issues' targets, prints the
document to stdout and saves it to bench/results/latest.json. Progress goes to stderr. Everything
started is reaped: sandboxes by the API and LocalAtoll's exit, peer containers by their modules.
Takes about 17-20 minutes on 2 cores (bench_templates alone ~8, bench_volumes ~5 and ~13 GB
written under /var/tmp). `--quick` runs tiny sample counts (a smoke test, ~1.5 min).
Seven sections run only when named in `--only`: `idle` (bench_idle, ~6 min), `density` (bench_density:
200 idle sandboxes and their memory, ~20 min), `budget` (bench_budget: 100 disk-tier sandboxes over
a disk budget, in two atolls of its own, ~3 min), `workers` (bench_workers: control-plane CPU per
pooled create and creates/s with 1, 2 and 3 workers, on an `atoll server` + 3 `atoll worker`s of
its own, ~4 min; then bench_pool_claims, the same CPU in process over a FakeWorker with 2,000 and
20,000 unrelated sandboxes, ~1 min), `replicas` (bench_replicas: an exec through a second
`atoll server` on the same PostgreSQL, ~30 s), `resume_elsewhere` (bench_resume_elsewhere: a
50 MB sandbox archived by one `atoll worker` resumed on another through a drain, beside the
same-worker archive resume, SeaweedFS on loopback, ~3 min) and `edge` (bench_edge: an exec through
`atoll edge` against one through the API, interleaved, ~1 min).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import typing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_api  # noqa: E402
import bench_budget  # noqa: E402
import bench_cli  # noqa: E402
import bench_default_pool  # noqa: E402
import bench_density  # noqa: E402
import bench_edge  # noqa: E402
import bench_files  # noqa: E402
import bench_idle  # noqa: E402
import bench_peers  # noqa: E402
import bench_pool_claims  # noqa: E402
import bench_pty  # noqa: E402
import bench_replicas  # noqa: E402
import bench_resume_elsewhere  # noqa: E402
import bench_shell  # noqa: E402
import bench_split  # noqa: E402
import bench_standby  # noqa: E402
import bench_templates  # noqa: E402
import bench_volumes  # noqa: E402
import bench_workers  # noqa: E402
import common as c  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

TARGETS = {
    "memory_resume_p50_ms": 5.0,
    "disk_resume_50MB_p50_ms": 300.0,
    "exec_true_p50_ms": 10.0,
    "create_first_exec_over_gvisor_pkg": 1.0,
    # issue 6, the worker seam (section `split`: atoll server + atoll worker beside atoll up)
    "split_exec_true_over_up": 1.25,
    "split_memory_resume_p50_ms": 5.0,
    "split_disk_resume_50MB_over_bare_restore": 1.1,
    "reconcile_200_worker_cpu_ms": 50.0,
    # issue 8, user templates (section `templates`)
    "templates_pooled_python_over_gvisor_pkg": 0.2,
    "templates_snapshot_python_over_gvisor_pkg": 1.0,
    "templates_burst_creates_per_s": 20.0,  # at least
    "templates_fork3_p50_ms": 2000.0,
    # issue 9, idle and lifetime (section `idle`, bench_idle: opt-in, --only idle; ~6 min)
    "idle_cpu_check_200_share_of_core": 0.01,
    # issue 18 item 6, host memory per idle sandbox (section `density`, bench_density: opt-in,
    # --only density; ~20 min)
    "density_settled_mb_per_sandbox": 50.0,
    "density_fresh_mb_per_sandbox": 50.0,
    # issue 9, files (section `files`)
    "files_tar_1000_speedup": 10.0,  # at least
    "files_watch_event_p50_ms": 100.0,
    # issue 9, terminals (section `pty`)
    "pty_keystroke_echo_p50_ms": 15.0,
    # issue 19, volumes and drives (section `volumes`)
    "volumes_seq_write_over_host": 0.5,  # at least
    "volumes_seq_read_over_host": 0.5,  # at least
    "drive_propagation_p50_ms": 100.0,
    # issue 19, the disk budget (section `budget`, bench_budget: opt-in, --only budget; ~3 min)
    "budget_under_after_last_pause_s": 10.0,
    "budget_failed_resumes": 0,
    "budget_running_touched": 0,
    # issue 21, workers (section `workers`, bench_workers: opt-in, --only workers; ~5 min)
    "workers_pooled_create_cpu_ms": 5.0,
    "workers_3_over_1_creates_per_s": 1.0,  # at least
    # issue 21, server replicas (section `replicas`, bench_replicas: opt-in, --only replicas)
    "replicas_exec_b_over_a": 1.1,
    # issue 21, resume on another worker (section `resume_elsewhere`: opt-in, --only resume_elsewhere)
    "resume_elsewhere_50MB_p50_ms": 2000.0,
    # issue 21 item 5, the data path off the control plane (section `edge`: opt-in, --only edge)
    "edge_exec_over_api": 1.1,
}
AT_LEAST = {
    "workers_3_over_1_creates_per_s",
    "templates_burst_creates_per_s",
    "files_tar_1000_speedup",
    "volumes_seq_write_over_host",
    "volumes_seq_read_over_host",
}


def _verdict(name: str, value: float | None, how: str, **extra: typing.Any) -> dict:
    """One target's entry: its limit, the measured value, whether it was met, how it was measured."""
    if name in AT_LEAST:
        met = value is not None and value >= TARGETS[name]
    else:
        met = value is not None and value <= TARGETS[name]
    return {"target": TARGETS[name], "value": value, "met": met, **extra, "how": how}


def check_targets(res: dict) -> dict:
    out: dict = {}
    sb = res.get("standby", {})
    mem = {
        k: v["memory"]["resume_api"]["p50"] for k, v in sb.items() if isinstance(v, dict) and "memory" in v
    }
    if mem:
        worst = max(mem.values())
        out["memory_resume_p50_ms"] = _verdict(
            "memory_resume_p50_ms",
            worst,
            "POST /resume of a memory-tier sandbox (thaw + agent health ping), worst size",
            by_size=mem,
        )
    if "50MB" in sb:
        out["disk_resume_50MB_p50_ms"] = _verdict(
            "disk_resume_50MB_p50_ms",
            sb["50MB"]["disk"]["resume_api"]["p50"],
            "POST /resume of a disk-tier sandbox holding 50 MB (runsc restore + agent health)",
        )
    if "api" in res:
        out["exec_true_p50_ms"] = _verdict(
            "exec_true_p50_ms",
            res["api"]["exec"]["api_exec_true"]["p50"],
            'POST /v1/sandboxes/{id}/exec {cmd: ["true"]} round trip',
        )
    if "peers" in res:
        name = "create_first_exec_over_gvisor_pkg"
        cold = res["peers"]["ratios_p50"]["atoll_cold/gvisor_pkg"]
        out[name] = _verdict(
            name,
            res["peers"]["ratios_p50"]["atoll_image/gvisor_pkg"],
            "p50 of (create + first exec of python3 -c pass) atoll / gvisor package; value: "
            "atoll's default create from the template image, cold_boot_value: a second atoll with "
            "ATOLL_TEMPLATE_SNAPSHOTS=0",
            cold_boot_value=cold,
            cold_boot_met=cold is not None and cold <= TARGETS[name],
        )
    sp = res.get("split", {})
    if "exec_true" in sp:
        out["split_exec_true_over_up"] = _verdict(
            "split_exec_true_over_up",
            sp["exec_true"]["split_over_up"],
            "p50 of exec ['true'] through atoll server + atoll worker / through atoll up, interleaved",
        )
    if "memory_resume_50MB" in sp:
        out["split_memory_resume_p50_ms"] = _verdict(
            "split_memory_resume_p50_ms",
            sp["memory_resume_50MB"]["split"]["p50"],
            "POST /resume of a memory-tier sandbox holding 50 MB through the split",
            up_value=sp["memory_resume_50MB"]["up"]["p50"],
        )
    if "disk_resume_50MB" in sp:
        out["split_disk_resume_50MB_over_bare_restore"] = _verdict(
            "split_disk_resume_50MB_over_bare_restore",
            sp["disk_resume_50MB"]["split_over_same_image_floor"],
            "p50 of POST /resume (disk tier, 50 MB) through the split / a bare runsc restore of a copy of "
            "the same image (its bundle, netns; no quota), interleaved; own_holder_floor: "
            "bench_standby's floor (its own holder, --network=none, no cgroup)",
            own_holder_floor_ratio=sp["disk_resume_50MB"]["split_over_own_holder_floor"],
        )
    if "reconcile" in sp:
        out["reconcile_200_worker_cpu_ms"] = _verdict(
            "reconcile_200_worker_cpu_ms",
            sp["reconcile"]["worker_cpu"]["p50"],
            f"worker CPU of one reconciliation pass over {sp['reconcile']['records']} live sandboxes",
        )
    tp = res.get("templates", {})
    if "create" in tp:
        r = tp["create"]["ratios_p50"]
        out["templates_pooled_python_over_gvisor_pkg"] = _verdict(
            "templates_pooled_python_over_gvisor_pkg",
            r["pooled_python/gvisor_pkg"],
            "p50 of (create claiming a frozen pooled sandbox + first exec of python3 -c pass) / the "
            "gvisor package's cold create + python3 -c pass, interleaved",
        )
        out["templates_snapshot_python_over_gvisor_pkg"] = _verdict(
            "templates_snapshot_python_over_gvisor_pkg",
            r["snapshot_python/gvisor_pkg"],
            "p50 of (create from a user template's snapshot, no pool + first python3 -c pass) / the "
            "gvisor package's, interleaved; base_value: the built-in base template the same way",
            base_value=r["base_python/gvisor_pkg"],
        )
    if "burst" in tp:
        b = tp["burst"]
        rates = [x for x in (b["sequential"]["creates_per_s"], b["threads_4"]["creates_per_s"]) if x]
        out["templates_burst_creates_per_s"] = _verdict(
            "templates_burst_creates_per_s",
            max(rates) if rates else None,
            f"creates/s claiming a full pool of {b['pool_size']} (at least; best of sequential and 4 "
            "threads); the pool refills at refill_per_s afterwards",
            sequential=b["sequential"]["creates_per_s"],
            threads_4=b["threads_4"]["creates_per_s"],
            refill_per_s=b["refill"]["per_s"],
        )
    if "fork" in tp:
        out["templates_fork3_p50_ms"] = _verdict(
            "templates_fork3_p50_ms",
            tp["fork"]["fork_wall"]["p50"],
            f"POST /fork {{count: 3}} of a sandbox holding {tp['fork']['holder_mb']} MiB (a running "
            "python3), wall time",
        )
    idle = res.get("idle", {}).get("levels", [])
    if idle and "check" in idle[-1]:
        last = idle[-1]
        out["idle_cpu_check_200_share_of_core"] = _verdict(
            "idle_cpu_check_200_share_of_core",
            last["check"]["cost_share_of_core"],
            f"CPU of the worker's real Node._sample_cpu per 0.5 s pass over {last['sandboxes']} idle "
            "running gVisor sandboxes, as a share of one core",
            sandboxes=last["sandboxes"],
            whole_process_share=last["process"]["share_of_core"],
        )
    dens = res.get("density", {}).get("levels", [])
    if dens:
        last = dens[-1]
        for moment in ("settled", "fresh"):
            m = last[moment]
            out[f"density_{moment}_mb_per_sandbox"] = _verdict(
                f"density_{moment}_mb_per_sandbox",
                m["mem_available"]["per_sandbox_mb"],
                f"host MemAvailable drop per idle default sandbox (python3 -c pass run once) at "
                f"{last['sandboxes']} sandboxes, {moment} ({m['seconds_since_last_create']} s after the last "
                "create); cgroup_usage_mean_mb: the sandboxes' memory cgroups, pss_mb: their host processes",
                sandboxes=last["sandboxes"],
                cgroup_usage_mean_mb=m["cgroup"]["usage"].get("mean"),
                pss_mb=m["processes"]["pss_total_per_sandbox_mb"],
            )
    fl = res.get("files", {})
    if "upload_1000" in fl:
        up = fl["upload_1000"]
        out["files_tar_1000_speedup"] = _verdict(
            "files_tar_1000_speedup",
            up["speedup_p50"],
            f"p50 of {up['n_files']} single PUT …/files (100 B each, one connection) / p50 of one PUT "
            "…/files/tar of the same files, alternating rounds, same sandbox (at least)",
        )
    if "watch_latency" in fl:
        w = fl["watch_latency"]
        out["files_watch_event_p50_ms"] = _verdict(
            "files_watch_event_p50_ms",
            w["put"]["p50"],
            "PUT …/files of a new file sent → its create line read from an open GET …/files/watch "
            "(an upper bound of write → event); exec_value: the file made by an exec instead",
            exec_value=w["exec"]["p50"],
        )
    if "pty" in res:
        out["pty_keystroke_echo_p50_ms"] = _verdict(
            "pty_keystroke_echo_p50_ms",
            res["pty"]["program_echo_p50_worst_ms"],
            "one byte over the public WebSocket to `cat` in raw mode and back, p50 (worse of back to "
            "back and 100 ms apart)",
        )
    vol = res.get("volumes", {})
    if "seq_io" in vol:
        seq = vol["seq_io"]
        for op in ("write", "read"):
            r = seq["ratios_p50"]
            out[f"volumes_seq_{op}_over_host"] = _verdict(
                f"volumes_seq_{op}_over_host",
                r[f"{op}_volume_over_host_dir"],
                f"p50 MB/s of dd {op} of {seq['size_mb']} MiB (bs=1M; write conv=fsync, read after the host's "
                "caches were dropped) on a volume inside gVisor / the same on a plain host directory, "
                f"{seq['rounds']} rounds interleaved; same_image_value: / the volume's own image mounted on the host",
                same_image_value=r[f"{op}_volume_over_host_volume_image"],
            )
    if "drive" in vol:
        d = vol["drive"]
        out["drive_propagation_p50_ms"] = _verdict(
            "drive_propagation_p50_ms",
            d["both"]["p50"],
            "a 4 KiB file closed in sandbox A → read whole in sandbox B (tight poll), both on one drive, "
            "clocks of the two sentries, both directions alternating; api_value: PUT /v1/drives/…/files "
            "sent → read in a sandbox; filer_value: the same on a drive served by a SeaweedFS filer",
            p95=d["both"]["p95"],
            api_value=d["api_to_sandbox"]["from_put_sent"]["p50"],
            filer_value=vol.get("drive_filer", {}).get("both", {}).get("p50"),
        )
    bud = res.get("budget", {})
    if "budget_enforcement" in bud:
        be = bud["budget_enforcement"]
        n, room = bud["sandboxes"], bud["budget"]["room_for_disk_tier_sandboxes"]
        out["budget_under_after_last_pause_s"] = _verdict(
            "budget_under_after_last_pause_s",
            be["under_budget_after_last_pause_s"],
            f"{n} sandboxes paused to the disk tier two at a time on a worker whose ATOLL_DISK_BUDGET_GB "
            f"holds ~{room}: seconds from the last pause's answer until its sandbox directories add up "
            "to less than the budget (sum of budget.sandbox_disk_bytes, sampled every 0.5 s)",
            archived=be["archived"],
            longest_idle_first=be["archived_are_the_longest_idle"],
            peak_over_budget=be["peak_over_budget"],
        )
        out["budget_failed_resumes"] = _verdict(
            "budget_failed_resumes",
            len(bud["resume"]["failures"]) + (n - bud["resume"]["resumed_ok"]),
            "of the same sandboxes, those whose resume failed or whose holder process did not answer "
            "from memory with its token and pid, with both files intact",
        )
        out["budget_running_touched"] = _verdict(
            "budget_running_touched",
            sum(
                1
                for k in bud["keepers"].values()
                if not k["untouched"] or set(k["states_seen"]) != {"running/None"}
            ),
            "running sandboxes kept beside them whose state, runtime generation, sentry host pid or "
            "counting process changed (or seen not running)",
        )
    wk = res.get("workers", {})
    if "real" in wk:
        cpu = wk["real"]["pooled_create_cpu"]
        out["workers_pooled_create_cpu_ms"] = _verdict(
            "workers_pooled_create_cpu_ms",
            cpu["claim"]["p50"],
            "CPU time of the `atoll server` process (all threads, /proc schedstat) around a POST "
            "/v1/sandboxes that claims a frozen pool member, 3 workers, p50; with_refill: the "
            "server's CPU per create including the keeper's refill (create + exec + pause)",
            p95=cpu["claim"]["p95"],
            with_refill_p50=cpu["with_refill"]["p50"],
        )
        cr = wk["real"]["creates_per_s"]
        out["workers_3_over_1_creates_per_s"] = _verdict(
            "workers_3_over_1_creates_per_s",
            cr["workers_3_over_1"],
            f"non-pooled creates/s ({cr['threads']} client threads, {cr['creates_per_round']} per round) "
            "with 3 workers ready over the same round's 1 worker (the others cordoned), median of the "
            "rounds; all workers share this machine's cores",
            workers_1=cr["workers_1"]["creates_per_s"],
            workers_3=cr["workers_3"]["creates_per_s"],
        )
    rp = res.get("replicas", {})
    if rp:
        out["replicas_exec_b_over_a"] = _verdict(
            "replicas_exec_b_over_a",
            rp["b_over_a"],
            "p50 of exec ['true'] through a second `atoll server` on the same PostgreSQL / through the "
            "server the worker registered with, interleaved; None: B did not serve it (through_b says why)",
            through_b=rp["through_b"],
        )
    ed = res.get("edge", {})
    if ed:
        out["edge_exec_over_api"] = _verdict(
            "edge_exec_over_api",
            ed["edge_over_api"],
            "p50 of exec ['true'] through `atoll edge` (straight to the worker, a cached grant) / through "
            "the API server (which relays it), interleaved",
            via_edge_p50=ed["via_edge"]["p50"],
            via_api_p50=ed["via_api"]["p50"],
        )
    re_ = res.get("resume_elsewhere", {})
    if re_:
        out["resume_elsewhere_50MB_p50_ms"] = _verdict(
            "resume_elsewhere_50MB_p50_ms",
            re_["moved"]["total"]["p50"],
            f"a sandbox holding {re_['held_mb']} MB, archived by one `atoll worker` into SeaweedFS on "
            "loopback: POST /v1/workers/{its worker}/drain, then POST …/exec ['true'] at once (it waits "
            "for the move and resumes it on the other worker), drain POST → exec 200, p50; the same-worker "
            "archive resume beside it",
            p95=re_["moved"]["total"]["p95"],
            same_worker_p50=re_["same_worker"]["resume_exec"]["p50"],
            intact=re_["intact"],
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sample counts (smoke test)")
    ap.add_argument(
        "--only",
        default="api,standby,peers,split,templates,files,pty,shell,cli,default_pool,volumes",
        help="comma-separated subset",
    )
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/latest.json")
    args = ap.parse_args()
    only = set(args.only.split(","))
    q = args.quick
    t0 = time.monotonic()
    doc: dict = {"benchmark": "atoll", "timestamp": c.timestamp(), "machine": c.machine_info(), "results": {}}
    res = doc["results"]
    with c.local_atoll() as a:
        c.warm_up(a)
        if "api" in only:
            c.log("== api: create and exec")
            res["api"] = bench_api.run(a, n_create=3 if q else 10, n_exec=10 if q else 50)
        if "standby" in only:
            c.log("== standby: pause/resume per tier and size")
            res["standby"] = bench_standby.run(
                a,
                sizes=(1, 50) if q else (1, 50, 200),
                n_mem=5 if q else 20,
                n_disk=2 if q else 8,
                n_raw=1 if q else 3,
            )
        if "peers" in only:
            c.log("== peers: create + first command")
            res["peers"] = bench_peers.run(a, n=2 if q else 10)
        if "split" in only:
            c.log("== split: atoll server + atoll worker beside atoll up")
            with bench_split.local_cluster() as split:
                c.warm_up(split)
                res["split"] = bench_split.run(
                    a,
                    split,
                    n_exec=30 if q else 300,
                    n_mem=5 if q else 30,
                    n_disk=2 if q else 8,
                    n_raw=1 if q else 3,
                    records=10 if q else 200,
                    passes=3 if q else 10,
                )
        if "templates" in only:
            c.log("== templates: warm pools, template snapshots, bursts, fork")
            res["templates"] = bench_templates.run(
                a,
                rounds=2 if q else 15,
                burst=8 if q else 40,
                n_fork=1 if q else 5,
                n_floor=1 if q else 2,
            )
        if "idle" in only:
            c.log("== idle: the CPU-activity check at many idle sandboxes")
            res["idle"] = bench_idle.run(a, (5,) if q else bench_idle.LEVELS, passes=6 if q else 40)
        if "density" in only:
            c.log("== density: host memory per idle sandbox")
            res["density"] = bench_density.run(
                a,
                (5,) if q else bench_density.LEVELS,
                **({"settle_s": 5.0, "min_settled_s": 20.0, "max_settled_s": 40.0} if q else {}),
            )
        if "budget" in only:
            c.log("== budget: 100 disk-tier sandboxes over a disk budget (two atolls of its own)")
            res["budget"] = bench_budget.run(**({"n": 12, "keepers": 2, "room": 4} if q else {}))
        if "workers" in only:
            c.log("== workers: control-plane CPU per pooled create, creates/s with 1-3 workers")
            res["workers"] = {
                "real": bench_workers.run(**({"bursts": 2, "rounds": 1, "creates": 4} if q else {})),
                "in_process": [
                    asyncio.run(bench_pool_claims.run(n, 20, 2 if q else 10)) for n in (2000, 20000, 0)
                ],
            }
        if "replicas" in only:
            c.log("== replicas: an exec through a second atoll server on the same PostgreSQL")
            res["replicas"] = bench_replicas.run(20 if q else 200)
        if "edge" in only:
            c.log("== edge: an exec through atoll edge against one through the API")
            res["edge"] = bench_edge.run(20 if q else 300)
        if "resume_elsewhere" in only:
            c.log("== resume_elsewhere: a 50 MB archived sandbox resumed on another worker")
            res["resume_elsewhere"] = bench_resume_elsewhere.run(*((2, 10) if q else (10, 50)))
        if "files" in only:
            c.log("== files: tar upload vs single PUTs, watch latency")
            res["files"] = bench_files.run(a, n_files=1000, rounds=1 if q else 3, n_events=5 if q else 30)
        if "pty" in only:
            c.log("== pty: keystroke echo through the WebSocket")
            res["pty"] = bench_pty.run(a, n_burst=30 if q else 300, n_typed=10 if q else 60)
        if "shell" in only:
            c.log("== shell: bash -l -c against sh -c, stdin round trip")
            res["shell"] = bench_shell.run(a, n=5 if q else 40)
        if "cli" in only:
            c.log("== cli: atoll --version and atoll sandbox exec as whole processes")
            res["cli"] = bench_cli.run(a, n=3 if q else 20)
        if "default_pool" in only:
            c.log("== default_pool: a default create claiming from base's pool vs restoring its snapshot")
            res["default_pool"] = bench_default_pool.run(a, n=2 if q else 10)
        if "volumes" in only:
            c.log("== volumes: volumes and drives against the sandbox's own disk and the host's")
            res["volumes"] = bench_volumes.run(a, **(bench_volumes.QUICK if q else {}))
        doc["template_image_made_ms"] = a.server_durations(None, "template base: image made")
        doc["atoll_server_log_errors"] = [
            r["msg"] for r in a.server_events() if r.get("level") in ("error", "critical")
        ][:20]
    doc["targets"] = check_targets(res)
    doc["quick"] = q
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    c.emit(doc)
    if not args.no_save:
        os.makedirs(RESULTS, exist_ok=True)
        tmp = os.path.join(RESULTS, "latest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, os.path.join(RESULTS, "latest.json"))
        c.log(f"saved {os.path.join(RESULTS, 'latest.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

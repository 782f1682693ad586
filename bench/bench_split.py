"""The control plane ↔ worker seam: what `atoll server` + a separate `atoll worker` cost against
`atoll up`, side by side in one run.

Run standalone (`.venv/bin/python bench/bench_split.py`, root; starts its own `atoll up` and its own
`atoll server` + `atoll worker`) or from bench/run_all.py (section `split`). Prints one JSON document.

  exec_true         POST …/exec {"cmd": ["true"]} on two fresh idle sandboxes, one per deployment,
                    interleaved (up, split, up, split, …); p50 each and split/up
  memory_resume     POST …/resume of a memory-tier sandbox holding 50 MB, 50 ms after the pause
                    (the VM's idle wake-up counted the same way on both), interleaved
  disk_resume_50MB  POST …/resume of a disk-tier sandbox holding 50 MB through each deployment,
                    interleaved with a bare `runsc restore --detach` of the *same image* (a copy of
                    the sandbox's committed snapshot, its own bundle with another cgroup, its
                    network namespace; no CPU quota, no checksum, no atoll), timed until runsc
                    returns; split/floor. Beside it the older floor of bench_standby.runsc_floor (a
                    holder of its own, --network=none, no cgroup), for comparison with earlier runs
  reconcile         POST /v1/workers/{id}/reconcile with N live sandbox records on the worker: the
                    worker's own CPU time for one pass (thread CPU), and its wall time

Traffic goes only to loopback and to the sandboxes' own veth pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import typing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402
from bench_standby import HOG, runsc_floor  # noqa: E402

from atoll.core import ids  # noqa: E402
from atoll.testing import LocalCluster  # noqa: E402
from atoll.worker.host import netns, runsc  # noqa: E402


@contextlib.contextmanager
def local_cluster() -> typing.Iterator[c.Atoll]:
    """`atoll server` + one `atoll worker` in fresh homes under /var/tmp, as a bench `Atoll`."""
    root = tempfile.mkdtemp(prefix="atoll-bench-split-", dir=c.BENCH_TMP)
    env = {"ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR, "ATOLL_LOG_LEVEL": "INFO", "ATOLL_LOG_FORMAT": "json"}
    cl = LocalCluster(root, workers=1, env=env)
    c.log(f"starting atoll server + atoll worker (root {root})")
    cl.start(timeout=600)
    a = c.Atoll(cl)  # type: ignore[arg-type]  (home, url, headers, env: the worker's home)
    try:
        yield a
    finally:
        a.close()
        cl.stop()
        shutil.rmtree(root, ignore_errors=True)


def _hold(a: c.Atoll, sid: str, mb: int) -> None:
    a.exec(sid, ["python3", "-I", "-c", HOG.format(mb=mb)], background=True)
    deadline = time.monotonic() + 120
    while (
        a.api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/.bench-hog-ready"}).status_code != 200
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the holder did not get ready")
        time.sleep(0.2)


def _post(a: c.Atoll, path: str, **body: typing.Any) -> tuple[float, dict]:
    with c.Timer() as t:
        r = a.api.post(path, json=body or None)
    if r.status_code != 200:
        raise RuntimeError(f"POST {path}: {r.status_code} {r.text}")
    return t.ms, r.json()


def exec_true(up: c.Atoll, split: c.Atoll, n: int) -> dict:
    sids = {"up": up.create()["id"], "split": split.create()["id"]}
    by = {"up": up, "split": split}
    xs: dict[str, list[float]] = {"up": [], "split": []}
    try:
        for i in range(n + 20):
            for name in ("up", "split"):
                with c.Timer() as t:
                    r = by[name].api.post(f"/v1/sandboxes/{sids[name]}/exec", json={"cmd": ["true"]})
                if r.status_code != 200 or r.json()["exit_code"] != 0:
                    raise RuntimeError(f"exec on {name}: {r.status_code} {r.text}")
                if i >= 20:  # warm-up
                    xs[name].append(t.ms)
    finally:
        up.delete(sids["up"])
        split.delete(sids["split"])
    out = {k: c.summarize(v) for k, v in xs.items()}
    out["split_over_up"] = c.ratio(out["split"], out["up"])
    c.log(
        f"exec true p50: up {out['up']['p50']:.2f} ms, split {out['split']['p50']:.2f} ms ({out['split_over_up']:.2f}x)"
    )
    return out


def memory_resume(up: c.Atoll, split: c.Atoll, n: int, mb: int = 50) -> dict:
    by = {"up": up, "split": split}
    sids = {name: a.create()["id"] for name, a in by.items()}
    xs: dict[str, list[float]] = {"up": [], "split": [], "up_back_to_back": [], "split_back_to_back": []}
    try:
        for name, a in by.items():
            _hold(a, sids[name], mb)
        for i in range(n + 3):
            for name, a in by.items():
                base = f"/v1/sandboxes/{sids[name]}"
                _, sb = _post(a, base + "/pause", tier="memory")
                assert sb["standby_tier"] == "memory", sb
                time.sleep(0.05)  # as bench_standby: this VM's halted vCPUs cost ~1.5 ms to wake
                ms, sb = _post(a, base + "/resume")
                assert sb["state"] == "running", sb
                if i >= 3:
                    xs[name].append(ms)
                _post(a, base + "/pause", tier="memory")
                ms, sb = _post(a, base + "/resume")  # right after the pause: nothing had time to sleep
                assert sb["state"] == "running", sb
                if i >= 3:
                    xs[name + "_back_to_back"].append(ms)
                time.sleep(0.05)
    finally:
        for name, a in by.items():
            a.delete(sids[name])
    out: dict = {k: c.summarize(v) for k, v in xs.items()}
    out["split_over_up"] = c.ratio(out["split"], out["up"])
    # where the time goes: the control plane's own step and the worker's part of it (its log)
    for name, a in by.items():
        server_log = getattr(a.local, "server", a.local).log_path
        steps = [
            r
            for r in _log_records(server_log)
            if r.get("msg") == "sandbox.resume_memory.complete" and r.get("sandbox_id") == sids[name]
        ][6::2]  # the resumes after 50 ms idle (each round has one, then one back to back)
        out[name + "_parts"] = {
            "server_step_ms": c.summarize([r["duration_ms"] for r in steps], keep_samples=False),
            "worker_ms": c.summarize([r["worker_ms"] for r in steps if "worker_ms" in r], keep_samples=False),
        }
    c.log(
        f"memory resume p50: up {out['up']['p50']:.2f} ms (server step {out['up_parts']['server_step_ms']['p50']:.2f}), "
        f"split {out['split']['p50']:.2f} ms (server step {out['split_parts']['server_step_ms']['p50']:.2f}, "
        f"worker {out['split_parts']['worker_ms']['p50']:.2f})"
    )
    return out


def _log_records(path: str) -> list[dict]:
    out = []
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def bare_restore_same_image(a: c.Atoll, sid: str) -> float:
    """`runsc restore` of a copy of `sid`'s committed snapshot, with its own bundle (another
    container id, runsc root and cgroup) and its network namespace, timed until runsc returns; the
    copy is deleted and eth0 addressed again before the sandbox itself is resumed."""
    work = tempfile.mkdtemp(prefix="atoll-bench-floor-", dir=c.BENCH_TMP)
    sbx = os.path.join(a.home, "sandboxes", sid)
    cid = "atoll-bench-floor-" + secrets.token_hex(4)
    cg = "/" + cid
    root = os.path.join(work, "root")
    name = ids.runtime_name(a.install_id, sid)
    try:
        shutil.copytree(os.path.join(sbx, "snapshot"), os.path.join(work, "img"))
        with open(os.path.join(sbx, "bundle", "config.json")) as f:
            spec = json.load(f)
        spec["linux"]["cgroupsPath"] = cg
        os.makedirs(os.path.join(work, "bundle"))
        with open(os.path.join(work, "bundle", "config.json"), "w") as f:
            json.dump(spec, f)
        asyncio.run(netns.readdress(name))
        with c.Timer() as t:
            asyncio.run(
                runsc.restore(
                    root,
                    os.path.join(work, "bundle"),
                    cid,
                    os.path.join(work, "img"),
                    os.path.join(work, "log"),
                )
            )
        return t.ms
    finally:
        c.run_quiet([c.RUNSC, f"--root={root}", "delete", "-force", cid], check=False)
        for ctl in glob.glob("/sys/fs/cgroup/*/"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(ctl, cg.lstrip("/")))
        asyncio.run(netns.readdress(name))
        shutil.rmtree(work, ignore_errors=True)


def disk_resume(up: c.Atoll, split: c.Atoll, n: int, n_raw: int, mb: int = 50) -> dict:
    by = {"up": up, "split": split}
    sids = {name: a.create()["id"] for name, a in by.items()}
    xs: dict[str, list[float]] = {"up": [], "split": [], "floor_up": [], "floor_split": []}
    try:
        for name, a in by.items():
            _hold(a, sids[name], mb)
        for i in range(n + 1):
            for name, a in by.items():
                sid = sids[name]
                base = f"/v1/sandboxes/{sid}"
                _, sb = _post(a, base + "/pause", tier="disk")
                assert sb["standby_tier"] == "disk", sb
                a.wait_containers_at_most(sid, 0)
                time.sleep(0.3)  # the worker's background delete and readdress of the old container
                floor = bare_restore_same_image(a, sid)
                time.sleep(0.1)
                ms, sb = _post(a, base + "/resume")
                assert sb["state"] == "running", sb
                if i >= 1:
                    xs[name].append(ms)
                    xs["floor_" + name].append(floor)
                snap = os.path.join(a.home, "sandboxes", sid, "snapshot")
                deadline = time.monotonic() + 30
                while os.path.exists(snap) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.1)
    finally:
        for name, a in by.items():
            a.delete(sids[name])
    out: dict = {k: c.summarize(v) for k, v in xs.items()}
    out["split_over_same_image_floor"] = c.ratio(out["split"], out["floor_split"])
    out["up_over_same_image_floor"] = c.ratio(out["up"], out["floor_up"])
    out["runsc_floor_own_holder"] = runsc_floor(mb, n_raw)["restore_detach"]
    out["split_over_own_holder_floor"] = c.ratio(out["split"], out["runsc_floor_own_holder"])
    c.log(
        f"disk resume {mb} MB p50: up {out['up']['p50']:.0f} ms (bare restore of its image "
        f"{out['floor_up']['p50']:.0f}), split {out['split']['p50']:.0f} ms (bare "
        f"{out['floor_split']['p50']:.0f}); own-holder floor {out['runsc_floor_own_holder']['p50']:.0f} ms"
    )
    return out


def reconcile(a: c.Atoll, records: int, passes: int) -> dict:
    wid = a.api.get("/v1/workers").json()["items"][0]["id"]
    sids = []
    try:
        for i in range(records):
            sids.append(a.create(memory_mb=128)["id"])
            if (i + 1) % 50 == 0:
                c.log(f"reconcile: {i + 1} sandboxes")
        wall, cpu = [], []
        for _ in range(passes + 1):
            r = a.api.post(f"/v1/workers/{wid}/reconcile")
            if r.status_code != 200:
                raise RuntimeError(f"reconcile: {r.status_code} {r.text}")
            rep = r.json()["worker"]
            if rep["removed"] or rep["failed"]:
                raise RuntimeError(f"a pass over healthy sandboxes changed something: {rep}")
            wall.append(rep["wall_ms"])
            cpu.append(rep["cpu_ms"])
            time.sleep(0.5)
        out = {
            "records": rep["runtimes"],
            "worker_cpu": c.summarize(cpu[1:]),
            "worker_wall": c.summarize(wall[1:]),
        }
        c.log(
            f"reconcile pass over {rep['runtimes']} runtimes: worker CPU p50 {out['worker_cpu']['p50']:.1f} ms"
        )
        return out
    finally:
        for sid in sids:
            a.api.delete(f"/v1/sandboxes/{sid}")
        for sid in sids:
            a.wait_gone(sid, 120)


SECTIONS = ("exec", "memory", "disk", "reconcile")


def run(
    up: c.Atoll,
    split: c.Atoll,
    n_exec: int = 300,
    n_mem: int = 30,
    n_disk: int = 8,
    n_raw: int = 3,
    records: int = 200,
    passes: int = 10,
    only: typing.Collection[str] = SECTIONS,
) -> dict:
    t0 = time.monotonic()
    out: dict = {}
    if "exec" in only:
        out["exec_true"] = exec_true(up, split, n_exec)
    if "memory" in only:
        out["memory_resume_50MB"] = memory_resume(up, split, n_mem)
    if "disk" in only:
        out["disk_resume_50MB"] = disk_resume(up, split, n_disk, n_raw)
    if "reconcile" in only:
        out["reconcile"] = reconcile(split, records, passes)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default=",".join(SECTIONS), help="comma-separated sections: " + ", ".join(SECTIONS)
    )
    ap.add_argument(
        "--records", type=int, default=200, help="sandboxes on the worker for the reconcile section"
    )
    args = ap.parse_args()
    only = set(args.only.split(","))
    with c.local_atoll() as up, local_cluster() as split:
        c.warm_up(up)
        c.warm_up(split)
        res = run(up, split, records=args.records, only=only)
        c.emit({"benchmark": "split", "when": c.timestamp(), "machine": c.machine_info(), "results": res})


if __name__ == "__main__":
    main()

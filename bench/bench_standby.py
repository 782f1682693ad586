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

disk_runsc_floor (n=3 per size): the same holder under plain runsc without atoll (template rootfs,
--network=none): `runsc checkpoint` until it exits, `runsc restore --detach` until it returns, then
`runsc exec true` — what the disk tier costs before atoll adds its network namespace, bundle,
agent health ping and bookkeeping. No CPU quota: the worker, too, lifts the sandbox's CFS quota for
`runsc checkpoint` and restores without one (it sets `cpus` again once the agent has answered), so
this is the like-for-like floor. disk_runsc_floor_1cpu: the same with a 1-core CFS quota (the
default `cpus`=1) during checkpoint and restore — what the quota would cost if it stayed on, as it
did in atoll before df6432d. host_blake2b: how long the worker's checksum of a checkpoint image
takes per 100 MiB on this host (part of every disk-tier pause).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
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
                n_before = skip["restore"]
                res["server"]["restore_parts"] = {
                    part: c.summarize(v[n_before:], keep_samples=False)
                    for part, v in a.server_parts(sid, "restore took").items()
                }
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


RAW_HOG = "import os, sys, time; b = os.urandom({mb} * 2**20); print('ready', flush=True); time.sleep(10**6)"


def runsc_floor(mb: int, n: int, cpus: float | None = None) -> dict:
    """The disk tier without atoll: plain runsc checkpoint / restore of the same holder program.

    A bundle over the template rootfs (read-only, /tmp tmpfs, --network=none, ptrace) runs the
    N MB holder detached; then n times: `runsc checkpoint` (timed until it exits), `runsc restore
    --detach` under a new container id (timed until it returns: this runsc restores eagerly) and
    `runsc exec true` (timed). Old containers are deleted untimed before the next step.
    Without `cpus` there is no CPU quota, as in atoll's own checkpoint and restore (the worker lifts
    the sandbox's quota for the checkpoint and sets it only after the restored agent answers). With
    `cpus`, the container keeps a CFS quota of that many cores throughout, so the sentry saves and
    loads the image inside it: the cost the worker now avoids.
    """
    rootfs = c.template_rootfs()
    work = tempfile.mkdtemp(prefix="atoll-bench-raw-", dir=c.BENCH_TMP)
    root = os.path.join(work, "root")
    bundle = os.path.join(work, "bundle")
    os.makedirs(bundle)
    spec = c.raw_runsc_spec(
        rootfs, ["python3", "-I", "-c", RAW_HOG.format(mb=mb)], ["PATH=/usr/local/bin:/usr/bin:/bin"]
    )
    cgroup = None
    if cpus:
        cgroup = "/atoll-bench-raw-" + secrets.token_hex(5)
        spec["linux"]["cgroupsPath"] = cgroup
        spec["linux"]["resources"] = {"cpu": {"quota": int(cpus * 100000), "period": 100000}}
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(spec, f)
    flags = [c.RUNSC, f"--root={root}", "--network=none", "--platform=ptrace"]
    log_path = os.path.join(work, "runsc.log")
    cids: list[str] = []

    def runsc(*args: str, timeout: float = 300) -> float:
        with open(log_path, "ab") as lf, c.Timer() as t:
            p = subprocess.run(
                [*flags, *args],
                stdin=subprocess.DEVNULL,
                stdout=lf,
                stderr=lf,
                start_new_session=True,
                timeout=timeout,
                check=False,
            )
        if p.returncode != 0:
            raise RuntimeError(f"runsc {args[0]} exited {p.returncode}: {c.tail_file(log_path)}")
        return t.ms

    def delete(cid: str) -> None:
        c.run_quiet([c.RUNSC, f"--root={root}", "delete", "-force", cid], check=False)

    ckpt, restore, first_exec, image = [], [], [], []
    try:
        cid = "atoll-bench-raw-" + secrets.token_hex(5)
        cids.append(cid)
        runsc("run", "--detach", "--bundle", bundle, cid)
        deadline = time.monotonic() + 120
        while "ready" not in c.tail_file(log_path, 4000):
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw {mb} MB holder not ready: {c.tail_file(log_path)}")
            time.sleep(0.1)
        for i in range(n + 1):  # the first cycle is a warm-up
            img = os.path.join(work, f"img-{i}")
            os.makedirs(img)
            t_ck = runsc("checkpoint", f"--image-path={img}", cid)
            delete(cid)
            size = os.path.getsize(os.path.join(img, "checkpoint.img"))
            cid = "atoll-bench-raw-" + secrets.token_hex(5)
            cids.append(cid)
            t_rs = runsc("restore", "--detach", "--bundle", bundle, f"--image-path={img}", cid)
            t_ex = runsc("exec", cid, "true")
            shutil.rmtree(img, ignore_errors=True)
            if i > 0:
                ckpt.append(t_ck)
                restore.append(t_rs)
                first_exec.append(t_ex)
                image.append(size / 2**20)
            time.sleep(0.2)
        c.log(
            f"raw runsc {mb} MB (cpus {cpus}): checkpoint p50 {c.summarize(ckpt)['p50']:.0f} ms, "
            f"restore p50 {c.summarize(restore)['p50']:.0f} ms"
        )
        return {
            "checkpoint": c.summarize(ckpt),
            "restore_detach": c.summarize(restore),
            "runsc_exec_true_after": c.summarize(first_exec),
            "image_mb": c.summarize(image, unit="MiB", keep_samples=False),
        }
    finally:
        for x in cids:
            delete(x)
        if cgroup:
            for ctl in glob.glob("/sys/fs/cgroup/*/"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(ctl, cgroup.lstrip("/")))
        shutil.rmtree(work, ignore_errors=True)


def blake2b_speed(mb: int = 64, n: int = 3) -> dict:
    """Host-side cost of the worker's image checksum (blake2b, 4 MiB chunks), in ms per 100 MiB."""
    buf = os.urandom(mb * 2**20)
    view = memoryview(buf)
    xs = []
    for _ in range(n):
        with c.Timer() as t:
            h = hashlib.blake2b(digest_size=20)
            for off in range(0, len(buf), 4 * 2**20):
                h.update(view[off : off + 4 * 2**20])
        xs.append(t.ms * 100 / mb)
    return c.summarize(xs, unit="ms per 100 MiB")


def run(
    a: c.Atoll, sizes: tuple[int, ...] = (1, 50, 200), n_mem: int = 20, n_disk: int = 8, n_raw: int = 3
) -> dict:
    t0 = time.monotonic()
    out = {f"{mb}MB": bench_size(a, mb, n_mem, n_disk) for mb in sizes}
    if n_raw:
        for mb in sizes:
            out[f"{mb}MB"]["disk_runsc_floor"] = runsc_floor(mb, n_raw)
            out[f"{mb}MB"]["disk_runsc_floor_1cpu"] = runsc_floor(mb, n_raw, cpus=1)
    out["host_blake2b"] = blake2b_speed()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


if __name__ == "__main__":
    c.run_main(run, "standby")

"""Drain of a worker holding N running sandboxes of 50 MB each: the time until it is evacuated, and
that nothing was lost (issue 21: N=20 within 30 s).

Run standalone as root (`.venv/bin/python bench/bench_drain.py [--n 20] [--quick]`): starts its own
`atoll server` + two `atoll worker`s (w0, w1) sharing an archive directory (ATOLL_ARCHIVE_DIR), makes
N sandboxes on w0 (w1 cordoned meanwhile), each with a process holding 50 MB of random bytes in
memory and a file, then `POST /v1/workers/{w0}/drain` and polls `GET /v1/workers/{w0}` until the
evacuation ends. Prints one JSON document:

  evacuate_s        from the POST until the evacuation said `done` (every sandbox checkpointed,
                    archived, adopted by w1, dropped on w0 and restored there: they are running)
  per_sandbox_s     evacuate_s / N (CONCURRENCY sandboxes move at once)
  moved, left       the evacuation's own counts
  intact            sandboxes on w1, running, whose holder process is the same pid, still alive,
                    and whose file is unchanged (N when nothing was lost)
  first_exec_ms     an exec on each moved sandbox right after (they are running: no resume)

Both workers share this machine's 2 cores (and whatever else runs on it): a drain here is CPU-bound
on checkpoint compression and restore. Traffic goes only to loopback.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402
import httpx  # noqa: E402
from bench_standby import HOG  # noqa: E402

from atoll.controlplane import evacuation  # noqa: E402
from atoll.testing import LocalCluster  # noqa: E402


def _exec(api: httpx.Client, sid: str, cmd: str) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    if r.status_code != 200:
        raise RuntimeError(f"exec on {sid}: {r.status_code} {r.text}")
    return r.json()


def run(n: int, mb: int) -> dict:
    root = tempfile.mkdtemp(prefix="atoll-bench-drain-", dir=c.BENCH_TMP)
    env = {
        "ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR,
        "ATOLL_ARCHIVE_DIR": os.path.join(root, "store"),
        "ATOLL_LOG_LEVEL": "INFO",
        "ATOLL_LOG_FORMAT": "json",
    }
    cl = LocalCluster(os.path.join(root, "cluster"), workers=2, env=env)
    c.log(f"starting atoll server + 2 workers (root {root})")
    cl.start(timeout=900)
    api = httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=600)
    try:
        ids = {w["name"]: w["id"] for w in api.get("/v1/workers").json()["items"]}
        api.post(f"/v1/workers/{ids['w1']}/drain", json={"evacuate": False}).raise_for_status()
        made: dict[str, str] = {}
        c.log(f"making {n} sandboxes holding {mb} MB each on w0")
        for i in range(n):
            sb = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": mb + 128})
            sb.raise_for_status()
            sid = sb.json()["id"]
            api.put(
                f"/v1/sandboxes/{sid}/files", params={"path": "/root/mark"}, content=f"{sid}-{i}".encode()
            )
            api.put(
                f"/v1/sandboxes/{sid}/files",
                params={"path": "/root/hog.py"},
                content=HOG.format(mb=mb).encode(),
            )
            pid = _exec(api, sid, "python3 -I /root/hog.py >/dev/null 2>&1 &\necho $!")["stdout"]
            made[sid] = pid.strip()
        for sid in made:
            deadline = time.monotonic() + 120
            while (
                api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/.bench-hog-ready"}).status_code
                != 200
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the holder of {sid} did not get ready")
                time.sleep(0.2)
        api.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": False}).raise_for_status()

        c.log("draining w0")
        t0 = time.perf_counter()
        r = api.post(f"/v1/workers/{ids['w0']}/drain", json={})
        if r.status_code != 202:
            raise RuntimeError(f"drain: {r.status_code} {r.text}")
        while True:
            w = api.get(f"/v1/workers/{ids['w0']}").json()
            if w["evacuation"]["state"] != "running":
                break
            time.sleep(0.1)
        evacuate_s = time.perf_counter() - t0
        ev = w["evacuation"]

        intact, first_exec = 0, []
        for sid, pid in made.items():
            sb = api.get(f"/v1/sandboxes/{sid}").json()
            with c.Timer() as t:
                out = _exec(api, sid, f"kill -0 {pid} && cat /root/mark")
            first_exec.append(t.ms)
            if (
                sb["worker"] == "w1"
                and sb["state"] == "running"
                and out["exit_code"] == 0
                and out["stdout"].startswith(sid)
            ):
                intact += 1
        return {
            "n": n,
            "mb_each": mb,
            "concurrency": evacuation.CONCURRENCY,
            "evacuate_s": round(evacuate_s, 2),
            "per_sandbox_s": round(evacuate_s / n, 2),
            "moved": ev["moved"],
            "left": ev["left"],
            "intact": intact,
            "evacuated": w["evacuated"],
            "first_exec_ms": c.summarize(first_exec),
            "goal": "N=20 within 30 s, nothing lost (issue 21)",
        }
    finally:
        api.close()
        cl.stop(reap=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="running sandboxes on the drained worker")
    ap.add_argument("--mb", type=int, default=50, help="memory each one's process holds")
    ap.add_argument("--quick", action="store_true", help="4 sandboxes")
    args = ap.parse_args()
    n = 4 if args.quick else args.n
    res = run(n, args.mb)
    c.emit({"benchmark": "drain", "when": c.timestamp(), "machine": c.machine_info(), "results": res})


if __name__ == "__main__":
    main()

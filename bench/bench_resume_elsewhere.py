"""Benchmark: a sandbox archived by one worker resumes on another (issue 21: 50 MB held, p50 ≤ 2 s
on loopback), with the same-worker archive resume measured beside it in the same run.

Run standalone as root (`.venv/bin/python bench/bench_resume_elsewhere.py [--rounds 10] [--mb 50]
[--quick] [--no-save]`) or from bench/run_all.py (`--only resume_elsewhere`). Starts a SeaweedFS
(atoll.testing.seaweed, loopback) and `atoll server` + two `atoll worker`s (w0, w1) archiving into
it over S3 (atoll.testing.LocalCluster). One sandbox (memory_mb 512, auto-standby off) runs a
`python3` holding MB random bytes in memory; the sha256 of those bytes is written once to
/root/sum (its disk). Prints one JSON document (also bench/results/resume_elsewhere.json unless
--no-save or --quick); progress on stderr.

Each round, after one untimed warm-up of each kind (both directions: the first adoption on a worker
may fetch the template's layers from the store), interleaved:

  moved   the sandbox is paused to the archive tier on its worker S (untimed), then what a user
          does to move it: `POST /v1/workers/{S}/drain` (the evacuation: the other worker T adopts
          the archive from the store by reference, under the sandbox's lock; an archived sandbox
          stays archived) and, right after its 202, `POST …/exec ["true"]`, which waits for the
          move (the lock) and resumes the sandbox on T (download, sha256 checks, unpack, `runsc
          restore`, agent). `GET /v1/workers/{S}` is then polled (untimed) until the evacuation is
          `done`, and S undrained. The next round moves it back.
            total            drain POST → the exec's 200 (the figure the target is on)
            exec_wait        exec POST → 200
            evacuation_done  drain POST → `done` seen (includes S dropping its copy, and polling)
            exec_came_first  rounds where the exec beat the evacuation to the lock (it would
                             resume on S, and the evacuation archive it again): expected 0
  same    the peer: paused to the archive tier on its worker, `POST …/exec ["true"]` resumes it
          there (the same download + restore, no move): resume_exec

After every round (untimed) the holder is asked to hash its buffer again (SIGUSR1; it writes the
digest to /tmp/check) and the round counts as `intact` only if that digest, /root/sum and the
digest recorded at the start agree, the pid is the same and the sandbox is running on the expected
worker. `breakdown` = what the processes logged for each resume: the server's step
(`sandbox.resume_archive.complete`, and its worker's share), the new worker's `sandbox.unarchive`
(download + verify + unpack + mount) and `restore took … (prepare, runsc and checksum, agent)`, the
server's `sandbox.moved … (N layer(s) fetched, M ms)` for the adoption.

Both workers, the server and SeaweedFS share this machine's cores (2 here) and whatever else runs
on it: `uptime` before and after is in the document. Traffic goes only to loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402
import httpx  # noqa: E402

from atoll.testing import LocalCluster  # noqa: E402
from atoll.testing.seaweed import SeaweedFS  # noqa: E402

POLL_S = 0.02

HOLDER = """\
import hashlib, os, signal
b = os.urandom({mb} * 2**20)
with open('/root/sum', 'w') as f:
    f.write(hashlib.sha256(b).hexdigest())
def check(*_):
    with open('/tmp/.check', 'w') as f:
        f.write(hashlib.sha256(b).hexdigest())
    os.rename('/tmp/.check', '/tmp/check')
signal.signal(signal.SIGUSR1, check)
open('/tmp/.ready', 'w').close()
while True:
    signal.pause()
"""

CHECK = (
    "rm -f /tmp/check; kill -USR1 {pid} || exit 3; i=0; "
    "while [ ! -e /tmp/check ] && [ $i -lt 1000 ]; do sleep 0.02; i=$((i+1)); done; "
    "cat /tmp/check; echo; cat /root/sum"
)


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def log_events(path: str, sid: str, prefix: str) -> list[dict]:
    """JSON log records of one sandbox whose message starts with `prefix` (oldest first)."""
    out = []
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("sandbox_id") == sid and rec.get("msg", "").startswith(prefix):
                out.append(rec)
    return out


def _ms(msg: str, pattern: str) -> float | None:
    m = re.search(pattern, msg)
    return float(m.group(1)) if m else None


class Bench:
    def __init__(self, cl: LocalCluster, mb: int):
        self.cl = cl
        self.mb = mb
        self.api = httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=600)
        self.ids = {w["name"]: w["id"] for w in self.api.get("/v1/workers").json()["items"]}
        self.logs = {w.name: w.log_path for w in cl.workers}

    # ---- the sandbox ---------------------------------------------------------------------------
    def _exec(self, sid: str, cmd: str | list[str]) -> dict:
        r = self.api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
        if r.status_code != 200:
            raise RuntimeError(f"exec {cmd!r} on {sid}: {r.status_code} {r.text}")
        return r.json()

    def holder(self) -> tuple[str, int, str]:
        """A sandbox on w0 whose process holds `mb` MB of random bytes: (id, pid, their sha256)."""
        self.set_draining("w1", True)
        try:
            r = self.api.post(
                "/v1/sandboxes", json={"idle_timeout_s": 0, "disk_after_s": 0, "memory_mb": 512}
            )
            if r.status_code != 201:
                raise RuntimeError(f"create: {r.status_code} {r.text}")
            sid = r.json()["id"]
        finally:
            self.set_draining("w1", False)
        self.api.put(
            f"/v1/sandboxes/{sid}/files",
            params={"path": "/root/holder.py"},
            content=HOLDER.format(mb=self.mb).encode(),
        ).raise_for_status()
        r = self.api.post(
            f"/v1/sandboxes/{sid}/exec",
            json={"cmd": ["python3", "-I", "/root/holder.py"], "background": True},
        )
        if r.status_code != 200:
            raise RuntimeError(f"holder: {r.status_code} {r.text}")
        pid = r.json()["pid"]
        deadline = time.monotonic() + 120
        while self.api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/.ready"}).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.mb} MB holder of {sid} did not get ready within 120 s")
            time.sleep(0.2)
        digest = self._exec(sid, "cat /root/sum")["stdout"].strip()
        return sid, pid, digest

    def intact(self, sid: str, pid: int, digest: str, worker: str) -> bool:
        sb = self.api.get(f"/v1/sandboxes/{sid}").json()
        out = self._exec(sid, CHECK.format(pid=pid))
        lines = out["stdout"].split()
        ok = (
            sb["worker"] == worker
            and sb["state"] == "running"
            and out["exit_code"] == 0
            and lines == [digest, digest]
        )
        if not ok:
            c.log(f"NOT intact: worker {sb['worker']} (want {worker}), state {sb['state']}, {out}")
        return ok

    def where(self, sid: str) -> str:
        return self.api.get(f"/v1/sandboxes/{sid}").json()["worker"]

    # ---- workers -------------------------------------------------------------------------------
    def set_draining(self, name: str, draining: bool, evacuate: bool = False) -> None:
        body = {"draining": True, "evacuate": evacuate} if draining else {"draining": False}
        r = self.api.post(f"/v1/workers/{self.ids[name]}/drain", json=body)
        if r.status_code not in (200, 202):
            raise RuntimeError(f"drain {name} {body}: {r.status_code} {r.text}")

    def archive(self, sid: str) -> None:
        r = self.api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
        if r.status_code != 200 or r.json()["standby_tier"] != "archive":
            raise RuntimeError(f"pause to archive: {r.status_code} {r.text}")

    # ---- one round of each kind ----------------------------------------------------------------
    def moved(self, sid: str) -> dict:
        src = self.where(sid)
        dst = "w1" if src == "w0" else "w0"
        self.archive(sid)
        pauses = len(log_events(self.cl.server.log_path, sid, "sandbox.pause_archive.started"))
        t0 = c.now_ms()
        r = self.api.post(f"/v1/workers/{self.ids[src]}/drain", json={})
        if r.status_code != 202:
            raise RuntimeError(f"drain {src}: {r.status_code} {r.text}")
        t_exec = c.now_ms()
        self._exec(sid, ["true"])  # waits for the move (the sandbox's lock), resumes it on dst
        t1 = c.now_ms()
        while True:  # untimed: the evacuation's verdict (after the old copy is dropped)
            w = self.api.get(f"/v1/workers/{self.ids[src]}").json()
            if w["evacuation"]["state"] != "running":
                break
            time.sleep(POLL_S)
        t_done = c.now_ms()
        self.set_draining(src, False)
        ev = w["evacuation"]
        if ev["moved"] != 1 or ev["left"]:
            raise RuntimeError(f"the evacuation of {src} did not move the sandbox: {ev}")
        if self.where(sid) != dst:
            raise RuntimeError(f"the sandbox is on {self.where(sid)}, not {dst}")
        out = {
            "from": src,
            "to": dst,
            "total": t1 - t0,
            "drain_api": t_exec - t0,
            "exec_wait": t1 - t_exec,
            "evacuation_done": t_done - t0,
            # the exec did not come first (else it would have resumed the sandbox on src, and the
            # evacuation archived it again)
            "exec_came_first": len(log_events(self.cl.server.log_path, sid, "sandbox.pause_archive.started"))
            > pauses,
            **self.parts(sid, dst),
        }
        adopted = log_events(self.cl.server.log_path, sid, "sandbox.moved")
        if adopted:
            msg = adopted[-1]["msg"]
            out["adopt_ms"] = _ms(msg, r"fetched, ([0-9.]+) ms")
            out["layers_fetched"] = _ms(msg, r"\(([0-9]+) layer")
        return out

    def same(self, sid: str) -> dict:
        here = self.where(sid)
        self.archive(sid)
        t0 = c.now_ms()
        self._exec(sid, ["true"])
        return {"on": here, "resume_exec": c.now_ms() - t0, **self.parts(sid, here)}

    def parts(self, sid: str, worker: str) -> dict:
        """The last resume's parts as the server and the resuming worker logged them (ms)."""
        out: dict = {}
        step = log_events(self.cl.server.log_path, sid, "sandbox.resume_archive.complete")
        if step:
            out["server_step"] = step[-1].get("duration_ms")
            out["worker_share"] = step[-1].get("worker_ms")
        un = log_events(self.logs[worker], sid, "sandbox.unarchive.complete")
        if un:
            msg = un[-1]["msg"]
            out["unarchive"] = _ms(msg, r"in ([0-9.]+) ms")
            # '… (N bytes; manifest a, fetch b, verify c, unpack d, layers e, removal f)'
            m = re.search(r"bytes; ([^)]*)\)", msg)
            for item in m.group(1).split(",") if m else ():
                name, _, ms = item.strip().rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[f"unarchive_{name}"] = float(ms)
        rs = log_events(self.logs[worker], sid, "restore took")
        if rs:
            m = re.match(
                r"restore took ([0-9.]+) ms \(prepare ([0-9.]+), runsc and checksum ([0-9.]+), agent ([0-9.]+)\)",
                rs[-1]["msg"],
            )
            if m:
                out["restore"], out["restore_prepare"], out["restore_runsc"], out["restore_agent"] = map(
                    float, m.groups()
                )
        return out

    def close(self) -> None:
        self.api.close()


def _summaries(rounds: list[dict], keys: tuple[str, ...]) -> dict:
    out = {}
    for k in keys:
        xs = [r[k] for r in rounds if r.get(k) is not None]
        if xs:
            s = c.summarize(xs)
            s["p95"] = round(c.percentile(sorted(xs), 0.95), 3)
            out[k] = s
    return out


def run(rounds: int = 10, mb: int = 50, keep: bool = False) -> dict:
    root = tempfile.mkdtemp(prefix="atoll-bench-resume-elsewhere-", dir=c.BENCH_TMP)
    try:
        return _run(root, rounds, mb)
    finally:
        if keep:
            c.log(f"kept {root} (the processes' logs)")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _run(root: str, rounds: int, mb: int) -> dict:
    load_before = uptime()
    with SeaweedFS(os.path.join(root, "seaweed")) as sw:
        env = {
            "ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR,
            **sw.env(),
            "ATOLL_LOG_LEVEL": "INFO",
            "ATOLL_LOG_FORMAT": "json",
        }
        cl = LocalCluster(os.path.join(root, "cluster"), workers=2, env=env)
        c.log(f"starting SeaweedFS + atoll server + 2 workers (root {root})")
        cl.start(timeout=900)
        b = Bench(cl, mb)
        try:
            sid, pid, digest = b.holder()
            c.log(f"holder {sid} (pid {pid}, {mb} MB) on {b.where(sid)}; warm-up")
            for _ in range(2):  # both directions once (a first adoption may fetch layers)
                w = b.moved(sid)
                if not b.intact(sid, pid, digest, w["to"]):
                    raise RuntimeError("the warm-up move lost the holder's state")
            b.same(sid)
            moved: list[dict] = []
            same: list[dict] = []
            intact = {"moved": 0, "same": 0}
            for i in range(rounds):
                for kind in ("moved", "same") if i % 2 == 0 else ("same", "moved"):
                    if kind == "moved":
                        r = b.moved(sid)
                        moved.append(r)
                        intact["moved"] += b.intact(sid, pid, digest, r["to"])
                    else:
                        r = b.same(sid)
                        same.append(r)
                        intact["same"] += b.intact(sid, pid, digest, r["on"])
                c.log(
                    f"round {i}: moved {moved[-1]['from']}->{moved[-1]['to']} total "
                    f"{moved[-1]['total']:.0f} ms (server step {moved[-1].get('server_step')}, "
                    f"evacuation done after {moved[-1]['evacuation_done']:.0f}); same worker "
                    f"{same[-1]['resume_exec']:.0f} ms"
                )
            keys = (
                "resume_exec",
                "server_step",
                "worker_share",
                "unarchive",
                *(
                    f"unarchive_{p}"
                    for p in (
                        "manifest",
                        "fetch",
                        "verify",
                        "unpack",
                        "verify_unpack",
                        "move",
                        "layers",
                        "removal",
                    )
                ),
                "restore",
                "restore_prepare",
                "restore_runsc",
                "restore_agent",
            )
            res = {
                "held_mb": mb,
                "rounds": rounds,
                "uptime_before": load_before,
                "moved": _summaries(
                    moved, ("total", "drain_api", "exec_wait", "evacuation_done", "adopt_ms", *keys)
                ),
                "exec_came_first": sum(bool(r["exec_came_first"]) for r in moved),
                "same_worker": _summaries(same, keys),
                "intact": intact,
                "layers_fetched": [r.get("layers_fetched") for r in moved],
                "directions": [f"{r['from']}->{r['to']}" for r in moved],
            }
            res["moved_total_over_same_worker"] = c.ratio(
                res["moved"]["total"], res["same_worker"]["resume_exec"]
            )
            res["moved_server_step_over_same_worker"] = c.ratio(
                res["moved"]["server_step"], res["same_worker"]["server_step"]
            )
            res["target_total_p50_ms"] = 2000.0
            res["uptime_after"] = uptime()
            return res
        finally:
            b.close()
            cl.stop(reap=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds of each kind (default 10)")
    ap.add_argument("--mb", type=int, default=50, help="MB the sandbox's process holds (default 50)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 10 MB (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/resume_elsewhere.json")
    ap.add_argument("--keep", action="store_true", help="keep the cluster's directory (its logs) after")
    args = ap.parse_args()
    machine = c.machine_info()
    res = run(2, 10, args.keep) if args.quick else run(args.rounds, args.mb, args.keep)
    doc = {
        "benchmark": "resume_elsewhere",
        "timestamp": c.timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
    }
    c.emit(doc)
    if not (args.quick or args.no_save):
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "resume_elsewhere.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: "create a sandbox and run the first command" — atoll against its peers.

Run standalone (`.venv/bin/python bench/bench_peers.py`, root, starts its own `atoll up`) or from
bench/run_all.py, which calls `run(atoll)`. Prints one JSON document to stdout; progress on stderr.

Every peer runs `python3 -c pass` from the same Debian 12 root filesystem (atoll's cached `base`
template layer, used read-only), with no network, under the same runsc (ptrace). The peers are
interleaved round by round (the order rotates) so that the machine's noise hits all of them alike;
n=10 each after one untimed warm-up each. Tear-down is never timed, and every round waits until the
previous sandbox is gone.

  atoll_image       the atoll under test (server defaults: a create restores the template image,
                    a checkpoint of a booted template sandbox the server made at start-up). Clock:
                    POST /v1/sandboxes sent → 201 (running, agent answered) → POST /exec
                    ["python3", "-c", "pass"] → answer received. Kept-alive httpx client.
  atoll_cold        the same against a second `atoll up` started here with
                    ATOLL_TEMPLATE_SNAPSHOTS=0: every create boots the sandbox cold (`runsc run`).
                    After each timed round, untimed, the cold-boot timeline probe of bench_api.
                    For both, after the clock stopped, a second `python3 -c pass` exec is timed on
                    its own (parts.second_exec_untimed): is a slow first exec a one-time cost?
  atoll_sdk         atoll_image through the Python SDK (`atoll.Client`): sandboxes.create() + sb.exec().
  gvisor_pkg        Google's `gvisor` PyPI package: `gvisor.Sandbox(network="none", mounts=…)`
                    (runsc run --detach of `sleep infinity` in a bundle whose /usr, /bin, /lib,
                    /lib64 and /etc are the template's, read-only; /tmp tmpfs) → `sb.exec("python3",
                    "-c", "pass")` (runsc exec) returned. Closed (runsc kill + delete) untimed.
  runsc_run         plain cold `runsc --network=none --platform=ptrace run --bundle B <id>` of
                    `python3 -c pass` with the template rootfs read-only as the bundle root and /tmp
                    a tmpfs; clock from spawning runsc until it exits (container torn down by runsc).
The ratio atoll_image / gvisor_pkg (p50) is the target "create + first exec ≤ 1.0× the gvisor
package's cold create + run"; atoll_cold / gvisor_pkg is the same for atoll's cold-boot fallback.
Before timing, each atoll's warm-up create must have been made the expected way (common.warm_up
waits for the template image first), and every timed create is checked against the worker's log.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_api  # noqa: E402
import common as c  # noqa: E402

import atoll  # noqa: E402

CMD = ["python3", "-c", "pass"]


def _bundle(rootfs: str) -> str:
    d = tempfile.mkdtemp(prefix="atoll-bench-runsc-", dir=c.BENCH_TMP)
    spec = c.raw_runsc_spec(rootfs, CMD, ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"])
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(spec, f)
    return d


class Peers:
    def __init__(self, a: c.Atoll, cold: c.Atoll, rootfs: str, work: str):
        self.a = a
        self.cold = cold
        self.rootfs = rootfs
        self.bundle = _bundle(rootfs)
        self.runsc_root = os.path.join(work, "runsc-root")
        os.makedirs(self.runsc_root, exist_ok=True)
        self.sdk = atoll.Client(base_url=a.local.url, api_key=a.local.api_key)
        self.split: dict[str, dict[str, list[float]]] = {}
        self.sids: dict[str, list[str]] = {"atoll_image": [], "atoll_cold": []}
        self.timeline = bench_api.CreateTimeline()

    def _note(self, peer: str, part: str, ms: float) -> None:
        self.split.setdefault(peer, {}).setdefault(part, []).append(ms)

    def _atoll(self, peer: str, a: c.Atoll) -> float:
        w0 = time.time()
        t0 = c.now_ms()
        sb = a.create()
        t1 = c.now_ms()
        r = a.exec(sb["id"], CMD)
        t2 = c.now_ms()
        if r["exit_code"] != 0:
            raise RuntimeError(f"{peer}: python3 exited {r['exit_code']}: {r['stderr'][-300:]}")
        self._note(peer, "create", t1 - t0)
        self._note(peer, "first_exec", t2 - t1)
        self._note(peer, "agent_duration_ms", r["duration_ms"])
        self.sids[peer].append(sb["id"])
        # After the clock stopped: a second python3 (is a slow first exec a one-time cost?) and,
        # for cold boots, the timeline probe. The warm-up round (first call) is not probed.
        with c.Timer() as t:
            a.exec(sb["id"], CMD)
        self._note(peer, "second_exec_untimed", t.ms)
        if peer == "atoll_cold" and len(self.sids[peer]) > 1:
            self.timeline.probe(a, sb["id"], w0)
        a.delete(sb["id"])
        return t2 - t0

    def atoll_image(self) -> float:
        return self._atoll("atoll_image", self.a)

    def atoll_cold(self) -> float:
        return self._atoll("atoll_cold", self.cold)

    def atoll_sdk(self) -> float:
        t0 = c.now_ms()
        sb = self.sdk.sandboxes.create(idle_timeout_s=0, disk_after_s=0)
        r = sb.exec(CMD)
        t1 = c.now_ms()
        if r.exit_code != 0:
            raise RuntimeError(f"atoll sdk: python3 exited {r.exit_code}")
        sb.delete()
        self.a.wait_gone(sb.id)
        return t1 - t0

    def gvisor_pkg(self) -> float:
        t0 = c.now_ms()
        sb = c.gvisor_sandbox(self.rootfs)
        try:
            t1 = c.now_ms()
            sb.exec(*CMD, timeout=60)
            t2 = c.now_ms()
        finally:
            sb.close()
        self._note("gvisor_pkg", "create", t1 - t0)
        self._note("gvisor_pkg", "first_exec", t2 - t1)
        return t2 - t0

    def runsc_run(self) -> float:
        cid = "atoll-bench-" + secrets.token_hex(6)
        argv = [c.RUNSC, f"--root={self.runsc_root}", "--network=none", "--platform=ptrace"]
        argv += ["run", "--bundle", self.bundle, cid]
        log = os.path.join(self.bundle, "runsc.log")
        try:
            with open(log, "ab") as lf:
                t0 = c.now_ms()
                p = subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, start_new_session=True, timeout=120
                )
                ms = c.now_ms() - t0
        finally:
            c.run_quiet([c.RUNSC, f"--root={self.runsc_root}", "delete", "-force", cid], check=False)
        if p.returncode != 0:
            with open(log, errors="replace") as f:
                raise RuntimeError(f"runsc run exited {p.returncode}: {f.read()[-500:]}")
        return ms

    def close(self) -> None:
        self.sdk.close()
        shutil.rmtree(self.bundle, ignore_errors=True)


def run(a: c.Atoll, n: int = 10) -> dict:
    t_start = time.monotonic()
    rootfs = c.template_rootfs()
    work = tempfile.mkdtemp(prefix="atoll-bench-peers-", dir=c.BENCH_TMP)
    with c.local_atoll(env={"ATOLL_TEMPLATE_SNAPSHOTS": "0"}) as cold:
        c.warm_up(cold)
        peers = Peers(a, cold, rootfs, work)
        try:
            return _run(a, cold, peers, n, t_start)
        finally:
            peers.close()
            shutil.rmtree(work, ignore_errors=True)


def _run(a: c.Atoll, cold: c.Atoll, peers: Peers, n: int, t_start: float) -> dict:
    with c.gvisor_sandbox(peers.rootfs) as sb:  # untimed: prove the package runs the template's files
        if not c.gvisor_sees_template(sb, peers.rootfs):
            raise RuntimeError("the gvisor package's sandbox does not see the template's /usr/bin")
    fns = {
        "atoll_image": peers.atoll_image,
        "atoll_cold": peers.atoll_cold,
        "atoll_sdk": peers.atoll_sdk,
        "gvisor_pkg": peers.gvisor_pkg,
        "runsc_run": peers.runsc_run,
    }
    names = list(fns)
    for name in names:  # one untimed warm-up each (page cache, runsc binary)
        fns[name]()
    samples: dict[str, list[float]] = {k: [] for k in names}
    for i in range(n):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            samples[name].append(fns[name]())
        c.log(f"peers round {i + 1}/{n}: " + ", ".join(f"{k} {samples[k][-1]:.0f} ms" for k in names))
    out: dict = {k: c.summarize(v) for k, v in samples.items()}
    for k in ("atoll_image", "atoll_cold", "gvisor_pkg"):
        # The warm-up's parts are dropped so that they match the n timed samples.
        out[k]["parts"] = {p: c.summarize(v[1:]) for p, v in peers.split[k].items()}
    for k, atl, want in (("atoll_image", a, "template image"), ("atoll_cold", cold, "cold boot")):
        out[k]["worker"] = bench_api.runtime_start_summary(atl, peers.sids[k][1:])
        made = out[k]["worker"]["created_by"]
        if set(made) != {want}:
            raise RuntimeError(f"{k}: timed creates were made by {made}, expected only {want!r}")
    out["atoll_cold"].update(peers.timeline.result())
    out["ratios_p50"] = {
        "atoll_image/gvisor_pkg": c.ratio(out["atoll_image"], out["gvisor_pkg"]),
        "atoll_cold/gvisor_pkg": c.ratio(out["atoll_cold"], out["gvisor_pkg"]),
        "atoll_sdk/gvisor_pkg": c.ratio(out["atoll_sdk"], out["gvisor_pkg"]),
        "atoll_image/atoll_cold": c.ratio(out["atoll_image"], out["atoll_cold"]),
        "atoll_image/runsc_run": c.ratio(out["atoll_image"], out["runsc_run"]),
        "gvisor_pkg/runsc_run": c.ratio(out["gvisor_pkg"], out["runsc_run"]),
    }
    out["ratios_mean"] = {
        "atoll_image/gvisor_pkg": c.ratio(out["atoll_image"], out["gvisor_pkg"], "mean"),
        "atoll_cold/gvisor_pkg": c.ratio(out["atoll_cold"], out["gvisor_pkg"], "mean"),
    }
    out["cold_server_log_errors"] = [
        r["msg"] for r in cold.server_events() if r.get("level") in ("error", "critical")
    ][:20]
    out["target_atoll_over_gvisor_pkg_max"] = 1.0
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


if __name__ == "__main__":
    c.run_main(run, "peers")

"""Benchmark: "create a sandbox and run the first command" — atoll against its peers.

Run standalone (`.venv/bin/python bench/bench_peers.py`, root, starts its own `atoll up`) or from
bench/run_all.py, which calls `run(atoll)`. Prints one JSON document to stdout; progress on stderr.

Every peer runs `python3 -c pass` from the same Debian 12 root filesystem (atoll's cached `base`
template layer, used read-only), with no network, under the same runsc (ptrace). The peers are
interleaved round by round (the order rotates) so that the machine's noise hits all of them alike;
n=8 each. Tear-down is never timed, and every round waits until the previous sandbox is gone.

  atoll             clock: POST /v1/sandboxes sent → 201 (running, agent answered) → POST /exec
                    ["python3", "-c", "pass"] → answer received. Kept-alive httpx client.
  atoll_sdk         the same through the Python SDK (`atoll.Client`): sandboxes.create() + sb.exec().
  gvisor_pkg        Google's `gvisor` PyPI package: `gvisor.Sandbox(network="none", mounts=…)`
                    (runsc run --detach of `sleep infinity` in a bundle whose /usr, /bin, /lib,
                    /lib64 and /etc are the template's, read-only; /tmp tmpfs) → `sb.exec("python3",
                    "-c", "pass")` (runsc exec) returned. Closed (runsc kill + delete) untimed.
  runsc_run         plain cold `runsc --network=none --platform=ptrace run --bundle B <id>` of
                    `python3 -c pass` with the template rootfs read-only as the bundle root and /tmp
                    a tmpfs; clock from spawning runsc until it exits (container torn down by runsc).
The ratio atoll / gvisor_pkg (p50) is the issue's target "create + first exec ≤ 1.0× the gvisor
package's cold create + run".
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

import common as c  # noqa: E402

import atoll  # noqa: E402

CMD = ["python3", "-c", "pass"]


def _bundle(rootfs: str) -> str:
    d = tempfile.mkdtemp(prefix="atoll-bench-runsc-", dir=c.BENCH_TMP)
    spec = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": CMD,
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "cwd": "/",
        },
        "root": {"path": rootfs, "readonly": True},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts", "network")],
        },
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(spec, f)
    return d


class Peers:
    def __init__(self, a: c.Atoll, rootfs: str, work: str):
        self.a = a
        self.rootfs = rootfs
        self.bundle = _bundle(rootfs)
        self.runsc_root = os.path.join(work, "runsc-root")
        os.makedirs(self.runsc_root, exist_ok=True)
        self.sdk = atoll.Client(base_url=a.local.url, api_key=a.local.api_key)
        self.split: dict[str, dict[str, list[float]]] = {}

    def _note(self, peer: str, part: str, ms: float) -> None:
        self.split.setdefault(peer, {}).setdefault(part, []).append(ms)

    def atoll(self) -> float:
        t0 = c.now_ms()
        sb = self.a.create()
        t1 = c.now_ms()
        r = self.a.exec(sb["id"], CMD)
        t2 = c.now_ms()
        if r["exit_code"] != 0:
            raise RuntimeError(f"atoll: python3 exited {r['exit_code']}: {r['stderr'][-300:]}")
        self._note("atoll", "create", t1 - t0)
        self._note("atoll", "first_exec", t2 - t1)
        self._note("atoll", "agent_duration_ms", r["duration_ms"])
        self.a.delete(sb["id"])
        return t2 - t0

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


def run(a: c.Atoll, n: int = 8) -> dict:
    t_start = time.monotonic()
    rootfs = c.template_rootfs()
    work = tempfile.mkdtemp(prefix="atoll-bench-peers-", dir=c.BENCH_TMP)
    peers = Peers(a, rootfs, work)
    try:
        with c.gvisor_sandbox(rootfs) as sb:  # untimed: prove the package runs the template's files
            if not c.gvisor_sees_template(sb, rootfs):
                raise RuntimeError("the gvisor package's sandbox does not see the template's /usr/bin")
        fns = {
            "atoll": peers.atoll,
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
        for k in ("atoll", "gvisor_pkg"):
            # The warm-up's parts are dropped so that they match the n timed samples.
            out[k]["parts"] = {p: c.summarize(v[1:]) for p, v in peers.split[k].items()}
        out["ratios_p50"] = {
            "atoll/gvisor_pkg": c.ratio(out["atoll"], out["gvisor_pkg"]),
            "atoll_sdk/gvisor_pkg": c.ratio(out["atoll_sdk"], out["gvisor_pkg"]),
            "atoll/runsc_run": c.ratio(out["atoll"], out["runsc_run"]),
            "gvisor_pkg/runsc_run": c.ratio(out["gvisor_pkg"], out["runsc_run"]),
        }
        out["ratios_mean"] = {"atoll/gvisor_pkg": c.ratio(out["atoll"], out["gvisor_pkg"], "mean")}
        out["target_atoll_over_gvisor_pkg_max"] = 1.0
        out["wall_s"] = round(time.monotonic() - t_start, 1)
        return out
    finally:
        peers.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    c.run_main(run, "peers")

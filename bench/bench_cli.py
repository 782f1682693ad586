"""Benchmark: what a command of the `atoll` CLI costs as a whole process, beside its floors, in one run.

Run standalone (`.venv/bin/python bench/bench_cli.py`, root, starts its own `atoll up`, writes
bench/results/cli.json) or from bench/run_all.py (section `cli`), which calls `run(atoll)`. Prints
one JSON document; progress on stderr. Loopback only.

  version         `atoll --version` (the console script of this interpreter's environment)
  exec_true       `atoll sandbox exec ID -- true`, standard input /dev/null
  python_floor    `python -c pass`, the same interpreter: what any Python CLI pays
  curl_exec_true  `curl` POSTing the same exec (`["true"]`): the request without Python (if curl)
  api_exec_true   the same exec over this process's kept-alive client: the server's part
Each round runs every variant once (order rotated, one untimed warm-up each). Per process: wall
time from spawn to reaped and its CPU time (user + sys, from wait4's rusage).
Targets (docs/specification.md #23, #24): version p50 ≤ 150 ms, exec_true p50 ≤ 250 ms.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

ATOLL = os.path.join(os.path.dirname(sys.executable), "atoll")


def _spawn(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Run argv to completion: (wall ms, CPU ms, exit status)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = (time.perf_counter() - t0) * 1000
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, (usage.ru_utime + usage.ru_stime) * 1000, proc.returncode


def run(a: c.Atoll, n: int = 20) -> dict:
    sb = a.create()
    sid = sb["id"]
    env = {**os.environ, "ATOLL_URL": a.local.url, "ATOLL_API_KEY": a.local.api_key}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: bytecode cached
    variants: dict[str, list[str] | None] = {
        "version": [ATOLL, "--version"],
        "exec_true": [ATOLL, "sandbox", "exec", sid, "--", "true"],
        "python_floor": [sys.executable, "-c", "pass"],
        "api_exec_true": None,
    }
    curl = shutil.which("curl")
    if curl:
        variants["curl_exec_true"] = [
            curl, "-sf", "-o", "/dev/null", "-H", f"Authorization: Bearer {a.local.api_key}",
            "-H", "Content-Type: application/json", "-d", json.dumps({"cmd": ["true"]}),
            f"{a.local.url}/v1/sandboxes/{sid}/exec",
        ]  # fmt: skip
    names = list(variants)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names if variants[k] is not None}
    try:
        for i in range(n + 1):  # round 0 is the warm-up
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                argv = variants[name]
                if argv is None:
                    with c.Timer() as t:
                        a.exec(sid, ["true"])
                    ms, cpu_ms, rc = t.ms, None, 0
                else:
                    ms, cpu_ms, rc = _spawn(argv, env)
                if rc != 0:
                    raise RuntimeError(f"{name}: exit status {rc}")
                if i:
                    wall[name].append(ms)
                    if cpu_ms is not None:
                        cpu[name].append(cpu_ms)
    finally:
        a.delete(sid)
    out = {
        "wall": {k: c.summarize(v) for k, v in wall.items()},
        "cpu": {k: c.summarize(v) for k, v in cpu.items()},
    }
    w = out["wall"]
    out["targets"] = {
        "version_p50_ms": {"value": w["version"]["p50"], "target": 150, "met": w["version"]["p50"] <= 150},
        "exec_true_p50_ms": {
            "value": w["exec_true"]["p50"],
            "target": 250,
            "met": w["exec_true"]["p50"] <= 250,
        },
    }
    out["ratios"] = {
        "version_over_python_floor": c.ratio(w["version"], w["python_floor"]),
        "exec_true_over_api_exec_true": c.ratio(w["exec_true"], w["api_exec_true"]),
    }
    if "curl_exec_true" in w:
        out["ratios"]["exec_true_over_curl_exec_true"] = c.ratio(w["exec_true"], w["curl_exec_true"])
    return out


def main() -> int:
    return c.run_main_sized(run, "cli", __doc__.split("\n")[0], full={"n": 20}, quick={"n": 3})


if __name__ == "__main__":
    sys.exit(main())

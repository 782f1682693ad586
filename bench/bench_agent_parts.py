"""Benchmark: what the guest agent's building blocks cost inside a gVisor sandbox, beside the same
on the host (the peer: no gVisor) in one run — the figures that decide how the agent starts a
command (docs/benchmarks.md: "`Start`'s extra hops, traced", "The SDK's deadline").

Run standalone (`.venv/bin/python bench/bench_agent_parts.py [--quick] [--no-save]`, root,
starts its own `atoll up`, writes bench/results/agent_parts.json). Prints one JSON document;
progress on stderr. Loopback only: the sandbox has no network policy and the snippet opens no
socket.

One Python snippet (the sandbox's python3 and the host's python, `-I -S`) times each of these
`n` times after a warm-up and prints the p50 and p90 in µs:

  timer_start_cancel   `threading.Timer(60, f)`, `start()`, `cancel()`: a thread started per
                       deadline (what the agent did before `deadlines.DEADLINES`)
  deadline_schedule    the agent's own `deadlines.Deadlines` (its source, sent with the snippet):
                       `call_later(60, f)` then `cancel()` — what a background command's deadline
                       costs now (a heap entry; its thread is woken only for a new earliest one)
  pool_handoff         `ThreadPoolExecutor.submit(f).result()`: a hand-off to a pooled thread and back
  pipe                 `os.pipe2` + two closes (a background command's stdin pipe, its exit wake)
  eventfd              `os.eventfd` + a close
  log_file             open (create), rename, close, unlink in /tmp (a background command's log)
  getpid               one cheap syscall (the floor of a syscall)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

DEADLINES_PY = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "src",
    "atoll",
    "guest",
    "agent",
    "deadlines.py",
)

SNIPPET = r"""
import concurrent.futures as cf, json, os, statistics, sys, tempfile, threading, time
N = int(sys.argv[1])
def timed(f):
    f(-1)
    xs = []
    for i in range(N):
        t = time.perf_counter(); f(i); xs.append((time.perf_counter() - t) * 1e6)
    xs.sort()
    return {"p50_us": round(statistics.median(xs), 1), "p90_us": round(xs[int(0.9 * (len(xs) - 1))], 1)}
def timer(i):
    t = threading.Timer(60, lambda: None); t.daemon = True; t.start(); t.cancel()
scheduler = Deadlines()
def deadline(i):
    scheduler.call_later(60, lambda: None).cancel()
pool = cf.ThreadPoolExecutor(2)
def handoff(i):
    pool.submit(lambda: None).result()
def pipe(i):
    r, w = os.pipe2(os.O_CLOEXEC); os.close(r); os.close(w)
def efd(i):
    os.close(os.eventfd(0, os.EFD_CLOEXEC))
d = tempfile.mkdtemp(dir="/tmp")
def log_file(i):
    a, b = f"{d}/spawn-{i}.log", f"{d}/proc-{i}.log"
    fd = os.open(a, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
    os.replace(a, b); os.close(fd); os.unlink(b)
print(json.dumps({
    "timer_start_cancel": timed(timer), "deadline_schedule": timed(deadline), "pool_handoff": timed(handoff),
    "pipe": timed(pipe), "eventfd": timed(efd), "log_file": timed(log_file), "getpid": timed(lambda i: os.getpid()),
}))
"""


def _snippet() -> str:
    """SNIPPET after the agent's deadlines module (its relative import of `log` replaced)."""
    src = open(DEADLINES_PY).read().replace("from .common import log", "log = print")
    return src + "\n" + SNIPPET


def _parts(out: str, where: str) -> dict:
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"{where}: the snippet printed no JSON: {out[-500:]!r}") from None


def run(a: c.Atoll, n: int = 300) -> dict:
    sb = a.create()
    sid = sb["id"]
    try:
        c.log(f"agent parts: in the sandbox x{n}")
        r = a.exec(sid, ["python3", "-I", "-S", "-c", _snippet(), str(n)], timeout_s=600)
        if r["exit_code"] != 0:
            raise RuntimeError(f"in the sandbox: exit {r['exit_code']}: {r['stderr'][-500:]}")
        sandbox = _parts(r["stdout"], "in the sandbox")
    finally:
        a.delete(sid)
    c.log(f"agent parts: on the host x{n}")
    host = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _snippet(), str(n)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    native = _parts(host.stdout, "on the host")
    out = {"n": n, "sandbox": sandbox, "host": native, "sandbox_over_host_p50": {}}
    for k, v in sandbox.items():
        base = native[k]["p50_us"]
        out["sandbox_over_host_p50"][k] = round(v["p50_us"] / base, 1) if base else None
        c.log(f"  {k:20} sandbox {v['p50_us']:9.1f} us   host {base:8.1f} us")
    return out


def main() -> int:
    return c.run_main_sized(run, "agent_parts", __doc__.split("\n")[0], full={"n": 300}, quick={"n": 20})


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: sandbox create latency and the exec round trip of `true`, with its parts and peers.

Run standalone (`.venv/bin/python bench/bench_api.py`, root, starts its own `atoll up`) or from
bench/run_all.py, which calls `run(atoll)`. Prints one JSON document to stdout; progress on stderr.

Measured (wall clock on the caller's side, `perf_counter_ns`, kept-alive httpx client on loopback):
  create            POST /v1/sandboxes sent → 201 received (sandbox running, its guest agent has
                    answered a health ping). n=10; each sandbox is deleted afterwards, untimed, and
                    the next create waits until the background `runsc delete` is done. With the
                    server's defaults a create restores the template image; `created_by` counts
                    what the worker logged ("template image" / "cold boot").
  exec, interleaved per round (n=50 after 5 warm-ups of each):
    api_exec_true        POST /v1/sandboxes/{id}/exec {"cmd": ["true"]} → 200
    agent_exec_true      the same request sent straight to the guest agent (no API / control plane)
    agent_health         GET /health straight to the guest agent (network + agent, no spawn)
    api_get_sandbox      GET /v1/sandboxes/{id} (HTTP + FastAPI + auth + record; no agent)
    runsc_exec_true      `runsc --root <home>/runsc exec <cid> true` on the same atoll sandbox
    gvisor_pkg_exec_true `gvisor.Sandbox.exec("true")` (the PyPI package; it shells out to runsc exec)
                         on its own sandbox over the same Debian rootfs
  agent_duration_ms  the agent's own `duration_ms` of each API exec (spawn → exit → pipes closed;
                     whole milliseconds)
Where the time goes (untimed probes next to the timed loops):
  create.timeline_ms_after_post  per cold-boot create only (null for template-image creates, whose
                     uptime is the image's): when the sentry's kernel started, when the agent's
                     python3 (PID 1) started and when the agent was ready, against the POST's clock
  in_sandbox / on_host  spawn and syscall costs measured by one Python script inside the sandbox and
                     on the host
  python_startup_in_sandbox  `python3 -c pass` and the agent's start up to listening, inside gVisor,
                     both as plain `-I` from sources and the way it starts (`-I -S`, agent.pyc)
  memory_tier_floor  freezer cgroup FROZEN / THAWED written directly + GET /health to the agent: the
                     memory tier without atoll's API and control plane
  host_fsync_ms      write + fsync + rename of a small file in ATOLL_HOME (the worker does this for
                     runtime.json on create, checkpoint, restore and delete; freeze and thaw write
                     no file)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

# Runs inside the sandbox (and on the host for comparison): per-operation cost in ms.
SPAWN_PROBE = r"""
import json, os, subprocess, time
def t(f, n):
    xs = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); xs.append((time.perf_counter() - t0) * 1000)
    xs.sort(); return {"p50": round(xs[len(xs) // 2], 3), "min": round(xs[0], 3), "n": n}
def spawn():
    pid = os.posix_spawn("/usr/bin/true", ["true"], os.environ); os.waitpid(pid, 0)
def syscalls():
    for _ in range(1000): os.getppid()
print(json.dumps({
    "subprocess_run_true_ms": t(lambda: subprocess.run(["/usr/bin/true"]), 30),
    "posix_spawn_wait_true_ms": t(spawn, 30),
    "syscall_getppid_us": t(syscalls, 5)["p50"],
}))
"""


def bench_create(a: c.Atoll, n: int = 10) -> dict:
    """n creates on `a` (template image unless the server runs with ATOLL_TEMPLATE_SNAPSHOTS=0)."""
    samples, sids = [], []
    timeline = CreateTimeline()
    for i in range(n):
        w0 = time.time()
        with c.Timer() as t:
            sb = a.create()
        if sb["state"] != "running":
            raise RuntimeError(f"create returned state {sb['state']}")
        samples.append(t.ms)
        sids.append(sb["id"])
        timeline.probe(a, sb["id"], w0)
        a.delete(sb["id"])
        c.log(f"create {i + 1}/{n}: {t.ms:.0f} ms")
    server_create = [x for sid in sids for x in a.server_durations(sid, "sandbox.create.complete")]
    out = {
        "create_api": c.summarize(samples),
        "server_create_step": c.summarize(server_create),
        **runtime_start_summary(a, sids),
        "notes": "server_create_step: the control plane's create step (worker create incl. template "
        "check, overlay, netns, runsc restore of the template image or runsc run, agent health, identity); "
        "server_runtime_start: the worker's part from the upper layer to the agent's answer, with its "
        "parts as the worker logs them (rootfs+netns set up concurrently; runsc = `runsc restore` of the "
        "template image or `runsc run` of a cold boot; agent = health ping, plus the /identity call "
        "after an image restore). created_by counts the worker's 'by template image|cold boot'.",
    }
    out.update(timeline.result())
    return out


def runtime_start_summary(a: c.Atoll, sids: list[str]) -> dict:
    """The worker's create lines of `sids`: how each was made, its duration and its parts."""
    starts = [r for sid in sids for r in a.runtime_starts(sid)]
    parts: dict[str, list[float]] = {}
    for r in starts:
        for k, v in r["parts"].items():
            parts.setdefault(k, []).append(v)
    created_by: dict[str, int] = {}
    for r in starts:
        created_by[r["how"]] = created_by.get(r["how"], 0) + 1
    return {
        "created_by": created_by,
        "server_runtime_start": c.summarize([r["ms"] for r in starts]),
        "server_runtime_start_parts": {k: c.summarize(v, keep_samples=False) for k, v in parts.items()},
    }


class CreateTimeline:
    """Untimed probes after cold-boot creates: when the sentry's kernel, PID 1 and the agent started.

    Only meaningful for a cold boot: a sandbox restored from a template image carries the image's
    /proc/uptime and PID 1 start time, so creates the worker logged 'by template image' are skipped.
    """

    KEYS = ("sentry_boot", "agent_pid1_start", "agent_ready")

    def __init__(self) -> None:
        self.xs: dict[str, list[float]] = {k: [] for k in self.KEYS}
        self.skipped = 0

    def probe(self, a: c.Atoll, sid: str, w0: float) -> None:
        if [r["how"] for r in a.runtime_starts(sid)] != ["cold boot"]:
            self.skipped += 1
            return
        for k, v in _create_timeline(a, sid, w0).items():
            self.xs[k].append(v)

    def result(self) -> dict:
        if not self.xs["sentry_boot"]:
            return {"timeline_ms_after_post": None, "timeline_skipped_not_cold": self.skipped}
        return {
            "timeline_ms_after_post": {k: c.summarize(v) for k, v in self.xs.items()},
            "timeline_skipped_not_cold": self.skipped,
            "timeline_notes": "cold boots only (untimed probes after each create, 10 ms resolution for "
            "the first two): when the sentry's kernel started (now - /proc/uptime inside), when PID 1 "
            "(the agent's python3) started (/proc/1/stat), and when the agent finished importing and "
            "built its state (its /health time - uptime_s), all against the wall clock when POST was "
            "sent (gVisor reads the host's clock).",
        }


TIMELINE_PROBE = (
    "import json, os, time; up = float(open('/proc/uptime').read().split()[0]); "
    "st = int(open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19]); "
    "print(json.dumps({'now': time.time(), 'uptime': up, 'pid1_ticks': st, 'hz': os.sysconf('SC_CLK_TCK')}))"
)


def _create_timeline(a: c.Atoll, sid: str, w0: float) -> dict[str, float]:
    agent = a.agent_conn(sid)
    try:
        _, h = agent.request("GET", "/health")
    finally:
        agent.close()
    p = json.loads(a.exec(sid, ["python3", "-I", "-c", TIMELINE_PROBE])["stdout"])
    boot = p["now"] - p["uptime"]
    return {
        "sentry_boot": round((boot - w0) * 1000, 1),
        "agent_pid1_start": round((boot + p["pid1_ticks"] / p["hz"] - w0) * 1000, 1),
        "agent_ready": round((h["time"] - h["uptime_s"] - w0) * 1000, 1),
    }


def bench_exec(a: c.Atoll, n: int = 50, warmup: int = 5) -> dict:
    sb = a.create()
    sid = sb["id"]
    cid = a.cid(sid)
    listed = a.runsc_list()
    if cid not in listed:
        raise RuntimeError(f"container {cid} not in `runsc list` ({listed})")
    rootfs = c.template_rootfs()
    agent = a.agent_conn(sid)
    gv = None
    gv_error = None
    try:
        try:
            gv = c.gvisor_sandbox(rootfs)
            if not c.gvisor_sees_template(gv, rootfs):
                gv_error = "the gvisor package's sandbox does not see the template's /usr/bin"
        except Exception as e:  # noqa: BLE001 - the peer is optional; report why it is missing
            gv_error = f"gvisor package unavailable: {e!r}"
        runsc_argv = [c.RUNSC, f"--root={a.runsc_root}", "exec", cid, "true"]
        durations: list[float] = []

        def api_exec() -> None:
            r = a.exec(sid, ["true"])
            if r["exit_code"] != 0:
                raise RuntimeError(f"true exited {r['exit_code']}")
            durations.append(r["duration_ms"])

        def agent_exec() -> None:
            st, r = agent.request("POST", "/exec", {"cmd": ["true"]})
            if st != 200 or r["exit_code"] != 0:
                raise RuntimeError(f"agent exec: {st} {r}")

        def agent_health() -> None:
            st, _ = agent.request("GET", "/health")
            if st != 200:
                raise RuntimeError(f"agent health: {st}")

        def api_get() -> None:
            r = a.api.get(f"/v1/sandboxes/{sid}")
            if r.status_code != 200:
                raise RuntimeError(f"GET sandbox: {r.status_code}")

        def runsc_exec() -> None:
            p = subprocess.run(
                runsc_argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=60,
                check=False,
            )
            if p.returncode != 0:
                raise RuntimeError(f"runsc exec: {p.returncode} {p.stderr[-300:]!r}")

        def gv_exec() -> None:
            gv.exec("true", timeout=60)

        methods = {
            "api_exec_true": api_exec,
            "agent_exec_true": agent_exec,
            "agent_health": agent_health,
            "api_get_sandbox": api_get,
            "runsc_exec_true": runsc_exec,
        }
        if gv is not None and gv_error is None:
            methods["gvisor_pkg_exec_true"] = gv_exec
        names = list(methods)
        for _ in range(warmup):
            for name in names:
                methods[name]()
        durations.clear()
        samples: dict[str, list[float]] = {k: [] for k in names}
        c.log(f"exec: {n} rounds of {', '.join(names)}")
        for i in range(n):
            for k in range(len(names)):  # rotate the order so no method always follows another
                name = names[(i + k) % len(names)]
                with c.Timer() as t:
                    methods[name]()
                samples[name].append(t.ms)
        out = {k: c.summarize(v) for k, v in samples.items()}
        out["agent_duration_ms_of_api_exec"] = c.summarize(durations)
        out["ratios_p50"] = {
            "runsc_exec/api_exec": c.ratio(out["runsc_exec_true"], out["api_exec_true"]),
            "api_exec/agent_exec": c.ratio(out["api_exec_true"], out["agent_exec_true"]),
        }
        if "gvisor_pkg_exec_true" in out:
            out["ratios_p50"]["gvisor_pkg_exec/api_exec"] = c.ratio(
                out["gvisor_pkg_exec_true"], out["api_exec_true"]
            )
        if gv_error:
            out["gvisor_pkg_error"] = gv_error
        out["in_sandbox"] = json.loads(a.exec(sid, ["python3", "-I", "-c", SPAWN_PROBE])["stdout"])
        host = subprocess.run(
            [sys.executable, "-I", "-c", SPAWN_PROBE],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        out["on_host"] = json.loads(host.stdout)
        out["python_startup_in_sandbox"] = python_startup(a, sid)
        out["memory_tier_floor"] = memory_tier_floor(a, sid, agent)
        out["host_fsync_ms"] = host_fsync(a.home)
        out["container_id"] = cid
        return out
    finally:
        agent.close()
        if gv is not None:
            gv.close()
        a.delete(sid)


def memory_tier_floor(a: c.Atoll, sid: str, agent: c.AgentConn, n: int = 20) -> dict:
    """The memory tier without atoll's API: write the sandbox's freezer cgroup, then ping the agent.

    freeze: FROZEN written → freezer.state reads FROZEN. thaw_plus_health: THAWED written →
    state reads THAWED → GET /health answered on the kept-alive direct connection. This is what
    POST /resume does inside the worker, minus HTTP, FastAPI, the lock and the database write.
    """
    path = f"/sys/fs/cgroup/freezer{a.cgroup(sid)}/freezer.state"

    def set_state(want: str) -> None:
        with open(path, "w") as f:
            f.write(want)
        deadline = time.monotonic() + 5
        while True:
            with open(path) as f:
                if f.read().strip() == want:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} did not reach {want}")
            time.sleep(0.0001)

    freeze, thaw = [], []
    try:
        for _ in range(n + 2):
            with c.Timer() as t:
                set_state("FROZEN")
            freeze.append(t.ms)
            time.sleep(0.02)
            with c.Timer() as t:
                set_state("THAWED")
                st, _ = agent.request("GET", "/health")
            if st != 200:
                raise RuntimeError(f"agent health after thaw: {st}")
            thaw.append(t.ms)
            time.sleep(0.02)
    finally:
        set_state("THAWED")
    return {"freeze": c.summarize(freeze[2:]), "thaw_plus_health": c.summarize(thaw[2:])}


def host_fsync(directory: str, n: int = 20) -> dict:
    tmp, final = os.path.join(directory, "bench-fsync.tmp"), os.path.join(directory, "bench-fsync.json")
    xs = []
    try:
        for _ in range(n):
            with c.Timer() as t:
                with open(tmp, "w") as f:
                    f.write("x" * 300)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            xs.append(t.ms)
    finally:
        for p in (tmp, final):
            if os.path.exists(p):
                os.unlink(p)
    return c.summarize(xs)


def python_startup(a: c.Atoll, sid: str, n: int = 5) -> dict:
    """Where part of create goes: a bare `python3 -c pass` and the agent's own start, inside gVisor.

    All as the agent's duration_ms (spawn → exit) of an exec, so the exec path itself is excluded.
    The agent probes run it with `--help`: everything a cold boot does before it listens (every
    module of the package imported, arguments parsed), then exit. `python3 -I` on
    agent-source.pyz (a zipapp, through runpy) compiles every module (the cost df6432d removed);
    `python3 -I -S` on agent.pyc (one bytecode file holding every module, no `site`) is exactly how
    it starts on a cold boot when the template's python3 matches the worker's (otherwise
    agent-source.pyz under -I -S); a sandbox made from the template image restores an agent that is
    already running. Keys were renamed when the agent became a package: results of the earlier
    probes (module import only, single-file agent.py / agent.pyc) are not comparable.
    """
    argvs = {
        "python3_c_pass_ms": ["python3", "-I", "-c", "pass"],
        "python3_S_c_pass_ms": ["python3", "-I", "-S", "-c", "pass"],
        "python3_agent_source_pyz_ms": ["python3", "-I", "/opt/atoll/agent-source.pyz", "--help"],
        "python3_S_agent_pyc_bundle_ms": ["python3", "-I", "-S", "/opt/atoll/agent.pyc", "--help"],
    }
    xs: dict[str, list[float]] = {k: [] for k in argvs}
    errors: dict[str, str] = {}
    for _ in range(n):
        for k, argv in argvs.items():
            if k in errors:
                continue
            r = a.exec(sid, argv)
            if r["exit_code"] != 0:
                errors[k] = r["stderr"][-300:]  # e.g. bytecode of another version (template python3 differs)
                continue
            xs[k].append(r["duration_ms"])
    out: dict = {k: c.summarize(v) for k, v in xs.items() if k not in errors}
    if errors:
        out["errors"] = errors
    return out


def run(a: c.Atoll, n_create: int = 10, n_exec: int = 50) -> dict:
    t0 = time.monotonic()
    out = {"create": bench_create(a, n_create), "exec": bench_exec(a, n_exec)}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


if __name__ == "__main__":
    c.run_main(run, "api")

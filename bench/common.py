"""Shared helpers of atoll's benchmarks: timing, summaries, machine info, a local atoll, runsc look-ups.

Every benchmark module (bench_api, bench_standby, bench_peers) imports this; bench/run_all.py uses it
to start one atoll for all of them. Nothing here sends traffic anywhere but loopback: atoll listens
on 127.0.0.1 and its sandboxes are created without a network policy, so their gateway lets nothing
out (bench_egress, which needs egress, allows only a test host in a namespace of its own).

Conventions: samples are wall-clock milliseconds from `time.perf_counter_ns()`; `summarize()` keeps
the raw samples next to p50/p90/min/max/mean/n; percentiles interpolate linearly between ranks.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import http.client
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import typing

import httpx

from atoll.core import ids
from atoll.testing import LocalAtoll
from atoll.worker.host import netns
from atoll.worker.host.bundle import AGENT_PORT
from atoll.worker.host.netns import SANDBOX_IP

TEMPLATE_DIR = os.environ.get("ATOLL_TEST_TEMPLATE_DIR", "/var/tmp/atoll-test-templates")
RUNSC = os.environ.get("ATOLL_RUNSC", "runsc")
BENCH_TMP = os.environ.get("ATOLL_BENCH_TMP", "/var/tmp")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---- timing and summaries ---------------------------------------------------------------------
def now_ms() -> float:
    return time.perf_counter_ns() / 1e6


class Timer:
    """`with Timer() as t: ...` then `t.ms`."""

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ms = (time.perf_counter_ns() - self._t0) / 1e6


def percentile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return float("nan")
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(samples: list[float], unit: str = "ms", keep_samples: bool = True) -> dict:
    xs = sorted(samples)
    out: dict[str, typing.Any] = {"unit": unit, "n": len(xs)}
    if xs:
        out.update(
            p50=round(percentile(xs, 0.5), 3),
            p90=round(percentile(xs, 0.9), 3),
            p99=round(percentile(xs, 0.99), 3),
            min=round(xs[0], 3),
            max=round(xs[-1], 3),
            mean=round(sum(xs) / len(xs), 3),
        )
    if keep_samples:
        out["samples"] = [round(x, 3) for x in samples]
    return out


def ratio(a: dict, b: dict, key: str = "p50") -> float | None:
    try:
        return round(a[key] / b[key], 3)
    except (KeyError, ZeroDivisionError, TypeError):
        return None


def timestamp() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# ---- machine info ------------------------------------------------------------------------------
def _first_line(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False
        ).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine_info() -> dict:
    cpu_model = None
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    try:
        from importlib.metadata import version

        gvisor_pkg = version("gvisor")
    except Exception:  # noqa: BLE001 - optional peer
        gvisor_pkg = None
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirty = subprocess.run(
        ["git", "-C", repo, "status", "--porcelain", "--", "src"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout.split("\n")
    return {
        "atoll_commit": _first_line(["git", "-C", repo, "rev-parse", "--short", "HEAD"]),
        "atoll_src_modified_files": [ln[3:] for ln in dirty if ln.strip()],
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "runsc": _first_line([RUNSC, "--version"]),
        "runsc_platform": "ptrace",
        "gvisor_python_package": gvisor_pkg,
        "loadavg_at_start": os.getloadavg(),
    }


def emit(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    sys.stdout.flush()


def log(msg: str) -> None:
    """Progress on stderr (stdout carries only the JSON document)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- a local atoll -----------------------------------------------------------------------------
class Atoll:
    """One `atoll up` (LocalAtoll) plus a kept-alive httpx client to its API."""

    def __init__(self, local: LocalAtoll):
        self.local = local
        # ATOLL_TEMPLATE_SNAPSHOTS=0: every create boots cold; otherwise creates restore the template image.
        self.template_snapshots = local.env.get("ATOLL_TEMPLATE_SNAPSHOTS", "1") not in ("0", "false", "no")
        self.home = os.path.realpath(local.home)
        self.install_id = ids.installation_id(self.home)
        self.runsc_root = os.path.join(self.home, "runsc")
        self.api = httpx.Client(base_url=local.url, headers=local.headers(), timeout=600)

    # sandboxes ---------------------------------------------------------------------------------
    def create(self, **body: typing.Any) -> dict:
        body.setdefault("idle_timeout_s", 0)
        body.setdefault("disk_after_s", 0)
        r = self.api.post("/v1/sandboxes", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"create failed: {r.status_code} {r.text}")
        return r.json()

    def exec(self, sid: str, cmd: str | list[str], **kw: typing.Any) -> dict:
        r = self.api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **kw})
        if r.status_code != 200:
            raise RuntimeError(f"exec {cmd!r} failed: {r.status_code} {r.text}")
        return r.json()

    def delete(self, sid: str, wait: bool = True, timeout: float = 60) -> None:
        """Delete; with wait, also wait until the worker removed its directory (runsc delete is async)."""
        self.api.delete(f"/v1/sandboxes/{sid}")
        if wait:
            self.wait_gone(sid, timeout)

    def wait_gone(self, sid: str, timeout: float = 60) -> None:
        d = os.path.join(self.home, "sandboxes", sid)
        deadline = time.monotonic() + timeout
        while os.path.exists(d) and time.monotonic() < deadline:
            time.sleep(0.05)

    # runtime facts (read-only peeks at the worker's files) ---------------------------------------
    def runtime(self, sid: str) -> dict:
        with open(os.path.join(self.home, "sandboxes", sid, "runtime.json")) as f:
            return json.load(f)

    def cid(self, sid: str) -> str:
        """runsc container id of the sandbox's current generation: atoll-<install>-<sid w/o sb->-<gen>."""
        return f"{ids.runtime_name(self.install_id, sid)}-{self.runtime(sid)['generation']}"

    def cgroup(self, sid: str) -> str:
        return f"/atoll-{self.install_id}/{sid}-{self.runtime(sid)['generation']}"

    def memory_usage_mb(self, sid: str) -> float | None:
        path = f"/sys/fs/cgroup/memory{self.cgroup(sid)}/memory.usage_in_bytes"
        try:
            with open(path) as f:
                return round(int(f.read()) / 2**20, 1)
        except (OSError, ValueError):
            return None

    def containers(self) -> list[str]:
        """Container ids runsc keeps state for under this installation's root (a directory listing)."""
        return sorted(
            os.path.basename(p).split("_sandbox:")[0]
            for p in glob.glob(os.path.join(self.runsc_root, "*_sandbox:*.state"))
        )

    def runsc_list(self) -> list[str]:
        out = subprocess.run(
            [RUNSC, f"--root={self.runsc_root}", "list", "-quiet"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
        return [ln.strip() for ln in out.splitlines() if ln.strip()]

    def wait_containers_at_most(self, sid: str, n: int = 1, timeout: float = 30) -> None:
        """Wait until background `runsc delete`s of older generations of `sid` are done."""
        stem = ids.runtime_name(self.install_id, sid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for c in self.containers() if c.startswith(stem)) <= n:
                return
            time.sleep(0.05)

    def server_events(self, sid: str | None = None, prefix: str = "") -> list[dict]:
        """The server's JSON log records (optionally of one sandbox, message starting with `prefix`)."""
        out = []
        with contextlib.suppress(OSError), open(self.local.log_path, errors="replace") as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if sid is not None and rec.get("sandbox_id") != sid:
                    continue
                if rec.get("msg", "").startswith(prefix):
                    out.append(rec)
        return out

    def server_durations(self, sid: str | None, prefix: str) -> list[float]:
        """Durations (ms) the server logged for one kind of event: `duration_ms` or 'took/in N ms'."""
        xs = []
        for rec in self.server_events(sid, prefix):
            if "duration_ms" in rec:
                xs.append(float(rec["duration_ms"]))
            else:
                m = re.search(r"(?:took|in) ([0-9.]+) ms", rec.get("msg", ""))
                if m:
                    xs.append(float(m.group(1)))
        return xs

    def server_parts(self, sid: str | None, prefix: str) -> dict[str, list[float]]:
        """Breakdowns the server logs as '… took N ms (part A, other part B)': {part: [ms, …]}."""
        out: dict[str, list[float]] = {}
        for rec in self.server_events(sid, prefix):
            m = re.search(r"\(([^)]*)\)", rec.get("msg", ""))
            if not m:
                continue
            for item in m.group(1).split(","):
                pm = re.match(r"\s*(.*?)\s+([0-9.]+)\s*(?:ms)?\s*$", item)
                if pm:
                    out.setdefault(pm.group(1), []).append(float(pm.group(2)))
        return out

    def runtime_starts(self, sid: str | None = None) -> list[dict]:
        """The worker's create lines: 'sandbox runtime started in N ms by template image|cold boot
        (rootfs+netns A, runsc B, agent C)' as {sandbox_id, ms, how, parts: {part: ms}}."""
        out = []
        for rec in self.server_events(sid, "sandbox runtime started"):
            m = re.match(r"sandbox runtime started in ([0-9.]+) ms by ([^(]+?) \(([^)]*)\)", rec["msg"])
            if not m:
                continue
            parts = {}
            for item in m.group(3).split(","):
                pm = re.match(r"\s*(.*?)\s+([0-9.]+)\s*$", item)
                if pm:
                    parts[pm.group(1)] = float(pm.group(2))
            out.append(
                {
                    "sandbox_id": rec.get("sandbox_id"),
                    "ms": float(m.group(1)),
                    "how": m.group(2),
                    "parts": parts,
                }
            )
        return out

    def template_images(self) -> list[str]:
        """Committed snapshots of the built-in templates of this installation
        (<home>/builds/<template>-<digest>/images/<runtime key>/<memory>m/manifest.json)."""
        pattern = os.path.join(self.home, "builds", "*-*", "images", "*", "*m", "manifest.json")
        return sorted(
            os.path.dirname(p)
            for p in glob.glob(pattern)
            if not os.path.relpath(p, os.path.join(self.home, "builds")).startswith("bld-")
        )

    def wait_template_image(self, timeout: float = 600) -> str:
        """Wait until the worker's start-up `prepare_template` has committed the base image."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            imgs = self.template_images()
            if imgs:
                return imgs[0]
            if any("no template image" in r.get("msg", "") for r in self.server_events()):
                raise RuntimeError(f"the server could not make a template image: {self.local.tail()}")
            time.sleep(0.2)
        raise RuntimeError(f"no template image under {self.home}/builds after {timeout} s")

    def agent_conn(self, sid: str) -> AgentConn:
        """A kept-alive HTTP connection straight to the sandbox's guest agent (bypassing the API)."""
        name = ids.runtime_name(self.install_id, sid)
        return AgentConn(netns.path(netns.host_side(name)))

    def close(self) -> None:
        self.api.close()


# ---- a direct channel to a guest agent ---------------------------------------------------------
class AgentConn:
    """HTTP/1.1 keep-alive to a guest agent at SANDBOX_IP:AGENT_PORT from the sandbox's host-side netns.

    Used only to split the API's exec round trip into its parts; the sandbox's own network is the
    veth pair atoll created, so nothing leaves the machine. The socket comes from the worker's
    `netns.socket_in`, so the bench opens it exactly as the worker does; the HTTP on
    top is the standard library's blocking client, not the worker's asyncio/h11 channel.
    """

    def __init__(self, ns_path: str):
        self.conn = http.client.HTTPConnection(SANDBOX_IP, AGENT_PORT, timeout=30)
        # The worker's own setns helper: the socket is born in the host-side netns (this thread enters
        # it and comes back), with SO_LINGER 0 (close = RST, no TIME_WAIT inside the sandbox) and
        # TCP_NODELAY. It comes non-blocking for asyncio; settimeout() makes it blocking again.
        sock = netns.socket_in(ns_path)
        sock.settimeout(30)
        sock.connect((SANDBOX_IP, AGENT_PORT))
        self.conn.sock = sock

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        self.conn.request(method, path, body=data, headers=headers)
        r = self.conn.getresponse()
        raw = r.read()
        return r.status, (json.loads(raw) if raw else {})

    def close(self) -> None:
        self.conn.close()


@contextlib.contextmanager
def local_atoll(keep_home: bool = False, env: dict[str, str] | None = None) -> typing.Iterator[Atoll]:
    """Start `atoll up` in a fresh home under /var/tmp, yield it, delete its sandboxes and stop it.

    `env` adds server variables, e.g. {"ATOLL_TEMPLATE_SNAPSHOTS": "0"} for an atoll that boots
    every sandbox cold."""
    home = tempfile.mkdtemp(prefix="atoll-bench-", dir=BENCH_TMP)
    # INFO + JSON: the server's lifecycle events (with their own durations) are parsed by server_events().
    env = {
        "ATOLL_TEMPLATE_DIR": TEMPLATE_DIR,
        "ATOLL_LOG_LEVEL": "INFO",
        "ATOLL_LOG_FORMAT": "json",
        **(env or {}),
    }
    local = LocalAtoll(home=home, env=env)
    log(
        f"starting atoll up (home {home}, ATOLL_TEMPLATE_SNAPSHOTS={env.get('ATOLL_TEMPLATE_SNAPSHOTS', '1')})"
    )
    local.start(timeout=300)
    a = Atoll(local)
    try:
        yield a
    finally:
        a.close()
        local.stop()
        if not keep_home and not _has_mounts_under(home):
            shutil.rmtree(home, ignore_errors=True)


def _has_mounts_under(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4].startswith(path + "/") for line in f)


def warm_up(a: Atoll) -> None:
    """One create + exec + delete that is not counted (builds the template layer if it is missing).

    With template images on, first wait until start-up's `prepare_template` has committed the image
    (a create before that waits for it), and check that the warm-up create really restored it."""
    if a.template_snapshots:
        t0 = time.monotonic()
        img = a.wait_template_image()
        log(f"template image ready after {time.monotonic() - t0:.1f} s: {os.path.basename(img)}")
    log("warm-up create (not counted)")
    sb = a.create()
    a.exec(sb["id"], ["true"])
    a.delete(sb["id"])
    how = [r["how"] for r in a.runtime_starts(sb["id"])]
    want = "template image" if a.template_snapshots else "cold boot"
    if how != [want]:
        raise RuntimeError(f"warm-up create was made by {how}, expected {want!r}: {a.local.tail()}")


def template_rootfs(name: str = "base") -> str:
    """The cached read-only root filesystem of an atoll template (built by a warm-up create): its
    layer `<template dir>/layers/<name>-<hash>/fs`."""
    for man in sorted(glob.glob(os.path.join(TEMPLATE_DIR, "layers", f"{name}-*", "layer.json"))):
        root = os.path.join(os.path.dirname(man), "fs")
        if os.path.isdir(root):
            return root
    raise RuntimeError(f"no built template {name!r} under {TEMPLATE_DIR}; run a warm-up create first")


def run_quiet(argv: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run a host command with stdin from /dev/null, in its own session, output captured."""
    return subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
        check=check,
        start_new_session=True,
    )


def tail_file(path: str, n: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_main(fn: typing.Callable[[Atoll], dict], name: str) -> None:
    """Standalone entry point of one benchmark module: own atoll, warm-up, one JSON document."""
    with local_atoll() as a:
        warm_up(a)
        result = fn(a)
    emit({"benchmark": name, "timestamp": timestamp(), "machine": machine_info(), "results": result})


def run_main_sized(
    fn: typing.Callable[..., dict], name: str, description: str, full: dict, quick: dict
) -> int:
    """Standalone entry point of a benchmark module whose sample counts are arguments of `fn`: own
    atoll, warm-up, `fn(atoll, **full)` — or `fn(atoll, **quick)` with `--quick` (a smoke test,
    never saved) — one JSON document on stdout, also written to bench/results/<name>.json unless
    `--no-save`."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="tiny sample counts (smoke test)")
    ap.add_argument("--no-save", action="store_true", help=f"do not write bench/results/{name}.json")
    args = ap.parse_args()
    machine = machine_info()
    with local_atoll() as a:
        warm_up(a)
        res = fn(a, **(quick if args.quick else full))
    doc = {
        "benchmark": name,
        "timestamp": timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
    }
    emit(doc)
    if not args.no_save and not args.quick:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


# ---- the gvisor PyPI package as a peer ---------------------------------------------------------
def gvisor_mounts(rootfs: str) -> list:
    """Mounts that make the gvisor package's sandbox see atoll's template rootfs instead of the host's.

    The package's bundle root is an empty read-only dir with the *host's* /bin, /usr, /lib, /lib64
    and /etc/alternatives bind-mounted read-only; it has no rootfs option. gVisor stacks mounts, so
    the template's directories bound (read-only) at the same places shadow the host's. /tmp is a tmpfs
    as in atoll. (Only /etc/alternatives stays the host's; python3 does not use it.)
    """
    import gvisor

    m = gvisor.Mount
    return [
        m.bind(os.path.join(rootfs, "usr"), "/usr", readonly=True),
        m.bind(os.path.join(rootfs, "usr/bin"), "/bin", readonly=True),
        m.bind(os.path.join(rootfs, "usr/lib"), "/lib", readonly=True),
        m.bind(os.path.join(rootfs, "usr/lib64"), "/lib64", readonly=True),
        m.bind(os.path.join(rootfs, "etc"), "/etc", readonly=True),
        m.tmpfs("/tmp"),
    ]


def gvisor_sandbox(rootfs: str):
    """A started `gvisor.Sandbox` (network none) over the template rootfs; use it as a context manager."""
    import gvisor

    return gvisor.Sandbox(network="none", mounts=gvisor_mounts(rootfs))


def gvisor_sees_template(sb, rootfs: str) -> bool:
    """Check (untimed) that the package's sandbox really runs the template's /usr/bin."""
    # (coreutils' statx fails with EINVAL on this runsc's bind mounts, so ask Python.)
    out, _ = sb.exec(
        "python3", "-I", "-c", "import os; print('\\n'.join(os.listdir('/usr/bin')))", timeout=60
    )
    return sorted(out.split()) == sorted(os.listdir(os.path.join(rootfs, "usr/bin")))


def raw_runsc_spec(rootfs: str, args: list[str], env: list[str]) -> dict:
    """OCI config of a plain runsc peer container: read-only `rootfs`, /tmp tmpfs, no network
    (the benchmarks run it with --network=none). Used by bench_peers and bench_standby."""
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": args, "env": env, "cwd": "/"},
        "root": {"path": rootfs, "readonly": True},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts", "network")]},
    }

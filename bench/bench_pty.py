"""Benchmark: terminal keystroke echo round trip through the public WebSocket.

Run standalone (`.venv/bin/python bench/bench_pty.py`, root, starts its own `atoll up`, writes
bench/results/pty.json) or from bench/run_all.py (section `pty`), which calls `run(atoll)`. Prints
one JSON document to stdout; progress on stderr. Loopback only: the client is on this host, the
sandbox has no network policy.

One sandbox (`base`), one terminal session each, attached with the `websockets` sync client
(compression off) on `ws://127.0.0.1:<port>/v1/sandboxes/{id}/pty/{pty_id}/ws`; each sample sends
one byte as a binary message and is timed until that byte comes back:

  program_echo   `stty raw -echo; exec cat`: the byte goes client -> control plane -> worker ->
                 guest agent -> pty master -> cat (a process wake-up) -> back. What a keystroke in
                 bash (readline echoes itself) or vim costs.
  ldisc_echo     plain `cat` (canonical mode): the terminal line discipline echoes the byte; cat
                 sleeps until a newline. The path without the program.
Standalone, the same runs again through `atoll server` + one `atoll worker` (section `split`:
the worker's port tunnel, `ATOLL-PTY` hello, carries the frames). Each mode runs back to back (`burst`) and with 100 ms between keystrokes (`typed`, about human
typing; this VM's idle vCPUs add ~1.5 ms to a message after idle time). Untimed warm-up: 20
keystrokes per mode. Target (docs/specification.md): program_echo p50 ≤ 15 ms, both pacings.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = {
    "program_echo": ["sh", "-c", "stty raw -echo; echo READY; exec cat"],
    "ldisc_echo": ["sh", "-c", "echo READY; exec cat"],
}


def _keystrokes(ws, n: int, gap_s: float) -> list[float]:
    samples = []
    for i in range(n):
        byte = bytes([ord("a") + i % 26])
        t0 = time.perf_counter()
        ws.send(byte)
        got = b""
        while byte not in got:
            msg = ws.recv(timeout=10)
            if isinstance(msg, bytes):
                got += msg
        samples.append((time.perf_counter() - t0) * 1000)
        if gap_s:
            time.sleep(gap_s)
    return samples


def _summary(samples: list[float]) -> dict:
    return {**c.summarize(samples, keep_samples=False), "p95": round(c.percentile(sorted(samples), 0.95), 3)}


def run(a: c.Atoll, n_burst: int = 300, n_typed: int = 60) -> dict:
    sb = a.create()
    sid = sb["id"]
    out: dict = {"how": "one byte per binary WebSocket message, timed until it is echoed back"}
    try:
        for mode, cmd in MODES.items():
            r = a.api.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24, "cmd": cmd})
            if r.status_code != 201:
                raise RuntimeError(f"open pty failed: {r.status_code} {r.text}")
            pty_id = r.json()["pty_id"]
            url = a.local.url.replace("http://", "ws://") + f"/v1/sandboxes/{sid}/pty/{pty_id}/ws"
            t0 = time.perf_counter()
            with connect(url, additional_headers=a.local.headers(), compression=None) as ws:
                seen = b""
                while b"READY" not in seen:
                    msg = ws.recv(timeout=30)
                    seen += msg if isinstance(msg, bytes) else b""
                attach_ms = (time.perf_counter() - t0) * 1000
                c.log(f"{mode}: warm-up")
                _keystrokes(ws, 20, 0)
                c.log(f"{mode}: {n_burst} keystrokes back to back, {n_typed} typed (100 ms apart)")
                burst = _keystrokes(ws, n_burst, 0)
                typed = _keystrokes(ws, n_typed, 0.1)
            a.api.delete(f"/v1/sandboxes/{sid}/pty/{pty_id}")
            out[mode] = {
                "burst": _summary(burst),
                "typed": _summary(typed),
                "attach_until_first_output_ms": round(attach_ms, 2),
            }
    finally:
        a.delete(sid)
    pe = out["program_echo"]
    out["program_echo_p50_worst_ms"] = max(pe["burst"]["p50"], pe["typed"]["p50"])
    return out


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sample counts (smoke test)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/pty.json")
    ap.add_argument("--no-split", action="store_true", help="skip the atoll server + atoll worker run")
    args = ap.parse_args()
    machine = c.machine_info()
    n = {"n_burst": 30 if args.quick else 300, "n_typed": 10 if args.quick else 60}
    with c.local_atoll() as a:
        c.warm_up(a)
        res = run(a, **n)
    if not args.no_split:
        import bench_split

        with bench_split.local_cluster() as split:
            c.warm_up(split)
            res["split"] = run(split, **n)
    doc = {
        "benchmark": "pty",
        "timestamp": c.timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
    }
    c.emit(doc)
    if not args.no_save:
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, "pty.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)
        c.log(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

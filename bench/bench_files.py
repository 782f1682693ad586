"""Benchmark: many small files as one tar vs one PUT each, and the latency of a watch event.

Run standalone (`.venv/bin/python bench/bench_files.py`, root, starts its own `atoll up`) or from
bench/run_all.py, which calls `run(atoll)`. Prints one JSON document to stdout (and saves it to
bench/results/files.json standalone); progress on stderr. Everything goes to loopback only.

Measured (wall clock on the caller's side, `perf_counter_ns`, kept-alive httpx client; one sandbox):
  upload, `rounds` rounds alternating the two ways, each into a fresh directory:
    tar_upload_1000   PUT /v1/sandboxes/{id}/files/tar?path=DIR with a plain tar of `n_files` files of
                      100 bytes (built in memory before the clock starts) → 200
    single_puts_1000  `n_files` × PUT /v1/sandboxes/{id}/files?path=DIR/f<i> (100 bytes each), in a
                      row on one connection
    speedup           single_puts p50 / tar p50
  watch_latency  GET …/files/watch?path=DIR open (after its `ready` line): for each of `n_events`
                 writes, the time from sending PUT …/files?path=DIR/p<i> (as `put`) or the moment an
                 exec that writes DIR/e<i> is sent (as `exec`) until the watch's first line naming
                 that file is read (`create`; for a PUT, the `rename` of its temp file onto it). PUT: the event can only be earlier than the
                 PUT's answer, so this bounds "write → event" from above by the whole HTTP round
                 trip of the write. exec: includes the exec's spawn inside gVisor.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _tar(n: int, size: int = 100) -> bytes:
    buf = io.BytesIO()
    payload = b"x" * size
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(n):
            info = tarfile.TarInfo(f"f{i}")
            info.size = size
            tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def upload(a: c.Atoll, sid: str, n_files: int, rounds: int) -> dict:
    blob = _tar(n_files)
    payload = b"x" * 100
    tar_ms: list[float] = []
    put_ms: list[float] = []
    for r in range(rounds):
        with c.Timer() as t:
            resp = a.api.put(
                f"/v1/sandboxes/{sid}/files/tar", params={"path": f"/bench/tar{r}"}, content=blob
            )
        assert resp.status_code == 200 and resp.json()["files"] == n_files, resp.text
        tar_ms.append(t.ms)
        with c.Timer() as t:
            for i in range(n_files):
                resp = a.api.put(
                    f"/v1/sandboxes/{sid}/files", params={"path": f"/bench/put{r}/f{i}"}, content=payload
                )
                assert resp.status_code == 204, resp.text
        put_ms.append(t.ms)
        c.log(f"  round {r}: tar {tar_ms[-1]:.0f} ms, {n_files} PUTs {put_ms[-1]:.0f} ms")
    count = a.exec(sid, "ls /bench/tar0 | wc -l; ls /bench/put0 | wc -l")["stdout"].split()
    assert count == [str(n_files), str(n_files)], count
    tar, puts = c.summarize(tar_ms), c.summarize(put_ms)
    return {
        "n_files": n_files,
        "file_bytes": 100,
        "tar_bytes": len(blob),
        "tar_upload": tar,
        "single_puts": puts,
        "speedup_p50": c.ratio(puts, tar),
    }


def watch_latency(a: c.Atoll, sid: str, n_events: int) -> dict:
    a.exec(sid, "mkdir -p /bench/watched")
    seen: dict[str, float] = {}
    cond = threading.Condition()
    ready = threading.Event()
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        import httpx

        try:
            with httpx.Client(base_url=a.local.url, headers=a.local.headers(), timeout=60) as cl:
                with cl.stream(
                    "GET", f"/v1/sandboxes/{sid}/files/watch", params={"path": "/bench/watched"}
                ) as r:
                    for line in r.iter_lines():
                        if not line.strip():
                            continue
                        ev = json.loads(line)
                        if ev.get("type") == "ready":
                            ready.set()
                        elif ev.get("type") in ("create", "rename"):  # a PUT ends with a rename onto the path
                            with cond:
                                seen.setdefault(ev["path"], c.now_ms())
                                cond.notify_all()
                        if stop.is_set():
                            return
        except Exception as e:  # noqa: BLE001 - reported in the document
            errors.append(repr(e))
            ready.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    if not ready.wait(30) or errors:
        raise RuntimeError(f"the watch did not start: {errors}")

    def wait_for(path: str, t0: float) -> float:
        with cond:
            if not cond.wait_for(lambda: path in seen, timeout=10):
                raise RuntimeError(f"no watch event for {path} within 10 s")
        return seen[path] - t0

    by_put: list[float] = []
    by_exec: list[float] = []
    for i in range(n_events):
        path = f"/bench/watched/p{i}"
        t0 = c.now_ms()
        a.api.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=b"1")
        by_put.append(wait_for(path, t0))
        path = f"/bench/watched/e{i}"
        t0 = c.now_ms()
        threading.Thread(target=a.exec, args=(sid, ["sh", "-c", f": > {path}"]), daemon=True).start()
        by_exec.append(wait_for(path, t0))
        time.sleep(0.01)
    stop.set()
    a.exec(sid, "touch /bench/watched/stop")  # one more event ends the reader
    t.join(10)
    return {"put": c.summarize(by_put), "exec": c.summarize(by_exec)}


def run(a: c.Atoll, n_files: int = 1000, rounds: int = 3, n_events: int = 30) -> dict:
    sb = a.create(idle_timeout_s=0)
    sid = sb["id"]
    try:
        c.log(f"== files: {n_files} small files as one tar vs {n_files} PUTs, {rounds} rounds")
        up = upload(a, sid, n_files, rounds)
        c.log(f"== files: watch latency, {n_events} events by PUT and by exec")
        w = watch_latency(a, sid, n_events)
    finally:
        a.delete(sid)
    return {"upload_1000": up, "watch_latency": w}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sample counts (smoke test)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/files.json")
    args = ap.parse_args()
    q = args.quick
    machine = c.machine_info()
    with c.local_atoll() as a:
        c.warm_up(a)
        res = run(a, n_files=1000, rounds=1 if q else 3, n_events=5 if q else 30)
    doc = {"benchmark": "files", "timestamp": c.timestamp(), "machine": machine, "results": res, "quick": q}
    c.emit(doc)
    if not args.no_save:
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, "files.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)
        c.log(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

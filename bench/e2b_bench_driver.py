"""Run by bench/bench_e2b.py inside the venv of the unmodified `e2b` 2.63.0 SDK and
`e2b-code-interpreter` 2.11.5 (tests/e2b_venv.py): reads one command per line on stdin, answers
one JSON line on stdout, so that its calls interleave with the benchmark's native ones.
E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY come from the environment. Commands:

  sdk              Sandbox.create() then commands.run("true"): {"create_ms", "run_ms", "total_ms"}
                   (the sandbox is killed afterwards, untimed)
  interp N         a code-interpreter-v1 sandbox, 5 warm-up calls, then N of each, interleaved:
                   run_code("1+1") through the SDK; the same POST /execute with a kept-alive
                   httpx client (no SDK); from inside the sandbox, a python3 client on the
                   service's own loopback port (no edge, no tunnel: the service and the kernel
                   alone); the service's kernel process driven by its own code inside the
                   sandbox (atoll.guest.interpreter.Context.execute: no HTTP); and, for
                   reference, a bare jupyter_client on a ZeroMQ kernel of its own process
                   inside the sandbox (execute "1+1", read IOPub until idle: what the service
                   used before) — {"sdk_ms", "raw_ms", "inside_ms", "service_kernel_ms",
                   "kernel_only_ms": [...], "first_run_ms"}
  quit
"""

from __future__ import annotations

import json
import os
import sys
import time

INSIDE = r"""
import http.client, json, sys, time
out = []
body = json.dumps({"code": "1+1"})
for _ in range(int(sys.argv[1])):
    c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[2]))
    t = time.perf_counter()
    c.request("POST", "/execute", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    out.append((time.perf_counter() - t) * 1000)
    c.close()
print(json.dumps(out))
"""
SERVICE_KERNEL = r"""
import json, sys, time
sys.path.insert(0, "/opt/atoll")
import interpreter
ctx = interpreter.Context("/tmp")
out = []
for i in range(int(sys.argv[1]) + 5):
    t = time.perf_counter()
    ctx.execute("1+1", {}, lambda line: None)
    if i >= 5:
        out.append((time.perf_counter() - t) * 1000)
ctx.shutdown()
print(json.dumps(out))
"""
KERNEL_ONLY = r"""
import json, os, sys, tempfile, time
from jupyter_client import KernelManager
run = tempfile.mkdtemp()
km = KernelManager(transport="ipc", ip=os.path.join(run, "k"), connection_file=os.path.join(run, "k.json"))
km.start_kernel()
kc = km.blocking_client()
kc.start_channels()
kc.wait_for_ready(timeout=120)
out = []
for i in range(int(sys.argv[1]) + 5):
    t = time.perf_counter()
    mid = kc.execute("1+1")
    while True:
        m = kc.get_iopub_msg()
        if m["parent_header"].get("msg_id") == mid and m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            break
    if i >= 5:
        out.append((time.perf_counter() - t) * 1000)
kc.stop_channels()
km.shutdown_kernel(now=True)
print(json.dumps(out))
"""


def sdk() -> dict:
    from e2b import Sandbox

    t0 = time.perf_counter()
    sbx = Sandbox.create()
    t1 = time.perf_counter()
    sbx.commands.run("true")
    t2 = time.perf_counter()
    Sandbox.kill(sbx.sandbox_id)
    return {"create_ms": (t1 - t0) * 1000, "run_ms": (t2 - t1) * 1000, "total_ms": (t2 - t0) * 1000}


def interp(n: int) -> dict:
    import httpx
    from e2b_code_interpreter import Sandbox as CodeSandbox

    t0 = time.perf_counter()
    sbx = CodeSandbox.create(timeout=600)
    try:
        sbx.run_code("1+1")
        out: dict = {"first_run_ms": (time.perf_counter() - t0) * 1000}
        for _ in range(5):
            sbx.run_code("1+1")
        headers = {
            "Content-Type": "application/json",
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "49999",
        }
        if sbx._envd_access_token:
            headers["X-Access-Token"] = sbx._envd_access_token
        url = os.environ["E2B_SANDBOX_URL"] + "/execute"
        out["sdk_ms"], out["raw_ms"] = [], []
        with httpx.Client(timeout=60) as raw:
            for _ in range(n):
                t = time.perf_counter()
                ex = sbx.run_code("1+1")
                out["sdk_ms"].append((time.perf_counter() - t) * 1000)
                if ex.text != "2":
                    raise RuntimeError(f"run_code('1+1') gave {ex.text!r}")
                t = time.perf_counter()
                r = raw.post(url, json={"code": "1+1"}, headers=headers)
                out["raw_ms"].append((time.perf_counter() - t) * 1000)
                if r.status_code != 200 or '"2"' not in r.text:
                    raise RuntimeError(f"POST /execute: {r.status_code} {r.text[:300]}")
        sbx.files.write("/tmp/inside.py", INSIDE)
        res = sbx.commands.run(f"python3 /tmp/inside.py {n} 49990", timeout=300)
        out["inside_ms"] = json.loads(res.stdout.strip().splitlines()[-1])
        sbx.files.write("/tmp/service_kernel.py", SERVICE_KERNEL)
        res = sbx.commands.run(f"python3 /tmp/service_kernel.py {n}", timeout=300)
        out["service_kernel_ms"] = json.loads(res.stdout.strip().splitlines()[-1])
        sbx.files.write("/tmp/kernel_only.py", KERNEL_ONLY)
        res = sbx.commands.run(f"python3 /tmp/kernel_only.py {n}", timeout=300)
        out["kernel_only_ms"] = json.loads(res.stdout.strip().splitlines()[-1])
        return out
    finally:
        CodeSandbox.kill(sbx.sandbox_id)


def main() -> None:
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            return
        try:
            if words[0] == "sdk":
                answer = sdk()
            elif words[0] == "interp":
                answer = interp(int(words[1]))
            else:
                answer = {"error": f"unknown command {words[0]!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the benchmark
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()

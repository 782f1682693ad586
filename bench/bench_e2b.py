"""Benchmark: the unmodified `e2b` SDK against atoll's E2B port beside atoll's own SDK and API, in
one run (issue 22's numbers).

Run standalone as root (`.venv/bin/python bench/bench_e2b.py [--quick] [--no-save]`). Starts
`atoll up` (atoll.testing; ATOLL_E2B_CODE_INTERPRETER=1, the template layers from the shared cache)
and the e2b 2.63.0 + e2b-code-interpreter 2.11.5 venv of tests/e2b_venv.py (built once under
/var/tmp/atoll-test-e2b), whose driver (bench/e2b_bench_driver.py) takes one command at a time, so
that the two sides interleave (native, E2B, native, …) after two untimed pairs:

  sdk_first_command   `Sandbox.create()` + first `commands.run("true")` (e2b SDK) against
                      `client.sandboxes.create()` + `exec("true", shell="bash")` (atoll's SDK: the
                      same `bash -l`); ratio E2B / native of the p50s (target ≤ 1.3×)
  server_exec         the same `bash -l -c true` with a 60 s deadline on one running sandbox each,
                      with kept-alive httpx clients and no SDK, so that the difference is the
                      servers' time: envd `process.Process/Start` with `Connect-Timeout-Ms: 60000`
                      (Connect, JSON; the edge child → the worker; what `commands.run` sends, its
                      default timeout being 60 s) against `POST /v1/sandboxes/{id}/exec {"cmd":
                      "true", "shell": "bash", "timeout_s": 60}` (the API) (target ≤ 1.1×)
  server_create       `POST /v2/sandboxes` against `POST /v1/sandboxes` the same way (+ the delete)
  run_code            a warm code-interpreter-v1 sandbox: `run_code("1+1")` p50 through the SDK
                      (target ≤ 50 ms), the same `POST /execute` with a kept-alive httpx client,
                      from inside the sandbox straight to the interpreter service (no edge, no
                      tunnel), the service's kernel process without HTTP, and for reference a
                      bare jupyter_client on a ZeroMQ kernel of its own process inside the
                      sandbox (the design the service used before): where the time goes

Prints one JSON document (also bench/results/e2b.json unless --no-save or --quick); progress on
stderr. Traffic only on loopback and the sandboxes' own veth pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common as c  # noqa: E402
import httpx  # noqa: E402

import atoll  # noqa: E402
from atoll.testing import LocalAtoll  # noqa: E402
from tests import e2b_venv  # noqa: E402

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2b_bench_driver.py")
START = {
    "Content-Type": "application/connect+json",
    "Connect-Protocol-Version": "1",
    "Connect-Timeout-Ms": "60000",  # as the SDK's commands.run sends it (timeout=60 by default)
}


class Driver:
    """The e2b SDK's side: a process in the SDK's venv, one command and one JSON answer at a time."""

    def __init__(self, env: dict[str, str]):
        python = str(e2b_venv.python("2.63"))
        self.proc = subprocess.Popen(
            [python, DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )

    def ask(self, command: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the e2b driver exited ({self.proc.poll()}) on {command!r}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"e2b driver, {command!r}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _envelope(msg: dict) -> bytes:
    raw = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(raw)) + raw


def _start_true(e2b: httpx.Client, sid: str, token: str) -> float:
    """envd's Start of `bash -l -c true`, read to its end; ms."""
    body = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]}, "stdin": False}
    headers = {**START, "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": token}
    with c.Timer() as t:
        r = e2b.post("/process.Process/Start", content=_envelope(body), headers=headers)
    if r.status_code != 200 or b'"end"' not in r.content or b"error" in r.content:
        raise RuntimeError(f"envd Start: {r.status_code} {r.content[:300]!r}")
    return t.ms


def _exec_true(api: httpx.Client, sid: str) -> float:
    with c.Timer() as t:
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "shell": "bash", "timeout_s": 60})
    if r.status_code != 200 or r.json()["exit_code"] != 0:
        raise RuntimeError(f"exec: {r.status_code} {r.text[:300]}")
    return t.ms


def _ok(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 300:
        raise RuntimeError(f"{r.request.method} {r.request.url}: {r.status_code} {r.text[:300]}")
    return r


def _side_by_side(samples: dict[str, list[float]], native: str, e2b: str, digits: int) -> dict:
    """A summary of each list of samples (ms) and `e2b_over_native`, the ratio of the p50s of the
    lists named `e2b` and `native`; the two p50s and the ratio are logged (`digits` decimals)."""
    out = {k: c.summarize(v, keep_samples=False) for k, v in samples.items()}
    out["e2b_over_native"] = c.ratio(out[e2b], out[native])
    c.log(
        f"  p50 native {out[native]['p50']:.{digits}f} ms / e2b {out[e2b]['p50']:.{digits}f} ms "
        f"= {out['e2b_over_native']}"
    )
    return out


def run(pairs: int, execs: int, run_codes: int) -> dict:
    root = tempfile.mkdtemp(prefix="atoll-bench-e2b-", dir=c.BENCH_TMP)
    env = {
        "ATOLL_TEMPLATE_DIR": c.TEMPLATE_DIR,
        "ATOLL_LOG_LEVEL": "INFO",
        "ATOLL_LOG_FORMAT": "json",
        "ATOLL_E2B_CODE_INTERPRETER": "1",
    }
    la = LocalAtoll(os.path.join(root, "home"), env=env)
    driver: Driver | None = None
    closers: list = []
    try:
        c.log(f"starting atoll up (root {root})")
        la.start(timeout=600)
        driver = Driver(
            {
                **{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
                "E2B_API_URL": la.e2b_url,
                "E2B_SANDBOX_URL": la.e2b_url,
                "E2B_API_KEY": la.api_key,
            }
        )
        client = atoll.Client(base_url=la.url, api_key=la.api_key)
        api = httpx.Client(base_url=la.url, headers=la.headers(), timeout=120)
        e2b = httpx.Client(base_url=la.e2b_url, headers={"X-API-KEY": la.api_key}, timeout=120)
        closers += [client, api, e2b]
        out: dict = {}

        # 1. the SDKs: create + first command, interleaved
        c.log(f"SDK create + first command: {pairs} pairs after 2 untimed")
        xs: dict[str, list[float]] = {k: [] for k in ("native_total", "native_create", "native_exec")}
        xs.update({k: [] for k in ("e2b_total", "e2b_create", "e2b_run")})
        for i in range(pairs + 2):
            with c.Timer() as total:
                with c.Timer() as made:
                    sb = client.sandboxes.create()
                with c.Timer() as ran:
                    res = sb.exec("true", shell="bash")
            sb.delete()
            if res.exit_code != 0:
                raise RuntimeError(f"native exec true: {res}")
            e = driver.ask("sdk")
            if i >= 2:
                xs["native_total"].append(total.ms)
                xs["native_create"].append(made.ms)
                xs["native_exec"].append(ran.ms)
                xs["e2b_total"].append(e["total_ms"])
                xs["e2b_create"].append(e["create_ms"])
                xs["e2b_run"].append(e["run_ms"])
        out["sdk_first_command"] = _side_by_side(xs, "native_total", "e2b_total", digits=0)

        # 2. server-side: the same command on a running sandbox each, no SDK
        c.log(f"server exec: {execs} pairs after 20 untimed")
        native_sid = _ok(api.post("/v1/sandboxes", json={"timeout_s": 900})).json()["id"]
        made = _ok(e2b.post("/v2/sandboxes", json={"templateID": "base", "timeout": 900})).json()
        e2b_sid, token = made["sandboxID"], made["envdAccessToken"]
        try:
            ex: dict[str, list[float]] = {"native": [], "e2b": []}
            for i in range(execs + 20):
                n = _exec_true(api, native_sid)
                e2 = _start_true(e2b, e2b_sid, token)
                if i >= 20:
                    ex["native"].append(n)
                    ex["e2b"].append(e2)
        finally:
            api.delete(f"/v1/sandboxes/{native_sid}")
            e2b.delete(f"/sandboxes/{e2b_sid}")
        out["server_exec"] = _side_by_side(ex, "native", "e2b", digits=1)

        # 3. server-side creates, no SDK
        c.log(f"server create: {pairs} pairs after 2 untimed")
        cr: dict[str, list[float]] = {"native": [], "e2b": []}
        for i in range(pairs + 2):
            with c.Timer() as t:
                sid = _ok(api.post("/v1/sandboxes", json={"timeout_s": 300, "on_timeout": "delete"})).json()[
                    "id"
                ]
            api.delete(f"/v1/sandboxes/{sid}")
            with c.Timer() as t2:
                sid = _ok(e2b.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
            e2b.delete(f"/sandboxes/{sid}")
            if i >= 2:
                cr["native"].append(t.ms)
                cr["e2b"].append(t2.ms)
        out["server_create"] = _side_by_side(cr, "native", "e2b", digits=0)

        # 4. run_code on a warm interpreter
        c.log("waiting for the code-interpreter-v1 template")
        deadline = time.monotonic() + 1800
        while True:
            t = api.get("/v1/templates/code-interpreter-v1").json()
            if t.get("status") == "ready":
                break
            if time.monotonic() > deadline or t.get("status") == "failed":
                raise RuntimeError(f"code-interpreter-v1 is not ready: {t}")
            time.sleep(2)
        c.log(f"run_code('1+1'): {run_codes} of each after 5 untimed")
        rc = driver.ask(f"interp {run_codes}")
        out["run_code"] = {
            "first_run_ms": round(rc["first_run_ms"], 1),
            "sdk": c.summarize(rc["sdk_ms"], keep_samples=False),
            "raw_http": c.summarize(rc["raw_ms"], keep_samples=False),
            "inside_sandbox": c.summarize(rc["inside_ms"], keep_samples=False),
            "service_kernel": c.summarize(rc["service_kernel_ms"], keep_samples=False),
            "kernel_only": c.summarize(rc["kernel_only_ms"], keep_samples=False),
        }
        c.log(
            "  p50 sdk {:.1f} ms, raw http {:.1f} ms, inside the sandbox {:.1f} ms, the service's kernel "
            "process {:.1f} ms, a ZeroMQ kernel of its own {:.1f} ms".format(
                out["run_code"]["sdk"]["p50"],
                out["run_code"]["raw_http"]["p50"],
                out["run_code"]["inside_sandbox"]["p50"],
                out["run_code"]["service_kernel"]["p50"],
                out["run_code"]["kernel_only"]["p50"],
            )
        )
        out["load_1m"] = os.getloadavg()[0]
        return out
    finally:
        for x in closers:
            x.close()
        if driver is not None:
            driver.close()
        la.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sample counts (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/e2b.json")
    args = ap.parse_args()
    doc = {
        "benchmark": "e2b",
        "timestamp": c.timestamp(),
        "machine": c.machine_info(),
        "load_1m_at_start": os.getloadavg()[0],
        "results": run(3, 10, 5) if args.quick else run(15, 100, 40),
        "quick": args.quick,
    }
    c.emit(doc)
    if not (args.quick or args.no_save):
        os.makedirs(c.RESULTS, exist_ok=True)
        with open(os.path.join(c.RESULTS, "e2b.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: what the shell convention costs — a string command under `bash -l -c` (atoll's
default when the sandbox has bash: the login profile is read, then atoll's env re-exported) against
`sh -c` and an argv without a shell, in one run; and the round trip of a line through a background
process's stdin route and its output route (the interactive path of process handles).

Run standalone (`.venv/bin/python bench/bench_shell.py`, root, starts its own `atoll up`, writes
bench/results/shell.json) or from bench/run_all.py (section `shell`), which calls `run(atoll)`.
Prints one JSON document; progress on stderr. Loopback only: the sandbox has no network policy.

  exec (interleaved, the order rotates each round, one untimed warm-up each; POST /exec → answer):
    argv_true     ["true"]: no shell at all (the floor)
    sh_true       "true" with shell "sh" (dash)
    bash_true     "true" with shell "bash" (`bash -l -c`: /etc/profile, ~/.profile, the re-export)
    sh_echo_path / bash_echo_path   'echo "$PATH"' in each (a command that reads the environment)
  stdin_echo: a background `cat`; per sample POST …/stdin one line, then GET …/output?offset=N
    (no follow) until the line came back (polled back to back) — the wall time of the whole loop.
Ratios are p50 over p50 of the same run: bash_true / sh_true is "the extra cost of bash -l".
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

VARIANTS = {
    "argv_true": {"cmd": ["true"]},
    "sh_true": {"cmd": "true", "shell": "sh"},
    "bash_true": {"cmd": "true", "shell": "bash"},
    "sh_echo_path": {"cmd": 'echo "$PATH"', "shell": "sh"},
    "bash_echo_path": {"cmd": 'echo "$PATH"', "shell": "bash"},
}


def bench_exec(a: c.Atoll, sid: str, n: int) -> dict:
    names = list(VARIANTS)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for name in names:  # warm-up
        a.exec(sid, **VARIANTS[name])
    for i in range(n):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            with c.Timer() as t:
                r = a.exec(sid, **VARIANTS[name])
            if r["exit_code"] != 0:
                raise RuntimeError(f"{name}: exit {r['exit_code']}: {r['stderr']}")
            samples[name].append(t.ms)
    out = {k: c.summarize(v) for k, v in samples.items()}
    out["ratios"] = {
        "bash_true_over_sh_true": c.ratio(out["bash_true"], out["sh_true"]),
        "sh_true_over_argv_true": c.ratio(out["sh_true"], out["argv_true"]),
        "bash_echo_over_sh_echo": c.ratio(out["bash_echo_path"], out["sh_echo_path"]),
    }
    out["extra_ms_bash_over_sh_p50"] = round(out["bash_true"]["p50"] - out["sh_true"]["p50"], 3)
    return out


def bench_stdin_echo(a: c.Atoll, sid: str, n: int) -> dict:
    r = a.api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat"], "background": True})
    r.raise_for_status()
    pid = r.json()["pid"]
    base = f"/v1/sandboxes/{sid}/processes/{pid}"
    offset = 0
    samples = []
    try:
        for i in range(n + 1):
            line = f"line {i}\n".encode()
            got = b""
            with c.Timer() as t:
                a.api.post(f"{base}/stdin", content=line).raise_for_status()
                while len(got) < len(line):
                    out = a.api.get(f"{base}/output", params={"offset": offset})
                    out.raise_for_status()
                    for raw in out.content.split(b"\n"):
                        if raw.strip():
                            obj = json.loads(raw)
                            got += obj.get("stdout", "").encode()
                            offset = obj["offset"]
            if got != line:
                raise RuntimeError(f"stdin echo: sent {line!r}, got {got!r}")
            if i:  # the first is a warm-up
                samples.append(t.ms)
    finally:
        a.api.delete(base)
    return {"round_trip": c.summarize(samples)}


def run(a: c.Atoll, n: int = 40) -> dict:
    sb = a.create()
    sid = sb["id"]
    try:
        c.log(f"shell: exec variants x{n}")
        res = {"exec": bench_exec(a, sid, n)}
        c.log(f"shell: stdin echo x{n}")
        res["stdin_echo"] = bench_stdin_echo(a, sid, n)
    finally:
        a.delete(sid)
    return res


def main() -> int:
    return c.run_main_sized(run, "shell", __doc__.split("\n")[0], full={"n": 40}, quick={"n": 5})


if __name__ == "__main__":
    sys.exit(main())

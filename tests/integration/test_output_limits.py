"""Floods of output: a non-streamed exec keeps a bounded head and tail of each stream (the sandbox and
the server survive), the streamed form still delivers every byte."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run

pytestmark = [pytest.mark.integration, pytest.mark.seam]

MIB = 1024 * 1024
DEFAULT_CAP = MIB  # ATOLL_MAX_EXEC_OUTPUT_KB's default, per stream


def _rss_peak_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def _reset_rss_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def test_40mb_of_binary_output_is_truncated_and_the_sandbox_survives(api, sandbox, atoll_server):
    sid = sandbox["id"]
    run(api, sid, "echo kept > /root/witness")
    server_pid = atoll_server.proc.pid
    _reset_rss_peak(server_pid)
    before = _rss_peak_kb(server_pid)
    cmd = "printf HEAD-MARK; head -c 40M /dev/urandom; printf TAIL-MARK; echo err-head >&2; echo err-tail >&2"
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text[:500]
    grown_mb = (_rss_peak_kb(server_pid) - before) / 1024
    print(f"atoll up's peak RSS grew by {grown_mb:.0f} MB")
    assert len(r.content) < 16 * MIB, f"a bounded answer was {len(r.content)} bytes"
    res = r.json()
    assert res["exit_code"] == 0
    out = res["stdout"]
    assert out.startswith("HEAD-MARK") and out.endswith("TAIL-MARK")
    total = 40 * MIB + len("HEAD-MARK") + len("TAIL-MARK")
    dropped = res["stdout_truncated_bytes"]
    # about all but the cap is dropped (a few bytes more when a cut falls inside a UTF-8 sequence)
    assert total - DEFAULT_CAP <= dropped <= total - DEFAULT_CAP + 8, dropped
    assert f"{dropped} bytes" in out, "the marker names the bytes dropped"
    assert res["stderr"] == "err-head\nerr-tail\n" and res["stderr_truncated_bytes"] == 0
    # the server did not hold the answer several times over (1.5 GB before the fix)
    assert grown_mb < 200, f"atoll up's peak RSS grew by {grown_mb:.0f} MB"
    # the sandbox lives, with its files
    assert run(api, sid, "cat /root/witness")["stdout"] == "kept\n"
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


def test_max_output_bytes_per_call(api, sandbox):
    sid = sandbox["id"]
    res = run(api, sid, "seq 1 100000", max_output_bytes=1000)
    out = res["stdout"]
    assert out.startswith("1\n2\n3\n") and out.endswith("99999\n100000\n")
    full = len("".join(f"{i}\n" for i in range(1, 100001)))
    assert res["stdout_truncated_bytes"] == full - 1000
    small = run(api, sid, "echo hi", max_output_bytes=1000)
    assert small["stdout"] == "hi\n" and small["stdout_truncated_bytes"] == 0
    # above the server's limit, or not a positive integer: 400 with the limit named
    for bad in (64 * MIB, 0, -1, "lots"):
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "max_output_bytes": bad})
        assert r.status_code == 400, r.text
        assert "max_output_bytes" in r.json()["error"]["message"]


def test_streamed_output_is_not_truncated(api, sandbox):
    sid = sandbox["id"]
    n = 40 * MIB
    got = 0
    final = None
    with api.stream(
        "POST",
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": f"head -c {n} /dev/zero | tr '\\0' x"},
        headers={"Accept": "application/x-ndjson"},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            msg = json.loads(line)
            if "stdout" in msg:
                assert set(msg["stdout"]) == {"x"}
                got += len(msg["stdout"])
            else:
                final = msg
    assert got == n
    assert final is not None and final["exit_code"] == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs /proc/<pid>/clear_refs")
def test_server_rss_is_bounded_for_control_character_floods(api, sandbox, atoll_server):
    """A stream of \\x01 bytes is the worst case for JSON escaping (6 bytes each)."""
    sid = sandbox["id"]
    server_pid = atoll_server.proc.pid
    _reset_rss_peak(server_pid)
    before = _rss_peak_kb(server_pid)
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "head -c 40M /dev/zero | tr '\\0' '\\1'"})
    assert r.status_code == 200, r.text[:300]
    grown_mb = (_rss_peak_kb(server_pid) - before) / 1024
    print(f"atoll up's peak RSS grew by {grown_mb:.0f} MB")
    assert grown_mb < 200, f"atoll up's peak RSS grew by {grown_mb:.0f} MB"
    res = r.json()
    assert res["stdout_truncated_bytes"] == 40 * MIB - DEFAULT_CAP
    assert res["stdout"].startswith("\x01" * 1000) and res["stdout"].endswith("\x01" * 1000)

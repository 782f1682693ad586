"""The CPU count programs see matches the sandbox's `cpus` (issue 5 item 2: `nproc` said 2 in a
cpus=1 sandbox, and programs size their thread pools by it): the agent narrows the CPU affinity
every command inherits, after a restore from the template image (made with cpus=1) and a disk
resume alike."""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import run

pytestmark = pytest.mark.integration


def _seen(api, sid: str) -> tuple[str, str]:
    out = run(api, sid, "nproc; python3 -c 'import os; print(len(os.sched_getaffinity(0)))'")
    assert out["exit_code"] == 0, out
    nproc, affinity = out["stdout"].split()
    return nproc, affinity


@pytest.mark.parametrize("cpus", [0.5, 1, 2])
def test_nproc_follows_cpus(api, cpus):
    want = str(max(1, min(int(-(-cpus // 1)), os.cpu_count() or 1)))
    r = api.post("/v1/sandboxes", json={"cpus": cpus, "idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        assert _seen(api, sid) == (want, want)
        assert api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}).status_code == 200
        assert _seen(api, sid) == (want, want)  # after the restore
    finally:
        api.delete(f"/v1/sandboxes/{sid}")

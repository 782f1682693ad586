"""Metering on a real gVisor sandbox (the shared `atoll up`): CPU burnt inside shows up in
`GET /v1/usage` as cpu_seconds from the runtime's cgroup, an idle one records next to none."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.integration

BURN_S = 4.0


def _cpu(api, sid: str) -> float:
    r = api.get("/v1/usage", params={"group_by": "sandbox"})
    assert r.status_code == 200, r.text
    return sum(i["cpu_seconds"] for i in r.json()["items"] if i["sandbox_id"] == sid)


def test_cpu_burnt_in_a_sandbox_is_metered(api):
    made = []
    try:
        for _ in range(2):
            r = api.post("/v1/sandboxes", json={"cpus": 1, "idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            made.append(r.json()["id"])
        hot, idle = made
        time.sleep(6)  # a first usage report of each (every 5 s)
        hot0, idle0 = _cpu(api, hot), _cpu(api, idle)
        code = f"import time\nt = time.time()\nwhile time.time() - t < {BURN_S}:\n    pass\n"
        r = api.post(f"/v1/sandboxes/{hot}/exec", json={"cmd": ["python3", "-c", code]})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        deadline = time.monotonic() + 15
        while _cpu(api, hot) - hot0 < BURN_S * 0.8 and time.monotonic() < deadline:
            time.sleep(0.5)
        burnt = _cpu(api, hot) - hot0
        # the cgroup counts the sentry's own work too; the quota (cpus=1) bounds it by wall time
        assert BURN_S * 0.8 <= burnt <= BURN_S + 6, burnt
        assert _cpu(api, idle) - idle0 < 1.0
    finally:
        for sid in made:
            api.delete(f"/v1/sandboxes/{sid}")

"""Metering on a real gVisor sandbox (the shared `atoll up`): CPU burnt inside shows up in
`GET /v1/usage` as the runtime cgroup's own CPU time (read beside it from cpuacct), and an idle
sandbox records next to none."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from atoll.core import ids

pytestmark = pytest.mark.integration

BURN_S = 3.0
REPORT_S = 5.0  # worker.service.node.USAGE_EVERY_S


def _cpu(api, sid: str) -> float:
    r = api.get("/v1/usage", params={"group_by": "sandbox"})
    assert r.status_code == 200, r.text
    return sum(i["cpu_seconds"] for i in r.json()["items"] if i["sandbox_id"] == sid)


def _cgroup_cpu(home: str, sid: str) -> float:
    with open(os.path.join(home, "sandboxes", sid, "runtime.json")) as f:
        gen = json.load(f)["generation"]
    path = f"/sys/fs/cgroup/cpuacct/atoll-{ids.installation_id(home)}/{sid}-{gen}/cpuacct.usage"
    with open(path) as f:
        return int(f.read()) / 1e9


def test_cpu_burnt_in_a_sandbox_is_the_cgroups_cpu_time(atoll_up):
    home = os.path.realpath(atoll_up.home)
    made = []
    with httpx.Client(base_url=atoll_up.url, headers=atoll_up.headers(), timeout=120) as api:
        try:
            for _ in range(2):
                r = api.post("/v1/sandboxes", json={"cpus": 1, "idle_timeout_s": 0})
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
            hot, idle = made
            time.sleep(REPORT_S + 1)  # a first usage report of each
            hot0, idle0, cg0 = _cpu(api, hot), _cpu(api, idle), _cgroup_cpu(home, hot)
            # a fixed amount of the guest's CPU time, whatever else the machine runs
            code = (
                f"import time\nt = time.process_time()\nwhile time.process_time() - t < {BURN_S}:\n    pass\n"
            )
            r = api.post(f"/v1/sandboxes/{hot}/exec", json={"cmd": ["python3", "-c", code]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            time.sleep(REPORT_S + 1.5)  # the next report after the burn
            burnt, cg = _cpu(api, hot) - hot0, _cgroup_cpu(home, hot) - cg0
            assert cg >= BURN_S * 0.5, (burnt, cg)
            # the same counter, read a report (≤ 5 s of an idle sandbox's CPU) apart
            assert abs(burnt - cg) <= 0.5, (burnt, cg)
            assert _cpu(api, idle) - idle0 < 0.5
        finally:
            for sid in made:
                api.delete(f"/v1/sandboxes/{sid}")

"""The unmodified `e2b` SDK (2.63.0 and 2.31.0, each in its own venv: tests/e2b_venv.py) against
a real `atoll up` (gVisor sandboxes) through atoll's E2B API, served by the edge child process on
ATOLL_E2B_PORT (controlplane.edge_host, e2b.app): create with metadata/envs/timeout, get_info,
list by metadata and paged, set_timeout, pause twice, is_running, connect (resume), metrics, kill
twice; and the SDK's exceptions for a wrong key and unknown ids. The driver runs in the venv
(tests/integration/e2b_sdk_driver.py) and prints what it saw."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests import e2b_venv

DRIVER = Path(__file__).with_name("e2b_sdk_driver.py")
pytestmark = pytest.mark.parametrize("release", ["2.63", "2.31"])


def drive(release: str, atoll_up, scenario: str) -> dict:
    python = e2b_venv.python(release)
    key = atoll_up.api_key
    if release == "2.31":  # it refuses any key but e2b_<hex> client-side (docs/e2b-compat.md §1.11)
        key = "e2b_" + key.encode().hex()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
        "E2B_API_URL": atoll_up.e2b_url,
        "E2B_SANDBOX_URL": atoll_up.e2b_url,
        "E2B_API_KEY": key,
    }
    proc = subprocess.run(
        [str(python), str(DRIVER), scenario], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"driver {scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_control_api_lifecycle(release, atoll_up):
    out = drive(release, atoll_up, "lifecycle")
    sid = out["id"]
    assert out["envd_version"] == "0.5.6"
    assert out["info"]["sandbox_id"] == sid and out["info"]["template_id"] == "base"
    assert out["info"]["metadata"]["odd"] == "a&b=c%" and out["info"]["state"] == "running"
    assert 100 <= out["info"]["end_minus_start_s"] <= 140  # timeout=120 from creation
    assert out["info"]["cpu_count"] >= 1 and out["info"]["memory_mb"] > 0
    assert out["listed"] == [sid]
    assert [len(p) for p in out["pages"]] == [1, 1] and out["first_page_has_next"] is True
    assert 590 <= out["end_after_set_timeout_s"] <= 700
    assert out["pause"] is True and out["state_after_pause"] == "paused"
    assert out["paused_listed"] == [sid]
    assert out["pause_again"] is False  # 409: already paused
    assert out["is_running_paused"] is False  # envd /health 502 while paused
    assert out["connected"] == sid and out["state_after_connect"] == "running"
    assert out["is_running_resumed"] is True
    assert len(out["metrics"]) == 1 and out["metrics"][0]["mem_total"] > 0
    assert out["kill"] is True and out["kill_again"] is False
    r = httpx.get(f"{atoll_up.url}/v1/sandboxes/{sid}", headers=atoll_up.headers())
    assert r.status_code == 404 or r.json()["state"] == "deleted"


def test_errors_arrive_as_the_sdk_exceptions(release, atoll_up):
    out = drive(release, atoll_up, "errors")
    assert out["wrong_key"] == "AuthenticationException"
    assert out["unknown_connect"] in ("NotFoundException", "SandboxNotFoundException")
    assert out["unknown_info"] in ("NotFoundException", "SandboxNotFoundException")
    assert out["unknown_kill"] is False
    assert out["unknown_template"].startswith("SandboxException") and "no-such-template" in out["unknown_template"]

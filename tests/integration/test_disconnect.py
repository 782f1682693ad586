"""A caller that hangs up during an exec gets its command stopped, and the sandbox is idle again."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.conftest import run

pytestmark = pytest.mark.integration


def test_client_disconnect_stops_the_command(api, atoll_server, sandbox):
    sid = sandbox["id"]
    with httpx.Client(base_url=atoll_server.url, headers=atoll_server.headers(), timeout=1.0) as short:
        with pytest.raises(httpx.ReadTimeout):
            short.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 300; touch /tmp/should-not-exist"})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ps = run(api, sid, "ps -eo args")
        assert ps["exit_code"] == 0, ps  # the next command runs at once (it used to wait 60 s, then 137)
        if "sleep 300" not in ps["stdout"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the command of a disconnected caller is still running")
    # Nothing is in flight any more: the sandbox can be paused.
    r = api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
    assert r.status_code == 200, r.text

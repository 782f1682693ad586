"""The CLI against a real `atoll up`: `atoll sandbox create` on a user template still being built
waits (its progress on stderr) and then creates; `metrics`, `update` and global options after the
subcommand work end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.integration


def _cli(atoll_server, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ATOLL_URL", "ATOLL_API_KEY")}
    return subprocess.run(
        [sys.executable, "-m", "atoll", *args, "--url", atoll_server.url, "--api-key", atoll_server.api_key],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_create_waits_for_a_template_being_built_then_metrics_and_update(api, atoll_server):
    name = "cli-wait-" + uuid.uuid4().hex[:8]
    # a step that takes a few seconds and is new (never cached): the build is still running when
    # the CLI's create starts
    r = api.post("/v1/templates", json={"name": name, "run": [f"sleep 4 && echo {name} > /etc/marker"]})
    assert r.status_code == 202, r.text
    sid = None
    try:
        p = _cli(atoll_server, "sandbox", "create", "--template", name, "--idle-timeout", "0")
        assert p.returncode == 0, (p.stdout, p.stderr)
        sid = p.stdout.strip()
        assert f"template {name!r} ready" in p.stderr, p.stderr
        assert (
            api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /etc/marker"}).json()["stdout"]
            == name + "\n"
        )

        p = _cli(atoll_server, "sandbox", "metrics", sid, "--json")
        assert p.returncode == 0, p.stderr
        m = json.loads(p.stdout)
        assert m["state"] == "running" and m["memory_used_mb"] > 0
        p = _cli(atoll_server, "sandbox", "metrics", sid)
        assert "of one core" in p.stdout and "processes" in p.stdout

        p = _cli(atoll_server, "sandbox", "update", sid, "--lifetime", "900", "--on-timeout", "delete")
        assert p.returncode == 0, p.stderr
        body = api.get(f"/v1/sandboxes/{sid}").json()
        assert body["on_timeout"] == "delete" and body["expires_at"] is not None

        p = _cli(atoll_server, "sandbox", "metrics", "sb-zzzzzzzzzzzzzzzz")
        assert p.returncode == 1 and "sandbox_not_found" in p.stderr and "Traceback" not in p.stderr
    finally:
        if sid:
            api.delete(f"/v1/sandboxes/{sid}")
        api.delete(f"/v1/templates/{name}")

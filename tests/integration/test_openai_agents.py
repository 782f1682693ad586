"""`atoll.integrations.openai_agents` against a real atoll (gVisor sandboxes): the OpenAI Agents
SDK 0.24 session lifecycle driven through `AtollSandboxClient` directly (never `Runner.run`; no
model is reachable here), in a venv that has `openai-agents` (tests/agents_venv.py) running the
driver tests/integration/openai_agents_driver.py, with atoll from this checkout."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tests import agents_venv

pytestmark = [pytest.mark.integration, pytest.mark.ecosystem]

DRIVER = Path(__file__).with_name("openai_agents_driver.py")


@pytest.fixture(scope="session")
def agents_python() -> Path:
    return agents_venv.python()


def drive(agents_python: Path, atoll_up, scenario: str, tmp_path: Path) -> dict:
    label = f"openai-agents-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [str(agents_python), str(DRIVER), scenario, str(tmp_path / "snapshots"), label],
        env=agents_venv.env(ATOLL_URL=atoll_up.url, ATOLL_API_KEY=atoll_up.api_key),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"driver {scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["left"] == [], f"sandboxes left behind by {scenario}: {out['left']}"
    return out


def test_session_exec_files_errors_and_pty(agents_python, atoll_up, tmp_path):
    out = drive(agents_python, atoll_up, "basic", tmp_path)
    # the manifest's environment wins over the options' env; commands run in the workspace root
    assert out["echo"] == {"stdout": "hi 1\n/workspace\n", "stderr": "", "exit_code": 0}
    assert out["fail"] == {"stdout": "", "stderr": "oops\n", "exit_code": 3}
    assert out["manifest_file"] == "from the manifest\n"
    assert out["written"] == "written by the agent\n"
    assert out["cat"]["stdout"] == "written by the agent\n"
    assert out["missing"] == "WorkspaceReadNotFoundError"
    assert out["timeout"] == "ExecTimeoutError"
    assert out["supports_pty"] is True
    assert out["pty_started"] == {"live": True, "exit_code": None}
    assert "got:abc" in out["pty"]["output"] and out["pty"]["exit_code"] == 0
    assert out["pty_plain"] == {"output": "one\ntwo\n", "exit_code": 0}
    assert out["running"] is True
    assert out["state_after_close"] == "gone"


def test_pause_on_exit_then_resume_by_state_and_by_id(agents_python, atoll_up, tmp_path):
    out = drive(agents_python, atoll_up, "resume", tmp_path)
    assert out["state_after_close"] == "standby"
    assert out["resumed_same_id"] is True
    assert out["resumed_file"] == "kept\n"
    assert out["state_after_second_close"] == "standby"
    assert out["by_id"] == {"stdout": "kept\n", "stderr": "", "exit_code": 0}
    assert out["state_after_by_id_close"] == "gone"
    assert out["unknown_id"] == "SandboxNotFound"


def test_workspace_snapshots_tar_and_fork_outlive_the_sandbox(agents_python, atoll_up, tmp_path):
    out = drive(agents_python, atoll_up, "snapshot", tmp_path)
    assert out["tar"] == {
        "first_state": "gone",
        "new_sandbox": True,
        "file": "tar-content\n",
        "stored_is_ref": False,
    }
    assert out["fork"] == {
        "first_state": "gone",
        "new_sandbox": True,
        "file": "fork-content\n",
        "stored_is_ref": True,
    }
    assert out["fork_snapshot_state"] == "standby"
    # the resumed session's close parked a new fork, named by the snapshot store: the only one left
    assert out["remaining"] == [[True, "standby"]]


def test_atoll_errors_arrive_as_the_agents_sdk_exceptions_and_ports_as_previews(
    agents_python, atoll_up, tmp_path
):
    out = drive(agents_python, atoll_up, "failures", tmp_path)
    assert out["bad_template"] == "TemplateNotFound"  # create lets atoll's error through, as E2B's does
    assert out["read_dir"] == {
        "type": "WorkspaceArchiveReadError",
        "code": "invalid_path",
        "retryable": False,
    }
    assert out["write_under_file"] == {
        "type": "WorkspaceArchiveWriteError",
        "code": "invalid_path",
        "retryable": False,
    }
    assert (
        out["port"]["host"].startswith("8000-sb-") and out["port"]["tls"] is True and out["port"]["has_query"]
    )
    assert out["unlisted_port"] == "not_configured"
    assert out["unknown_pty"] == "PtySessionNotFoundError"
    assert out["exec_gone"] == {"type": "ExecTransportError", "code": "sandbox_not_found", "retryable": False}
    assert out["running_gone"] is False

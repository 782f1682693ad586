"""The framework-free half of `atoll.integrations.openai_agents` (`_mapping`: options and manifest
environment -> `sandboxes.create` arguments, the Agents SDK's `sudo -u` prefix -> exec's user, fork
snapshot references, atoll error classification), the `openai-agents` extra in pyproject.toml, and
the ImportError a missing extra gives. Runs without openai-agents installed (the main venv has none:
its websockets pin is newer than openai-agents 0.24 allows)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from atoll import errors
from atoll.integrations import _openai_agents_mapping as _mapping

ROOT = Path(__file__).resolve().parents[2]


def test_create_kwargs_pass_only_what_is_set_and_the_manifest_env_wins():
    options = {
        "template": "py",
        "env": {"A": "options", "B": "options"},
        "metadata": {"team": "x"},
        "memory_mb": 1024,
        "cpus": None,
        "network": {"allow_out": ["pypi.org"]},
        "exposed_ports": (8000,),
        "pause_on_exit": True,
        "pause_tier": "disk",
        "workspace_persistence": "fork",
    }
    kwargs = _mapping.create_kwargs(options, {"B": "manifest", "C": "manifest"})
    assert kwargs == {
        "template": "py",
        "metadata": {"team": "x"},
        "memory_mb": 1024,
        "network": {"allow_out": ["pypi.org"]},
        "env": {"A": "options", "B": "manifest", "C": "manifest"},
    }


def test_create_kwargs_without_env_send_none():
    assert _mapping.create_kwargs({"template": "base", "env": None}, {}) == {"template": "base"}


def test_every_create_field_is_an_argument_of_sandboxes_create():
    import inspect

    from atoll._client._async.sandboxes import AsyncSandboxes

    params = inspect.signature(AsyncSandboxes.create).parameters
    assert set(_mapping.CREATE_FIELDS) <= set(params), set(_mapping.CREATE_FIELDS) - set(params)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sh", "-lc", "id -un"], (["sh", "-lc", "id -un"], None)),
        (["sudo", "-u", "alice", "--", "sh", "-lc", "id -un"], (["sh", "-lc", "id -un"], "alice")),
        (["sudo", "-n", "true"], (["sudo", "-n", "true"], None)),  # not the SDK's prefix: left alone
    ],
)
def test_split_user(argv, expected):
    assert _mapping.split_user(argv) == expected


@pytest.mark.parametrize(
    ("timeout", "expected"), [(None, None), (2.5, 2.5), (0, 0.001), (-1, 0.001), (1e9, 86400.0)]
)
def test_exec_timeout_fits_the_servers_bounds(timeout, expected):
    assert _mapping.exec_timeout_s(timeout) == expected


def test_snapshot_reference_round_trip_and_a_tar_is_not_one():
    raw = _mapping.encode_snapshot_ref("sb_abc123")
    assert raw.startswith(_mapping.SNAPSHOT_MAGIC)
    assert _mapping.decode_snapshot_ref(raw) == "sb_abc123"
    assert _mapping.decode_snapshot_ref(b"./\x00\x00\x00" + b"\x00" * 500) is None
    assert _mapping.decode_snapshot_ref(_mapping.SNAPSHOT_MAGIC) is None  # no id: not a reference


@pytest.mark.parametrize(
    ("error", "kind", "retryable"),
    [
        (
            errors.FileNotFound("no such file: /workspace/x", code="file_not_found", status_code=404),
            "not_found",
            False,
        ),
        (errors.APITimeoutError("timed out after 30 s"), "timeout", True),
        (errors.SandboxNotFound("sandbox sb_x not found", code="sandbox_not_found"), "gone", False),
        (errors.SandboxBusy("busy", code="sandbox_busy"), "transport", True),
        (errors.DiskFull("disk full", code="disk_full"), "transport", False),
    ],
)
def test_error_kind_context_and_retryable(error, kind, retryable):
    assert _mapping.error_kind(error) == kind
    assert _mapping.retryable(error) is error.retryable is retryable
    context = _mapping.error_context(error)
    assert (
        context["backend"] == "atoll" and context["code"] == error.code and context["detail"] == error.message
    )


def test_error_context_of_a_non_atoll_error():
    assert _mapping.error_context(OSError("reset")) == {"backend": "atoll", "detail": "OSError: reset"}
    assert _mapping.retryable(OSError("reset")) is None


def test_the_extra_pins_openai_agents_and_fits_its_websockets_range():
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["optional-dependencies"]["openai-agents"] == ["openai-agents==0.24.0"]
    # openai-agents 0.24.0 requires websockets>=15.0,<17: atoll's pin must be a 16.x
    (ws,) = [d for d in project["dependencies"] if d.startswith("websockets")]
    assert ws.startswith("websockets==16."), ws


def test_import_atoll_does_not_import_agents_and_a_missing_extra_says_how_to_install_it():
    code = (
        "import sys, atoll, atoll.integrations\n"
        "assert 'agents' not in sys.modules\n"
        # agents made unimportable even where it is installed: a None entry in sys.modules
        "sys.modules['agents'] = None\n"
        "try:\n"
        "    import atoll.integrations.openai_agents\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'atoll[openai-agents]'" in proc.stdout, proc.stdout + proc.stderr

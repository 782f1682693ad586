"""The CLI's polish: `--version`, shell completion, global options anywhere (cli.argv), the
progress wait of a create on a template being built, `sandbox update` and `sandbox metrics`.
CliRunner over an httpx.MockTransport (tests/unit/test_cli.py's `routes`), plus the real entry
point in a subprocess where argv handling is what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import atoll
from atoll.cli import argv, progress
from tests.unit.test_cli import SANDBOX, Routes, mock_routes, run


@pytest.fixture
def routes(monkeypatch) -> Routes:
    """As tests/unit/test_cli.py's: make_client over a MockTransport answering canned routes."""
    return mock_routes(monkeypatch)


FIGURES = {
    "sandbox_id": "sb_1",
    "state": "running",
    "standby_tier": None,
    "cpu_percent": 97.5,
    "memory_used_mb": 41.2,
    "memory_limit_mb": 512,
    "disk_used_mb": 53.0,
    "disk_limit_mb": 4096,
    "processes": 3,
}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["sandbox", "list", "--url", "U"], ["sandbox", "--url", "U", "list"]),
        (["--url=U", "sandbox", "get", "X"], ["sandbox", "--url=U", "get", "X"]),
        (["sandbox", "list", "--api-key", "K", "--json"], ["sandbox", "--api-key", "K", "list", "--json"]),
        (["--json", "sandbox", "get", "X"], ["sandbox", "get", "X", "--json"]),
        (["secret", "list", "--url", "U"], ["--url", "U", "secret", "list"]),
        (["workers", "--json", "--url", "U"], ["workers", "--url", "U", "--json"]),
        (
            ["sandbox", "exec", "X", "--url", "U", "--", "jq", "--json", "--url", "u2"],
            ["sandbox", "--url", "U", "exec", "X", "--", "jq", "--json", "--url", "u2"],
        ),
        (["sandbox", "list"], ["sandbox", "list"]),
        (["sandbox", "list", "--url"], ["sandbox", "list", "--url"]),  # no value: click says so
    ],
)
def test_normalize_moves_global_options_to_their_owner(given, expected):
    assert argv.normalize(given) == expected


def test_version_and_completion_through_the_real_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "atoll", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == f"atoll {atoll.__version__}"
    script = Path(sys.executable).with_name("atoll")  # the console script: completion is for `atoll`
    out = subprocess.run(
        [str(script), "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        # typer detects the parent's shell unless told not to (then the option takes the shell's
        # name): under `make` the parent is sh, which typer does not support
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert (
        "_ATOLL_COMPLETE=complete_bash" in out.stdout
        and "complete -o default -F _atoll_completion atoll" in out.stdout
    )


def test_global_options_after_the_subcommand_reach_the_server(unused_tcp_port):
    """The real entry point: --url after `list` is used (a refused loopback port, named in the error)."""
    url = f"http://127.0.0.1:{unused_tcp_port}"
    out = subprocess.run(
        [sys.executable, "-m", "atoll", "sandbox", "list", "--url", url, "--api-key", "k"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and url in out.stderr and "Traceback" not in out.stderr


def test_top_level_url_applies_to_every_group(routes):
    routes.on("GET", "/v1/sandboxes", httpx.Response(200, json={"items": []}))
    routes.on("GET", "/v1/secrets", httpx.Response(200, json={"items": []}))
    assert (
        run(*argv.normalize(["sandbox", "list", "--url", "http://a.test", "--api-key", "k"])).exit_code == 0
    )
    assert routes.factory_args[-1] == ("http://a.test", "k")
    assert run("--url", "http://b.test", "sandbox", "list").exit_code == 0
    assert routes.factory_args[-1] == ("http://b.test", None)
    assert run(*argv.normalize(["secret", "list", "--url", "http://c.test"])).exit_code == 0
    assert routes.factory_args[-1] == ("http://c.test", None)


def test_create_with_a_lifetime(routes):
    routes.on("POST", "/v1/sandboxes", httpx.Response(201, json=SANDBOX))
    result = run("sandbox", "create", "--lifetime", "300", "--on-timeout", "delete")
    assert result.exit_code == 0, result.output
    body = json.loads(routes.last.content)
    assert body["timeout_s"] == 300 and body["on_timeout"] == "delete"
    result = run("sandbox", "create", "--on-timeout", "explode")
    assert result.exit_code == 2 and "explode" in result.output
    result = run("sandbox", "create", "--on-worker-lost", "restore")
    assert result.exit_code == 0 and json.loads(routes.last.content)["on_worker_lost"] == "restore"
    result = run("sandbox", "create", "--on-worker-lost", "pray")
    assert result.exit_code == 2 and "pray" in result.output


def test_create_waits_for_a_template_being_built(routes, monkeypatch):
    answers = iter(
        [
            {"name": "py", "status": "building", "progress": "apt: 10/40\nsteps: 2/5"},
            {"name": "py", "status": "building", "progress": "steps: 4/5"},
            {"name": "py", "status": "ready", "progress": ""},
        ]
    )
    seen = []

    class Templates:
        def __call__(self, request):
            seen.append(request.url.path)
            if request.url.path == "/v1/templates/py":
                return httpx.Response(200, json=next(answers))
            return httpx.Response(201, json=SANDBOX)

    monkeypatch.setattr(progress, "POLL_S", 0.0)
    handler = Templates()
    routes.routes.clear()
    monkeypatch.setattr(type(routes), "__call__", lambda self, req: handler(req))
    result = run("sandbox", "create", "--template", "py")
    assert result.exit_code == 0, result.output
    assert seen == ["/v1/templates/py"] * 3 + ["/v1/sandboxes"]  # waited, then created
    assert "template 'py' ready" in result.stderr


def test_update_and_metrics(routes):
    routes.on("PATCH", "/v1/sandboxes/sb_1", httpx.Response(200, json={**SANDBOX, "on_timeout": "delete"}))
    result = run("sandbox", "update", "sb_1", "--lifetime", "60", "--on-timeout", "delete")
    assert result.exit_code == 0, result.output
    assert json.loads(routes.last.content) == {"timeout_s": 60.0, "on_timeout": "delete"}
    result = run("sandbox", "update", "sb_1", "--no-lifetime")
    assert json.loads(routes.last.content) == {"timeout_s": None}
    result = run("sandbox", "update", "sb_1", "--on-worker-lost", "fail")
    assert result.exit_code == 0 and json.loads(routes.last.content) == {"on_worker_lost": "fail"}
    assert run("sandbox", "update", "sb_1", "--no-lifetime", "--lifetime", "5").exit_code == 2

    routes.on("GET", "/v1/sandboxes/sb_1/metrics", httpx.Response(200, json=FIGURES))
    result = run("sandbox", "metrics", "sb_1")
    assert result.exit_code == 0, result.output
    for text in ("97.5% of one core", "41.2 / 512 MB", "53.0 / 4096 MB", "processes"):
        assert text in result.stdout
    result = run("sandbox", "metrics", "sb_1", "--json")
    assert json.loads(result.stdout) == FIGURES
    result = run("sandbox", "metrics", "sb_nope")
    assert result.exit_code == 1 and "error: not_found" in result.stderr


def test_shell_size_falls_back_to_80x24_for_an_unsized_terminal():
    import fcntl
    import struct
    import termios

    from atoll.cli import shell

    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        assert shell._size(slave) == (80, 24)  # was (1, 1): an unusable remote terminal
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 132, 0, 0))
        assert shell._size(slave) == (132, 50)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 5000, 0, 0, 0))
        assert shell._size(slave) == (80, 1000)
    finally:
        os.close(master)
        os.close(slave)

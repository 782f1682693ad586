"""Unit tests of the `atoll` CLI (`atoll.cli.main`), run with typer's CliRunner.

Hermetic: `atoll.cli.main.make_client` is monkeypatched to build an SDK client over an
`httpx.MockTransport` whose handler answers from canned routes and records the requests;
`atoll up` is tested against a stand-in `atoll.up` module.
"""

from __future__ import annotations

import json
import sys
import types

import httpx
import pytest
from typer.testing import CliRunner

import atoll
from atoll.cli import argv as cli_argv
from atoll.cli import main as cli

NDJSON = "application/x-ndjson"
SANDBOX = {
    "id": "sb_1",
    "state": "running",
    "standby_tier": None,
    "standby_reason": None,
    "template": "base",
    "metadata": {"team": "x"},
    "created_at": "2026-01-01T00:00:00Z",
}


def api_error(status: int, code: str, message: str) -> httpx.Response:
    """An API error response as the server writes one (request id `r`)."""
    return httpx.Response(status, json={"error": {"code": code, "message": message, "request_id": "r"}})


class Routes:
    """A MockTransport handler: `(METHOD, path) -> Response` routes, every request recorded."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], httpx.Response] = {}
        self.requests: list[httpx.Request] = []
        self.factory_args: list[tuple[str | None, str | None]] = []

    def on(self, method: str, path: str, response: httpx.Response) -> None:
        self.routes[(method, path)] = response

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        route = self.routes.get((request.method, request.url.path))
        if route is None:
            return api_error(404, "not_found", "no route")
        return route

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]


def mock_routes(monkeypatch) -> Routes:
    """ATOLL_URL and ATOLL_API_KEY unset, and `make_client` patched to build an SDK client over a
    MockTransport answering the returned Routes (its url and key recorded in `factory_args`). For
    the `routes` fixtures of the CLI's unit tests."""
    monkeypatch.delenv("ATOLL_URL", raising=False)
    monkeypatch.delenv("ATOLL_API_KEY", raising=False)
    r = Routes()

    def make_client(url, api_key, ca_file=None):
        r.factory_args.append((url, api_key))
        return atoll.Client(url or "http://atoll.test", api_key, transport=httpx.MockTransport(r))

    monkeypatch.setattr(cli, "make_client", make_client)
    return r


@pytest.fixture
def routes(monkeypatch) -> Routes:
    return mock_routes(monkeypatch)


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli.app, list(args), env=env)


def _stream(*objs: dict) -> httpx.Response:
    body = "".join(json.dumps(o) + "\n" for o in objs)
    return httpx.Response(200, content=body.encode(), headers={"content-type": NDJSON})


def test_create_prints_id_and_sends_options(routes):
    routes.on("POST", "/v1/sandboxes", httpx.Response(201, json=SANDBOX))
    result = run(
        "sandbox",
        "create",
        "--env",
        "A=1",
        "--env",
        "B=x=y",
        "--metadata",
        "team=x",
        "--idle-timeout",
        "30",
        "--memory-mb",
        "256",
        "--cpus",
        "2",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == "sb_1\n"
    assert json.loads(routes.last.content) == {
        "template": "base",
        "env": {"A": "1", "B": "x=y"},
        "metadata": {"team": "x"},
        "idle_timeout_s": 30.0,
        "memory_mb": 256,
        "cpus": 2.0,
    }
    result = run("sandbox", "create", "--template", "py", "--json")
    assert json.loads(result.stdout)["id"] == "sb_1"
    assert json.loads(routes.last.content) == {"template": "py"}


def test_bad_pair_is_a_usage_error(routes):
    result = run("sandbox", "create", "--env", "NOEQUALS")
    assert result.exit_code == 2
    assert "KEY=VALUE" in result.output
    assert routes.requests == []


def test_list_table_and_json(routes):
    other = {**SANDBOX, "id": "sb_2", "state": "standby", "standby_tier": "disk", "metadata": {}}
    routes.on("GET", "/v1/sandboxes", httpx.Response(200, json={"items": [SANDBOX, other]}))
    result = run("sandbox", "list", "--state", "running", "--metadata", "team=x")
    assert result.exit_code == 0, result.output
    assert routes.last.url.params["state"] == "running"
    assert routes.last.url.params["metadata.team"] == "x"
    for text in ("ID", "STATE", "sb_1", "sb_2", "standby", "disk", "team=x"):
        assert text in result.stdout
    result = run("sandbox", "list", "--json")
    assert [s["id"] for s in json.loads(result.stdout)] == ["sb_1", "sb_2"]
    routes.on("GET", "/v1/sandboxes", httpx.Response(200, json={"items": []}))
    result = run("sandbox", "list")
    assert result.exit_code == 0 and result.stdout == "" and "no sandboxes" in result.stderr


def test_get_prints_json(routes):
    routes.on("GET", "/v1/sandboxes/sb_1", httpx.Response(200, json=SANDBOX))
    result = run("sandbox", "get", "sb_1")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == SANDBOX


def test_exec_streams_output_and_exits_with_its_code(routes):
    routes.on(
        "POST",
        "/v1/sandboxes/sb_1/exec",
        _stream(
            {"stdout": "hello "},
            {"stderr": "warn\n"},
            {"stdout": "world\n"},
            {"exit_code": 7, "timed_out": False},
        ),
    )
    result = run(
        "sandbox", "exec", "sb_1", "--timeout", "5", "--env", "K=V", "--cwd", "/tmp", "--", "ls", "-la"
    )
    assert result.exit_code == 7
    assert result.stdout == "hello world\n" and result.stderr == "warn\n"
    assert routes.last.headers["accept"] == NDJSON
    assert json.loads(routes.last.content) == {
        "cmd": ["ls", "-la"],
        "timeout_s": 5.0,
        "env": {"K": "V"},
        "cwd": "/tmp",
    }


def test_exec_forwards_stdin_that_is_not_a_terminal(routes):
    routes.on("POST", "/v1/sandboxes/sb_1/exec", _stream({"stdout": "HI\n"}, {"exit_code": 0}))
    result = CliRunner().invoke(
        cli.app, ["sandbox", "exec", "sb_1", "--shell", "sh", "--", "tr a-z A-Z"], input="hi\n"
    )
    assert result.exit_code == 0 and result.stdout == "HI\n"
    assert json.loads(routes.last.content) == {"cmd": "tr a-z A-Z", "stdin": "hi\n", "shell": "sh"}
    result = CliRunner().invoke(
        cli.app, ["sandbox", "exec", "sb_1", "--no-stdin", "--", "cat"], input="ignored"
    )
    assert result.exit_code == 0 and "stdin" not in json.loads(routes.last.content)


def test_exec_command_forms(routes):
    routes.on("POST", "/v1/sandboxes/sb_1/exec", _stream({"exit_code": 0}))
    assert run("sandbox", "exec", "sb_1", "--", "echo $HOME | wc -c").exit_code == 0
    assert json.loads(routes.last.content)["cmd"] == "echo $HOME | wc -c"
    assert run("sandbox", "exec", "sb_1", "--", "true").exit_code == 0
    assert json.loads(routes.last.content)["cmd"] == ["true"]
    assert run("sandbox", "exec", "sb_1", "--", "echo", "a b").exit_code == 0
    assert json.loads(routes.last.content)["cmd"] == ["echo", "a b"]


@pytest.mark.parametrize(
    ("final", "status"),
    [
        ({"exit_code": 0, "timed_out": False}, 0),
        ({"exit_code": 137, "timed_out": True}, 137),
        ({"exit_code": None, "timed_out": True}, 124),
        ({"exit_code": -9, "timed_out": False}, 137),
    ],
)
def test_exec_exit_status(routes, final, status):
    routes.on("POST", "/v1/sandboxes/sb_1/exec", _stream(final))
    result = run("sandbox", "exec", "sb_1", "--", "x")
    assert result.exit_code == status
    assert ("timed_out" in result.stderr) == final["timed_out"]


def test_exec_stream_error_is_reported(routes):
    routes.on(
        "POST",
        "/v1/sandboxes/sb_1/exec",
        _stream({"stdout": "part"}, {"error": {"code": "runtime_error", "message": "exec stream broke"}}),
    )
    result = run("sandbox", "exec", "sb_1", "--", "x")
    assert result.exit_code == 1
    assert result.stdout == "part"
    assert result.stderr == "error: runtime_error: exec stream broke\n"


def test_network_options(routes):
    routes.on("POST", "/v1/sandboxes", httpx.Response(201, json=SANDBOX))
    result = run(
        "sandbox",
        "create",
        "--allow-out",
        "pypi.org",
        "--allow-out",
        "*.github.com:443",
        "--deny-out",
        "x.org",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(routes.last.content)["network"] == {
        "allow_out": ["pypi.org", "*.github.com:443"],
        "deny_out": ["x.org"],
    }
    applied = {"allow_out": ["pypi.org"], "deny_out": []}
    routes.on("PUT", "/v1/sandboxes/sb_1/network", httpx.Response(200, json=applied))
    result = run("sandbox", "network", "sb_1", "--allow-out", "PyPI.org")
    assert result.exit_code == 0 and json.loads(result.stdout) == applied
    assert json.loads(routes.last.content) == {"allow_out": ["PyPI.org"], "deny_out": []}
    routes.on("GET", "/v1/sandboxes/sb_1", httpx.Response(200, json={**SANDBOX, "network": applied}))
    result = run("sandbox", "network", "sb_1", "--show")
    assert json.loads(result.stdout) == applied and routes.last.method == "GET"


def test_pause_resume_rm(routes):
    paused = {**SANDBOX, "state": "standby", "standby_tier": "disk"}
    routes.on("POST", "/v1/sandboxes/sb_1/pause", httpx.Response(200, json=paused))
    routes.on("POST", "/v1/sandboxes/sb_1/resume", httpx.Response(200, json=SANDBOX))
    routes.on("DELETE", "/v1/sandboxes/sb_1", httpx.Response(204))
    result = run("sandbox", "pause", "sb_1", "--tier", "disk")
    assert result.exit_code == 0 and result.stdout == "sb_1 standby (disk)\n"
    assert json.loads(routes.last.content) == {"tier": "disk"}
    assert run("sandbox", "pause", "sb_1").exit_code == 0
    assert json.loads(routes.last.content) == {"tier": "memory"}
    assert run("sandbox", "pause", "sb_1", "--tier", "swap").exit_code == 2
    routes.on(
        "POST", "/v1/sandboxes/sb_1/pause", httpx.Response(200, json={**paused, "standby_tier": "archive"})
    )
    result = run("sandbox", "pause", "sb_1", "--tier", "archive")
    assert result.exit_code == 0 and result.stdout == "sb_1 standby (archive)\n"
    assert json.loads(routes.last.content) == {"tier": "archive"}
    result = run("sandbox", "resume", "sb_1")
    assert result.exit_code == 0 and result.stdout == "sb_1 running\n"
    result = run("sandbox", "rm", "sb_1")
    assert result.exit_code == 0 and routes.last.method == "DELETE"


def test_api_errors_print_code_and_message_without_traceback(routes):
    routes.on(
        "GET",
        "/v1/sandboxes/sb_9",
        httpx.Response(
            404, json={"error": {"code": "sandbox_not_found", "message": "sandbox sb_9 not found"}}
        ),
    )
    result = run("sandbox", "get", "sb_9")
    assert result.exit_code == 1
    assert result.stderr == "error: sandbox_not_found: sandbox sb_9 not found\n"
    assert "Traceback" not in result.output and result.stdout == ""


def test_connection_error_is_reported(monkeypatch):
    def refused(request):
        raise httpx.ConnectError("Connection refused")

    monkeypatch.setattr(
        cli,
        "make_client",
        lambda url, key, ca_file=None: atoll.Client(
            "http://127.0.0.1:1", transport=httpx.MockTransport(refused)
        ),
    )
    result = run("sandbox", "list")
    assert result.exit_code == 1
    assert result.stderr.startswith(
        "error: connection_error: cannot connect to the atoll server at http://127.0.0.1:1"
    )
    assert "atoll up" in result.stderr


def test_url_and_api_key_options_and_env(routes):
    routes.on("GET", "/v1/sandboxes", httpx.Response(200, json={"items": []}))
    run("sandbox", "--url", "http://x.test", "--api-key", "k1", "list")
    assert routes.factory_args[-1] == ("http://x.test", "k1")
    assert routes.last.headers["authorization"] == "Bearer k1"
    assert str(routes.last.url).startswith("http://x.test/v1/sandboxes")
    run("sandbox", "list", env={"ATOLL_URL": "http://env.test", "ATOLL_API_KEY": "k2"})
    assert routes.factory_args[-1] == ("http://env.test", "k2")
    run("sandbox", "list")
    assert routes.factory_args[-1] == (None, None)


def test_make_client_uses_the_sdk_defaults(monkeypatch):
    monkeypatch.setenv("ATOLL_URL", "http://from-env.test")
    with cli.make_client(None, None) as client:
        assert client.base_url == "http://from-env.test"
    with cli.make_client("http://given.test/", "k") as client:
        assert client.base_url == "http://given.test"


def test_up_calls_the_server_module(monkeypatch, tmp_path):
    calls = []
    fake_up = types.ModuleType("atoll.up")
    fake_up.main = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "atoll.up", fake_up)
    monkeypatch.setattr(atoll, "up", fake_up, raising=False)
    result = run("up", "--port", "9000", "--home", str(tmp_path), "--host", "0.0.0.0", "--slots", "8")
    assert result.exit_code == 0, result.output
    assert calls == [{"port": 9000, "home": str(tmp_path), "host": "0.0.0.0", "slots": 8}]
    run("up")
    assert calls[-1] == {"port": None, "home": None, "host": None, "slots": None}


def test_worker_passes_its_slots(monkeypatch):
    import atoll.worker.service as service

    calls = []
    fake = types.ModuleType("atoll.worker.service.main")
    fake.main = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "atoll.worker.service.main", fake)
    monkeypatch.setattr(service, "main", fake, raising=False)
    result = run("worker", "--server", "http://127.0.0.1:7080", "--slots", "4")
    assert result.exit_code == 0, result.output
    assert calls[-1]["slots"] == 4 and calls[-1]["server"] == "http://127.0.0.1:7080"
    run("worker", "--server", "http://127.0.0.1:7080")
    assert calls[-1]["slots"] is None  # the worker's settings read ATOLL_WORKER_SLOTS then


def test_up_without_the_server_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "atoll.up", None)
    monkeypatch.delattr(atoll, "up", raising=False)
    result = run("up")
    assert result.exit_code == 1
    assert "pip install 'atoll[server]'" in result.stderr
    assert "Traceback" not in result.output


def test_mcp_passes_the_connection_and_its_options(monkeypatch):
    import atoll.integrations

    calls = []
    fake = types.ModuleType("atoll.integrations.mcp")
    fake.main = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "atoll.integrations.mcp", fake)
    monkeypatch.setattr(atoll.integrations, "mcp", fake, raising=False)
    argv = cli_argv.normalize(["mcp", "--url", "http://a:1", "--api-key", "k", "--ca-file", "/ca.pem"])
    assert argv == ["--url", "http://a:1", "--api-key", "k", "--ca-file", "/ca.pem", "mcp"]
    result = run(*argv)
    assert result.exit_code == 0, result.output
    assert calls[-1] == {
        "url": "http://a:1",
        "api_key": "k",
        "ca_file": "/ca.pem",
        "http": False,
        "host": "127.0.0.1",
        "port": 7090,
    }
    result = run("mcp", "--http", "--host", "::1", "--port", "9000")
    assert result.exit_code == 0, result.output
    assert calls[-1] == {
        "url": None,
        "api_key": None,
        "ca_file": None,
        "http": True,
        "host": "::1",
        "port": 9000,
    }
    assert run("mcp", "--http", "--port", "0").exit_code == 2  # a port outside 1-65535 is refused
    assert " mcp " in run("--help").stdout


def test_mcp_without_the_mcp_extra(monkeypatch):
    import atoll.integrations

    monkeypatch.setitem(sys.modules, "atoll.integrations.mcp", None)
    monkeypatch.delattr(atoll.integrations, "mcp", raising=False)
    result = run("mcp")
    assert result.exit_code == 2
    assert "pip install 'atoll[mcp]'" in result.stderr
    assert "Traceback" not in result.output


def test_help_lists_commands():
    result = run("sandbox", "--help")
    assert result.exit_code == 0
    for name in ("create", "list", "get", "exec", "pause", "resume", "rm"):
        assert name in result.stdout

"""Unit tests of `atoll worker drain NAME` (atoll.cli.workers) with typer's CliRunner over an
`httpx.MockTransport`: the name is found in the list, what each flag sends, what stays is
printed with its reason, an unknown name is a clear error."""

from __future__ import annotations

import json
import sys
import types

import httpx
import pytest

import atoll
from atoll.cli import main as cli
from atoll.cli import workers as workers_cli

from .test_cli import Routes, mock_routes, run

WID = "wk-aaaaaaaaaaaaaaaa"
W = {"id": WID, "name": "w1", "state": "ready", "sandboxes": 2, "evacuated": False, "evacuation": None}


@pytest.fixture
def routes(monkeypatch) -> Routes:
    r = mock_routes(monkeypatch)
    r.on("GET", "/v1/workers", httpx.Response(200, json={"items": [W], "next_cursor": None}))
    return r


def test_drain_evacuates_by_default_and_prints_what_stays(routes):
    ev = {
        "state": "done",
        "moved": 1,
        "left": [{"id": "sb-bbbbbbbbbbbbbbbb", "reason": "kept in the memory tier: epoll"}],
        "pool_members_dropped": 0,
        "started_at": "x",
        "finished_at": "y",
    }
    routes.on(
        "POST",
        f"/v1/workers/{WID}/drain",
        httpx.Response(202, json={**W, "state": "draining", "sandboxes": 1, "evacuation": ev}),
    )
    result = run("worker", "drain", "w1")
    assert result.exit_code == 0, result.output
    assert json.loads(routes.last.content) == {"draining": True, "evacuate": True}
    assert (
        "1 moved, 1 left" in result.stdout and "sb-bbbbbbbbbbbbbbbb: kept in the memory tier" in result.stdout
    )
    routes.on("GET", f"/v1/workers/{WID}", httpx.Response(200, json={**W, "evacuation": ev}))
    assert run("worker", "drain", "w1", "--wait").exit_code == 2  # something stayed


def test_a_resumed_evacuation_shows_what_is_to_go():
    ev = {"state": "running", "moved": 2, "pending": 3, "left": [], "resumed_at": "2026-12-06T01:00:00+00:00"}
    line = workers_cli._summary({**W, "state": "draining", "evacuation": ev})
    assert "2 moved, 0 left, 3 to go (resumed 2026-12-06T01:00:00+00:00)" in line, line


def test_no_evacuate_and_undo(routes):
    routes.on("POST", f"/v1/workers/{WID}/drain", httpx.Response(202, json={**W, "state": "draining"}))
    assert run("worker", "drain", WID, "--no-evacuate").exit_code == 0
    assert json.loads(routes.last.content) == {"draining": True, "evacuate": False}
    routes.on("POST", f"/v1/workers/{WID}/drain", httpx.Response(200, json=W))
    result = run("worker", "drain", "w1", "--undo")
    assert result.exit_code == 0 and "w1: ready" in result.stdout, result.output
    assert json.loads(routes.last.content) == {"draining": False}


@pytest.mark.parametrize("flag", ["--no-evacuate", "--wait"])
def test_undo_with_a_drain_flag_is_a_usage_error(routes, flag):
    result = run("worker", "drain", "w1", "--undo", flag)
    assert result.exit_code == 2, result.output
    assert "--undo" in result.output and flag in result.output and "drain only" in result.output
    assert routes.requests == []  # nothing was sent


def test_an_unknown_worker_is_a_clear_error(routes):
    result = run("worker", "drain", "nope")
    assert result.exit_code == 1 and "no worker named 'nope' (known: w1)" in result.output


def test_drain_and_a_worker_take_the_ca_file_and_connection_given_to_atoll(monkeypatch):
    """cli.argv moves `--url`, `--api-key` and `--ca-file` of `atoll worker …` in front of
    `worker`: drain and a worker read them from there."""
    seen: list[tuple] = []

    def make_client(url, api_key, ca_file=None):
        seen.append((url, api_key, ca_file))
        return atoll.Client("http://atoll.test", api_key, transport=httpx.MockTransport(lambda r: None))

    monkeypatch.setattr(cli, "make_client", make_client)
    result = run("--url", "https://u.test", "--api-key", "k", "--ca-file", "/ca.pem", "worker", "drain", "w1")
    assert seen == [("https://u.test", "k", "/ca.pem")], result.output

    started: list[dict] = []
    fake = types.ModuleType("atoll.worker.service.main")
    fake.main = lambda **kw: started.append(kw)
    import atoll.worker.service as service

    monkeypatch.setattr(service, "main", fake, raising=False)
    monkeypatch.setitem(sys.modules, "atoll.worker.service.main", fake)
    result = run("--ca-file", "/ca.pem", "worker", "--server", "https://u.test")
    assert result.exit_code == 0, result.output
    assert started and started[0]["ca_file"] == "/ca.pem"
    started.clear()
    run("--ca-file", "/ca.pem", "worker", "--server", "https://u.test", "--ca-file", "/own.pem")
    assert started[0]["ca_file"] == "/own.pem"

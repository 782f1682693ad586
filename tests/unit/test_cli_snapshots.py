"""Unit tests of `atoll snapshot ...` and `atoll sandbox create --snapshot` (atoll.cli.snapshots)
with typer's CliRunner over an `httpx.MockTransport`: what each command sends and prints."""

from __future__ import annotations

import json

import httpx
import pytest

from .test_cli import Routes, api_error, mock_routes, run

SID = "sb-aaaaaaaaaaaaaaaa"
SNAP = {
    "id": "snp-0123456789abcdef",
    "name": "base-1",
    "names": ["base-1"],
    "tenant_id": "default",
    "sandbox_id": SID,
    "template": "base",
    "memory": True,
    "memory_mb": 512,
    "bytes": 3 * 2**20,
    "worker": "local",
    "created_at": "2026-12-07T03:00:00+00:00",
}


@pytest.fixture
def routes(monkeypatch) -> Routes:
    return mock_routes(monkeypatch)


def test_snapshot_create_sends_name_kind_and_replace_and_prints_the_id(routes):
    routes.on("POST", f"/v1/sandboxes/{SID}/snapshots", httpx.Response(201, json=SNAP))
    result = run("snapshot", "create", SID, "--name", "base-1")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == SNAP["id"]
    assert json.loads(routes.last.content) == {"name": "base-1", "memory": True}
    assert run("snapshot", "create", SID, "--files-only", "--replace", "--name", "x").exit_code == 0
    assert json.loads(routes.last.content) == {"name": "x", "memory": False, "replace": True}


def test_snapshot_list_get_rm_and_a_create_from_one(routes):
    routes.on("GET", "/v1/snapshots", httpx.Response(200, json={"items": [SNAP], "next_cursor": None}))
    result = run("snapshot", "list", "--sandbox", SID)
    assert result.exit_code == 0, result.output
    assert SNAP["id"] in result.stdout and "base-1" in result.stdout and "memory" in result.stdout
    header, row = result.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "TENANT", "SANDBOX", "KIND", "MB", "CREATED"]
    assert row.split()[:4] == [SNAP["id"], "base-1", "default", SID]
    assert routes.last.url.params["sandbox_id"] == SID
    routes.on("GET", f"/v1/snapshots/{SNAP['id']}", httpx.Response(200, json=SNAP))
    assert json.loads(run("snapshot", "get", SNAP["id"]).stdout)["id"] == SNAP["id"]
    routes.on("DELETE", f"/v1/snapshots/{SNAP['id']}", httpx.Response(204))
    assert run("snapshot", "rm", SNAP["id"]).exit_code == 0
    routes.on(
        "POST", "/v1/sandboxes", httpx.Response(201, json={"id": "sb-bbbbbbbbbbbbbbbb", "state": "running"})
    )
    result = run("sandbox", "create", "--snapshot", "base-1")
    assert result.exit_code == 0, result.output
    assert json.loads(routes.last.content) == {"snapshot": "base-1"}
    routes.on(
        "DELETE",
        f"/v1/snapshots/{SNAP['id']}",
        api_error(404, "snapshot_not_found", "gone"),
    )
    result = run("snapshot", "rm", SNAP["id"])
    assert result.exit_code == 1 and "snapshot_not_found" in result.output


def test_snapshot_get_and_rm_take_a_name_quoting_its_slash(routes):
    named = {**SNAP, "name": "team/web:v1", "names": ["team/web:v1"]}
    routes.on("GET", "/v1/snapshots/team/web:v1", httpx.Response(200, json=named))
    result = run("snapshot", "get", "team/web:v1")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["id"] == SNAP["id"]
    assert routes.last.url.raw_path == b"/v1/snapshots/team%2Fweb%3Av1"  # one segment on the wire
    routes.on("DELETE", "/v1/snapshots/team/web:v1", httpx.Response(204))
    result = run("snapshot", "rm", "team/web:v1")
    assert result.exit_code == 0 and result.stdout.strip() == "team/web:v1", result.output
    assert routes.last.method == "DELETE" and routes.last.url.raw_path == b"/v1/snapshots/team%2Fweb%3Av1"

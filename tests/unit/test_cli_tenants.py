"""Unit tests of `atoll tenant ...` and `atoll key ...` (atoll.cli.tenants) with typer's CliRunner
over an `httpx.MockTransport`: what each command sends, what it prints (a key once, on stdout,
its id and warning on stderr), lists that follow every page, and bad usage."""

from __future__ import annotations

import json

import httpx
import pytest

import atoll
from atoll.cli import main as cli

from .test_cli import Routes, api_error, mock_routes, run


@pytest.fixture
def routes(monkeypatch) -> Routes:
    return mock_routes(monkeypatch)


TENANT = {"id": "tn-aaaaaaaaaaaaaaaa", "name": "acme", "quotas": {"max_running": 2}}
KEY = {
    "id": "ak-bbbbbbbbbbbbbbbb",
    "key": "atk_ak-bbbbbbbbbbbbbbbb_secret",
    "scope": "tenant",
    "tenant_id": TENANT["id"],
    "expires_at": None,
    "revoked_at": None,
}


def _body(r: Routes) -> dict:
    return json.loads(r.last.content)


def test_tenant_create_sends_quotas_and_prints_the_id(routes):
    routes.on("POST", "/v1/tenants", httpx.Response(201, json=TENANT))
    result = run("tenant", "create", "acme", "--max-running", "2", "--max-memory-mb", "4096")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == TENANT["id"]
    assert _body(routes) == {"name": "acme", "quotas": {"max_running": 2, "max_memory_mb": 4096}}
    assert run("tenant", "create", "bare").exit_code == 0
    assert _body(routes) == {"name": "bare"}
    result = run("tenant", "create", "snaps", "--max-snapshots", "10", "--max-snapshot-gb", "2.5")
    assert result.exit_code == 0, result.output
    assert _body(routes) == {"name": "snaps", "quotas": {"max_snapshots": 10, "max_snapshot_gb": 2.5}}


def test_tenant_list_follows_pages_and_prints_a_table(monkeypatch):
    pages = {
        None: {"items": [TENANT], "next_cursor": "c1"},
        "c1": {
            "items": [{**TENANT, "id": "tn-cccccccccccccccc", "name": "other", "quotas": {}}],
            "next_cursor": None,
        },
    }
    seen: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.params.get("cursor"))
        return httpx.Response(200, json=pages[request.url.params.get("cursor")])

    monkeypatch.setattr(
        cli,
        "make_client",
        lambda url, key, ca_file=None: atoll.Client(
            "http://atoll.test", "k", transport=httpx.MockTransport(handle)
        ),
    )
    result = run("tenant", "list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "QUOTAS"]
    assert (
        "acme" in lines[1] and "max_running=2" in lines[1] and "other" in lines[2] and lines[2].endswith("-")
    )
    assert seen == [None, "c1"]
    result = run("tenant", "list", "--json")
    assert [t["name"] for t in json.loads(result.stdout)] == ["acme", "other"]


def test_tenant_update_and_rm(routes):
    routes.on("PATCH", f"/v1/tenants/{TENANT['id']}", httpx.Response(200, json=TENANT))
    routes.on("DELETE", f"/v1/tenants/{TENANT['id']}", httpx.Response(204))
    assert (
        run("tenant", "update", TENANT["id"], "--max-running", "5", "--unset", "max-memory-mb").exit_code == 0
    )
    assert _body(routes) == {"quotas": {"max_running": 5, "max_memory_mb": None}}
    args = ("tenant", "update", TENANT["id"], "--max-snapshot-gb", "4", "--unset", "max-snapshots")
    assert run(*args).exit_code == 0
    assert _body(routes) == {"quotas": {"max_snapshot_gb": 4, "max_snapshots": None}}
    assert run("tenant", "update", TENANT["id"]).exit_code == 2  # nothing to change
    assert run("tenant", "update", TENANT["id"], "--unset", "bogus").exit_code == 2
    result = run("tenant", "rm", TENANT["id"])
    assert result.exit_code == 0 and result.stdout.strip() == TENANT["id"]
    assert routes.last.method == "DELETE"


def test_key_create_prints_the_key_once_on_stdout(routes):
    routes.on("POST", f"/v1/tenants/{TENANT['id']}/keys", httpx.Response(201, json=KEY))
    result = run("key", "create", "--tenant", TENANT["id"], "--expires", "2030-01-01T00:00:00Z")
    assert result.exit_code == 0, result.output
    assert result.stdout == KEY["key"] + "\n"
    assert "shown only this once" in result.stderr and KEY["id"] in result.stderr
    assert _body(routes) == {"expires_at": "2030-01-01T00:00:00Z"}
    routes.on("POST", "/v1/keys", httpx.Response(201, json={**KEY, "scope": "worker", "tenant_id": None}))
    assert run("key", "create", "--scope", "worker").exit_code == 0
    assert _body(routes) == {"scope": "worker"}
    assert run("key", "create").exit_code == 0
    assert _body(routes) == {"scope": "admin"}
    assert run("key", "create", "--scope", "tenant").exit_code == 2
    assert run("key", "create", "--tenant", "x", "--scope", "admin").exit_code == 2


def test_key_list_and_rm(routes):
    routes.on(
        "GET",
        "/v1/keys",
        httpx.Response(
            200, json={"items": [{k: v for k, v in KEY.items() if k != "key"}], "next_cursor": None}
        ),
    )
    routes.on("DELETE", f"/v1/keys/{KEY['id']}", httpx.Response(204))
    result = run("key", "list", "--tenant", TENANT["id"])
    assert result.exit_code == 0, result.output
    assert KEY["id"] in result.stdout and "secret" not in result.stdout
    assert routes.last.url.params.get("tenant_id") == TENANT["id"]
    result = run("key", "rm", KEY["id"])
    assert result.exit_code == 0 and result.stdout.strip() == KEY["id"]


def test_api_errors_are_one_line(routes):
    routes.on(
        "DELETE",
        f"/v1/tenants/{TENANT['id']}",
        api_error(409, "tenant_in_use", "owns: sandbox sb-1"),
    )
    result = run("tenant", "rm", TENANT["id"])
    assert result.exit_code == 1 and "tenant_in_use: owns: sandbox sb-1" in result.stderr

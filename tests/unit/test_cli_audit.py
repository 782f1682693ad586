"""`atoll audit` (atoll.cli.audit) over a canned server (tests/unit/test_cli.py's MockTransport
routes): every page followed, the filters sent as query parameters, a table or JSON, errors."""

from __future__ import annotations

import json

import httpx

from tests.unit.test_cli import routes, run  # noqa: F401 - routes is a fixture

ROW = {
    "at": "2026-12-05T08:00:00.123456+00:00",
    "key_id": "ak-0000000000000001",
    "tenant_id": "tn-0000000000000001",
    "action": "sandbox.create",
    "target": "sb-0000000000000001",
    "result": {"status": 201, "error": None},
    "request_id": "req_1",
    "source": "127.0.0.1",
}


class Pages:
    """GET /v1/audit answered in two pages joined by a cursor."""

    def __init__(self) -> None:
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if request.url.params.get("cursor") == "c1":
            denied = {
                **ROW,
                "action": "key.create",
                "target": None,
                "result": {"status": 403, "error": "forbidden"},
            }
            return httpx.Response(200, json={"items": [denied], "next_cursor": None})
        return httpx.Response(200, json={"items": [ROW], "next_cursor": "c1"})


def _serve(monkeypatch, handler) -> None:
    import atoll
    from atoll.cli import main as cli

    monkeypatch.setattr(
        cli,
        "make_client",
        lambda url, key, ca_file=None: atoll.Client(
            "http://atoll.test", key, transport=httpx.MockTransport(handler)
        ),
    )


def test_audit_table_follows_pages_and_sends_filters(monkeypatch):
    pages = Pages()
    _serve(monkeypatch, pages)
    r = run(
        "audit",
        "--from",
        "2026-12-01T00:00:00Z",
        "--to",
        "2026-12-06",
        "--tenant",
        "tn-x",
        "--action",
        "key.*",
    )
    assert r.exit_code == 0, r.output
    assert "sandbox.create" in r.output and "sb-0000000000000001" in r.output
    assert "403 forbidden" in r.output and "2026-12-05T08:00:00.123456Z" in r.output
    first = pages.seen[0].url.params
    assert (first["from"], first["to"], first["tenant_id"], first["action"]) == (
        "2026-12-01T00:00:00Z",
        "2026-12-06",
        "tn-x",
        "key.*",
    )
    assert [p.url.params.get("cursor") for p in pages.seen] == [None, "c1"]


def test_audit_json_and_limit(monkeypatch):
    pages = Pages()
    _serve(monkeypatch, pages)
    r = run("audit", "--json", "--limit", "1")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == [ROW] and len(pages.seen) == 1
    assert pages.seen[0].url.params["limit"] == "1"
    assert run("audit", "--limit", "0").exit_code == 2  # a usage error


def test_audit_errors_and_empty(monkeypatch, routes):  # noqa: F811 - the fixture
    routes.on(
        "GET",
        "/v1/audit",
        httpx.Response(403, json={"error": {"code": "forbidden", "message": "/v1/audit needs an admin key"}}),
    )
    r = run("audit")
    assert r.exit_code == 1 and "forbidden: /v1/audit needs an admin key" in r.output
    routes.on("GET", "/v1/audit", httpx.Response(200, json={"items": [], "next_cursor": None}))
    r = run("audit")
    assert r.exit_code == 0 and "no audit entries" in r.output

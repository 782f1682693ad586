"""The SDK's lists follow `next_cursor` (every page, once), and `client.tenants` / `client.keys`
send what the REST contract says (sync and async), over an `httpx.MockTransport`."""

from __future__ import annotations

import datetime as dt
import json

import httpx
import pytest

import atoll

URL = "http://atoll.test"


class Paged:
    """A server whose lists answer `limit` items a page, recording each request."""

    def __init__(self, n: int = 25, limit: int = 10) -> None:
        self.items = [{"id": f"sb-{i:016d}", "state": "running", "metadata": {}} for i in range(n)]
        self.limit = limit
        self.requests: list[httpx.Request] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path, params = request.url.path, request.url.params
        if request.method == "GET" and path in ("/v1/sandboxes", "/v1/tenants", "/v1/keys", "/v1/secrets"):
            start = int(params.get("cursor", "c0")[1:])
            page = self.items[start : start + self.limit]
            nxt = f"c{start + self.limit}" if start + self.limit < len(self.items) else None
            return httpx.Response(200, json={"items": page, "next_cursor": nxt})
        body = json.loads(request.content) if request.content else None
        return httpx.Response(
            201 if request.method == "POST" else 200 if request.method != "DELETE" else 204,
            json={"method": request.method, "path": path, "body": body}
            if request.method != "DELETE"
            else None,
        )


def test_lists_follow_every_cursor_once():
    server = Paged()
    with atoll.Client(URL, "k", transport=httpx.MockTransport(server.handle)) as c:
        got = c.sandboxes.list(state="running", metadata={"team": "a"})
    assert [s.id for s in got] == [i["id"] for i in server.items]
    cursors = [r.url.params.get("cursor") for r in server.requests]
    assert cursors == [None, "c10", "c20"]
    assert all(
        r.url.params.get("state") == "running" and r.url.params.get("metadata.team") == "a"
        for r in server.requests
    )


def test_a_server_that_does_not_page_is_one_page():
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"items": [{"name": "s", "hosts": []}]})

    with atoll.Client(URL, "k", transport=httpx.MockTransport(handle)) as c:
        assert [s.name for s in c.secrets.list()] == ["s"]


def test_a_cursor_that_repeats_is_an_error_not_a_loop():
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"items": [{"id": "x"}], "next_cursor": "same"})

    with (
        atoll.Client(URL, "k", transport=httpx.MockTransport(handle)) as c,
        pytest.raises(atoll.errors.ServerError),
    ):
        c.tenants.list()


def test_tenants_and_keys_send_the_contract():
    server = Paged()
    with atoll.Client(URL, "k", transport=httpx.MockTransport(server.handle)) as c:
        assert c.tenants.create("acme", quotas={"max_running": 2}) == {
            "method": "POST",
            "path": "/v1/tenants",
            "body": {"name": "acme", "quotas": {"max_running": 2}},
        }
        assert c.tenants.create("bare")["body"] == {"name": "bare"}
        assert c.tenants.update("tn-1", quotas={"max_running": None})["body"] == {
            "quotas": {"max_running": None}
        }
        assert c.tenants.get("tn-1")["path"] == "/v1/tenants/tn-1"
        c.tenants.delete("tn-1")
        when = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
        k = c.tenants.create_key("tn-1", expires_at=when)
        assert k["path"] == "/v1/tenants/tn-1/keys" and k["body"] == {
            "expires_at": "2030-01-01T00:00:00+00:00"
        }
        assert c.keys.create(scope="worker")["body"] == {"scope": "worker"}
        c.keys.revoke("ak-1")
        assert len(c.keys.list(tenant_id="tn-1")) == 25
        with pytest.raises(ValueError, match="timezone"):
            c.keys.create(expires_at=dt.datetime(2030, 1, 1))
        with pytest.raises(ValueError):
            c.tenants.get("")
    seen = [(r.method, r.url.path) for r in server.requests]
    assert ("DELETE", "/v1/tenants/tn-1") in seen and ("DELETE", "/v1/keys/ak-1") in seen
    assert ("PATCH", "/v1/tenants/tn-1") in seen
    assert server.requests[-1].url.params.get("tenant_id") == "tn-1"


async def test_async_lists_follow_cursors_too():
    server = Paged(n=31, limit=7)
    async with atoll.AsyncClient(URL, "k", transport=httpx.MockTransport(server.handle)) as c:
        assert len(await c.tenants.list()) == 31
        assert (await c.keys.create())["body"] == {"scope": "admin"}

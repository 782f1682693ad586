"""The SDK's `edge_url`: a sandbox's exec and process calls go to the edge, every other call to the
API, both with the same key; `$ATOLL_EDGE_URL` sets it; without it nothing changes."""

from __future__ import annotations

import json

import httpx
import pytest

import atoll
from atoll._client import _base

API = "http://api.test:7080"
EDGE = "http://edge.test:7082"
SID = "sb-0123456789abcdef"
SANDBOX = {"id": SID, "state": "running", "template": "base", "metadata": {}}


def _transport(seen: list[tuple[str, str, str]]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url.host), request.method, request.url.path))
        assert request.headers["authorization"] == "Bearer key"
        if request.url.path.endswith("/exec"):
            return httpx.Response(
                200,
                json={"exit_code": 0, "stdout": "hi\n", "stderr": "", "duration_ms": 1, "timed_out": False},
            )
        if request.url.path.endswith("/signal") or request.url.path.endswith("/processes/7"):
            info = {"pid": 7, "cmd": "sleep", "running": False, "exit_code": -15, "background": True}
            return httpx.Response(200, json={**info, "started_at": 1.0})
        return httpx.Response(200, json=SANDBOX)

    return httpx.MockTransport(handle)


def test_data_calls_go_to_the_edge_and_control_calls_to_the_api(monkeypatch):
    monkeypatch.delenv(_base.ENV_EDGE_URL, raising=False)
    seen: list[tuple[str, str, str]] = []
    with atoll.Client(API, "key", edge_url=EDGE, transport=_transport(seen)) as c:
        assert c.edge_url == EDGE
        sb = c.sandboxes.get(SID)
        assert sb.exec("echo hi").stdout == "hi\n"
    assert seen == [
        ("api.test", "GET", f"/v1/sandboxes/{SID}"),
        ("edge.test", "POST", f"/v1/sandboxes/{SID}/exec"),
    ]


def test_the_edge_comes_from_the_environment_and_is_optional(monkeypatch):
    seen: list[tuple[str, str, str]] = []
    monkeypatch.setenv(_base.ENV_EDGE_URL, EDGE + "/")
    with atoll.Client(API, "key", transport=_transport(seen)) as c:
        assert c.edge_url == EDGE
    monkeypatch.delenv(_base.ENV_EDGE_URL)
    with atoll.Client(API, "key", transport=_transport(seen)) as c:
        assert c.edge_url is None
        c.sandboxes.get(SID).exec("echo hi")
    assert {host for host, _, _ in seen} == {"api.test"}


@pytest.mark.parametrize(
    ("method", "path", "edge"),
    [
        ("POST", f"/v1/sandboxes/{SID}/exec", True),
        ("GET", f"/v1/sandboxes/{SID}/processes/7", True),
        ("DELETE", f"/v1/sandboxes/{SID}/processes/7", True),
        ("GET", f"/v1/sandboxes/{SID}/processes/7/output", True),
        ("POST", f"/v1/sandboxes/{SID}/processes/7/stdin", True),
        ("POST", f"/v1/sandboxes/{SID}/processes/7/signal", True),
        ("POST", f"/v1/sandboxes/{SID}/processes/7/wait", True),
        ("GET", f"/v1/sandboxes/{SID}/processes", True),
        ("POST", f"/v1/sandboxes/{SID}/processes", False),
        ("POST", f"/v1/sandboxes/{SID}/pause", False),
        ("GET", f"/v1/sandboxes/{SID}", False),
        ("PUT", f"/v1/sandboxes/{SID}/files", True),
        ("GET", f"/v1/sandboxes/{SID}/files", True),
        ("DELETE", f"/v1/sandboxes/{SID}/files", True),
        ("GET", f"/v1/sandboxes/{SID}/files/stat", True),
        ("GET", f"/v1/sandboxes/{SID}/files/list", True),
        ("POST", f"/v1/sandboxes/{SID}/files/mkdir", True),
        ("POST", f"/v1/sandboxes/{SID}/files/move", True),
        ("POST", f"/v1/sandboxes/{SID}/files/chmod", True),
        ("GET", f"/v1/sandboxes/{SID}/files/watch", True),
        ("PUT", f"/v1/sandboxes/{SID}/files/tar", True),
        ("GET", f"/v1/sandboxes/{SID}/files/tar", True),
        ("GET", f"/v1/sandboxes/{SID}/files/mkdir", False),
        ("DELETE", f"/v1/sandboxes/{SID}/files/tar", False),
        ("POST", f"/v1/sandboxes/{SID}/files/stat", False),
        ("GET", f"/v1/sandboxes/{SID}/files/other", False),
        ("POST", "/v1/sandboxes", False),
        ("POST", f"/v1/sandboxes/{SID}/pty", True),
        ("DELETE", f"/v1/sandboxes/{SID}/pty/pty_0123456789ab", True),
        ("GET", f"/v1/sandboxes/{SID}/pty/pty_0123456789ab/ws", True),
        ("GET", f"/v1/sandboxes/{SID}/pty", True),
        ("DELETE", f"/v1/sandboxes/{SID}/pty", False),
        ("POST", f"/v1/sandboxes/{SID}/pty/pty_0123456789ab", False),
    ],
)
def test_which_routes_the_edge_serves(method, path, edge):
    assert _base.edge_route(method, path) is edge, json.dumps([method, path])


async def test_the_async_client_routes_the_same_way(monkeypatch):
    monkeypatch.delenv(_base.ENV_EDGE_URL, raising=False)
    seen: list[tuple[str, str, str]] = []
    async with atoll.AsyncClient(API, "key", edge_url=EDGE, transport=_transport(seen)) as c:
        sb = await c.sandboxes.get(SID)
        assert (await sb.exec("echo hi")).stdout == "hi\n"
    assert [h for h, _, _ in seen] == ["api.test", "edge.test"]


def test_an_edge_that_cannot_be_reached_is_named_as_the_edge(monkeypatch):
    """A connection failure to the edge names the edge and ATOLL_EDGE_URL (not ATOLL_URL, which
    names the API and is not the one to fix)."""
    monkeypatch.delenv(_base.ENV_EDGE_URL, raising=False)

    def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.host == "edge.test":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=SANDBOX)

    with atoll.Client(API, "key", edge_url=EDGE, transport=httpx.MockTransport(refuse)) as c:
        sb = c.sandboxes.get(SID)
        with pytest.raises(atoll.errors.APIConnectionError) as e:
            sb.exec("true")
    assert EDGE in str(e.value) and "ATOLL_EDGE_URL" in str(e.value) and "ATOLL_URL " not in str(e.value)
    with pytest.raises(atoll.errors.APIConnectionError) as e:
        with atoll.Client(API, "key", transport=httpx.MockTransport(refuse)) as c:
            raise _base.connection_error(httpx.ConnectError("refused"), API)
    assert "ATOLL_URL" in str(e.value) and "ATOLL_EDGE_URL" not in str(e.value)

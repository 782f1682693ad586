"""`atoll edge` in process over a real control plane (FakeAtoll under uvicorn) and a real worker API
(worker.httpapi over a FakeWorker, registered through its real registration loop): answers as the
API's, one grant per key and sandbox while it lasts, a refused grant asked again once, the server's
refusals passed through, and the errors of an edge with nothing behind it."""

from __future__ import annotations

import base64
import dataclasses
import json
import socket

import httpx
import pytest

from atoll.core import worker_api as api
from atoll.edge import service
from atoll.shared import http11
from atoll.testing import free_port
from tests.component.test_worker_protocol import KEY, cluster  # noqa: F401 - the fixture

NDJSON = {"Accept": "application/x-ndjson"}


def _edge_client(edge: service.Edge, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=edge.app()),
        base_url="http://edge.test",
        headers=headers,
        timeout=30,
    )


@pytest.fixture
async def via(cluster):  # noqa: F811
    cp, c, fake, reg, _ = cluster
    edge = service.Edge(str(c.base_url))
    e = _edge_client(edge)
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    yield c, e, edge, fake, r.json()["id"]
    await e.aclose()
    await edge.aclose()


async def test_exec_through_the_edge_answers_as_the_api_with_one_grant(via):
    c, e, edge, fake, sid = via
    fake.exec_handler = lambda spec: api.ExecResult(3, f"ran {spec.cmd}\u2028é", "err", 7, False, 0, 0)
    for body in ({"cmd": ["echo", "hi"]}, {"cmd": "x", "env": {"A": "1"}}):
        a = await c.post(f"/v1/sandboxes/{sid}/exec", json=body)
        b = await e.post(f"/v1/sandboxes/{sid}/exec", json=body)
        assert (b.status_code, b.json()) == (200, a.json())
        a = await c.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=NDJSON)
        b = await e.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=NDJSON)
        assert b.headers["content-type"].startswith("application/x-ndjson")
        assert [json.loads(x) for x in b.content.split(b"\n") if x] == [
            json.loads(x) for x in a.content.split(b"\n") if x
        ]
    assert edge.grants.asked == 1  # cached for the key and sandbox
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 9", "background": True})
    assert r.status_code == 200, r.text
    pid = r.json()["pid"]
    assert (await e.get(f"/v1/sandboxes/{sid}/processes/{pid}")).json() == (
        await c.get(f"/v1/sandboxes/{sid}/processes/{pid}")
    ).json()
    assert (await e.delete(f"/v1/sandboxes/{sid}/processes/{pid}")).status_code == 204
    r = await e.delete(f"/v1/sandboxes/{sid}/processes/{pid}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "process_not_found", r.text


async def test_files_through_the_edge_answer_as_through_the_api(via):
    c, e, edge, fake, sid = via
    f = f"/v1/sandboxes/{sid}/files"
    assert (await e.put(f, params={"path": "/d/f"}, content=b"\x00data")).status_code == 204
    assert (await c.get(f, params={"path": "/d/f"})).content == b"\x00data"
    r = await e.get(f, params={"path": "/d/f"})
    assert (r.status_code, r.content, r.headers.get("content-length")) == (200, b"\x00data", "5")
    raw = base64.b64encode(b"/d/\xff").decode()
    assert (await e.put(f, params={"path_b64": raw}, content=b"z")).status_code == 204
    assert fake.runtimes[sid].files[b"/d/\xff"] == b"z"
    for sub in ("/list", "/stat"):
        params = {"path": "/d" if sub == "/list" else "/d/f"}
        a, b = await c.get(f + sub, params=params), await e.get(f + sub, params=params)
        assert (b.status_code, b.json()) == (200, a.json()), b.text
    r = await e.get(f, params={"path": "/nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found", r.text
    r = await e.get(f, params={"path": "/d/../etc"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path", r.text
    r = await e.put(f, params={"path": "/big"}, content=b"x" * ((1 << 20) + 1))
    assert r.status_code == 413 and "ATOLL_MAX_FILE_MB" in r.json()["error"]["message"], r.text
    assert (await e.delete(f, params={"path": "/d/f"})).status_code == 204
    assert (await c.get(f, params={"path": "/d/f"})).status_code == 404


async def test_a_refused_grant_is_asked_for_again_once(via):
    c, e, edge, fake, sid = via
    assert (await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
    key = next(iter(edge.grants._cache))
    g = edge.grants._cache[key]
    sid_, exp, scope, _mac = g.grant.split(".")
    edge.grants._cache[key] = dataclasses.replace(g, grant=f"{sid_}.{exp}.{scope}.forged")  # as a stale token
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text
    assert edge.grants.asked == 2 and edge.grants._cache[key].grant == g.grant.rsplit(".", 1)[0] + "." + _mac


async def test_the_servers_refusals_and_the_edges_own_errors(via):
    c, e, edge, fake, sid = via
    async with _edge_client(edge, key="wrong") as bad:
        r = await bad.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
    async with _edge_client(edge, key=None) as none:
        r = await none.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"], r.text
    # a key that is not ASCII (latin-1 bytes on the wire): 401, not a 500 from the grant request
    r = await e.post(
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": "true"},
        headers={"Authorization": "Bearer \u00e9".encode("latin-1")},
    )
    assert r.status_code == 401 and "printable ASCII" in r.json()["error"]["message"], r.text
    r = await e.post("/v1/sandboxes/sb-0000000000000000/exec", json={"cmd": "true"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found", r.text
    r = await e.post("/v1/sandboxes/nope/exec", json={"cmd": "true"})
    assert r.status_code == 400 and "not a sandbox id" in r.json()["error"]["message"], r.text
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"], r.text
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "max_output_bytes": 1 << 40})
    assert r.status_code == 400 and "above this server's limit" in r.json()["error"]["message"], r.text
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "max_output_bytes": 0})
    assert r.status_code == 400 and "max_output_bytes" in r.json()["error"]["message"], r.text
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": {"no": 1}})
    assert r.status_code == 400 and "malformed exec request" in r.json()["error"]["message"], r.text
    # `background` is true or false, through the edge as through the API (not "yes", not 1)
    for odd in ("yes", 1, "false"):
        for client in (c, e):
            r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "background": odd})
            assert r.status_code == 400 and "background" in r.json()["error"]["message"], (odd, r.text)
    for method, path in (
        ("POST", f"/v1/sandboxes/{sid}/pause"),
        ("GET", "/v1/sandboxes"),
        ("PUT", "/v1/x"),
        ("GET", f"/v1/sandboxes/{sid}/metrics"),
    ):
        r = await e.request(method, path)
        assert r.status_code == 404 and str(c.base_url).rstrip("/") in r.json()["error"]["message"], r.text
    assert (await e.get("/healthz")).json()["status"] == "ok"


async def test_a_worker_that_breaks_after_the_call_was_sent_is_no_invitation_to_run_it_again(
    via, monkeypatch
):
    """A worker lost once an exec was sent (its outcome unknown) must not be answered as retryable, as
    the server's seam does not: the SDK or a client retrying on `retryable` would run it twice.
    A read that broke, or a connection that never opened, is retryable."""
    c, e, edge, fake, sid = via
    assert (await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
    channel = edge.workers.channel(next(iter(edge.grants._cache.values())))
    broke: list[Exception] = []

    def stream(*a, **kw):
        raise broke[0]

    monkeypatch.setattr(channel, "stream", stream)
    broke.append(http11.ChannelError("connection reset while waiting for the answer"))
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "rm -rf /data"})
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["retryable"]) == (503, "worker_unavailable", False), r.text
    assert "outcome is unknown" in err["message"], r.text
    r = await e.get(f"/v1/sandboxes/{sid}/files", params={"path": "/d/f"})
    err = r.json()["error"]
    assert (r.status_code, err["retryable"]) == (503, True) and "only reads" in err["message"], r.text
    broke[0] = http11.ConnectFailed("connection refused")
    r = await e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    err = r.json()["error"]
    assert (r.status_code, err["retryable"]) == (503, True) and "did not reach it" in err["message"], r.text


async def test_an_edge_whose_server_is_down_says_so():
    url = f"http://127.0.0.1:{free_port()}"
    edge = service.Edge(url)
    async with _edge_client(edge) as e:
        r = await e.post("/v1/sandboxes/sb-0000000000000000/exec", json={"cmd": "true"})
    await edge.aclose()
    assert r.status_code == 503 and url in r.json()["error"]["message"], r.text


def test_a_port_in_use_names_the_setting():
    held = service.listen("127.0.0.1", 0)
    # asyncio sets TCP_NODELAY on accepted sockets only when the listener's proto says TCP: without
    # it an answer in two writes waited for the client's delayed ACK (+40 ms on half the execs)
    assert held.proto == socket.IPPROTO_TCP
    try:
        with pytest.raises(SystemExit) as e:
            service.listen("127.0.0.1", held.getsockname()[1])
        assert "is in use" in str(e.value.code) and "ATOLL_EDGE_PORT" in str(e.value.code)
    finally:
        held.close()


def test_a_server_url_ending_in_v1_is_refused_and_an_unreachable_one_warned_of():
    assert service.server_url_problem("http://127.0.0.1:7080") is None
    assert service.server_url_problem("https://atoll.example/api/") is None
    problem = service.server_url_problem("http://127.0.0.1:7080/v1/")
    assert problem and "without /v1" in problem and "--server http://127.0.0.1:7080)" in problem
    url = f"http://127.0.0.1:{free_port()}"
    warning = service.server_warning(url, None, timeout=2)
    assert warning and url in warning and "cannot be reached" in warning


async def test_a_server_that_answers_healthz_is_not_warned_of(cluster):  # noqa: F811
    _, c, _, _, _ = cluster
    import asyncio

    assert await asyncio.to_thread(service.server_warning, str(c.base_url), None) is None

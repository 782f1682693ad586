"""E2B's control API (atoll.e2b.app) in front of the real control plane over a FakeWorker: each
SDK call's answer shape and status, and every error as `{"code": int, "message": str}` (what the
`e2b` SDKs parse) with `Should-Retry` where a retry is or is not safe. The real SDK against a
real `atoll up` is tests/integration/test_e2b_sdk.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import urllib.parse

import httpx
import pytest
import uvicorn

from atoll.core import errors
from atoll.e2b import app as e2b_app
from atoll.e2b import control
from atoll.edge import seam
from atoll.testing import FakeAtoll

TOKEN_KEY = b"test-token-key"


@contextlib.asynccontextmanager
async def on_loopback(app):
    """`app` served by uvicorn on a free loopback port: its URL (the E2B app reaches the API over
    TCP, as in the edge)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


class _NoResume:
    """The fake worker as the edge's seam asked not to resume sandbox `sid` gives it
    (edge.seam.GrantedWorker, resume=False): its refusal of a sandbox that is not running (the
    worker's 409, then the grant route's) is `SandboxPaused`."""

    def __init__(self, worker, sid: str):
        self._worker = worker
        self._sid = sid

    def __getattr__(self, name: str):
        f = getattr(self._worker, name)
        if not callable(f):
            return f
        return lambda *a, **kw: _Refusing(f(*a, **kw), self._sid)


class _Refusing:
    """An awaitable or async context manager of the fake worker, its invalid_state as SandboxPaused."""

    def __init__(self, got, sid: str):
        self._got = got
        self._sid = sid

    @contextlib.contextmanager
    def _paused(self):
        try:
            yield
        except errors.Conflict as e:
            if e.code != "invalid_state":
                raise
            raise seam.SandboxPaused(control.paused_message(self._sid), detail=e.message) from None

    def __await__(self):
        return self._run().__await__()

    async def _run(self):
        with self._paused():
            return await self._got

    async def __aenter__(self):
        with self._paused():
            return await self._got.__aenter__()

    async def __aexit__(self, *exc):
        return await self._got.__aexit__(*exc)


@pytest.fixture
async def e2b(tmp_path):
    async with FakeAtoll(tmp_path) as fake, on_loopback(fake.app) as api_url:
        seams: list[str] = []
        resumes: list[bool] = []

        def seam_for(request, sid: str, resume: bool = True):
            seams.append(sid)
            resumes.append(resume)
            return fake.worker if resume else _NoResume(fake.worker, sid)

        looks: list[str] = []

        async def state_of(sid: str) -> dict | None:  # as the edge child's `state` op answers
            looks.append(sid)
            try:
                rec = fake.manager.get(sid)
            except Exception:  # noqa: BLE001 - unknown: None
                return None
            return {"state": str(rec.state), "compat": rec.compat}

        app = e2b_app.create_app(
            e2b_app.Settings(api_url=api_url, token_key=TOKEN_KEY), state_of=state_of, seam_for=seam_for
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://e2b",
            headers={"X-API-KEY": fake.api_key},
        ) as c:
            c.fake = fake  # type: ignore[attr-defined]
            c.seams = seams  # type: ignore[attr-defined]
            c.resumes = resumes  # type: ignore[attr-defined]
            c.looks = looks  # type: ignore[attr-defined]
            yield c
        await app.control.aclose()


CONNECT_STREAM = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


def _envelope(msg: dict) -> bytes:
    """One Connect stream message (JSON codec)."""
    raw = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(raw)) + raw


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"code", "message"} and body["code"] == status and isinstance(body["message"], str)
    return body["message"]


async def test_create_get_list_timeout_pause_connect_kill(e2b):
    r = await e2b.post(
        "/v2/sandboxes",
        json={
            "templateID": "base",
            "metadata": {"who": "me", "odd": "a&b=c%"},
            "envVars": {"X": "1"},
            "timeout": 120,
        },
    )
    assert r.status_code == 201, r.text
    sb = r.json()
    sid = sb["sandboxID"]
    assert (
        sb["templateID"] == "base" and sb["clientID"] == "atoll" and sb["envdVersion"] == control.ENVD_VERSION
    )
    assert sb["envdAccessToken"] == control.access_token(TOKEN_KEY, sid)
    rec = (await e2b.fake.http.get(f"/v1/sandboxes/{sid}")).json()
    assert rec["env"] == {"X": "1"} and rec["on_timeout"] == "delete" and rec["network"]["allow_out"] == ["*"]

    # 2.31's create (POST /sandboxes) with its always-sent fields
    old = await e2b.post(
        "/sandboxes",
        json={
            "templateID": "base",
            "allow_internet_access": False,
            "autoPause": True,
            "autoResume": {"enabled": False},
            "envVars": {},
            "metadata": {},
            "secure": True,
            "timeout": 300,
        },
    )
    assert old.status_code == 201, old.text
    other = old.json()["sandboxID"]
    rec2 = (await e2b.fake.http.get(f"/v1/sandboxes/{other}")).json()
    assert rec2["on_timeout"] == "pause" and rec2["network"]["allow_out"] == []

    d = (await e2b.get(f"/sandboxes/{sid}")).json()
    assert d["state"] == "running" and d["metadata"] == {"who": "me", "odd": "a&b=c%"}
    assert d["lifecycle"] == {"autoResume": False, "onTimeout": "kill"} and d["allowInternetAccess"] is True

    # the SDK's metadata encoding: urlencode({quote(k): quote(v)})
    q = urllib.parse.urlencode({urllib.parse.quote("odd"): urllib.parse.quote("a&b=c%")})
    listed = (await e2b.get("/v2/sandboxes", params={"metadata": q})).json()
    assert [s["sandboxID"] for s in listed] == [sid]
    page1 = await e2b.get("/v2/sandboxes", params={"limit": "1"})
    assert len(page1.json()) == 1 and page1.headers.get("x-next-token")
    page2 = await e2b.get("/v2/sandboxes", params={"limit": "1", "nextToken": page1.headers["x-next-token"]})
    assert len(page2.json()) == 1 and page2.json()[0]["sandboxID"] != page1.json()[0]["sandboxID"]
    assert "x-next-token" not in page2.headers

    assert (await e2b.post(f"/sandboxes/{sid}/timeout", json={"timeout": 600})).status_code == 204
    assert (await e2b.get(f"/sandboxes/{sid}/health")).status_code == 404  # not a route
    health = await e2b.get(
        "/health", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": sb["envdAccessToken"]}
    )
    assert health.status_code == 204

    assert (await e2b.post(f"/sandboxes/{sid}/pause", json={})).status_code == 204
    assert "already paused" in _error(await e2b.post(f"/sandboxes/{sid}/pause"), 409)
    assert (await e2b.get("/v2/sandboxes", params={"state": "paused"})).json()[0]["sandboxID"] == sid
    paused = await e2b.get(
        "/health", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": sb["envdAccessToken"]}
    )
    assert "was not found" in _error(paused, 502) and "paused" in paused.json()["message"]
    assert (await e2b.fake.http.get(f"/v1/sandboxes/{sid}")).json()["state"] == "standby"  # never resumed

    r = await e2b.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60})
    assert r.status_code == 201 and r.json()["sandboxID"] == sid, r.text
    again = await e2b.post(f"/sandboxes/{sid}/connect", json={"timeout": 30})  # 2.31, running: 200
    assert again.status_code == 200
    assert (await e2b.post(f"/sandboxes/{sid}/resume", json={"timeout": 30})).status_code == 200

    m = (await e2b.get(f"/sandboxes/{sid}/metrics")).json()
    assert len(m) == 1 and {"cpuUsedPct", "memUsed", "diskTotal", "timestampUnix"} <= set(m[0])

    assert (await e2b.delete(f"/sandboxes/{sid}")).status_code == 204
    _error(await e2b.delete(f"/sandboxes/{sid}"), 404)
    _error(await e2b.get(f"/sandboxes/{sid}"), 404)
    gone = await e2b.get("/health", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": sb["envdAccessToken"]})
    _error(gone, 502)
    await e2b.delete(f"/sandboxes/{other}")


async def test_errors_are_e2b_shaped(e2b):
    _error(await e2b.get("/sandboxes/sb-0000000000000000", headers={"X-API-KEY": "wrong"}), 401)
    no_key = await e2b.get("/v2/sandboxes", headers={"X-API-KEY": ""})
    assert "E2B_API_KEY" in _error(no_key, 401)
    assert "hex" in _error(await e2b.get("/v2/sandboxes", headers={"X-API-KEY": "e2b_zz"}), 401)
    _error(await e2b.get("/sandboxes/sb-0000000000000000"), 404)
    _error(await e2b.get("/sandboxes/not-an-id"), 404)
    _error(await e2b.post("/v2/sandboxes", content=b"{nope"), 400)
    assert "timeout" in _error(await e2b.post("/v2/sandboxes", json={"timeout": -1}), 400)
    assert "rules" in _error(await e2b.post("/v2/sandboxes", json={"network": {"rules": {"x": 1}}}), 400)
    _error(await e2b.post("/v2/sandboxes", json={"templateID": "no-such-template"}), 404)
    assert "state" in _error(await e2b.get("/v2/sandboxes", params={"state": "sleepy"}), 400)
    _error(await e2b.get("/sandboxes/sb-0000000000000000/logs"), 404)
    _error(await e2b.patch("/sandboxes/sb-0000000000000000"), 404)
    _error(await e2b.post("/sandboxes/sb-0000000000000000/timeout", json={}), 400)
    assert (await e2b.get("/snapshots")).json() == []
    # a body that is no object: 400 in JSON's words (not Python's NoneType)
    for raw, kind in ((b"null", "null"), (b"[]", "an array"), (b"7", "a number")):
        assert f"not {kind}" in _error(await e2b.post("/v2/sandboxes", content=raw), 400), raw
    # a bad page token is named as the SDKs name it (nextToken, its x-next-token), never "cursor"
    for path in ("/v2/sandboxes", "/sandboxes", "/snapshots"):
        msg = _error(await e2b.get(path, params={"nextToken": "made-up"}), 400)
        assert "nextToken 'made-up'" in msg and "x-next-token" in msg and "cursor" not in msg, (path, msg)
    # envd paths: header required, the token checked
    assert "E2b-Sandbox-Id" in _error(await e2b.get("/health"), 404)
    _error(
        await e2b.get("/health", headers={"E2b-Sandbox-Id": "sb-0000000000000000", "X-Access-Token": "x"}),
        401,
    )
    wrong = await e2b.post(
        "/filesystem.Filesystem/Stat",
        json={"path": "/"},
        headers={"E2b-Sandbox-Id": "sb-0000000000000000", "X-Access-Token": "nope"},
    )
    _error(wrong, 401)
    assert e2b.seams == []  # refused before any data path was asked for


async def test_envd_services_run_over_the_seam_the_edge_gives(e2b):
    sb = (await e2b.post("/v2/sandboxes", json={})).json()
    headers = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"]}
    for _ in range(2):
        r = await e2b.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    assert e2b.seams == [sb["sandboxID"]]  # one service per (sandbox, token), kept for the next call
    missing = await e2b.post("/filesystem.Filesystem/Stat", json={"path": "/nope"}, headers=headers)
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"  # a Connect error


@pytest.mark.parametrize("auto_resume", [False, True])
async def test_envd_calls_to_a_paused_sandbox_resume_it_only_with_auto_resume(e2b, auto_resume):
    body = {"autoPause": True, "autoResume": {"enabled": auto_resume}}
    sb = (await e2b.post("/sandboxes", json=body)).json()
    sid = sb["sandboxID"]
    rec = e2b.fake.manager.get(sid)
    assert rec.compat == {"created_via": "e2b", "auto_resume": auto_resume, "on_timeout": "pause"}
    assert rec.on_timeout == "pause"
    assert rec.idle_timeout_s == 0  # E2B has no idle standby
    info = (await e2b.get(f"/sandboxes/{sid}")).json()
    assert info["lifecycle"] == {"autoResume": auto_resume, "onTimeout": "pause"}
    assert (await e2b.post(f"/sandboxes/{sid}/pause")).status_code == 204
    headers = {"E2b-Sandbox-Id": sid, "X-Access-Token": sb["envdAccessToken"]}
    health = await e2b.get("/health", headers=headers)
    assert "it is paused" in _error(health, 502)  # /health never resumes
    stat = await e2b.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers=headers)
    files = await e2b.get("/files", params={"path": "/etc/hostname"}, headers=headers)
    if auto_resume:  # handed to a seam that resumes it (its grant does: test_edge_seam.py)
        assert e2b.seams == [sid, sid] and e2b.resumes == [True, True]
        # its state was looked up once (/health, then the first envd call): calls that resume
        # it need no look-up, only those that may have to answer "paused" do
        assert e2b.looks == [sid, sid]
    else:  # envd's answer for a paused sandbox: the SDKs read "was not found" as not running
        # the first call looks the sandbox up and is refused before any data path is asked for;
        # later calls are not looked up: their seam, asked not to resume, meets the sandbox
        # paused (the worker's refusal, then the grant route's), and the answer is the same 502,
        # for plain HTTP, for Connect (not its `unavailable`) and for a stream
        assert "was not found: it is paused" in _error(stat, 502)
        assert "was not found: it is paused" in _error(files, 502)
        assert e2b.looks == [sid, sid] and e2b.seams == [sid]  # /health's look, the stat's
        stat = await e2b.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers=headers)
        assert "was not found: it is paused" in _error(stat, 502)
        start = await e2b.post(
            "/process.Process/Start",
            content=_envelope({"process": {"cmd": "true"}}),
            headers={**headers, **CONNECT_STREAM},
        )
        assert "was not found: it is paused" in _error(start, 502)
        # the code interpreter's routes too, with the token and without (2.11.5's /contexts)
        port = {"E2b-Sandbox-Port": "49999"}
        for h in ({**headers, **port}, {"E2b-Sandbox-Id": sid, **port}):
            assert "was not found: it is paused" in _error(await e2b.get("/contexts", headers=h), 502)
        assert e2b.looks == [sid, sid]  # one look per sandbox (and /health's, which never resumes)
        assert set(e2b.seams) == {sid} and set(e2b.resumes) == {False}
        assert e2b.fake.manager.get(sid).state == "standby"


async def test_without_a_data_path_envd_calls_are_502(tmp_path):
    app = e2b_app.create_app(e2b_app.Settings(api_url="http://127.0.0.1:9", token_key=TOKEN_KEY))
    sid = "sb-0000000000000000"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e2b") as c:
        r = await c.post(
            "/filesystem.Filesystem/Stat",
            json={"path": "/"},
            headers={"E2b-Sandbox-Id": sid, "X-Access-Token": control.access_token(TOKEN_KEY, sid)},
        )
        assert "no data path" in _error(r, 502)
        h = await c.get(
            "/health", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": control.access_token(TOKEN_KEY, sid)}
        )
        assert "was not found" in _error(h, 502)
    await app.control.aclose()


async def test_fork_network_and_idempotent_create(e2b):
    key = {"Idempotency-Key": "e2b-create-1"}
    a = (await e2b.post("/v2/sandboxes", json={"metadata": {"k": "v"}}, headers=key)).json()
    b = (await e2b.post("/v2/sandboxes", json={"metadata": {"k": "v"}}, headers=key)).json()
    assert a["sandboxID"] == b["sandboxID"]
    sid = a["sandboxID"]
    r = await e2b.put(
        f"/sandboxes/{sid}/network", json={"allow_internet_access": False, "allowOut": ["1.2.3.4"]}
    )
    assert r.status_code == 204, r.text
    net = (await e2b.fake.http.get(f"/v1/sandboxes/{sid}")).json()["network"]
    assert net == {"allow_out": ["1.2.3.4"], "deny_out": []}
    assert "egressProxy" in _error(await e2b.put(f"/sandboxes/{sid}/network", json={"egressProxy": "x"}), 400)
    forked = await e2b.post(f"/sandboxes/{sid}/fork", json={"count": 2, "timeout": 90})
    assert forked.status_code == 201, forked.text
    copies = [c["sandbox"] for c in forked.json()]
    assert len(copies) == 2 and all(c["sandboxID"] != sid for c in copies)
    assert all(c["envdAccessToken"] == control.access_token(TOKEN_KEY, c["sandboxID"]) for c in copies)
    _error(await e2b.post(f"/sandboxes/{sid}/fork", json={"count": 0}), 400)
    _error(await e2b.post(f"/sandboxes/{sid}/snapshots", json={"name": 3}), 400)
    _error(await e2b.post(f"/sandboxes/{sid}/snapshots", json={"memory": "no"}), 400)
    _error(await e2b.post("/sandboxes/sb-0000000000000000/snapshots", json={}), 404)


async def test_named_snapshots_map_onto_atolls(e2b):
    r = await e2b.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    r = await e2b.post(f"/sandboxes/{sid}/snapshots", json={"name": "e2b-snap"})
    assert r.status_code == 201, r.text
    info = r.json()
    assert set(info) == {"snapshotID", "names"} and info["names"] == ["e2b-snap"]
    r = await e2b.post(f"/sandboxes/{sid}/snapshots", json={})  # unnamed, memory by default
    assert r.status_code == 201 and r.json()["names"] == [], r.text
    unnamed = r.json()["snapshotID"]
    # a used name goes to the new snapshot (E2B's semantics), the old one is gone
    r = await e2b.post(f"/sandboxes/{sid}/snapshots", json={"name": "e2b-snap", "memory": False})
    assert r.status_code == 201, r.text
    latest = r.json()["snapshotID"]
    assert latest != info["snapshotID"] and info["snapshotID"] not in e2b.fake.worker.snapshots
    # list: all, by sandbox, by name, paged with x-next-token
    r = await e2b.get("/snapshots")
    assert [s["snapshotID"] for s in r.json()] == [unnamed, latest] and "x-next-token" not in r.headers
    assert [s["snapshotID"] for s in (await e2b.get("/snapshots", params={"name": "e2b-snap"})).json()] == [
        latest
    ]
    assert len((await e2b.get("/snapshots", params={"sandboxID": sid})).json()) == 2
    r = await e2b.get("/snapshots", params={"limit": 1})
    assert len(r.json()) == 1 and r.headers["x-next-token"]
    r = await e2b.get("/snapshots", params={"limit": 1, "nextToken": r.headers["x-next-token"]})
    assert [s["snapshotID"] for s in r.json()] == [latest]
    # a create's templateID names a snapshot by id or by name
    for ref in (unnamed, "e2b-snap"):
        r = await e2b.post("/v2/sandboxes", json={"templateID": ref, "timeout": 60})
        assert r.status_code == 201, r.text
        made = r.json()["sandboxID"]
        assert e2b.fake.worker.runtimes[made].spec.snapshot_id in (unnamed, latest)
    gone = await e2b.post("/v2/sandboxes", json={"templateID": "snp-0000000000000000"})
    assert "snapshot snp-0000000000000000 was not found" in _error(gone, 404)  # not "template"
    # DELETE /templates/{id}: a snapshot's id deletes it (204, then 404); other ids are 404
    assert (await e2b.delete(f"/templates/{latest}")).status_code == 204
    _error(await e2b.delete(f"/templates/{latest}"), 404)
    _error(await e2b.delete("/templates/base"), 404)
    assert latest not in e2b.fake.worker.snapshots


async def test_a_snapshot_quota_is_an_e2b_error_naming_the_limit(e2b):
    """create_snapshot past the tenant's max_snapshots: 403 in E2B's shape (the SDK raises
    SandboxException "403: quota_exceeded: …"), saying the limit, the use and how to make room."""
    r = await e2b.fake.http.patch("/v1/tenants/default", json={"quotas": {"max_snapshots": 1}})
    assert r.status_code == 200, r.text
    sid = (await e2b.post("/v2/sandboxes", json={"timeout": 60})).json()["sandboxID"]
    first = await e2b.post(f"/sandboxes/{sid}/snapshots", json={"name": "only"})
    assert first.status_code == 201, first.text
    r = await e2b.post(f"/sandboxes/{sid}/snapshots", json={})
    msg = _error(r, 403)
    assert msg.startswith("quota_exceeded: max_snapshots 1 reached: the tenant keeps 1 snapshot;"), msg
    assert "Sandbox.delete_snapshot" in msg and r.headers.get("Should-Retry") is None
    # the name E2B points at a new state replaces the old snapshot: no more kept, admitted
    again = await e2b.post(f"/sandboxes/{sid}/snapshots", json={"name": "only"})
    assert again.status_code == 201 and again.json()["snapshotID"] != first.json()["snapshotID"]


async def test_the_e2b_hex_key_spelling_is_accepted(e2b):
    key = "e2b_" + e2b.fake.api_key.encode().hex()
    assert (await e2b.get("/v2/sandboxes", headers={"X-API-KEY": key})).status_code == 200


async def test_an_unreachable_api_is_503_and_a_post_is_not_retried():
    # a peer that takes the connection and closes it without an answer: the call was sent
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    mute.setblocking(False)

    async def hang_up():
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(mute)
            await loop.sock_recv(conn, 65536)
            conn.close()

    closer = asyncio.ensure_future(hang_up())
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        for port, post_status, get_retry in (
            (mute.getsockname()[1], "false", "true"),
            (refused.getsockname()[1], "true", "true"),
        ):
            app = e2b_app.create_app(e2b_app.Settings(api_url=f"http://127.0.0.1:{port}"))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e2b") as c:
                r = await c.post("/v2/sandboxes", json={}, headers={"X-API-KEY": "k"})
                _error(r, 503)
                assert r.headers["Should-Retry"] == post_status, (port, r.text)
                if post_status == "false":
                    assert "may have taken effect" in r.json()["message"]
                g = await c.get("/v2/sandboxes", headers={"X-API-KEY": "k"})
                _error(g, 503)
                assert g.headers["Should-Retry"] == get_retry
            await app.control.aclose()
    finally:
        closer.cancel()
        mute.close()
        refused.close()


async def test_pause_waits_for_a_call_in_flight_then_answers_503(e2b, monkeypatch):
    monkeypatch.setattr(e2b_app, "PAUSE_BUSY_RETRY_S", 0.3)
    sid = (await e2b.post("/v2/sandboxes", json={})).json()["sandboxID"]
    e2b.fake.manager.ledger.inflight[sid] = 1
    try:
        r = await e2b.post(f"/sandboxes/{sid}/pause")
        assert "in progress" in _error(r, 503) and r.headers["Should-Retry"] == "true"
    finally:
        e2b.fake.manager.ledger.inflight.pop(sid, None)
    assert (await e2b.post(f"/sandboxes/{sid}/pause")).status_code == 204


async def test_files_and_processes_are_mounted_when_their_modules_are_there(e2b):
    """e2b.envd_http (`/files`) and e2b.envd_process (`process.Process`) are mounted by import;
    skipped on a branch without them."""
    pytest.importorskip("atoll.e2b.envd_http")
    pytest.importorskip("atoll.e2b.envd_process")
    sb = (await e2b.post("/v2/sandboxes", json={})).json()
    h = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"]}
    w = await e2b.post(
        "/files", params={"path": "/tmp/x.txt"}, files={"file": ("x.txt", b"hello")}, headers=h
    )
    assert w.status_code == 200 and w.json()[0]["path"] == "/tmp/x.txt", w.text
    r = await e2b.get("/files", params={"path": "/tmp/x.txt"}, headers=h)
    assert r.status_code == 200 and r.content == b"hello"
    p = await e2b.post("/process.Process/List", json={}, headers=h)
    assert p.status_code == 200, p.text


async def test_pause_ends_open_process_streams_and_watches(e2b):
    """E2B's pause with a process stream and a watch open: the API is asked with end_streams, the
    worker ends both (Connect `canceled`), the pause is a 204 and the process runs on. atoll's own
    pause, without end_streams, is not changed (its 409 sandbox_busy needs a real worker)."""
    sb = (await e2b.post("/v2/sandboxes", json={})).json()
    sid = sb["sandboxID"]
    worker = e2b.fake.worker
    headers = {
        "E2b-Sandbox-Id": sid,
        "X-Access-Token": sb["envdAccessToken"],
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
    }

    def envelope(msg: dict) -> bytes:
        raw = json.dumps(msg).encode()
        return struct.pack(">BI", 0, len(raw)) + raw

    def last_frame(body: bytes) -> dict:
        out = {}
        while body:
            _, n = struct.unpack(">BI", body[:5])
            out, body = json.loads(body[5 : 5 + n]), body[5 + n :]
        return out

    start = asyncio.ensure_future(
        e2b.post(
            "/process.Process/Start",
            content=envelope({"process": {"cmd": "sleep", "args": ["100"]}}),
            headers=headers,
        )
    )
    watch = asyncio.ensure_future(
        e2b.post("/filesystem.Filesystem/WatchDir", content=envelope({"path": "/"}), headers=headers)
    )
    for _ in range(500):
        if worker.runtimes[sid].processes and worker.stream_ends.count(sid) == 2:
            break
        await asyncio.sleep(0.01)
    assert worker.stream_ends.count(sid) == 2
    assert (await e2b.post(f"/sandboxes/{sid}/pause")).status_code == 204
    for r in (await asyncio.wait_for(start, 10), await asyncio.wait_for(watch, 10)):
        assert r.status_code == 200, r.text
        err = last_frame(r.content)["error"]
        assert err["code"] == "canceled" and "paused" in err["message"], err
    assert ("pause", sid) in worker.calls
    assert all(p.running for p in worker.runtimes[sid].processes.values())
    assert e2b.fake.manager.get(sid).state == "standby"


async def test_the_answers_domain_names_the_ingress_router_when_set(tmp_path):
    """ATOLL_E2B_DOMAIN (Settings.domain): create, connect and detail answer it as `domain`, from
    which the SDKs build `{port}-{id}.{domain}`; unset, `domain` is null (the SDKs' E2B_DOMAIN)."""
    async with FakeAtoll(tmp_path) as fake, on_loopback(fake.app) as api_url:
        for domain in ("atoll.localhost:7101", None):
            app = e2b_app.create_app(e2b_app.Settings(api_url=api_url, token_key=TOKEN_KEY, domain=domain))
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://e2b",
                headers={"X-API-KEY": fake.api_key},
            ) as c:
                created = await c.post("/v2/sandboxes", json={"templateID": "base"})
                assert created.status_code == 201 and created.json()["domain"] == domain, created.text
                sid = created.json()["sandboxID"]
                connected = await c.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60})
                assert connected.status_code == 200 and connected.json()["domain"] == domain
                assert (await c.get(f"/sandboxes/{sid}")).json()["domain"] == domain
                assert (await c.delete(f"/sandboxes/{sid}")).status_code == 204
            await app.control.aclose()


async def test_an_admin_keys_create_by_name_looks_only_in_its_own_tenant(e2b):
    """A name held by another tenant's snapshot is no snapshot of the admin key's (`default`): the
    create takes it as a template name (before, the admin's list spanned every tenant, so the name
    was taken for a snapshot and the create said the snapshot was not found)."""
    fake = e2b.fake
    r = await fake.http.post("/v1/tenants", json={"name": "other"})
    tid = r.json()["id"]
    key = (await fake.http.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=fake.app),
        base_url="http://api",
        headers={"Authorization": f"Bearer {key}"},
    ) as t:
        sid = (await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
        assert (
            await t.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "team/theirs"})
        ).status_code == 201
    r = await e2b.post("/v2/sandboxes", json={"templateID": "team/theirs", "timeout": 60})
    msg = _error(r, 404)
    assert "template" in msg and "snapshot" not in msg, msg
    # the admin's own snapshot of that name is found, '/' and all
    sid = (await e2b.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})).json()["sandboxID"]
    assert (await e2b.post(f"/sandboxes/{sid}/snapshots", json={"name": "team/theirs"})).status_code == 201
    r = await e2b.post("/v2/sandboxes", json={"templateID": "team/theirs", "timeout": 60})
    assert r.status_code == 201, r.text

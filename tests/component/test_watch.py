"""`GET /v1/sandboxes/watch` (controlplane.routes_watch) and terminals authenticated in their first
message (`?auth=message`, controlplane.app), against the control plane in process served by uvicorn
on loopback over a FakeWorker: the snapshot, then creates, pauses and deletes as lines; tenant
scoping; a revoked key ends the stream; two control planes sharing their records see each other's
changes."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from websockets.asyncio.client import connect

from atoll.controlplane import routes_watch
from atoll.core import secretbox
from atoll.testing import FakeAtoll
from tests.component.conftest import KEY, create, serve_on_loopback


@pytest.fixture
async def served(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as f, serve_on_loopback(f.app) as addr:
        f.url = f"http://{addr}"
        f.ws_url = f"ws://{addr}"
        yield f
        f.worker.ptys.close_all()


class Watch:
    """One open watch stream, read a line at a time."""

    def __init__(self, lines):
        self.lines = lines

    async def next(self) -> dict:
        return json.loads(await asyncio.wait_for(anext(self.lines), 10))

    async def until(self, pred) -> dict:
        while True:
            line = await self.next()
            if pred(line):
                return line


@contextlib.asynccontextmanager
async def _watch(url: str, key: str, query: str = ""):
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        async with c.stream("GET", "/v1/sandboxes/watch" + query) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["content-type"].startswith("application/x-ndjson")
            yield Watch(r.aiter_lines())


def _is(sid: str, state: str):
    return lambda line: (
        line["type"] == "sandbox" and line["sandbox"]["id"] == sid and line["sandbox"]["state"] == state
    )


async def test_snapshot_then_changes(served):
    old = await create(served.http, metadata={"team": "a"})
    async with _watch(served.url, KEY) as w:
        first = await w.next()
        assert first["type"] == "sandbox" and first["sandbox"]["id"] == old
        assert first["sandbox"]["metadata"] == {"team": "a"}
        assert await w.next() == {"type": "synced", "count": 1}
        sid = await create(served.http)
        await w.until(_is(sid, "running"))
        assert (
            await served.http.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
        ).status_code == 200
        paused = await w.until(_is(sid, "standby"))
        assert paused["sandbox"]["standby_tier"] == "memory"
        assert (await served.http.delete(f"/v1/sandboxes/{old}")).status_code == 204
        await w.until(_is(old, "deleted"))


async def test_a_tenant_sees_only_its_own_and_a_revoked_key_ends_the_stream(served):
    c = served.http
    tid = (await c.post("/v1/tenants", json={"name": "watcher"})).json()["id"]
    made = (await c.post(f"/v1/tenants/{tid}/keys", json={})).json()
    theirs = await create(c, tenant_id=tid)
    async with _watch(served.url, made["key"]) as w:
        assert (await w.next())["sandbox"]["id"] == theirs
        assert await w.next() == {"type": "synced", "count": 1}
        other = await create(c)  # the default tenant's: never on this stream
        mine = await create(c, tenant_id=tid)
        line = await w.until(lambda x: x["type"] == "sandbox")
        assert line["sandbox"]["id"] == mine, (line, other)
        assert (await c.delete(f"/v1/keys/{made['id']}")).status_code == 204
        with pytest.raises((StopAsyncIteration, httpx.HTTPError)):
            while True:
                await w.next()
    async with _watch(served.url, KEY, f"?tenant_id={tid}") as w:  # an admin key, one tenant
        ids = {(await w.next())["sandbox"]["id"] for _ in range(2)}
        assert ids == {theirs, mine}
        assert await w.next() == {"type": "synced", "count": 2}


async def test_without_a_key_401(served):
    async with httpx.AsyncClient(base_url=served.url) as c:
        r = await c.get("/v1/sandboxes/watch")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


async def test_two_servers_sharing_records_see_each_others_changes(tmp_path):
    key = secretbox.new_key()
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    async with (
        FakeAtoll(tmp_path / "a", api_key=KEY, database_url=url, secrets_key=key) as a,
        FakeAtoll(tmp_path / "b", api_key=KEY, database_url=url, secrets_key=key) as b,
        serve_on_loopback(a.app) as addr,
    ):
        async with _watch(f"http://{addr}", KEY) as w:
            assert await w.next() == {"type": "synced", "count": 0}
            sid = await create(b.http)  # through the other server
            await w.until(_is(sid, "running"))


async def test_a_terminal_authenticated_in_its_first_message(served):
    sid = await create(served.http)
    r = await served.http.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24})
    pty_id = r.json()["pty_id"]
    url = f"{served.ws_url}/v1/sandboxes/{sid}/pty/{pty_id}/ws?auth=message"
    async with connect(url) as ws:
        await ws.send(json.dumps({"authorization": f"Bearer {KEY}"}))
        await ws.send(b"hello\r")
        seen = bytearray()
        while b"hello" not in seen:
            msg = await asyncio.wait_for(ws.recv(), 10)
            assert isinstance(msg, bytes), msg
            seen += msg
    async with connect(url) as ws:  # a wrong key: an error message, then 4401
        await ws.send(json.dumps({"authorization": "Bearer nope"}))
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["error"]["code"] == "unauthorized"
        with pytest.raises(Exception) as closed:
            await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 4401, closed.value
    async with connect(url) as ws:  # not JSON at all
        await ws.send("Bearer " + KEY)
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["error"]["code"] == "unauthorized"


async def test_the_snapshot_comes_a_page_at_a_time_newest_first(served, monkeypatch):
    monkeypatch.setattr(routes_watch, "SNAPSHOT_BATCH", 2)
    made = [await create(served.http) for _ in range(5)]
    async with _watch(served.url, KEY) as w:
        got = [(await w.next())["sandbox"]["id"] for _ in range(5)]
        assert got == made[::-1]
        assert await w.next() == {"type": "synced", "count": 5}
        await served.http.delete(f"/v1/sandboxes/{made[0]}")
        await w.until(_is(made[0], "deleted"))

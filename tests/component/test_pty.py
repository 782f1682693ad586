"""Terminals over the public WebSocket, against the control plane in process served by uvicorn on
loopback, over a FakeWorker whose terminals are real host ptys running a line-echo program
(atoll.testing.fake_pty): the tty's echo, resizes, exit codes, reattach with scrollback, auth of
the handshake and bad input."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect

from atoll.shared import logconfig
from atoll.testing import FakeAtoll
from tests.component.conftest import KEY, create, serve_on_loopback


@pytest.fixture
async def served(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as f:
        try:
            async with serve_on_loopback(f.app) as addr:
                f.ws_url = f"ws://{addr}"
                f.url = f"http://{addr}"
                yield f
        finally:
            f.worker.ptys.close_all()


def _ws(f, sid, pty_id, key=KEY):
    return connect(
        f"{f.ws_url}/v1/sandboxes/{sid}/pty/{pty_id}/ws",
        additional_headers={"Authorization": f"Bearer {key}"},
    )


async def _read_until(ws, needle: bytes, seen: bytearray) -> bytearray:
    while needle not in seen:
        msg = await asyncio.wait_for(ws.recv(), 10)
        assert isinstance(msg, bytes), msg
        seen += msg
    return seen


async def _open(f, sid, **body) -> str:
    r = await f.http.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24, **body})
    assert r.status_code == 201, r.text
    assert set(r.json()) == {"pty_id", "pid"}
    return r.json()["pty_id"]


async def test_round_trip_resize_and_exit_code(served):
    sid = await create(served.http)
    pty_id = await _open(served, sid, term="vt100", cols=90, rows=30)
    async with _ws(served, sid, pty_id) as ws:
        seen = await _read_until(ws, b"fake-tty ready", bytearray())
        await ws.send(b"hello there\r")
        await _read_until(ws, b"you said: hello there", seen)
        assert b"hello there\r\n" in seen  # the tty echoed the typed line
        await ws.send(b"term\r")
        await _read_until(ws, b"vt100\r\n", seen)
        await ws.send(b"size\r")
        await _read_until(ws, b"90x30", seen)
        await ws.send(json.dumps({"resize": [132, 43]}))
        await ws.send(b"size\r")
        await _read_until(ws, b"132x43", seen)
        await ws.send(b"exit 7\r")
        while True:
            msg = await asyncio.wait_for(ws.recv(), 10)
            if isinstance(msg, str):
                assert json.loads(msg) == {"exit_code": 7}
                break
        with pytest.raises(websockets.ConnectionClosedOK):
            await asyncio.wait_for(ws.recv(), 10)
    r = await served.http.get(f"/v1/sandboxes/{sid}/pty")
    [item] = r.json()["items"]
    assert item["pty_id"] == pty_id and item["running"] is False and item["exit_code"] == 7


async def test_reattach_replays_scrollback_and_continues(served):
    sid = await create(served.http)
    pty_id = await _open(served, sid)
    async with _ws(served, sid, pty_id) as ws:
        seen = await _read_until(ws, b"fake-tty ready", bytearray())
        await ws.send(b"first line\r")
        await _read_until(ws, b"you said: first line", seen)
    async with _ws(served, sid, pty_id) as ws:  # the session lived on without a client
        seen = await _read_until(ws, b"you said: first line", bytearray())
        await ws.send(b"second\r")
        await _read_until(ws, b"you said: second", seen)
        # a finished session keeps its code for a late attach
        await ws.send(b"exit 4\r")
        while not isinstance(msg := await asyncio.wait_for(ws.recv(), 10), str):
            pass
        assert json.loads(msg) == {"exit_code": 4}
    async with _ws(served, sid, pty_id) as ws:
        seen = bytearray()
        while not isinstance(msg := await asyncio.wait_for(ws.recv(), 10), str):
            seen += msg
        assert b"you said: second" in seen and json.loads(msg) == {"exit_code": 4}


async def test_bad_input(served):
    c = served.http
    sid = await create(c)
    for cols in (0, 100000):
        r = await c.post(f"/v1/sandboxes/{sid}/pty", json={"cols": cols, "rows": 24})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert "cols" in r.json()["error"]["message"] and str(cols) in r.json()["error"]["message"]
    r = await c.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24, "colour": True})
    assert r.status_code == 400, r.text
    r = await c.post("/v1/sandboxes/sb-aaaaaaaaaaaaaaaa/pty", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    r = await c.delete(f"/v1/sandboxes/{sid}/pty/pty_000000000000")
    assert r.status_code == 404 and r.json()["error"]["code"] == "pty_not_found", r.text
    # unknown id on the socket: one error message, then a close with 4404
    async with _ws(served, sid, "pty_000000000000") as ws:
        err = json.loads(await ws.recv())
        assert err["error"]["code"] == "pty_not_found"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 4404
    # a wrong key: the handshake is refused with atoll's 401
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with _ws(served, sid, "pty_000000000000", key="wrong"):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "unauthorized"
    # a bad resize is refused in-band; the session goes on
    pty_id = await _open(served, sid)
    async with _ws(served, sid, pty_id) as ws:
        seen = await _read_until(ws, b"fake-tty ready", bytearray())
        for bad in ({"resize": [0, 24]}, {"resize": [100000, 24]}, {"resize": "big"}, {"nope": 1}):
            await ws.send(json.dumps(bad))
            msg = await asyncio.wait_for(ws.recv(), 10)
            while isinstance(msg, bytes):
                msg = await asyncio.wait_for(ws.recv(), 10)
            assert json.loads(msg)["error"]["code"] == "invalid_request", msg
        await ws.send(b"size\r")
        await _read_until(ws, b"80x24", seen)
    r = await c.delete(f"/v1/sandboxes/{sid}/pty/{pty_id}")
    assert r.status_code == 204
    r = await c.get(f"/v1/sandboxes/{sid}/pty")
    assert pty_id not in [i["pty_id"] for i in r.json()["items"]]


async def test_an_oversized_message_closes_1009_and_the_session_lives_on(served):
    sid = await create(served.http)
    pty_id = await _open(served, sid)
    async with _ws(served, sid, pty_id) as ws:
        seen = await _read_until(ws, b"fake-tty ready", bytearray())
        await ws.send(b"x" * ((1 << 20) + 1) + b"\r")
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                seen += await asyncio.wait_for(ws.recv(), 10)
        assert closed.value.rcvd.code == 1009, closed.value
        assert b"xxxx" not in seen  # none of it was typed
    async with _ws(served, sid, pty_id) as ws:
        await ws.send(b"still here\r")
        await _read_until(ws, b"you said: still here", bytearray())


async def test_sdk_sends_large_input_in_messages_the_server_takes(served):
    import atoll

    async with atoll.AsyncClient(served.url, KEY) as client:
        sandbox = await client.sandboxes.create(idle_timeout_s=0)
        async with await sandbox.pty() as term:
            out = bytearray()
            while b"fake-tty ready" not in out:
                out += await term.read(timeout=10)
            # 3 MiB: one message would be refused (1009); the tty keeps the first 4095 bytes of a line
            await term.send(b"a" * (3 << 20) + b"\rlast line\r")
            while b"you said: last line" not in out:
                out += await term.read(timeout=10)
            assert b"you said: aaaa" in out


async def test_a_key_in_the_query_of_a_refused_handshake_stays_out_of_the_log(served):
    """uvicorn logs each WebSocket handshake with its query string; through the handler the entry
    points install, the key is redacted and the rest of the line is kept."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logconfig.configure("text", "INFO")
    buffer = io.StringIO()
    root.handlers[0].setStream(buffer)  # type: ignore[attr-defined]
    try:
        sid = await create(served.http)
        secret = "query-key-" + "7" * 24
        url = f"{served.ws_url}/v1/sandboxes/{sid}/pty/pty_000000000000/ws?cols=80&key={secret}"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with connect(url, additional_headers={"Authorization": f"Bearer {secret}"}):
                pass
        assert refused.value.response.status_code == 401
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    out = buffer.getvalue()
    assert secret not in out, out
    assert f'"WebSocket /v1/sandboxes/{sid}/pty/pty_000000000000/ws?cols=80&key=[redacted]" 401' in out, out


async def test_pty_on_standby_sandbox_resumes_it(served):
    c = served.http
    sid = await create(c)
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 200 and r.json()["state"] == "standby", r.text
    pty_id = await _open(served, sid)
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    async with _ws(served, sid, pty_id) as ws:
        await _read_until(ws, b"fake-tty ready", bytearray())
        # while the terminal is open it is activity: an explicit pause is refused as busy
        r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_busy", r.text


async def test_sdk_async_terminal(served):
    import atoll

    async with atoll.AsyncClient(served.url, KEY) as client:
        sandbox = await client.sandboxes.create(idle_timeout_s=0)
        async with await sandbox.pty(cols=70, rows=20, term="dumb") as term:
            out = bytearray()
            while b"fake-tty ready" not in out:
                out += await term.read(timeout=10)
            await term.send("term\r")
            await term.resize(101, 33)
            await term.send(b"size\r")
            while b"101x33" not in out:
                out += await term.read(timeout=10)
            assert b"dumb\r\n" in out
            pty_id = term.pty_id
        async with await sandbox.pty_attach(pty_id) as term:  # detached and back: scrollback
            out = bytearray()
            async for chunk in term:
                out += chunk
                if b"101x33" in out:
                    break
            with pytest.raises(atoll.InvalidRequest):
                await term.resize(0, 10)
            await term.send("exit 9\r")
            assert await term.wait(timeout=10) == 9
        with pytest.raises(atoll.NotFound) as missing:
            await sandbox.pty_attach("pty_000000000000")
        assert missing.value.code == "pty_not_found"
        assert [p["exit_code"] for p in await sandbox.ptys()] == [9]


async def test_sdk_sync_terminal_in_thread(served):
    code, out = await asyncio.to_thread(_sync_session, served.url)
    assert code == 2 and b"you said: hi" in out


def _sync_session(url: str):
    import atoll

    with atoll.Client(url, KEY) as client:
        sandbox = client.sandboxes.create(idle_timeout_s=0)
        with sandbox.pty() as term:
            out = bytearray()
            term.send("hi\r")
            while b"you said: hi" not in out:
                out += term.read(timeout=10)
            term.send("exit 2\r")
            code = term.wait(timeout=10)
        with pytest.raises(atoll.Unauthorized):
            bad = atoll.Client(url, "wrong")
            try:
                atoll.Sandbox(bad, {"id": sandbox.id}).pty_attach(term.pty_id)
            finally:
                bad.close()
        return code, bytes(out)


async def test_a_terminal_closes_when_its_key_is_revoked(served):
    """Issue 20: an open terminal of a tenant key ends (1008) as soon as the key is revoked."""
    c = served.http
    tid = (await c.post("/v1/tenants", json={"name": "pty-rv"})).json()["id"]
    k = (await c.post(f"/v1/tenants/{tid}/keys", json={})).json()
    async with httpx.AsyncClient(
        transport=served.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {k['key']}"}
    ) as t:
        sid = await create(t)
        r = await t.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24})
        pty_id = r.json()["pty_id"]
    async with _ws(served, sid, pty_id, key=k["key"]) as ws:
        await _read_until(ws, b"fake-tty ready", bytearray())
        assert (await c.delete(f"/v1/keys/{k['id']}")).status_code == 204
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008

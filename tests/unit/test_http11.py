"""The shared HTTP/1.1 client (atoll.shared.http11): kept-alive connections the peer closed while idle are
not reused (a POST on one used to fail, and the control plane then took the worker for gone), and a
peer that is not there is ConnectFailed, not a broken answer."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from atoll.shared import http11
from atoll.testing import free_port


@contextlib.asynccontextmanager
async def _serve(app: FastAPI, **config):
    """`app` under uvicorn on a free loopback port (yielded) while the block runs."""
    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off", **config)
    )
    task = asyncio.ensure_future(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        srv.should_exit = True
        await task


@contextlib.asynccontextmanager
async def _server(keep_alive_s: float):
    app = FastAPI()

    @app.post("/x")
    async def x():
        return {"ok": 1}

    async with _serve(app, timeout_keep_alive=keep_alive_s) as port:
        yield port


async def test_an_idle_connection_the_peer_closed_is_not_reused():
    async with _server(keep_alive_s=0.3) as port:
        ch = http11.Channel("127.0.0.1", port)
        assert (await ch.request("POST", "/x", json={})).status_code == 200
        await asyncio.sleep(0.8)  # the server closes the idle keep-alive connection
        assert (await ch.request("POST", "/x", json={})).json() == {"ok": 1}
        await ch.aclose()


async def test_nobody_listening_is_connect_failed():
    ch = http11.Channel("127.0.0.1", free_port())
    with pytest.raises(http11.ConnectFailed):
        await ch.request("GET", "/")


@contextlib.asynccontextmanager
async def _streaming_server():
    """A server whose GET /lines?tail_s=T&more=N answers `exit` then, T seconds later, N more bytes
    and its end (`forever=1`: never ends); GET /port answers the caller's port (one per connection)."""
    app = FastAPI()

    @app.get("/lines")
    async def lines(tail_s: float = 0.0, more: int = 0, forever: int = 0):
        async def body():
            yield b'{"exit": 0}\n'
            await asyncio.sleep(tail_s)
            if more:
                yield b"x" * more
            while forever:
                await asyncio.sleep(0.05)
                yield b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")

    @app.get("/port")
    async def caller_port(request: Request):
        return {"port": request.client.port}

    async with _serve(app) as port:
        yield port


async def _first_line_then_leave(ch: http11.Channel, finished: bool, **params: str) -> int:
    """Read GET /lines up to its first line and leave (marked finished or not); the port of the
    connection the next call comes on, once the rest of the answer has had time to come."""
    async with ch.stream("GET", "/lines", params=params) as r:
        async for chunk in r.aiter_raw():
            assert chunk.startswith(b'{"exit"')
            break
        if finished:
            r.finished()
    await asyncio.sleep(0.3)
    return (await ch.request("GET", "/port")).json()["port"]


async def test_a_stream_left_at_its_last_line_keeps_its_connection_when_marked_finished():
    async with _streaming_server() as port:
        ch = http11.Channel("127.0.0.1", port)
        first = (await ch.request("GET", "/port")).json()["port"]
        # the rest (the chunked terminator) comes 0.1 s later: read in the background, then kept
        assert await _first_line_then_leave(ch, True, tail_s="0.1") == first
        assert await _first_line_then_leave(ch, True, tail_s="0", more="1000") == first
        # not marked: leaving early closes it, as before (the peer sees the caller gone)
        other = await _first_line_then_leave(ch, False, tail_s="0.1")
        assert other != first
        # marked, but more than DRAIN_BYTES follows, or the answer does not end within DRAIN_S
        assert await _first_line_then_leave(ch, True, more=str(http11.DRAIN_BYTES + 1)) not in (first, other)
        await ch.aclose()


async def test_a_finished_stream_that_does_not_end_is_closed_after_the_drain_time(monkeypatch):
    monkeypatch.setattr(http11, "DRAIN_S", 0.3)
    async with _streaming_server() as port:
        ch = http11.Channel("127.0.0.1", port)
        first = (await ch.request("GET", "/port")).json()["port"]
        async with ch.stream("GET", "/lines", params={"forever": "1"}) as r:
            async for _ in r.aiter_raw():
                break
            r.finished()
        # meanwhile the connection is being drained: another call takes a new one
        during = (await ch.request("GET", "/port")).json()["port"]
        assert during != first
        await asyncio.sleep(0.6)
        assert not ch._draining and len(ch._open) == 1  # the endless one was closed
        assert (await ch.request("GET", "/port")).json()["port"] == during
        await ch.aclose()

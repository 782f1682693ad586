"""The shared HTTP/1.1 client (atoll.shared.http11): kept-alive connections the peer closed while idle are
not reused (a POST on one used to fail, and the control plane then took the worker for gone), and a
peer that is not there is ConnectFailed, not a broken answer."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvicorn
from fastapi import FastAPI

from atoll.shared import http11
from atoll.testing import free_port


@contextlib.asynccontextmanager
async def _server(keep_alive_s: float):
    app = FastAPI()

    @app.post("/x")
    async def x():
        return {"ok": 1}

    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_config=None, timeout_keep_alive=keep_alive_s, lifespan="off"
        )
    )
    task = asyncio.ensure_future(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        srv.should_exit = True
        await task


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

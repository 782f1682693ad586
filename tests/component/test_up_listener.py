"""`atoll up`'s loopback seam listener (atoll.up.SeamListener) over a FakeWorker: it gives the
worker a loopback URL and a fresh token, takes a grant minted with that token for the sandbox's
data verbs and refuses anything else (401), and ATOLL_UP_WORKER_PORT is checked at start (a bad
value or a port in use is a setting error naming it)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from atoll import up
from atoll.core import config, grants
from atoll.core import worker_api as api
from atoll.testing import FakeWorker


def test_the_port_setting_is_checked():
    assert up.worker_port({}) == 0 and up.worker_port({"ATOLL_UP_WORKER_PORT": "7090"}) == 7090
    for bad in ("x", "-1", "70000", "1.5"):
        with pytest.raises(config.SettingsError, match="ATOLL_UP_WORKER_PORT"):
            up.worker_port({"ATOLL_UP_WORKER_PORT": bad})
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(config.SettingsError, match="ATOLL_UP_WORKER_PORT .* is in use"):
            up.SeamListener(FakeWorker("local"), taken.getsockname()[1]).bind()
    finally:
        taken.close()


async def test_the_listener_takes_grants_minted_with_its_token():
    fake = FakeWorker("local")
    sid = "sb-aaaaaaaaaaaaaaaa"
    await fake.create(api.SandboxSpec(sid, "base", 256, 1.0, 1024))
    listener = up.SeamListener(fake)
    url = await listener.start()
    try:
        assert url.startswith("http://127.0.0.1:") and fake.url == url and fake.token
        assert fake.tunnel_port > 0
        grant, _ = grants.mint(fake.token, sid, time.time())
        async with httpx.AsyncClient(base_url=url + "/worker/v1", timeout=10) as c:
            hdr = {"Authorization": f"Grant {grant}", "Atoll-Protocol": str(api.PROTOCOL_VERSION)}
            r = await c.get(f"/sandboxes/{sid}/processes", headers=hdr)
            assert r.status_code == 200, r.text
            r = await c.get("/inventory", headers=hdr)
            assert r.status_code == 401, r.text
            forged, _ = grants.mint("another token", sid, time.time())
            r = await c.get(
                f"/sandboxes/{sid}/processes", headers={**hdr, "Authorization": f"Grant {forged}"}
            )
            assert r.status_code == 401, r.text
    finally:
        await listener.aclose()
    async with httpx.AsyncClient(timeout=2) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(url + "/worker/v1/info")

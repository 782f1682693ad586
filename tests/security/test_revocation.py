"""A key revoked (or expiring) while a request made with it is still running: the request is cut,
not allowed to run on (issue 20). The control plane under a real uvicorn on loopback, a fake
worker whose exec takes 30 s (a long command, a stream): revoking the key ends the request at
once on this server; an expiry (or a revocation by another server) within Keys.STREAM_CHECK_S."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import httpx

from atoll.testing import FakeAtoll, free_port
from tests.component.test_worker_protocol import _serve

KEY = "revocation-key"


async def test_revoking_a_key_cuts_its_running_requests(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as cp:
        port = free_port()
        async with _serve(cp.app, port):
            url = f"http://127.0.0.1:{port}"
            admin = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            tid = (await admin.post("/v1/tenants", json={"name": "rv"})).json()["id"]
            soon = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)).isoformat()
            k1 = (await admin.post(f"/v1/tenants/{tid}/keys", json={})).json()
            k2 = (await admin.post(f"/v1/tenants/{tid}/keys", json={"expires_at": soon})).json()
            t1 = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k1['key']}"}, timeout=60)
            t2 = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k2['key']}"}, timeout=60)
            sid = (await t1.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
            cp.worker.delay["exec"] = 30
            try:
                long1 = asyncio.ensure_future(t1.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 30"}))
                long2 = asyncio.ensure_future(t2.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 30"}))
                await asyncio.sleep(0.5)
                assert not long1.done() and not long2.done()
                t0 = time.monotonic()
                assert (await admin.delete(f"/v1/keys/{k1['id']}")).status_code == 204
                r1 = await asyncio.wait_for(long1, 5)
                assert time.monotonic() - t0 < 3.0  # cut, not run out: the exec would take 30 s
                assert r1.status_code == 401 and "revoked or expired" in r1.json()["error"]["message"]
                r2 = await asyncio.wait_for(long2, 3 + 2 * 2.0 + 2)  # expiry + two watch periods
                assert r2.status_code == 401
                # the admin key's requests are not cut, and the sandbox is fine
                cp.worker.delay["exec"] = 0
                assert (
                    await admin.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
                ).status_code == 200
            finally:
                cp.worker.delay["exec"] = 0
                for c in (admin, t1, t2):
                    await c.aclose()

"""The dashboard's page and assets (controlplane.ui_pages) and `GET /v1/whoami`, in process: /ui,
its assets and the favicon need no key and name no other site; the API behind them still does;
whoami answers the key's scope and tenant."""

from __future__ import annotations

import re

import httpx

from atoll.controlplane import ui_pages


def _anon(fake) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=fake.transport, base_url="http://atoll")


async def test_the_page_and_its_assets_need_no_key(fake):
    async with _anon(fake) as c:
        r = await c.get("/ui")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert not re.search(r"https?://", r.text)
        assets = re.findall(r'(?:src|href)="(/ui/assets/[^"]+)"', r.text)
        assert len(assets) == 3, assets
        for path in [*assets, "/favicon.ico"]:
            got = await c.get(path)
            assert got.status_code == 200 and got.content, path
        assert (await c.get("/ui/")).status_code == 308
        assert (await c.get("/ui/assets/missing.js")).status_code == 404
        assert (await c.get("/v1/sandboxes")).status_code == 401
        assert (await c.get("/v1/whoami")).status_code == 401
    for path in ("/ui", "/ui/assets/app.js", "/favicon.ico"):
        assert ui_pages.is_public(path)
    assert not ui_pages.is_public("/ui/other") and not ui_pages.is_public("/uix")


async def test_whoami(fake):
    c = fake.http
    assert (await c.get("/v1/whoami")).json() == {"key_id": "admin", "scope": "admin", "tenant_id": None}
    tid = (await c.post("/v1/tenants", json={"name": "who"})).json()["id"]
    assert (await c.get(f"/v1/whoami?tenant_id={tid}")).json()["tenant_id"] == tid
    made = (await c.post(f"/v1/tenants/{tid}/keys", json={})).json()
    async with _anon(fake) as anon:
        r = await anon.get("/v1/whoami", headers={"Authorization": f"Bearer {made['key']}"})
    assert r.json() == {"key_id": made["id"], "scope": "tenant", "tenant_id": tid}

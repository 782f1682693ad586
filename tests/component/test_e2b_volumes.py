"""E2B volumes (atoll.e2b.volumes) in front of the real control plane over a FakeWorker: the
control calls (create, list, get, destroy) as drives of the key's tenant, the volume content API
with the volume token (stat, listings with depth, mkdir, write/read, owner and mode, remove),
every error E2B-shaped, and a token that opens its own volume only. The real SDK against a real
`atoll up` is tests/integration/test_e2b_sdk.py."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from atoll.e2b import app as e2b_app
from atoll.testing import FakeAtoll
from tests.component.test_e2b_app import _error, on_loopback


@pytest.fixture
async def e2b(tmp_path):
    async with FakeAtoll(tmp_path) as fake, on_loopback(fake.app) as api_url:
        app = e2b_app.create_app(e2b_app.Settings(api_url=api_url, token_key=b"k", volume_mb=32))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://e2b", headers={"X-API-KEY": fake.api_key}
        ) as c:
            c.fake = fake  # type: ignore[attr-defined]
            yield c
        await app.control.aclose()


def _vol(c: httpx.AsyncClient, token: str) -> httpx.AsyncClient:
    """A client of the volume content API as the SDK is: the token, no API key."""
    return httpx.AsyncClient(
        transport=c._transport, base_url="http://e2b", headers={"Authorization": f"Bearer {token}"}
    )


async def test_volume_control_calls_are_drives_of_the_tenant(e2b):
    r = await e2b.post("/volumes", json={"name": "data"})
    assert r.status_code == 201, r.text
    v = r.json()
    assert (v["volumeID"], v["name"]) == ("data", "data") and v["token"]
    drive = (await e2b.fake.http.get("/v1/drives/data")).json()
    assert drive["size_mb"] == 32
    r = await e2b.get("/volumes/data")
    assert r.status_code == 200 and r.json() == v  # the same token every time
    assert (await e2b.post("/volumes", json={"name": "more"})).status_code == 201
    assert (await e2b.get("/volumes")).json() == [
        {"volumeID": "data", "name": "data"},
        {"volumeID": "more", "name": "more"},
    ]
    assert "exists" in _error(await e2b.post("/volumes", json={"name": "data"}), 409)
    assert "name" in _error(await e2b.post("/volumes", json={"name": "a/b"}), 400)
    assert "name" in _error(await e2b.post("/volumes", json={}), 400)
    _error(await e2b.post("/volumes", json={"name": "x"}, headers={"X-API-KEY": "atk_no_such"}), 401)
    assert (await e2b.delete("/volumes/more")).status_code == 204
    _error(await e2b.delete("/volumes/more"), 404)
    _error(await e2b.get("/volumes/more"), 404)
    # a sandbox created with the volume mounted gets the drive
    r = await e2b.post(
        "/v2/sandboxes",
        json={"templateID": "base", "timeout": 60, "volumeMounts": [{"name": "data", "path": "/mnt/v"}]},
    )
    assert r.status_code == 201, r.text
    sb = (await e2b.fake.http.get(f"/v1/sandboxes/{r.json()['sandboxID']}")).json()
    assert sb["drives"] == [{"name": "data", "path": "/mnt/v", "read_only": False}]


async def test_volume_content_calls_with_the_token(e2b):
    tok = (await e2b.post("/volumes", json={"name": "data"})).json()["token"]
    other = (await e2b.post("/volumes", json={"name": "other"})).json()["token"]
    async with _vol(e2b, tok) as v:
        r = await v.put("/volumecontent/data/file", params={"path": "/d/a.txt"}, content=b"hello")
        assert r.status_code == 201, r.text
        a = r.json()
        assert {k: a[k] for k in ("name", "type", "path", "size", "mode")} == {
            "name": "a.txt",
            "type": "file",
            "path": "/d/a.txt",
            "size": 5,
            "mode": 0o644,
        }
        assert dt.datetime.fromisoformat(a["mtime"]).tzinfo is not None and "target" not in a
        r = await v.put(
            "/volumecontent/data/file", params={"path": "b.txt", "mode": "384", "uid": "1000"}, content=b"x"
        )
        assert (r.status_code, r.json()["path"], r.json()["mode"], r.json()["uid"]) == (
            201,
            "/b.txt",
            0o600,
            1000,
        )
        r = await v.get("/volumecontent/data/file", params={"path": "/d/a.txt"})
        assert (r.status_code, r.content) == (200, b"hello")
        assert (await v.get("/volumecontent/data/path", params={"path": "/d"})).json()["type"] == "directory"
        r = await v.post("/volumecontent/data/dir", params={"path": "/n/m", "force": "true", "mode": "448"})
        assert (r.status_code, r.json()["type"], r.json()["mode"]) == (201, "directory", 0o700)
        _error(
            await v.post("/volumecontent/data/dir", params={"path": "/x/y"}), 404
        )  # no parents unless force
        r = await v.get("/volumecontent/data/dir", params={"path": "/", "depth": "2"})
        assert [e["path"] for e in r.json()] == ["/b.txt", "/d", "/d/a.txt", "/n", "/n/m"]
        r = await v.get("/volumecontent/data/dir", params={"path": "/"})
        assert [e["path"] for e in r.json()] == ["/b.txt", "/d", "/n"]
        r = await v.patch(
            "/volumecontent/data/path", params={"path": "/d/a.txt"}, json={"gid": 5, "mode": 0o640}
        )
        assert (r.status_code, r.json()["gid"], r.json()["mode"]) == (200, 5, 0o640)
        assert (await v.delete("/volumecontent/data/path", params={"path": "/d"})).status_code == 204
        _error(await v.get("/volumecontent/data/path", params={"path": "/d/a.txt"}), 404)
        _error(await v.get("/volumecontent/data/file", params={"path": "/d/a.txt"}), 404)
        _error(await v.delete("/volumecontent/data/path", params={"path": "/d"}), 404)
        # bad input: E2B-shaped 400s naming the value
        assert "mode" in _error(
            await v.post("/volumecontent/data/dir", params={"path": "/q", "mode": "x"}), 400
        )
        assert "path" in _error(await v.get("/volumecontent/data/path"), 400)
        assert "depth" in _error(
            await v.get("/volumecontent/data/dir", params={"path": "/", "depth": "99"}), 400
        )
        assert "owner" in _error(
            await v.patch("/volumecontent/data/path", params={"path": "/b.txt"}, json={"owner": 1}), 400
        )
        # this volume's token opens this volume only
        _error(await v.get("/volumecontent/other/dir", params={"path": "/"}), 401)
    async with _vol(e2b, other) as o:
        assert (await o.get("/volumecontent/other/dir", params={"path": "/"})).json() == []
        _error(await o.get("/volumecontent/data/file", params={"path": "/b.txt"}), 401)
    for bad in ("", "nope", tok + "x"):
        async with _vol(e2b, bad) as b:
            _error(await b.get("/volumecontent/data/file", params={"path": "/b.txt"}), 401)
    # the API key is no volume token
    async with _vol(e2b, e2b.fake.api_key) as k:
        _error(await k.get("/volumecontent/data/file", params={"path": "/b.txt"}), 401)

"""Drive tokens (E2B's volume token) and the drive file routes E2B's volume content API needs, over
a FakeWorker: a token opens its own drive's file routes and nothing else (not another drive of its
tenant, not a same-named drive of another tenant, not the drive's other routes, not a drive made
again under the same name); stat, mkdir, attrs and deep listings answer what they set."""

from __future__ import annotations

import httpx

from atoll.controlplane import db as dbm


def _as(fake, auth: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": auth} if auth is not None else {}
    return httpx.AsyncClient(transport=fake.transport, base_url="http://atoll", headers=headers)


async def _tenant(c, name: str) -> tuple[str, str]:
    r = await c.post("/v1/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = await c.post(f"/v1/tenants/{tid}/keys", json={})
    assert r.status_code == 201, r.text
    return tid, r.json()["key"]


async def _drive(c, name: str) -> str:
    r = await c.post("/v1/drives", json={"name": name, "size_mb": 16})
    assert r.status_code == 201, r.text
    r = await c.post(f"/v1/drives/{name}/token")
    assert r.status_code == 200, r.text
    assert r.json()["scheme"] == "E2B-Volume" and r.json()["name"] == name
    return r.json()["token"]


def _code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


async def test_a_drive_token_opens_its_drives_files_and_nothing_else(fake):
    tid_a, key_a = await _tenant(fake.http, "ta")
    _, key_b = await _tenant(fake.http, "tb")
    async with _as(fake, f"Bearer {key_a}") as a, _as(fake, f"Bearer {key_b}") as b:
        tok = await _drive(a, "data")
        other = await _drive(a, "other")
        tok_b = await _drive(b, "data")  # the same name in another tenant
        assert len({tok, other, tok_b}) == 3
        assert (
            await b.put("/v1/drives/data/files", params={"path": "/b.txt"}, content=b"B")
        ).status_code == 200
        async with _as(fake, f"E2B-Volume {tok}") as t:
            r = await t.put("/v1/drives/data/files", params={"path": "/d/a.txt"}, content=b"hello")
            assert r.status_code == 200, r.text
            assert (await t.get("/v1/drives/data/files", params={"path": "/d/a.txt"})).content == b"hello"
            assert (await a.get("/v1/drives/data/files", params={"path": "/d/a.txt"})).content == b"hello"
            r = await t.get("/v1/drives/data/files/list", params={"path": "/"})
            assert [e["path"] for e in r.json()["items"]] == ["/d"]
            assert (await t.get("/v1/drives/data/files/stat", params={"path": "/d"})).json()["type"] == "dir"
            assert (await t.post("/v1/drives/data/files/mkdir", params={"path": "/e"})).status_code == 201
            r = await t.patch("/v1/drives/data/files", params={"path": "/e"}, json={"mode": 0o700})
            assert r.json()["mode"] == 0o700
            # not another drive of its tenant, nor the drive's other routes, nor anything else
            assert _code(await t.get("/v1/drives/other/files", params={"path": "/d/a.txt"})) == (
                401,
                "unauthorized",
            )
            for method, path in (
                ("GET", "/v1/drives/data"),
                ("DELETE", "/v1/drives/data"),
                ("GET", "/v1/drives/data/tar"),
                ("POST", "/v1/drives/data/token"),
                ("POST", "/v1/drives/data/clone"),
                ("GET", "/v1/drives"),
                ("GET", "/v1/volumes/data/files/list"),
                ("GET", "/v1/sandboxes"),
            ):
                assert _code(await t.request(method, path)) == (401, "unauthorized"), (method, path)
            # tenant b's token opens b's drive `data` only: a's file is not there
            async with _as(fake, f"E2B-Volume {tok_b}") as tb:
                r = await tb.get("/v1/drives/data/files", params={"path": "/b.txt"})
                assert r.content == b"B"
                assert _code(await tb.get("/v1/drives/data/files", params={"path": "/d/a.txt"}))[0] == 404
            # a's token with b's tenant id in front (or any other edit) is refused
            mac = tok.partition(".")[2]
            for forged in (
                f"{tok_b.partition('.')[0]}.{mac}",
                tok + "x",
                "default." + mac,
                "",
                "x",
                tok.upper(),
            ):
                async with _as(fake, f"E2B-Volume {forged}") as f:
                    r = await f.get("/v1/drives/data/files", params={"path": "/d/a.txt"})
                    assert _code(r) == (401, "unauthorized"), forged
                    assert "drive token" in r.json()["error"]["message"]
            # a key is no drive token and a drive token is no key
            async with _as(fake, f"E2B-Volume {key_a}") as f:
                assert _code(await f.get("/v1/drives/data/files", params={"path": "/d/a.txt"}))[0] == 401
            async with _as(fake, f"Bearer {tok}") as f:
                assert _code(await f.get("/v1/drives/data/files", params={"path": "/d/a.txt"}))[0] == 401
        # a drive deleted and made again under the same name has a new token; the old one is dead
        assert (await a.delete("/v1/drives/data")).status_code == 204
        r = await a.post("/v1/drives", json={"name": "data", "size_mb": 16})
        assert r.status_code == 201
        with fake.manager.db.session.begin() as s:  # made in another second than the first
            rec = s.get(dbm.StoreRecord, (tid_a, "drive", "data"))
            rec.created_at = rec.created_at.replace(year=rec.created_at.year + 1)
        async with _as(fake, f"E2B-Volume {tok}") as t:
            assert _code(await t.get("/v1/drives/data/files/list"))[0] == 401
        assert (await a.post("/v1/drives/data/token")).json()["token"] != tok


async def test_mkdir_attrs_stat_and_deep_listings(fake):
    c = fake.http
    await _drive(c, "tree")
    assert (
        await c.put("/v1/drives/tree/files", params={"path": "/a/b/c.txt"}, content=b"xyz")
    ).status_code == 200
    r = await c.post("/v1/drives/tree/files/mkdir", params={"path": "/n/m"}, json={"mode": 0o750, "uid": 7})
    assert _code(r) == (404, "file_not_found")  # no parents without `parents`
    r = await c.post(
        "/v1/drives/tree/files/mkdir",
        params={"path": "/n/m"},
        json={"parents": True, "mode": 0o750, "uid": 7},
    )
    assert r.status_code == 201, r.text
    assert {k: r.json()[k] for k in ("path", "type", "mode", "uid", "gid")} == {
        "path": "/n/m",
        "type": "dir",
        "mode": 0o750,
        "uid": 7,
        "gid": 0,
    }
    r = await c.post("/v1/drives/tree/files/mkdir", params={"path": "/a/b/c.txt"})
    assert _code(r) == (409, "invalid_state")
    r = await c.get("/v1/drives/tree/files/list", params={"path": "/", "depth": 3})
    assert [e["path"] for e in r.json()["items"]] == ["/a", "/a/b", "/a/b/c.txt", "/n", "/n/m"]
    r = await c.get("/v1/drives/tree/files/list", params={"path": "/", "depth": 1})
    assert [e["path"] for e in r.json()["items"]] == ["/a", "/n"]
    st = (await c.get("/v1/drives/tree/files/stat", params={"path": "/a/b/c.txt"})).json()
    assert (st["type"], st["size"], st["target"]) == ("file", 3, None)
    assert {"uid", "gid", "atime", "mtime", "ctime"} <= set(st)
    r = await c.patch("/v1/drives/tree/files", params={"path": "/a/b/c.txt"}, json={"uid": 1000, "gid": 1000})
    assert (r.json()["uid"], r.json()["gid"], r.json()["mode"]) == (1000, 1000, 0o644)
    # bad input: a clear 400 naming the value, nothing changed
    for params, body, words in (
        ({"path": "/a/b/c.txt"}, {"mode": 0o10000}, "mode"),
        ({"path": "/a/b/c.txt"}, {"uid": -1}, "uid"),
        ({"path": "/a/b/c.txt"}, {"owner": 1}, "owner"),
        ({"path": "a"}, {"mode": 1}, "absolute"),
    ):
        r = await c.patch("/v1/drives/tree/files", params=params, json=body)
        assert r.status_code == 400 and words in r.text, (params, body, r.text)
    for depth in ("0", "17", "x", "-1"):
        r = await c.get("/v1/drives/tree/files/list", params={"path": "/", "depth": depth})
        assert _code(r) == (400, "invalid_request") and "depth" in r.text, depth
    assert _code(await c.get("/v1/drives/tree/files/stat", params={"path": "/nope"})) == (
        404,
        "file_not_found",
    )
    r = await c.delete("/v1/drives/tree/files", params={"path": "/a"})
    assert r.status_code == 204
    r = await c.get("/v1/drives/tree/files/list", params={"path": "/", "depth": 4})
    assert [e["path"] for e in r.json()["items"]] == ["/n", "/n/m"]
    assert (await c.get("/v1/drives/tree/files/stat", params={"path": "/n/m"})).json()["mode"] == 0o750

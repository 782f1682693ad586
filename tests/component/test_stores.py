"""Volumes and drives in the control plane over a FakeWorker: one holder per volume (also under
concurrent creates), delete refused while attached, a holder's delete frees the volume for the
next create (which waits for the detach instead of a 409), bad input (a body that is no tar),
drive files."""

from __future__ import annotations

import asyncio
import gzip
import io
import tarfile

from atoll.core import errors
from tests.component.conftest import create


async def _volume(c, name="data", size_mb=64):
    r = await c.post("/v1/volumes", json={"name": name, "size_mb": size_mb})
    assert r.status_code == 201, r.text
    return r.json()


async def test_a_volume_has_one_holder_even_under_concurrent_creates(fake):
    c = fake.http
    v = await _volume(c)
    assert (v["name"], v["size_mb"], v["attached_to"]) == ("data", 64, None)
    body = {"idle_timeout_s": 0, "volumes": [{"name": "data", "path": "/data"}]}
    rs = await asyncio.gather(*[c.post("/v1/sandboxes", json=body) for _ in range(5)])
    won = [r for r in rs if r.status_code == 201]
    lost = [r for r in rs if r.status_code != 201]
    assert len(won) == 1, [r.text for r in rs]
    holder = won[0].json()["id"]
    assert won[0].json()["volumes"] == [{"name": "data", "path": "/data", "read_only": False}]
    for r in lost:
        err = r.json()["error"]
        assert r.status_code == 409 and err["code"] == "volume_in_use" and holder in err["message"]
    assert (await c.get("/v1/volumes/data")).json()["attached_to"] == holder
    r = await c.delete("/v1/volumes/data")
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_in_use" and holder in r.text
    # the worker's copy is placed where the volume lives and got the mount
    [spec] = [s for s in fake.worker.runtimes.values() if s.spec.sandbox_id == holder]
    assert [(m.kind, m.name, m.path) for m in spec.spec.mounts] == [("volume", "data", "/data")]


async def test_a_create_right_after_the_holders_delete_waits_for_the_detach(fake):
    c, worker = fake.http, fake.worker
    await _volume(c)
    first = await create(c, volumes=[{"name": "data", "path": "/data"}])
    worker.delay["delete"] = 0.5  # the worker takes a while to remove the sandbox
    assert (await c.delete(f"/v1/sandboxes/{first}")).status_code == 204
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "volumes": [{"name": "data", "path": "/x"}]})
    assert r.status_code == 201, r.text
    assert ("delete", first) in worker.calls
    assert (await c.get("/v1/volumes/data")).json()["attached_to"] == r.json()["id"]
    assert (await c.delete(f"/v1/sandboxes/{r.json()['id']}")).status_code == 204

    async def free():
        while (await c.get("/v1/volumes/data")).json()["attached_to"] is not None:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(free(), 5)
    assert (await c.delete("/v1/volumes/data")).status_code == 204
    assert (await c.get("/v1/volumes/data")).status_code == 404


async def test_a_failed_create_frees_its_volume(fake):
    c, worker = fake.http, fake.worker
    await _volume(c)
    worker.fail.add("create")
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "volumes": [{"name": "data", "path": "/d"}]})
    assert r.status_code >= 500
    worker.fail.discard("create")
    assert (await c.get("/v1/volumes/data")).json()["attached_to"] is None
    await create(c, volumes=[{"name": "data", "path": "/d"}])


async def test_bad_input_gets_clear_errors_and_changes_nothing(fake):
    c = fake.http
    for body, code, words in (
        ({"name": "a/b", "size_mb": 64}, 400, "invalid volume name"),
        ({"name": "x" * 65, "size_mb": 64}, 400, "invalid volume name"),
        ({"name": "ok", "size_mb": 0}, 400, "size_mb"),
        ({"name": "ok", "size_mb": 10**9}, 400, "size_mb"),
    ):
        r = await c.post("/v1/volumes", json=body)
        assert r.status_code == code and words in r.json()["error"]["message"], r.text
    assert (await c.get("/v1/volumes")).json()["items"] == []
    await _volume(c)
    r = await c.post("/v1/volumes", json={"name": "data", "size_mb": 64})
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_exists"
    for mounts, words in (
        ([{"name": "data", "path": "/proc"}], "/proc"),
        ([{"name": "data", "path": "/opt/atoll/x"}], "/opt/atoll"),
        ([{"name": "data", "path": "relative"}], "absolute"),
        ([{"name": "nope", "path": "/n"}], "no volume named 'nope'"),
    ):
        r = await c.post("/v1/sandboxes", json={"volumes": mounts})
        assert r.status_code in (400, 404) and words in r.json()["error"]["message"], r.text
    r = await c.post(
        "/v1/sandboxes",
        json={
            "volumes": [{"name": "data", "path": "/data"}],
            "drives": [{"name": "data", "path": "/data/x"}],
        },
    )
    assert r.status_code in (400, 404), r.text
    assert (await c.get("/v1/volumes/data")).json()["attached_to"] is None  # nothing stays taken
    assert (await c.get("/v1/volumes/no-such")).status_code == 404


async def test_a_drive_is_shared_and_its_files_are_reachable_without_a_sandbox(fake):
    c = fake.http
    r = await c.post("/v1/drives", json={"name": "shared", "size_mb": 8})
    assert r.status_code == 201 and r.json()["attached_to"] == []
    a = await create(c, drives=[{"name": "shared", "path": "/shared"}])
    b = await create(c, drives=[{"name": "shared", "path": "/s", "read_only": True}])
    assert sorted((await c.get("/v1/drives/shared")).json()["attached_to"]) == sorted([a, b])
    r = await c.put("/v1/drives/shared/files", params={"path": "/dir/a.txt"}, content=b"hello")
    assert r.status_code == 200 and r.json()["size"] == 5
    assert (await c.get("/v1/drives/shared/files", params={"path": "/dir/a.txt"})).content == b"hello"
    names = [
        e["name"]
        for e in (await c.get("/v1/drives/shared/files/list", params={"path": "/dir"})).json()["items"]
    ]
    assert names == ["a.txt"]
    for bad in ("/../etc/passwd", "relative"):
        r = await c.get("/v1/drives/shared/files", params={"path": bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path", r.text
    r = await c.delete("/v1/drives/shared")
    assert r.status_code == 409 and r.json()["error"]["code"] == "drive_in_use"


async def test_a_tar_import_holds_the_volume_against_creates_and_deletes(fake):
    import io
    import tarfile

    c, worker = fake.http, fake.worker
    await _volume(c)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        ti = tarfile.TarInfo("a.txt")
        ti.size = 1
        t.addfile(ti, io.BytesIO(b"a"))
    worker.delay["write_store_tar"] = 0.5
    imp = asyncio.ensure_future(c.put("/v1/volumes/data/tar", content=buf.getvalue()))
    await asyncio.sleep(0.2)
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "volumes": [{"name": "data", "path": "/d"}]})
    assert r.status_code == 409 and "a tar import" in r.json()["error"]["message"], r.text
    r = await c.delete("/v1/volumes/data")
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_in_use", r.text
    assert (await imp).status_code == 200
    assert (await c.get("/v1/volumes/data")).json()["attached_to"] is None
    await create(c, volumes=[{"name": "data", "path": "/d"}])


async def test_a_body_that_is_not_a_tar_is_a_400_and_changes_nothing(fake):
    """PUT …/tar of drives, volumes and a sandbox's files with a body that is no tar archive (the
    OpenAPI fuzz found a 500): 400 invalid_request naming the problem; nothing is written."""
    c = fake.http
    assert (await c.post("/v1/drives", json={"name": "shared", "size_mb": 8})).status_code == 201
    await _volume(c)
    r = await c.put("/v1/drives/shared/files", params={"path": "/kept.txt"}, content=b"kept")
    assert r.status_code in (200, 201, 204), r.text
    sid = await create(c)
    good = io.BytesIO()
    with tarfile.open(fileobj=good, mode="w:gz") as t:
        ti = tarfile.TarInfo("new.txt")
        ti.size = 3
        t.addfile(ti, io.BytesIO(b"new"))
    bodies = [b"garbage" * 100, b"", b'{"not": "a tar"}', gzip.compress(b"plain text"), good.getvalue()[:40]]
    for url in ("/v1/drives/shared/tar", "/v1/volumes/data/tar", f"/v1/sandboxes/{sid}/files/tar"):
        for body in bodies:
            r = await c.put(url, content=body, params={"path": "/root"} if "sandboxes" in url else None)
            assert r.status_code == 400, (url, body[:20], r.status_code, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_request" and "not a tar archive" in err["message"], (url, err)
            if "sandboxes" not in url:
                assert "send a tar (optionally gzip) stream" in err["message"], err
    drive = fake.worker.stores[("drive", "shared")]["files"]
    assert drive == {b"/kept.txt": b"kept"}, drive
    assert fake.worker.stores[("volume", "data")]["files"] == {}
    r = await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/new.txt"})
    assert r.status_code == 404, r.text
    # the same routes take a gzip tar
    r = await c.put("/v1/drives/shared/tar", content=good.getvalue())
    assert r.status_code == 200 and r.json()["files"] == 1, r.text
    assert (await c.get("/v1/drives/shared/files", params={"path": "/new.txt"})).content == b"new"


async def test_a_drive_delete_waits_out_a_worker_still_taking_a_deleted_sandbox_down(fake, monkeypatch):
    c, worker = fake.http, fake.worker
    assert (await c.post("/v1/drives", json={"name": "shared", "size_mb": 16})).status_code == 201
    real = worker.delete_store
    refusals = []

    async def still_mounted(kind, name):
        if len(refusals) < 3:  # the worker has not removed the deleted sandbox's runtime yet
            refusals.append(name)
            raise errors.Conflict(f"{kind} {name!r} is mounted by sandbox(es) sb-x", code=f"{kind}_in_use")
        await real(kind, name)

    monkeypatch.setattr(worker, "delete_store", still_mounted)
    r = await c.delete("/v1/drives/shared")
    assert r.status_code == 204, r.text
    assert len(refusals) == 3 and ("drive", "shared") not in worker.stores
    # a sandbox that mounts it (as the records say) is a 409 at once, the worker not asked
    assert (await c.post("/v1/drives", json={"name": "shared", "size_mb": 16})).status_code == 201
    sid = await create(c, drives=[{"name": "shared", "path": "/s"}])
    r = await c.delete("/v1/drives/shared")
    assert r.status_code == 409 and sid in r.text and len(refusals) == 3

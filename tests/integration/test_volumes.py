"""Volumes and drives with real gVisor sandboxes: a volume's data outlives its sandbox and the
disk tier, its size limit reaches the writer as ENOSPC, it passes to the next sandbox as soon as
its holder's delete answered. A drive shared by sandboxes and by the API, which never follows a link
a sandbox planted, and mount paths through a template's links: tests/security/test_sandbox_boundary.py."""

from __future__ import annotations

import io
import tarfile
import time
import uuid

import pytest

from tests.conftest import run

pytestmark = pytest.mark.integration


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _create(api, **kw) -> str:
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, **kw})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_a_volume_outlives_its_sandbox_the_disk_tier_and_holds_its_size(api):
    vol = _name("vol")
    assert api.post("/v1/volumes", json={"name": vol, "size_mb": 32}).status_code == 201
    sids: list[str] = []
    try:
        a = _create(api, volumes=[{"name": vol, "path": "/data"}])
        sids.append(a)
        out = run(
            api, a, "echo one > /data/a.txt && dd if=/dev/zero of=/data/fill bs=1M count=64 2>&1; echo rc=$?"
        )
        assert "No space left on device" in out["stdout"] and "rc=1" in out["stdout"], out
        out = run(api, a, "rm /data/fill && echo two > /data/b.txt && cat /data/a.txt /data/b.txt")
        assert out["stdout"] == "one\ntwo\n", out  # a full volume broke nothing else
        r = api.post(f"/v1/sandboxes/{a}/pause", json={"tier": "disk"})
        assert r.json()["standby_tier"] == "disk", r.text
        assert run(api, a, "cat /data/a.txt")["stdout"] == "one\n"  # resumed with its volume
        run(api, a, "echo three > /data/c.txt")
        r = api.post(f"/v1/sandboxes/{a}/pause", json={"tier": "archive"})
        assert r.json()["standby_tier"] == "archive", r.text
        assert run(api, a, "cat /data/a.txt /data/c.txt")["stdout"] == "one\nthree\n"  # and from the archive
        run(api, a, "rm /data/c.txt")
        # a clone and an export while attached: what the sandbox has written
        clone = _name("clone")
        r = api.post(f"/v1/volumes/{vol}/clone", json={"name": clone})
        assert r.status_code == 201 and r.json()["attached_to"] is None, r.text
        with tarfile.open(fileobj=io.BytesIO(api.get(f"/v1/volumes/{clone}/tar").content)) as t:
            assert sorted(t.getnames()) == ["a.txt", "b.txt"]
        r = api.post("/v1/sandboxes", json={"volumes": [{"name": vol, "path": "/d"}]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "volume_in_use" and a in r.text
        assert api.delete(f"/v1/volumes/{vol}").status_code == 409
        assert api.delete(f"/v1/sandboxes/{a}").status_code == 204
        t0 = time.monotonic()
        b = _create(api, volumes=[{"name": vol, "path": "/mnt/v", "read_only": True}])  # waits for the detach
        sids.append(b)
        assert time.monotonic() - t0 < 30
        assert run(api, b, "cat /mnt/v/a.txt")["stdout"] == "one\n"
        out = api.post(f"/v1/sandboxes/{b}/exec", json={"cmd": "touch /mnt/v/x"}).json()
        assert out["exit_code"] != 0 and "Read-only" in out["stderr"], out
        assert api.get(f"/v1/volumes/{vol}").json()["attached_to"] == b
        # import into the free clone; a tar with a member going out is refused
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            ti = tarfile.TarInfo("new/c.txt")
            ti.size = 3
            t.addfile(ti, io.BytesIO(b"c!\n"))
        r = api.put(f"/v1/volumes/{clone}/tar", content=buf.getvalue())
        assert r.status_code == 200 and r.json()["files"] == 1, r.text
        r = api.put(f"/v1/volumes/{vol}/tar", content=buf.getvalue())
        assert r.status_code == 409 and r.json()["error"]["code"] == "volume_in_use"
        assert api.delete(f"/v1/volumes/{clone}").status_code == 204
    finally:
        for sid in sids:
            api.delete(f"/v1/sandboxes/{sid}")
        deadline = time.monotonic() + 60
        while api.delete(f"/v1/volumes/{vol}").status_code == 409 and time.monotonic() < deadline:
            time.sleep(0.2)


def test_a_volume_path_that_is_a_file_in_the_template_is_a_clear_400_and_frees_the_volume(api):
    vol = _name("vol")
    assert api.post("/v1/volumes", json={"name": vol, "size_mb": 8}).status_code == 201
    try:
        r = api.post("/v1/sandboxes", json={"volumes": [{"name": vol, "path": "/usr/bin/env"}]})
        assert r.status_code == 400 and "is a file" in r.json()["error"]["message"], r.text
        assert api.get(f"/v1/volumes/{vol}").json()["attached_to"] is None
    finally:
        for sb in api.get("/v1/sandboxes", params={"state": "failed"}).json()["items"]:
            api.delete(f"/v1/sandboxes/{sb['id']}")
        assert api.delete(f"/v1/volumes/{vol}").status_code == 204

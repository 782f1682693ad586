"""Named snapshots with real gVisor sandboxes (`atoll up`): a snapshot keeps a sandbox's disk files,
its /tmp (tmpfs: in the memory image) and its running processes; two sandboxes made from it both
have them, with identities of their own; a files-only snapshot (memory: false) gives the disk
files only; deleting it removes it from the worker. Records and bad input: tests/component."""

from __future__ import annotations

import concurrent.futures
import os
import uuid

import pytest

from tests.conftest import run

pytestmark = pytest.mark.integration

NONCE = uuid.uuid4().hex[:8]


def out(api, sid: str, cmd: str) -> str:
    r = run(api, sid, cmd)
    assert r["exit_code"] == 0, r
    return r["stdout"].strip()


def test_snapshot_restores_files_tmp_and_processes_into_distinct_sandboxes(api, atoll_up):
    made: list[str] = []
    snaps: list[str] = []
    try:
        r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 256})
        assert r.status_code == 201, r.text
        src = r.json()["id"]
        made.append(src)
        out(api, src, f"echo disk-{NONCE} > /root/disk.txt && echo tmp-{NONCE} > /tmp/mem.txt")
        r = api.post(f"/v1/sandboxes/{src}/exec", json={"cmd": "sleep 4321", "background": True})
        assert r.status_code == 200, r.text

        r = api.post(f"/v1/sandboxes/{src}/snapshots", json={"name": f"full-{NONCE}"})
        assert r.status_code == 201, r.text
        full = r.json()
        snaps.append(full["id"])
        assert full["memory"] is True and full["memory_mb"] == 256 and full["bytes"] > 1_000_000, full
        r = api.post(f"/v1/sandboxes/{src}/snapshots", json={"memory": False})
        assert r.status_code == 201, r.text
        files_only = r.json()
        snaps.append(files_only["id"])
        assert 0 < files_only["bytes"] < full["bytes"], (files_only, full)
        snap_dirs = [os.path.join(atoll_up.home, "snapshots", s) for s in snaps]
        assert all(os.path.isdir(d) for d in snap_dirs)

        # the source runs on, untouched
        assert out(api, src, "cat /tmp/mem.txt") == f"tmp-{NONCE}"
        assert "sleep 4321" in out(api, src, "ps -eo args")
        assert out(api, src, "cat /root/disk.txt") == f"disk-{NONCE}"

        # the snapshot outlives the sandbox it was taken of
        assert api.delete(f"/v1/sandboxes/{src}").status_code == 204
        made.remove(src)
        # two creates at once, by name and by id
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(
                    lambda ref: api.post("/v1/sandboxes", json={"snapshot": ref, "idle_timeout_s": 0}),
                    (f"full-{NONCE}", full["id"]),
                )
            )
        for r in answers:
            assert r.status_code == 201, r.text
            made.append(r.json()["id"])
        copies = [r.json()["id"] for r in answers]
        assert len({src, *copies}) == 3
        for sid in copies:
            assert out(api, sid, "cat /root/disk.txt") == f"disk-{NONCE}"
            assert out(api, sid, "cat /tmp/mem.txt") == f"tmp-{NONCE}"
            assert "sleep 4321" in out(api, sid, "ps -eo args")
            assert out(api, sid, "hostname") == sid
        out(api, copies[0], "echo changed > /root/disk.txt")
        assert out(api, copies[1], "cat /root/disk.txt") == f"disk-{NONCE}"

        # files only: the disk file, not /tmp (memory) nor the process; any memory size
        r = api.post(
            "/v1/sandboxes", json={"snapshot": files_only["id"], "idle_timeout_s": 0, "memory_mb": 512}
        )
        assert r.status_code == 201, r.text
        cold = r.json()["id"]
        made.append(cold)
        assert r.json()["memory_mb"] == 512
        assert out(api, cold, "cat /root/disk.txt") == f"disk-{NONCE}"
        assert run(api, cold, "cat /tmp/mem.txt")["exit_code"] != 0
        assert "sleep 4321" not in out(api, cold, "ps -eo args")

        # a memory snapshot refuses another memory size
        r = api.post("/v1/sandboxes", json={"snapshot": full["id"], "memory_mb": 512})
        assert r.status_code == 400 and "256" in r.json()["error"]["message"], r.text

        for s, d in zip(snaps, snap_dirs, strict=True):
            assert api.delete(f"/v1/snapshots/{s}").status_code == 204
            assert not os.path.exists(d)
        snaps.clear()
        assert api.delete(f"/v1/snapshots/{full['id']}").status_code == 404
        assert out(api, copies[0], "echo alive") == "alive"  # made from it, it lives on
    finally:
        for s in snaps:
            api.delete(f"/v1/snapshots/{s}")
        for sid in made:
            api.delete(f"/v1/sandboxes/{sid}")


def test_a_snapshot_survives_a_restart_and_unfinished_ones_are_swept(local):
    from tests.integration.conftest import client as _client

    local.start(timeout=600)
    with _client(local) as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
        out(c, sid, f"echo kept-{NONCE} > /root/k.txt")
        c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 9876", "background": True})
        r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "restart"})
        assert r.status_code == 201, r.text
        snap = r.json()["id"]
    # what a worker killed mid-snapshot leaves: a directory without kept.json
    debris = os.path.join(local.home, "snapshots", "snp-00000000000000ff")
    os.makedirs(os.path.join(debris, "upper"))
    local.stop(reap=False)
    local.start(timeout=600)
    assert not os.path.exists(debris)
    with _client(local) as c:
        r = c.post("/v1/sandboxes", json={"snapshot": "restart", "idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        copy = r.json()["id"]
        assert out(c, copy, "cat /root/k.txt") == f"kept-{NONCE}"
        assert "sleep 9876" in out(c, copy, "ps -eo args")
        assert c.delete(f"/v1/snapshots/{snap}").status_code == 204

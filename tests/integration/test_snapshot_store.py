"""A named snapshot in the shared object store is created from on a worker that never held it.

`atoll server` + worker w0 sharing an object store (ATOLL_ARCHIVE_DIR, a directory both read)
with worker w1, whose template directory is its own (its `base` layer a separate copy under
another instance, as if it had run mmdebstrap itself). A sandbox on w0 writes a file on disk and
one in /tmp (tmpfs: in the memory image) and starts a process; its snapshot is uploaded in the
background (`stored` turns true). w0 is drained: a create from the snapshot goes to w1, which
downloads it (checked against its manifest), fetches w0's very base layer and restores it — the
files and the process are there. w0 then stops and is removed: a second create is served from w1's
copy, and deleting the snapshot removes the stored objects (through w1) and w1's copy."""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
import uuid

import httpx
import pytest

from atoll.testing import LocalCluster, LocalWorker
from tests.conftest import TEMPLATE_CACHE
from tests.integration.test_adopt import _separate_base

pytestmark = pytest.mark.integration

NONCE = uuid.uuid4().hex[:8]


def _out(c: httpx.Client, sid: str, cmd: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.json()
    return r.json()["stdout"].strip()


def _timings(log_path: str) -> None:
    """What the upload and the download cost, as the worker logged it (shown with -s)."""
    with open(log_path, errors="replace") as f:
        for line in f:
            if any(w in line for w in ("published:", "stored in", "fetched from", "fetched in")):
                print(line.strip()[:300])


def test_a_stored_snapshot_is_created_on_another_worker_after_its_own_is_gone(tmp_path):
    store = tmp_path / "store"
    env = {
        "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
        "ATOLL_ARCHIVE_DIR": str(store),
        "ATOLL_HEARTBEAT_S": "1",
        "ATOLL_WORKER_LOST_S": "6",
    }
    cl = LocalCluster(tmp_path / "cluster", workers=1, env=env)
    cl.start(timeout=900)
    w1 = None
    own = tmp_path / "w1-templates"
    try:
        c = httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=300)
        r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 256})
        assert r.status_code == 201, r.text
        src = r.json()["id"]
        assert r.json()["worker"] == "w0"
        _out(c, src, f"echo disk-{NONCE} > /root/disk.txt && echo tmp-{NONCE} > /tmp/mem.txt")
        r = c.post(f"/v1/sandboxes/{src}/exec", json={"cmd": "sleep 4321", "background": True})
        assert r.status_code == 200, r.text

        t0 = time.monotonic()
        r = c.post(f"/v1/sandboxes/{src}/snapshots", json={"name": f"travel-{NONCE}"})
        assert r.status_code == 201, r.text
        snap = r.json()
        took_snapshot = time.monotonic() - t0
        for _ in range(600):
            snap = c.get(f"/v1/snapshots/{snap['id']}").json()
            if snap["stored"]:
                break
            time.sleep(0.2)
        assert snap["stored"] is True and snap["worker"] == "w0", snap
        took_stored = time.monotonic() - t0
        print(
            f"snapshot answered in {took_snapshot:.2f} s, stored after {took_stored:.2f} s ({snap['bytes']} bytes)"
        )
        _timings(cl.workers[0].log_path)
        with open(store / "snapshots" / snap["id"] / "manifest.json") as f:
            man = json.load(f)
        assert man["memory"] is True and man["layers"] and (store / man["key"]).is_file(), man
        assert c.delete(f"/v1/sandboxes/{src}").status_code == 204

        base_key, own_instance = _separate_base(TEMPLATE_CACHE, str(own))
        w1 = LocalWorker(
            tmp_path / "cluster" / "worker-1",
            cl.url,
            cl.api_key,
            "w1",
            env={**env, "ATOLL_TEMPLATE_DIR": str(own)},
        )
        w1.start()
        w1.wait_state("ready", 600)
        ids = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}
        assert c.post(f"/v1/workers/{ids['w0']}/drain", json={"evacuate": False}).status_code == 202

        r = c.post("/v1/sandboxes", json={"snapshot": f"travel-{NONCE}", "idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        first = r.json()
        assert first["worker"] == "w1", first
        sid = first["id"]
        assert _out(c, sid, "cat /root/disk.txt") == f"disk-{NONCE}"
        assert _out(c, sid, "cat /tmp/mem.txt") == f"tmp-{NONCE}"
        assert "sleep 4321" in _out(c, sid, "ps -eo args")
        assert _out(c, sid, "hostname") == sid
        # w1 restored onto w0's very base layer (fetched), not its own separately made one
        fetched = [os.path.basename(d) for d in glob.glob(str(own / "layers" / "*@*"))]
        assert any(f.startswith(base_key + "@") for f in fetched), fetched
        with open(own / "layers" / base_key / "layer.json") as f:
            assert json.load(f)["instance"] == own_instance
        _timings(w1.log_path)
        w1_copy = os.path.join(w1.home, "snapshots", snap["id"])
        assert os.path.isfile(os.path.join(w1_copy, "kept.json"))

        # w0 stops and is removed: the snapshot is still created from, on w1
        cl.workers[0].terminate(60)
        for _ in range(200):
            if cl.workers[0].worker_state() == "lost":
                break
            time.sleep(0.1)
        assert c.delete(f"/v1/workers/{ids['w0']}").status_code == 204
        r = c.post("/v1/sandboxes", json={"snapshot": snap["id"], "idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        second = r.json()
        assert second["worker"] == "w1"
        assert _out(c, second["id"], "cat /tmp/mem.txt /root/disk.txt") == f"tmp-{NONCE}\ndisk-{NONCE}"

        # deleting it removes the stored copy (through w1, w0 being gone) and w1's own
        assert c.delete(f"/v1/snapshots/{snap['id']}").status_code == 204
        assert not os.path.exists(store / "snapshots" / snap["id"])
        assert not os.path.exists(w1_copy)
        assert _out(c, first["id"], "echo alive") == "alive"  # made from it, it lives on
        for sid in (first["id"], second["id"]):
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    finally:
        if w1 is not None:
            cl.workers.append(w1)
        cl.stop(reap=True)
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(own, ignore_errors=True)

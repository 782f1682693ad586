"""A user template's build serves creates on a worker that never built it (issue 21).

`atoll server` + worker w0 sharing an object store (ATOLL_ARCHIVE_DIR, a directory both read) with
worker w1, whose template directory is its own: its `base` layer is a separate copy under another
instance (as if it had run mmdebstrap itself, which is not byte-identical). w0 builds a template
(a files step and a run step in gVisor) and publishes it (`in_store: true`); w0 is drained, so the
create goes to w1, which fetches the build by id — w0's very layers, its own `base` untouched —
and the sandbox sees the files the build put there. w1 never runs a build step."""

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


def test_a_sandbox_is_created_from_a_user_template_on_a_worker_that_never_built_it(tmp_path):
    store = tmp_path / "store"
    env = {"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE, "ATOLL_ARCHIVE_DIR": str(store), "ATOLL_HEARTBEAT_S": "1"}
    cl = LocalCluster(tmp_path / "cluster", workers=1, env=env)
    cl.start(timeout=900)
    w1 = None
    own = tmp_path / "w1-templates"
    try:
        c = httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=300)
        name = f"fetch-{uuid.uuid4().hex[:6]}"
        spec = {
            "name": name,
            "from": "base",
            "files": {"/app/marker": "made-on-w0\n"},
            "run": ["echo built-by-run > /app/run.txt"],
            "workdir": "/app",
        }
        r = c.post("/v1/templates", json=spec)
        assert r.status_code == 202, r.text
        bid = r.json()["build_id"]
        for _ in range(1200):
            t = c.get(f"/v1/templates/{name}").json()
            if t["status"] == "failed" or (t["status"] == "ready" and t["in_store"]):
                break
            time.sleep(0.5)
        assert t["status"] == "ready" and t["in_store"] is True, t
        with open(store / "builds" / f"{bid}.json") as f:
            man = json.load(f)
        assert man["build_id"] == bid and len(man["layers"]) == 3  # run, files, base (top first)

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

        r = c.post("/v1/sandboxes", json={"template": name, "idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert (sb["worker"], sb["build_id"]) == ("w1", bid), sb
        out = c.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "cat marker run.txt && pwd"}).json()
        assert out["exit_code"] == 0, out
        assert out["stdout"] == "made-on-w0\nbuilt-by-run\n/app\n", out

        # w1 fetched w0's very layers (its own `base` stays as it was, unused) and built nothing
        fetched = sorted(os.path.basename(d) for d in glob.glob(str(own / "layers" / "*@*")))
        assert [m["key"] + "@" + m["instance"] for m in man["layers"]] == [
            next(f for f in fetched if f.startswith(m["key"] + "@")) for m in man["layers"]
        ], fetched
        with open(own / "layers" / base_key / "layer.json") as f:
            assert json.load(f)["instance"] == own_instance
        with open(os.path.join(w1.home, "builds", bid, "build.json")) as f:
            record = json.load(f)
        assert record["fetched"] is True and record["status"] == "ready"
        with open(os.path.join(w1.home, "builds", bid, "log")) as f:
            log = f.read()
        assert "FETCHED" in log and "STEP" not in log, log

        # deleting the template removes it from the store too
        assert c.delete(f"/v1/sandboxes/{sb['id']}").status_code == 204
        for _ in range(100):
            r = c.delete(f"/v1/templates/{name}")
            if r.status_code != 409:
                break
            time.sleep(0.2)
        assert r.status_code == 204, r.text
        assert not (store / "builds" / f"{bid}.json").exists()
    finally:
        if w1 is not None:
            cl.workers.append(w1)
        cl.stop(reap=True)
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(own, ignore_errors=True)

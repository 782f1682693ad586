"""An archived sandbox comes back on a worker that never built its template (issue 19).

`atoll server` + worker w0 sharing an archive directory (ATOLL_ARCHIVE_DIR: a store both can
read, so archives publish their template layers) with worker w1, which has a template directory
of its own: its `base` layer is a separate copy with another instance (as if it had built it
itself — mmdebstrap output differs byte for byte) and it has never built the user template. A
sandbox made on w0 from the user template runs a counting process, is archived, w0 stops and is
removed: w1 adopts the sandbox, fetches w0's very layers (never its own `base`) and resumes it
with the process still counting and its files intact."""

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

pytestmark = pytest.mark.integration

BEAT = (
    'python3 -c \'import os, time\nx=[0]\nwhile True:\n  x[0]+=1; open("/tmp/beat.tmp","w").write(str(x[0])); '
    'os.replace("/tmp/beat.tmp", "/tmp/beat"); time.sleep(0.1)\' > /dev/null 2>&1 &\necho $!'
)


def _separate_base(src_templates: str, dest_templates: str) -> tuple[str, str]:
    """A copy of the built-in `base` layer under a new instance: (key, instance)."""
    [layer] = [d for d in glob.glob(os.path.join(src_templates, "layers", "base-*")) if "@" not in d]
    key = os.path.basename(layer)
    dest = os.path.join(dest_templates, "layers", key)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.system(f"cp -a --reflink=auto {layer} {dest}")  # noqa: S605 - fixed paths of this test
    with open(os.path.join(dest, "layer.json")) as f:
        meta = json.load(f)
    meta["instance"] = uuid.uuid4().hex
    with open(os.path.join(dest, "layer.json"), "w") as f:
        json.dump(meta, f)
    if os.path.exists(os.path.join(dest, "instance")):
        os.unlink(os.path.join(dest, "instance"))
    return key, meta["instance"]


def test_an_archived_sandbox_resumes_on_a_worker_that_never_built_its_template(tmp_path):
    env = {
        "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
        "ATOLL_ARCHIVE_DIR": str(tmp_path / "store"),
        "ATOLL_WORKER_LOST_S": "6",
        "ATOLL_HEARTBEAT_S": "1",
    }
    cl = LocalCluster(tmp_path / "cluster", workers=1, env=env)
    cl.start(timeout=900)
    w1 = None
    try:
        c = httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=300)
        name = f"adopt-{uuid.uuid4().hex[:6]}"
        r = c.post(
            "/v1/templates", json={"name": name, "from": "base", "files": {"/app/marker": "made-on-w0\n"}}
        )
        assert r.status_code == 202, r.text
        for _ in range(600):
            t = c.get(f"/v1/templates/{name}").json()
            if t.get("status") in ("ready", "failed"):
                break
            time.sleep(0.5)
        assert t["status"] == "ready", t
        sb = c.post("/v1/sandboxes", json={"template": name, "idle_timeout_s": 0}).json()
        sid = sb["id"]
        assert sb["worker"] == "w0"
        pid = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": BEAT}).json()["stdout"].strip()
        c.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes.txt"}, content=b"kept across workers"
        )
        time.sleep(0.5)
        before = int(c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/beat"}).text)
        r = c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
        assert r.status_code == 200 and r.json()["standby_tier"] == "archive", r.text

        own = tmp_path / "w1-templates"
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
        w0 = cl.workers[0]
        w0.terminate(60)  # a worker that stops is shown lost at once
        w0_id = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}["w0"]
        for _ in range(200):
            if w0.worker_state() == "lost":
                break
            time.sleep(0.1)
        assert c.delete(f"/v1/workers/{w0_id}").status_code == 204

        sb = c.get(f"/v1/sandboxes/{sid}").json()
        assert (sb["state"], sb["standby_tier"], sb["worker"]) == ("standby", "archive", "w1"), sb
        r = c.post(
            f"/v1/sandboxes/{sid}/exec",
            json={"cmd": f"kill -0 {pid} && cat /tmp/beat && echo && cat /app/marker /root/notes.txt"},
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["exit_code"] == 0, out
        count, marker, notes = out["stdout"].split("\n", 2)
        assert int(count) >= before and marker == "made-on-w0" and notes == "kept across workers"
        time.sleep(0.5)
        later = int(c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/beat"}).text)
        assert later > int(count), "the process does not run on after the move"
        assert c.get(f"/v1/sandboxes/{sid}").json()["worker"] == "w1"
        # w1 restored onto w0's layers: its own separately made `base` was not used
        fetched = [os.path.basename(d) for d in glob.glob(str(own / "layers" / "*@*"))]
        assert any(f.startswith(base_key + "@") for f in fetched), fetched
        with open(own / "layers" / base_key / "layer.json") as f:
            assert json.load(f)["instance"] == own_instance
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        c.delete(f"/v1/templates/{name}")
    finally:
        if w1 is not None:
            cl.workers.append(w1)
        cl.stop(reap=True)
        shutil.rmtree(tmp_path / "store", ignore_errors=True)
        shutil.rmtree(tmp_path / "w1-templates", ignore_errors=True)

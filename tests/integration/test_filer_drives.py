"""A drive served by a real SeaweedFS filer (ATOLL_FILER_URL) is shared by sandboxes on two
different workers and by the API; its size is a quota that reaches the writer; deleting it stops
every worker's mount and removes it from the filer."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import httpx
import pytest

from atoll.testing import LocalCluster
from atoll.testing.seaweed import SeaweedFS
from tests.conftest import TEMPLATE_CACHE, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_filer_drive_is_shared_across_workers(tmp_path):
    with SeaweedFS(data_dir=str(tmp_path / "seaweed")) as sw:
        sw.start()
        cluster = LocalCluster(
            tmp_path / "cluster",
            workers=2,
            env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE, "ATOLL_FILER_URL": sw.atoll_filer_url},
        )
        cluster.start(timeout=600)
        try:
            with httpx.Client(base_url=cluster.url, headers=cluster.headers(), timeout=300) as api:
                r = api.post("/v1/drives", json={"name": "team", "size_mb": 16})
                assert r.status_code == 201, r.text
                a = api.post(
                    "/v1/sandboxes", json={"idle_timeout_s": 0, "drives": [{"name": "team", "path": "/team"}]}
                )
                assert a.status_code == 201, a.text
                first = a.json()["worker_id"]
                # cordoned (evacuate: false): the next goes elsewhere
                r = api.post(f"/v1/workers/{first}/drain", json={"evacuate": False})
                assert r.status_code == 202
                b = api.post(
                    "/v1/sandboxes", json={"idle_timeout_s": 0, "drives": [{"name": "team", "path": "/t"}]}
                )
                assert b.status_code == 201, b.text
                assert b.json()["worker_id"] != first
                a_id, b_id = a.json()["id"], b.json()["id"]
                # gVisor's gofer keeps the host file open after the program closes it, so the FUSE
                # client publishes a file to the filer at fsync (sync), not at close (measured)
                run(api, a_id, "mkdir -p /team/out && echo from-a > /team/out/x && sync /team/out/x")
                deadline = time.monotonic() + 10
                while run(api, b_id, "cat /t/out/x 2>/dev/null || true")["stdout"] != "from-a\n":
                    assert time.monotonic() < deadline, "a file written on one worker never reached the other"
                    time.sleep(0.1)
                r = api.put("/v1/drives/team/files", params={"path": "/api.txt"}, content=b"api")
                assert r.status_code == 200, r.text
                deadline = time.monotonic() + 10
                while run(api, a_id, "cat /team/api.txt 2>/dev/null || true")["stdout"] != "api":
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
                out = run(api, b_id, "dd if=/dev/zero of=/t/big bs=1M count=40 2>&1; echo rc=$?")
                assert "No space left" in out["stdout"] and "rc=1" in out["stdout"], out
                assert api.delete(f"/v1/sandboxes/{a_id}").status_code == 204
                assert api.delete(f"/v1/sandboxes/{b_id}").status_code == 204
                deadline = time.monotonic() + 60
                while (r := api.delete("/v1/drives/team")).status_code == 409 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert r.status_code == 204, r.text
                with pytest.raises(urllib.error.HTTPError):
                    urllib.request.urlopen(f"{sw.filer_url}/atoll/drives/team/api.txt", timeout=5)
        finally:
            cluster.stop(reap=True)

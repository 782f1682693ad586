"""A worker registers with a `worker`-scoped key (issue 20), real split deployment: the worker
becomes ready and serves sandboxes; the same key cannot call the public API; a revoked worker
key cannot register again. The admin key still registers (with a deprecation warning)."""

from __future__ import annotations

import httpx
import pytest

from atoll.testing import LocalServer, LocalWorker
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration

ENV = {"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE, "ATOLL_HEARTBEAT_S": "1"}


def test_a_worker_key_registers_a_worker_and_opens_nothing_else(tmp_path):
    server = LocalServer(tmp_path / "server", env=ENV).start()
    worker = None
    try:
        admin = httpx.Client(base_url=server.url, headers=server.headers(), timeout=120)
        r = admin.post("/v1/keys", json={"scope": "worker"})
        assert r.status_code == 201, r.text
        wkey, kid = r.json()["key"], r.json()["id"]
        worker = LocalWorker(tmp_path / "w", server.url, wkey, "wk1", env=ENV).start()
        worker.wait_state("ready", 240)
        sid = admin.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
        out = admin.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo served"}).json()
        assert out["stdout"] == "served\n"
        w = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {wkey}"}, timeout=30)
        for method, path in (
            ("GET", "/v1/sandboxes"),
            ("POST", f"/v1/sandboxes/{sid}/exec"),
            ("GET", "/v1/workers"),
        ):
            r = w.request(method, path, json={"cmd": "id"} if method == "POST" else None)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (path, r.text)
        assert admin.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert admin.delete(f"/v1/keys/{kid}").status_code == 204
        r = w.post("/v1/workers/register", json={"url": "http://127.0.0.1:9", "info": {}})
        assert r.status_code == 401
        with open(server.log_path) as f:
            assert "registered with an admin key" not in f.read()
    finally:
        if worker is not None:
            worker.terminate(60)
        server.terminate(30)
        if worker is not None:
            from atoll.testing.local import purge

            purge(worker.home)

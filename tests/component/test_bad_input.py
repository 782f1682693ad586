"""Bad input at the control plane (in process, fake worker): nested JSON, odd pids, impossible
resources, output limits beyond the server's, path_b64 checks — each a 400 with a message, no 500."""

from __future__ import annotations

import base64

import httpx
import pytest

from atoll import settings
from atoll.controlplane import api, db, lifecycle, metrics
from tests.component.fake_worker import FakeWorker

KEY = "component-key"


@pytest.fixture
async def env(tmp_path):
    worker = FakeWorker()
    m = metrics.Metrics()
    manager = lifecycle.SandboxManager(db.open_database(f"sqlite:///{tmp_path}/db.sqlite"), worker, m)
    app = api.create_app(manager, api_key=KEY, max_file_bytes=1024, max_exec_output_bytes=4096)
    await manager.start()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://atoll",
        headers={"Authorization": f"Bearer {KEY}"},
    ) as c:
        r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        yield c, worker, r.json()["id"]
    await manager.stop()


def _msg(r: httpx.Response, status: int = 400, code: str = "invalid_request") -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    return r.json()["error"]["message"]


async def test_deeply_nested_json(env):
    c, _, sid = env
    assert "nested" in _msg(await c.post("/v1/sandboxes", content=b"[" * 100000))
    assert "nested" in _msg(await c.post(f"/v1/sandboxes/{sid}/exec", content=b'{"cmd": ' + b"[" * 100000))
    deep_value = b'{"cmd": "true", "env": ' + b"[" * 900 + b"]" * 900 + b"}"
    assert "env" in _msg(await c.post(f"/v1/sandboxes/{sid}/exec", content=deep_value))


async def test_pids_must_be_ascii_digits(env):
    c, worker, sid = env
    for pid in ("%D9%A3", "%EF%BC%93", "3%C2%B2", "-1", "0"):
        assert "pid" in _msg(await c.delete(f"/v1/sandboxes/{sid}/processes/{pid}"))
    assert not [v for v, s in worker.calls if v.startswith("agent DELETE")]


async def test_resources(env):
    c, _, _ = env
    assert "cpus" in _msg(await c.post("/v1/sandboxes", json={"cpus": 1e-9}))
    assert "memory_mb" in _msg(await c.post("/v1/sandboxes", json={"memory_mb": 65536 * 1024}))
    host_mb = api._host_memory_mb()
    if host_mb < 65536:
        assert str(host_mb) in _msg(await c.post("/v1/sandboxes", json={"memory_mb": host_mb + 1}))


async def test_max_output_bytes_is_bounded_by_the_server(env):
    c, _, sid = env
    msg = _msg(await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "max_output_bytes": 4097}))
    assert "4096" in msg and "ATOLL_MAX_EXEC_OUTPUT_KB" in msg
    assert (
        await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "max_output_bytes": 4096})
    ).status_code == 200


async def test_path_b64_checks(env):
    c, _, sid = env
    files = f"/v1/sandboxes/{sid}/files"

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    for params in (
        {"path_b64": "%%%"},
        {"path_b64": b64(b"rel/a")},
        {"path_b64": b64(b"/a/../b")},
        {"path_b64": b64(b"/a\x00b")},
        {"path_b64": b64(b"/" + b"a" * 5000)},
        {"path": "/a", "path_b64": b64(b"/a")},
    ):
        _msg(await c.get(files, params=params), 400, "invalid_path")
    assert (await c.delete(files, params={"path_b64": b64(b"/a\xff")})).status_code == 204
    assert (
        await c.delete(files, params={"path_b64": base64.urlsafe_b64encode(b"/\xfb\xff").decode()})
    ).status_code == 204


def test_exec_output_setting(monkeypatch):
    assert settings.load().max_exec_output_kb == 1024
    monkeypatch.setenv("ATOLL_MAX_EXEC_OUTPUT_KB", "64")
    assert settings.load().max_exec_output_kb == 64
    for bad in ("0", "65537", "lots"):
        monkeypatch.setenv("ATOLL_MAX_EXEC_OUTPUT_KB", bad)
        with pytest.raises(settings.SettingsError, match="ATOLL_MAX_EXEC_OUTPUT_KB"):
            settings.load()

"""Bad input at the control plane (in process, fake worker): nested JSON, odd pids, impossible
resources, output limits beyond the server's, path_b64 checks — each a 400 with a message, no 500."""

from __future__ import annotations

import base64

import httpx
import pytest

from atoll.controlplane import settings
from atoll.core import config
from atoll.testing import FakeAtoll, FakeWorker
from tests.component.conftest import create


@pytest.fixture
async def env(fake):
    sid = await create(fake.http)
    yield fake.http, fake.worker, sid


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
    assert not [v for v, s in worker.calls if v.startswith("kill")]


async def test_resources(env, tmp_path):
    c, _, _ = env
    assert "cpus" in _msg(await c.post("/v1/sandboxes", json={"cpus": 1e-9}))
    assert "memory_mb" in _msg(await c.post("/v1/sandboxes", json={"memory_mb": 65536 * 1024}))
    # more than any worker's memory: refused before any work, naming the largest worker's
    async with FakeAtoll(tmp_path / "small", [FakeWorker("small", memory_mb=4096)]) as small:
        msg = _msg(await small.http.post("/v1/sandboxes", json={"memory_mb": 8192}))
        assert "4096" in msg and "8192" in msg
        assert not small.worker.calls


async def test_max_output_bytes_is_bounded_by_the_server(env):
    c, _, sid = env
    msg = _msg(await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "max_output_bytes": 4097}))
    assert "4096" in msg and "ATOLL_MAX_EXEC_OUTPUT_KB" in msg
    assert (
        await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "max_output_bytes": 4096})
    ).status_code == 200


async def test_path_b64_checks(env):
    c, worker, sid = env
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
    worker.runtimes[sid].files[b"/a\xff"] = b"x"  # names that are not UTF-8
    worker.runtimes[sid].files[b"/\xfb\xff"] = b"x"
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
        with pytest.raises(config.SettingsError, match="ATOLL_MAX_EXEC_OUTPUT_KB"):
            settings.load()


async def test_an_encoded_slash_in_an_id_is_a_400_never_a_redirect(env):
    """`…/pty/..%2f` decodes to `…/pty/../`; the router answered it with a 307 to `…/pty/..`, which
    a client that follows redirects resolves to `/v1/sandboxes/{id}`: the sandbox's delete."""
    c, worker, sid = env
    for path in (f"/v1/sandboxes/{sid}/pty/..%2f", f"/v1/sandboxes/{sid}/pty/x%2F", "/v1/workers/..%2f"):
        for method in ("DELETE", "GET"):
            r = await c.request(method, path)
            assert "encoded '/'" in _msg(r), r.text
            assert "location" not in r.headers
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert ("delete", sid) not in worker.calls


async def test_a_long_id_is_not_echoed_whole(env):
    c, _, sid = env
    long = "x" * 5000
    for r, status, code in (
        (await c.get(f"/v1/workers/{long}"), 400, "invalid_request"),
        (await c.post(f"/v1/workers/{long}/drain", json={}), 400, "invalid_request"),
        (await c.get(f"/v1/sandboxes/{long}"), 400, "invalid_request"),
        (await c.delete(f"/v1/sandboxes/{sid}/pty/{long}"), 404, "pty_not_found"),
        (await c.get(f"/v1/templates/{long}"), 404, "template_not_found"),
        (await c.get(f"/v1/secrets/{long}"), 400, "invalid_request"),
    ):
        message = _msg(r, status, code)
        assert len(message) < 2100 and long not in message, (r.request.url.path[:40], len(message))
    message = _msg(await c.get(f"/v1/workers/{long}"))
    assert "(5000 characters)" in message and "ids look like 'wk-'" in message, message

"""Grants in `atoll up` (the suite's shared installation) with a real gVisor sandbox: its in-process
worker's seam listens on loopback with a token of its own, so the grant route answers a URL and a
grant (it was 409 before), and the data path works through it — the edge's WorkerAPI
(edge.seam.GrantedWorker, with a key and with the envd access token alone: files, exec, a
background process's output, a terminal through the port tunnel) and `atoll edge` itself."""

from __future__ import annotations

import asyncio
import urllib.parse

import httpx
import pytest

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.edge import seam, service
from atoll.guest.agent import ptyframes
from atoll.testing import LocalEdge

pytestmark = pytest.mark.integration


@pytest.fixture
def up_sandbox(atoll_up):
    with httpx.Client(base_url=atoll_up.url, headers=atoll_up.headers(), timeout=600) as c:
        r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        yield c, sid
        c.delete(f"/v1/sandboxes/{sid}")


def test_the_grant_route_answers_in_up_with_a_loopback_worker(up_sandbox):
    c, sid = up_sandbox
    r = c.post(f"/v1/sandboxes/{sid}/grant")
    assert r.status_code == 200, r.text
    g = r.json()
    url = urllib.parse.urlsplit(g["worker"]["url"])
    assert (url.scheme, url.hostname) == ("http", "127.0.0.1") and url.port
    assert g["worker"]["tunnel_port"] > 0 and g["grant"].startswith(sid + ".") and g["e2b_access_token"]
    # the listener takes grants and its own token only: a call without either is 401
    r = httpx.get(f"{g['worker']['url']}/worker/v1/sandboxes/{sid}/processes", timeout=10)
    assert r.status_code == 401, r.text
    r = httpx.get(
        f"{g['worker']['url']}/worker/v1/inventory",
        headers={"Authorization": f"Grant {g['grant']}"},
        timeout=10,
    )
    assert r.status_code == 401, r.text


def test_the_granted_worker_and_atoll_edge_work_against_up(atoll_up, up_sandbox, tmp_path):
    c, sid = up_sandbox
    key = atoll_up.headers()["Authorization"]

    async def through_the_seam() -> None:
        edge = service.Edge(atoll_up.url)
        try:
            w = seam.seam_for(edge, key, sid)
            token = await w.e2b_access_token()

            async def body():
                yield b"hello from the edge\n"

            await w.write_file(sid, "/tmp/g.txt", body(), None)
            async with w.read_file(sid, "/tmp/g.txt") as dl:
                assert b"".join([x async for x in dl.chunks]) == b"hello from the edge\n"
            assert (await w.stat_file(sid, "/tmp/g.txt")).size == 20
            assert "g.txt" in [e.name for e in await w.list_files(sid, "/tmp")]
            res = await w.exec(sid, api.ExecSpec(cmd="cat /tmp/g.txt; id -u", max_output_bytes=1 << 16))
            assert res.exit_code == 0 and res.stdout.startswith("hello from the edge\n"), res
            p = await w.start_process(sid, api.ExecSpec(cmd="echo one; echo two", max_output_bytes=1 << 16))
            async with w.process_output(sid, p.pid, 0, True) as events:
                got = [ev async for ev in events]
            assert "".join(e.text for e in got if isinstance(e, api.ProcessOutput)) == "one\ntwo\n"
            assert isinstance(got[-1], api.ProcessExit) and got[-1].exit_code == 0
            # a terminal through the worker's port tunnel, with the grant
            pty = await w.open_pty(
                sid, api.PtySpec(cols=80, rows=24, cmd=["sh", "-c", "echo pty-ok; sleep 30"])
            )
            stream = await w.attach_pty(sid, pty.pty_id)
            try:
                seen = b""
                async with asyncio.timeout(30):
                    while b"pty-ok" not in seen:
                        chunk = await stream.read(65536)
                        assert chunk, f"the terminal stream ended early: {seen!r}"
                        seen += chunk
            finally:
                stream.close()
                await w.kill_pty(sid, pty.pty_id)
            assert seen[:1] == bytes([ptyframes.DATA])
            # the envd access token alone opens the same sandbox
            t = seam.seam_for_access_token(edge, token, sid)
            assert (await t.stat_file(sid, "/tmp/g.txt")).size == 20
            with pytest.raises(errors.Unauthorized):
                await seam.seam_for_access_token(edge, token[::-1], sid).stat_file(sid, "/tmp/g.txt")
        finally:
            await edge.aclose()

    asyncio.run(through_the_seam())

    edge = LocalEdge(tmp_path / "edge", atoll_up.url).start()
    try:
        with httpx.Client(base_url=edge.url, headers={"Authorization": key}, timeout=120) as e:
            r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /tmp/g.txt"})
            assert r.status_code == 200, r.text
            assert r.json()["stdout"] == "hello from the edge\n"
            r = e.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/g.txt"})
            assert (r.status_code, r.content) == (200, b"hello from the edge\n")
    finally:
        edge.terminate()

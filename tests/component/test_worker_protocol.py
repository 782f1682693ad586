"""The control plane ↔ worker protocol over real HTTP, without runsc: the control plane's app and the
worker's API (worker.httpapi) each under uvicorn on a loopback port, a FakeWorker behind the worker
API, and the worker's real registration loop. Every public call then crosses the seam as JSON."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json

import httpx
import pytest
import uvicorn

from atoll.controlplane import evacuation
from atoll.core import errors
from atoll.core import worker_api as api
from atoll.core.lifecycle import Tier
from atoll.testing import FakeAtoll, FakeWorker, free_port
from atoll.worker.service import httpapi, registration
from atoll.worker.service import settings as worker_settings

KEY = "protocol-key"


@contextlib.asynccontextmanager
async def _serve(app, port: int):
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_config=None, lifespan="off", timeout_graceful_shutdown=0.1
        )
    )
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def _worker(server_url: str, fake: FakeWorker, *, key: str = KEY, home: str = "/nonexistent"):
    creds = httpapi.Credentials()
    port = free_port()
    s = worker_settings.WorkerSettings(
        home=home, name=fake.name, server_url=server_url, api_key=key, heartbeat_s=0.2
    )
    reg = registration.Registration(s, fake, creds, f"http://127.0.0.1:{port}")  # type: ignore[arg-type]
    async with _serve(httpapi.create_app(fake, creds), port):
        task = asyncio.ensure_future(reg.run())
        try:
            yield reg, task, port
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await reg.aclose()


async def _until_ready(handle, tries: int = 300) -> bool:
    """Whether a server's handle of a worker is `ready` within `tries` looks 20 ms apart (taking a
    worker over takes a while on a loaded machine)."""
    for _ in range(tries):
        if handle.state == "ready":
            return True
        await asyncio.sleep(0.02)
    return handle.state == "ready"


@pytest.fixture
async def cluster(tmp_path):
    async with FakeAtoll(tmp_path, [], api_key=KEY, max_file_bytes=1 << 20) as cp:
        # 5 s, not less: the server, the worker and the test share one event loop here, and a loaded
        # machine (CI, three processes beside gVisor sandboxes) stalled it past 1 s, losing the
        # worker under a test about something else. Tests about losing one set less themselves.
        cp.manager.workers.lost_after_s = 5.0
        port = free_port()
        async with _serve(cp.app, port):
            url = f"http://127.0.0.1:{port}"
            fake = FakeWorker("w1")
            async with _worker(url, fake) as (reg, task, wport):
                http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
                for _ in range(200):
                    if (await http.get("/healthz")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                # registered and taken over (ready): a loaded machine takes a while, and a create
                # before that is a 503 no_worker that no test here is about
                for _ in range(400):
                    items = (await http.get("/v1/workers")).json()["items"]
                    if [w["state"] for w in items] == ["ready"]:
                        break
                    await asyncio.sleep(0.05)
                yield cp, http, fake, reg, wport
                await http.aclose()


async def test_every_call_crosses_the_seam(cluster):
    cp, c, fake, reg, _ = cluster
    ws = (await c.get("/v1/workers")).json()["items"]
    assert [(w["name"], w["state"], w["protocol"]) for w in ws] == [("w1", "ready", api.PROTOCOL_VERSION)]
    assert ws[0]["url"].startswith("http://127.0.0.1:") and ws[0]["last_heartbeat_at"]
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "env": {"A": "1"}})
    assert r.status_code == 201, r.text
    sb = r.json()
    sid = sb["id"]
    assert sb["worker"] == "w1" and fake.runtimes[sid].spec.env == {"A": "1"}
    fake.exec_handler = lambda spec: api.ExecResult(3, f"ran {spec.cmd}\u2028é", "err", 7, False, 0, 0)
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "hi"]})
    assert r.json() == {
        "exit_code": 3,
        "stdout": "ran ['echo', 'hi']\u2028é",
        "stderr": "err",
        "duration_ms": 7,
        "timed_out": False,
        "stdout_truncated_bytes": 0,
        "stderr_truncated_bytes": 0,
    }
    r = await c.post(
        f"/v1/sandboxes/{sid}/exec", json={"cmd": "x"}, headers={"Accept": "application/x-ndjson"}
    )
    lines = [json.loads(x) for x in r.content.split(b"\n") if x]
    assert lines == [
        {"stdout": "ran x\u2028é"},
        {"stderr": "err"},
        {"exit_code": 3, "timed_out": False, "duration_ms": 7},
    ]
    assert (
        await c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/d/f"}, content=b"\x00data")
    ).status_code == 204
    assert (await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/d/f"})).content == b"\x00data"
    raw = base64.b64encode(b"/d/\xff").decode()
    assert (
        await c.put(f"/v1/sandboxes/{sid}/files", params={"path_b64": raw}, content=b"z")
    ).status_code == 204
    assert fake.runtimes[sid].files[b"/d/\xff"] == b"z"
    names = [
        e["name_b64"]
        for e in (await c.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/d"})).json()["items"]
    ]
    assert sorted(names) == sorted([base64.b64encode(b"f").decode(), base64.b64encode(b"\xff").decode()])
    r = await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
    pid = (await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 9", "background": True})).json()[
        "pid"
    ]
    assert [p["pid"] for p in (await c.get(f"/v1/sandboxes/{sid}/processes")).json()["items"]] == [pid]
    assert (await c.delete(f"/v1/sandboxes/{sid}/processes/{pid}")).status_code == 204
    r = await c.delete(f"/v1/sandboxes/{sid}/processes/{pid}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "process_not_found"
    fake.gate_blockers = ["an epoll server"]
    sb = (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).json()
    assert (sb["standby_tier"], sb["standby_reason"]) == (
        "memory",
        "kept in the memory tier: an epoll server",
    )
    fake.gate_blockers = []
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).json()[
        "standby_tier"
    ] == "disk"
    assert (await c.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"
    fake.fail.add("checkpoint")
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_failed"
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "failed"
    assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    for _ in range(100):
        if sid not in fake.runtimes:
            break
        await asyncio.sleep(0.02)
    assert sid not in fake.runtimes


async def test_run_process_crosses_the_seam(cluster):
    """The server's RemoteWorker over the worker's HTTP API: run_process is one call, the
    process first, then its output follow and exit; a refused start is the worker's error."""
    cp, c, fake, reg, _ = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    remote = cp.manager.workers.handles[reg.worker_id].worker
    fake.exec_handler = lambda spec: api.ExecResult(0, "é\n", "", 1, False, 0, 0)
    async with remote.run_process(sid, api.ExecSpec(cmd="cat", max_output_bytes=1 << 20)) as (run, events):
        assert [p.pid for p in await remote.list_processes(sid)] == [run.pid]
        it = aiter(events)
        first = await anext(it)
        assert isinstance(first, api.ProcessOutput) and (first.text, first.offset) == ("é\n", 3)
        fake.end_process(sid, run.pid, 0)
        rest = [ev async for ev in it]
    assert rest == [api.ProcessExit(0, False, 0, 3)], rest
    # leaving early leaves the process running; a pause with end_streams ends the follow with
    # ProcessEnded at the offset it stopped (the process runs on after a resume)
    async with remote.run_process(sid, api.ExecSpec(cmd="cat", max_output_bytes=1 << 20)) as (left, events):
        assert isinstance(await anext(aiter(events)), api.ProcessOutput)
    assert (await remote.get_process(sid, left.pid)).running
    async with remote.run_process(sid, api.ExecSpec(cmd="cat", max_output_bytes=1 << 20)) as (run, events):
        it = aiter(events)
        assert isinstance(await anext(it), api.ProcessOutput)
        pausing = asyncio.create_task(remote.pause(sid, Tier.MEMORY, end_streams=True))
        rest = [ev async for ev in it]
        await pausing
    assert rest == [api.ProcessEnded("paused", 3)], rest
    await remote.resume(sid)
    assert (await remote.get_process(sid, run.pid)).running
    fake.fail.add("start_process")
    with pytest.raises(errors.RuntimeFailure, match="fake start_process failure"):
        async with remote.run_process(sid, api.ExecSpec(cmd="x", max_output_bytes=1)):
            pass


async def test_a_death_reported_by_the_worker_fails_the_record(cluster):
    cp, c, fake, reg, _ = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    fake.kill(sid, "stopped by the host's OOM killer")
    for _ in range(100):
        sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
        if sb["state"] == "failed":
            break
        await asyncio.sleep(0.02)
    assert sb["state"] == "failed" and "OOM" in sb["failure_reason"]


async def test_the_worker_refuses_calls_without_its_token(cluster):
    cp, c, fake, reg, wport = cluster
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{wport}") as w:
        hdr = {"Atoll-Protocol": str(api.PROTOCOL_VERSION)}
        r = await w.get("/worker/v1/inventory", headers=hdr)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        r = await w.get("/worker/v1/inventory", headers={**hdr, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 401  # the admin key is not the worker token
        r = await w.get("/worker/v1/inventory", headers={"Atoll-Protocol": "99", "Authorization": "Bearer x"})
        assert r.status_code == 401  # without the token not even the protocol version is told
        token = reg.creds.token.decode() if isinstance(reg.creds.token, bytes) else reg.creds.token
        r = await w.get(
            "/worker/v1/inventory", headers={"Atoll-Protocol": "99", "Authorization": f"Bearer {token}"}
        )
        assert r.status_code == 409 and r.json()["error"]["code"] == "incompatible_protocol"
        assert "99" in r.json()["error"]["message"]


async def test_server_side_protocol_checks(cluster):
    cp, c, fake, reg, _ = cluster
    info = {
        "name": "old",
        "version": "0",
        "protocol": 99,
        "installation": "x",
        "capacity": {"memory_mb": 1, "cpus": 1, "disk_mb": 1},
    }
    r = await c.post("/v1/workers/register", json={"url": "http://127.0.0.1:1", "info": info})
    assert r.status_code == 409 and r.json()["error"]["code"] == "incompatible_protocol"  # no header
    r = await c.post(
        "/v1/workers/register",
        json={"url": "http://127.0.0.1:1", "info": info},
        headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)},
    )
    assert r.status_code == 409 and "protocol 99" in r.json()["error"]["message"]
    r = await c.post(
        f"/v1/workers/{reg.worker_id}/heartbeat",
        json={"epoch": "stale"},
        headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)},
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_not_registered"
    r = await c.post(
        "/v1/workers/register",
        json={"url": "ftp://x", "info": info},
        headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)},
    )
    assert r.status_code == 400
    ok = {**info, "name": "ghost", "protocol": api.PROTOCOL_VERSION}
    # (this server has no CA: https:// is refused too; plain http:// only on loopback)
    for url in ("https://127.0.0.1:1", "http://127.0.0.1", "http://127.0.0.1:notaport", "http://10.0.0.5:1"):
        r = await c.post(
            "/v1/workers/register",
            json={"url": url, "info": ok},
            headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)},
        )
        assert r.status_code == 400 and "https://" in r.json()["error"]["message"], r.text
    assert "ghost" not in [w["name"] for w in (await c.get("/v1/workers")).json()["items"]]
    async with httpx.AsyncClient(base_url=str(c.base_url)) as anon:
        r = await anon.post("/v1/workers/register", json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401


async def test_a_wrong_key_stops_the_worker_with_a_clear_message(cluster):
    cp, c, fake, reg, _ = cluster
    async with _worker(str(c.base_url), FakeWorker("w2", installation="w2"), key="wrong") as (_reg, task, _):
        with pytest.raises(registration.Fatal, match="ATOLL_API_KEY"):
            await asyncio.wait_for(task, 10)
    assert "w2" not in [w["name"] for w in (await c.get("/v1/workers")).json()["items"]]


async def test_a_forgotten_registration_registers_again(cluster):
    """What a server restart looks like to a worker: its epoch is unknown; it registers again,
    under the same id, and is taken over (ready) with its sandboxes."""
    cp, c, fake, reg, _ = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    handle = cp.manager.workers.handles[reg.worker_id]
    r = await c.post(f"/v1/workers/{handle.id}/drain", json={"draining": True, "evacuate": False})
    assert r.status_code == 202
    handle.epoch = "forgotten"
    cp.manager.workers._lose(handle, "server restarted")
    for _ in range(200):
        if handle.state == "draining" and handle.epoch != "forgotten":
            break
        await asyncio.sleep(0.02)
    # taken over again under the same id, and the operator's drain outlasted the re-registration
    assert handle.state == "draining" and reg.worker_id == handle.id
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text


async def test_a_worker_without_heartbeats_is_lost_then_back(cluster):
    cp, c, fake, reg, _ = cluster
    cp.manager.workers.lost_after_s = 1.0
    reg.heartbeat_s = 60  # stops heartbeating
    for _ in range(200):
        if (await c.get("/v1/workers")).json()["items"][0]["state"] == "lost":
            break
        await asyncio.sleep(0.05)
    w = (await c.get("/v1/workers")).json()["items"][0]
    assert w["state"] == "lost" and "heartbeat" in w["state_reason"]
    assert await reg.heartbeat()  # it comes back: taken over again
    for _ in range(100):
        if (await c.get("/v1/workers")).json()["items"][0]["state"] == "ready":
            break
        await asyncio.sleep(0.02)
    assert (await c.get("/v1/workers")).json()["items"][0]["state"] == "ready"


async def test_a_takeover_that_breaks_unexpectedly_is_tried_again_at_the_next_heartbeat(cluster, monkeypatch):
    """A takeover (`_adopt`) that raised something other than an atoll error left the worker
    `joining` for good: a heartbeat takes over only a lost worker. It is lost again now, with the
    cause, and the next heartbeat takes it over."""
    cp, c, fake, reg, _ = cluster
    registry = cp.manager.workers
    handle = registry.handles[reg.worker_id]
    joined = registry.listener.worker_joined
    broke = []

    async def once(h, inv, started):
        if not broke:
            broke.append(h.name)
            raise RuntimeError("records unreadable")
        return await joined(h, inv, started)

    monkeypatch.setattr(registry.listener, "worker_joined", once)
    reg.heartbeat_s = 60
    registry._lose(handle, "test: lost")
    assert await reg.heartbeat()  # taken over: it breaks
    for _ in range(100):
        if handle.state == "lost" and broke:
            break
        await asyncio.sleep(0.02)
    assert handle.state == "lost" and "RuntimeError: records unreadable" in handle.reason, handle.reason
    assert await reg.heartbeat()  # the next heartbeat takes it over
    assert await _until_ready(handle, tries=100), handle.reason


async def _register(c, info: dict, url: str = "http://127.0.0.1:9") -> httpx.Response:
    body = json.dumps({"url": url, "info": info})  # ASCII: lone surrogates travel as \ud800 escapes
    return await c.post(
        "/v1/workers/register", content=body, headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)}
    )


def _info(**kw) -> dict:
    base = {
        "name": "x1",
        "version": "1",
        "protocol": api.PROTOCOL_VERSION,
        "installation": "abc123",
        "capacity": {"memory_mb": 1024, "cpus": 1, "disk_mb": 1024},
    }
    return {**base, **kw}


async def test_a_bad_registration_is_400_and_changes_nothing(cluster):
    """Found by validation: a lone surrogate in a registration was a 500 that left a ghost worker
    and stopped the watch that marks workers lost."""
    cp, c, fake, reg, _ = cluster
    before = (await c.get("/v1/workers")).json()["items"]
    real = before[0]
    raw = '{"url": "http://127.0.0.1:9", "info": {"name": "\\ud800", "version": "1", "protocol": 2, "installation": "x", "capacity": {"memory_mb": 1, "cpus": 1, "disk_mb": 1}}}'
    r = await c.post(
        "/v1/workers/register", content=raw, headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)}
    )
    assert r.status_code == 400, r.text
    bad = [
        _info(name=""),
        _info(name="a\nb"),
        _info(name="x" * 65),
        _info(name="-x"),
        _info(capacity={"memory_mb": -1, "cpus": 1, "disk_mb": 1}),
        # found by validation: NaN was accepted and made GET /v1/workers invalid JSON
        _info(capacity={"memory_mb": 1, "cpus": float("nan"), "disk_mb": 1}),
        _info(capacity={"memory_mb": 1, "cpus": float("inf"), "disk_mb": 1}),
        _info(capacity={"memory_mb": 2**70, "cpus": 1, "disk_mb": 1}),
        _info(capacity={"memory_mb": 1, "cpus": 1, "disk_mb": 1, "slots": -1}),
        _info(capacity={"memory_mb": 1, "cpus": 1, "disk_mb": 1, "slots": 100_001}),
        _info(capacity={"memory_mb": 1, "cpus": 1, "disk_mb": 1, "slots": 1.5}),
        _info(version="\x00"),
        _info(installation="NOT AN ID"),
        _info(name=real["name"], installation=real["installation"], version="\ud800"),
    ]
    for info in bad:
        r = await _register(c, info)
        assert r.status_code == 400, (info, r.text)
    r = await c.post(
        "/v1/workers/register",
        json={"url": "http://127.0.0.1:9", "info": _info(), "more": 1},
        headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)},
    )
    assert r.status_code == 400
    after = (await c.get("/v1/workers")).json()["items"]
    assert [(w["name"], w["state"]) for w in after] == [(w["name"], w["state"]) for w in before]
    # one home cannot register under a second name
    r = await _register(c, _info(name="twin", installation=real["installation"]))
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_conflict"
    assert "home" in r.json()["error"]["message"]
    # the watch still marks silent workers lost
    cp.manager.workers.lost_after_s = 1.0
    reg.heartbeat_s = 60
    for _ in range(200):
        if (await c.get("/v1/workers")).json()["items"][0]["state"] == "lost":
            break
        await asyncio.sleep(0.05)
    assert (await c.get("/v1/workers")).json()["items"][0]["state"] == "lost"


async def test_calls_in_flight_end_with_503_when_their_worker_is_lost(cluster):
    """Found by validation: a call to a stopped (SIGSTOP) worker waited forever, holding the
    sandbox's lock; now losing the worker ends it."""
    cp, c, fake, reg, _ = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    fake.delay["exec"] = 30
    call = asyncio.ensure_future(c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 30"}))
    await asyncio.sleep(0.3)
    handle = cp.manager.workers.handles[reg.worker_id]
    cp.manager.workers._lose(handle, "no heartbeat for 16s")
    r = await asyncio.wait_for(call, 5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    # the exec was sent: the answer must not claim that nothing changed
    err = r.json()["error"]
    assert "outcome is unknown" in err["message"] and "the command may have run" in err["message"], err
    assert "nothing" not in err["message"] and err["retryable"] is False, err
    # a call made while the worker is lost is never sent: nothing changed, retry later
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    err = r.json()["error"]
    assert r.status_code == 503 and "not sent" in err["message"] and "nothing" in err["message"], err
    assert err["retryable"] is True


async def test_a_read_or_write_cut_off_says_what_is_known(cluster):
    """The worker is lost while a file read and a file write are under way: the read changed
    nothing (retryable), the write's outcome is unknown (a PUT: repeating it is harmless)."""
    cp, c, fake, reg, _ = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    assert (await c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/a"}, content=b"x")).status_code < 300
    started = asyncio.Event()
    real_list = fake.list_files

    async def slow_list(sandbox_id, path):
        started.set()
        await asyncio.sleep(30)
        return await real_list(sandbox_id, path)

    fake.list_files = slow_list  # type: ignore[method-assign]
    read = asyncio.ensure_future(c.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/"}))
    fake.delay["write_file"] = 30
    write = asyncio.ensure_future(c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/b"}, content=b"y"))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.3)
    cp.manager.workers._lose(cp.manager.workers.handles[reg.worker_id], "no heartbeat for 16s")
    r_read, r_write = await asyncio.wait_for(asyncio.gather(read, write), 5)
    e_read, e_write = r_read.json()["error"], r_write.json()["error"]
    assert r_read.status_code == 503 and "only reads" in e_read["message"], e_read
    assert "nothing about the sandbox changed" in e_read["message"] and e_read["retryable"] is True
    assert r_write.status_code == 503 and "outcome is unknown" in e_write["message"], e_write
    assert "the file change may have been made" in e_write["message"] and e_write["retryable"] is True


async def test_a_worker_that_refuses_connections_changed_nothing(cluster):
    cp, c, fake, reg, wport = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    handle = cp.manager.workers.handles[reg.worker_id]
    handle.worker._channel.abort_now()  # its kept-alive connections: the next call connects anew
    handle.worker._channel._addr = ("127.0.0.1", free_port())  # nothing listens there
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    err = r.json()["error"]
    assert r.status_code == 503 and "did not reach it" in err["message"], err
    assert "nothing about the sandbox changed" in err["message"] and err["retryable"] is True


async def test_a_registered_workers_slots_show_in_its_capacity(cluster):
    """capacity.slots crosses the seam at registration (0, no limit, when an older worker leaves
    it out) and GET /v1/workers shows it with allocated.slots."""
    cp, c, fake, reg, _ = cluster
    ws = {w["name"]: w for w in (await c.get("/v1/workers")).json()["items"]}
    assert (ws["w1"]["capacity"]["slots"], ws["w1"]["allocated"]["slots"]) == (0, 0)
    cap = {"memory_mb": 1024, "cpus": 1, "disk_mb": 1024, "slots": 3}
    r = await _register(c, _info(name="x2", installation="abc124", capacity=cap))
    assert r.status_code == 201, r.text
    ws = {w["name"]: w for w in (await c.get("/v1/workers")).json()["items"]}
    assert (ws["x2"]["capacity"]["slots"], ws["x2"]["allocated"]["slots"]) == (3, 0)


@pytest.mark.databases
async def test_a_worker_moves_to_the_next_server_when_its_server_dies(tmp_path, database_url):
    """`--server A,B` (two servers on one database): the worker joins A; when A stops answering, after
    FAILOVER_BEATS missed heartbeats it joins B, which takes it over — a sandbox made through A is
    served through B, files and all."""
    async with (
        FakeAtoll(tmp_path / "a", [], api_key=KEY, database_url=database_url, tier_policy=False) as a,
        FakeAtoll(tmp_path / "b", [], api_key=KEY, database_url=database_url, tier_policy=False) as b,
    ):
        pa, pb = free_port(), free_port()
        ua, ub = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
        fake = FakeWorker("w1")
        creds = httpapi.Credentials()
        wport = free_port()
        s = worker_settings.WorkerSettings(
            home="/nonexistent", name="w1", server_url=ua, server_urls=(ua, ub), api_key=KEY, heartbeat_s=0.2
        )
        reg = registration.Registration(s, fake, creds, f"http://127.0.0.1:{wport}")  # type: ignore[arg-type]
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with (
            _serve(httpapi.create_app(fake, creds), wport),
            _serve(b.app, pb),
            httpx.AsyncClient(base_url=ua, headers=hdr, timeout=30) as ca,
            httpx.AsyncClient(base_url=ub, headers=hdr, timeout=30) as cb,
        ):
            task: asyncio.Future | None = None
            try:
                async with _serve(a.app, pa):
                    task = asyncio.ensure_future(reg.run())  # A answers: it joins A, the first
                    for _ in range(300):
                        if (await ca.get("/healthz")).status_code == 200:
                            break
                        await asyncio.sleep(0.02)
                    assert reg.server == ua
                    r = await ca.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                    assert r.status_code == 201, r.text
                    sid = r.json()["id"]
                    assert (
                        await ca.put(f"/v1/sandboxes/{sid}/files", params={"path": "/f"}, content=b"kept")
                    ).status_code == 204
                # A is gone: B takes the worker over within a few heartbeats
                for _ in range(300):
                    r = await cb.get(f"/v1/sandboxes/{sid}/files", params={"path": "/f"})
                    if r.status_code == 200:
                        break
                    assert r.status_code == 503, r.text  # worker_unavailable until it joined B
                    await asyncio.sleep(0.05)
                assert r.status_code == 200 and r.content == b"kept", r.text
                assert reg.server == ub
                ws = (await cb.get("/v1/workers")).json()["items"]
                assert [(w["name"], w["state"]) for w in ws] == [("w1", "ready")]
                r = await cb.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
                assert r.status_code == 200, r.text
            finally:
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                await reg.aclose()


async def test_every_server_calls_a_worker_another_server_holds(tmp_path, database_url, database_kind):
    """Two servers on one PostgreSQL database, one worker registered with A only: B calls it with the
    token A stored sealed (`borrowed`) — the sandbox made through A is served through B, a create
    through B lands on it; a drain and an undrain through B are followed by A; when the worker registers
    again (a new token) B follows within a look; B with another secrets key says why it cannot."""
    if database_kind != "postgresql":
        pytest.skip("servers share the records (and borrow workers) only on PostgreSQL")
    from atoll.controlplane import workers as workers_mod

    key = b"k" * 32
    async with (
        FakeAtoll(
            tmp_path / "a", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as a,
        FakeAtoll(
            tmp_path / "b", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as b,
        FakeAtoll(
            tmp_path / "c",
            [],
            api_key=KEY,
            database_url=database_url,
            tier_policy=False,
            secrets_key=b"x" * 32,
        ) as c,
    ):
        pa, pb = free_port(), free_port()
        ua, ub = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
        fake = FakeWorker("w1")
        creds = httpapi.Credentials()
        wport = free_port()
        s = worker_settings.WorkerSettings(
            home="/nonexistent", name="w1", server_url=ua, api_key=KEY, heartbeat_s=0.2
        )
        reg = registration.Registration(s, fake, creds, f"http://127.0.0.1:{wport}")  # type: ignore[arg-type]
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with (
            _serve(httpapi.create_app(fake, creds), wport),
            _serve(a.app, pa),
            _serve(b.app, pb),
            httpx.AsyncClient(base_url=ua, headers=hdr, timeout=30) as ca,
            httpx.AsyncClient(base_url=ub, headers=hdr, timeout=30) as cb,
        ):
            task = asyncio.ensure_future(reg.run())
            try:
                for _ in range(300):
                    if (await ca.get("/healthz")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                r = await ca.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                assert (
                    await ca.put(f"/v1/sandboxes/{sid}/files", params={"path": "/f"}, content=b"kept")
                ).status_code == 204
                hb = b.manager.workers
                await hb.others()  # what its watch does every OTHERS_EVERY_S
                h = hb.handles[hb._by_name["w1"]]
                assert h.borrowed is not None and h.state == "ready" and h.reason == workers_mod.BORROWED
                r = await cb.get(f"/v1/sandboxes/{sid}/files", params={"path": "/f"})
                assert r.status_code == 200 and r.content == b"kept", r.text
                # its resource use reaches B too (B may hold the lease that meters)
                for _ in range(200):
                    fake.emit(api.UsageReport((api.Usage(sid, 1.5, 1 << 20, 3),)))
                    if sid in b.manager.usage:
                        break
                    await asyncio.sleep(0.02)
                assert b.manager.usage[sid].cpu_seconds == 1.5
                ws = (await cb.get("/v1/workers")).json()["items"]
                assert [(w["name"], w["state"]) for w in ws] == [("w1", "ready")]
                r = await cb.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                assert r.status_code == 201 and r.json()["worker"] == "w1", r.text
                other = r.json()["id"]
                r = await ca.post(f"/v1/sandboxes/{other}/exec", json={"cmd": ["true"]})
                assert r.status_code == 200, r.text
                # a drain through B is written to the row; A, which holds the worker, follows
                # (cordon only here: one worker, nowhere to move to), and so does an undrain
                r = await cb.post(f"/v1/workers/{h.id}/drain", json={"draining": True, "evacuate": False})
                assert r.status_code == 202 and r.json()["state"] == "draining", r.text
                ha = a.manager.workers.handles[h.id]
                assert ha.state == "ready"
                await a.manager.workers.others()
                assert ha.state == "draining" and ha.record.draining
                r = await ca.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
                r = await cb.post(f"/v1/workers/{h.id}/drain", json={"draining": False})
                assert r.status_code == 200 and r.json()["state"] == "ready", r.text
                await a.manager.workers.others()
                assert ha.state == "ready" and not ha.record.draining
                # B wrote no more of the record A holds than the cordon
                rec = b.manager.db.get_worker(h.id)
                assert rec is not None and rec.state == "ready" and rec.state_reason is None
                # the worker registers again (a new token): B's old token is refused with a
                # retryable 503, never a 401 to the client, and the next look borrows it again
                task.cancel()  # its heartbeats would race the registrations made here
                with contextlib.suppress(BaseException):
                    await task
                await reg.register()  # as after a restart of A: a new token
                r = await cb.get(f"/v1/sandboxes/{sid}/files", params={"path": "/f"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
                assert "no longer accepts" in r.json()["error"]["message"]
                assert h.borrowed is None and h.state == "lost"
                await hb.others()
                assert h.borrowed is not None
                r = await cb.get(f"/v1/sandboxes/{sid}/files", params={"path": "/f"})
                assert r.status_code == 200 and r.content == b"kept", r.text
                # a server with another secrets key cannot unseal the token: it says why
                await c.manager.workers.others()
                hc = c.manager.workers.handles[h.id]
                assert hc.worker is None and "ATOLL_SECRETS_KEY_FILE" in (hc.reason or "")
            finally:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await reg.aclose()


async def test_a_server_whose_worker_moved_to_another_borrows_it_back(tmp_path, database_url, database_kind):
    """A worker registered with A moves to B (`--server A,B`: A missed its heartbeats): A's token is
    refused from then on. A takes it for lost, held elsewhere, and calls it through B's stored token
    (borrowed) like any other server — its sandboxes are served through A again, never a 503 for good."""
    if database_kind != "postgresql":
        pytest.skip("servers share the records (and borrow workers) only on PostgreSQL")
    key = b"k" * 32
    async with (
        FakeAtoll(
            tmp_path / "a", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as a,
        FakeAtoll(
            tmp_path / "b", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as b,
    ):
        pa, pb = free_port(), free_port()
        ua, ub = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
        fake = FakeWorker("w1")
        creds = httpapi.Credentials()
        wport = free_port()
        s = worker_settings.WorkerSettings(
            home="/nonexistent", name="w1", server_url=ua, server_urls=(ua, ub), api_key=KEY, heartbeat_s=0.2
        )
        reg = registration.Registration(s, fake, creds, f"http://127.0.0.1:{wport}")  # type: ignore[arg-type]
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with (
            _serve(httpapi.create_app(fake, creds), wport),
            _serve(a.app, pa),
            _serve(b.app, pb),
            httpx.AsyncClient(base_url=ua, headers=hdr, timeout=30) as ca,
        ):
            try:
                await reg.register()
                for _ in range(300):
                    if (await ca.get("/healthz")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                r = await ca.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                assert (
                    await ca.put(f"/v1/sandboxes/{sid}/files", params={"path": "/f"}, content=b"kept")
                ).status_code == 204
                wa = a.manager.workers
                ha = wa.handles[wa._by_name["w1"]]
                # the worker moves to B (a new token there)
                assert await reg._next_server("A missed heartbeats")
                await reg.register()
                hb = b.manager.workers.handles[ha.id]
                assert await _until_ready(hb)
                # A's token is refused: a retryable 503, and A knows at once it is held elsewhere
                r = await ca.get(f"/v1/sandboxes/{sid}/files", params={"path": "/f"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
                assert ha.state == "lost", ha.state
                # an evacuation A ran of it halts now and writes its progress: that is all it
                # writes of the row B holds (not A's old token, URL or state)
                ev = evacuation.Evacuation(ha.id, pending=[sid])
                a.manager.evacuations.runs[ha.id] = ev
                a.manager.evacuations._save(ev, ha)
                rec = a.manager.db.get_worker(ha.id)
                assert rec is not None and rec.token_sealed == hb.record.token_sealed and rec.state == "ready"
                await wa.others()  # what A's watch does every OTHERS_EVERY_S
                assert ha.borrowed is not None and ha.state == "ready", (ha.state, ha.reason)
                r = await ca.get(f"/v1/sandboxes/{sid}/files", params={"path": "/f"})
                assert r.status_code == 200 and r.content == b"kept", r.text
                # A wrote nothing of the row B holds
                rec = a.manager.db.get_worker(ha.id)
                assert rec is not None and rec.state == "ready" and rec.token_sealed == hb.record.token_sealed
            finally:
                await reg.aclose()


async def test_a_worker_another_server_holds_cannot_be_removed_here(tmp_path, database_url, database_kind):
    """A server that cannot call a worker another server hears from (another secrets key) shows it
    lost; removing it there is refused (409 invalid_state), its row and sandboxes stay intact."""
    if database_kind != "postgresql":
        pytest.skip("servers share the records only on PostgreSQL")
    async with (
        FakeAtoll(
            tmp_path / "a",
            [],
            api_key=KEY,
            database_url=database_url,
            tier_policy=False,
            secrets_key=b"k" * 32,
        ) as a,
        FakeAtoll(
            tmp_path / "c",
            [],
            api_key=KEY,
            database_url=database_url,
            tier_policy=False,
            secrets_key=b"x" * 32,
        ) as c,
    ):
        pa, pc = free_port(), free_port()
        ua, uc = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pc}"
        fake = FakeWorker("w1")
        creds = httpapi.Credentials()
        wport = free_port()
        s = worker_settings.WorkerSettings(
            home="/nonexistent", name="w1", server_url=ua, api_key=KEY, heartbeat_s=0.2
        )
        reg = registration.Registration(s, fake, creds, f"http://127.0.0.1:{wport}")  # type: ignore[arg-type]
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with (
            _serve(httpapi.create_app(fake, creds), wport),
            _serve(a.app, pa),
            _serve(c.app, pc),
            httpx.AsyncClient(base_url=ua, headers=hdr, timeout=30) as ca,
            httpx.AsyncClient(base_url=uc, headers=hdr, timeout=30) as cc,
        ):
            try:
                await reg.register()
                for _ in range(300):
                    if (await ca.get("/healthz")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                r = await ca.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                await c.manager.workers.others()
                hc = c.manager.workers.handles[reg.worker_id]
                assert hc.state == "lost" and hc.worker is None
                r = await cc.delete(f"/v1/workers/{hc.id}")
                assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state", r.text
                assert "another server" in r.json()["error"]["message"]
                assert a.manager.db.get_worker(hc.id) is not None
                r = await ca.get(f"/v1/sandboxes/{sid}")
                assert r.status_code == 200 and r.json()["state"] == "running", r.text
            finally:
                await reg.aclose()


@contextlib.asynccontextmanager
async def _drained_through_a_undrained_through_b(tmp_path, database_url):
    """Servers A and B on one database (one secrets key) and a worker registered with A only: A
    drains it (cordon), B borrows it (sees it draining) and undrains it through the row; A has not
    looked at the row since. Yields (a, b, ca, cb, ha, hb): the servers, a client of each, and A's
    and B's handles of the worker."""
    key = b"k" * 32
    async with (
        FakeAtoll(
            tmp_path / "a", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as a,
        FakeAtoll(
            tmp_path / "b", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as b,
    ):
        pa, pb = free_port(), free_port()
        ua, ub = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
        fake = FakeWorker("w1")
        creds = httpapi.Credentials()
        wport = free_port()
        s = worker_settings.WorkerSettings(
            home="/nonexistent", name="w1", server_url=ua, api_key=KEY, heartbeat_s=0.2
        )
        reg = registration.Registration(s, fake, creds, f"http://127.0.0.1:{wport}")  # type: ignore[arg-type]
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with (
            _serve(httpapi.create_app(fake, creds), wport),
            _serve(a.app, pa),
            _serve(b.app, pb),
            httpx.AsyncClient(base_url=ua, headers=hdr, timeout=30) as ca,
            httpx.AsyncClient(base_url=ub, headers=hdr, timeout=30) as cb,
        ):
            try:
                await reg.register()
                wa = a.manager.workers
                ha = wa.handles[reg.worker_id]
                await _until_ready(ha)
                r = await ca.post(f"/v1/workers/{ha.id}/drain", json={"draining": True, "evacuate": False})
                assert r.status_code == 202 and ha.state == "draining", r.text
                await b.manager.workers.others()
                hb = b.manager.workers.handles[ha.id]
                assert hb.borrowed is not None and hb.state == "draining"
                r = await cb.post(f"/v1/workers/{ha.id}/drain", json={"draining": False})
                assert r.status_code == 200 and r.json()["state"] == "ready", r.text
                yield a, b, ca, cb, ha, hb
            finally:
                await reg.aclose()


async def test_an_undrain_through_a_borrower_is_not_undone_by_the_holders_evacuation(
    tmp_path, database_url, database_kind
):
    """A drains (and evacuates) the worker it holds; B undrains it through the row. A verdict of
    A's evacuation saved before A reads the row writes only the evacuation's progress: A then
    follows the undrain (ready), it is not lost under A's copy of `draining`. An evacuation asked
    through B of a worker A already keeps cordoned runs on A."""
    if database_kind != "postgresql":
        pytest.skip("servers share the records (and borrow workers) only on PostgreSQL")
    async with _drained_through_a_undrained_through_b(tmp_path, database_url) as (a, b, ca, cb, ha, hb):
        wa = a.manager.workers
        # a verdict of an evacuation A runs of it is saved before A reads the row again
        ev = evacuation.Evacuation(ha.id)
        a.manager.evacuations.runs[ha.id] = ev
        a.manager.evacuations._save(ev, ha)
        await wa.others()
        assert ha.state == "ready", (ha.state, ha.reason)
        rec = a.manager.db.get_worker(ha.id)
        assert rec is not None and not rec.draining
        ev.state = "done"
        # cordoned through A, then an evacuation asked through B: A runs it
        r = await ca.post(f"/v1/workers/{ha.id}/drain", json={"draining": True, "evacuate": False})
        assert r.status_code == 202 and ha.state == "draining", r.text
        await b.manager.workers.others()
        r = await cb.post(f"/v1/workers/{ha.id}/drain", json={"draining": True, "evacuate": True})
        assert r.status_code == 202, r.text
        await wa.others()
        run = a.manager.evacuations.runs.get(ha.id)
        assert run is not None and run is not ev and run.active
        r = await cb.post(f"/v1/workers/{ha.id}/drain", json={"draining": False})
        assert r.status_code == 200, r.text
        await wa.others()
        assert ha.state == "ready" and run.stop


async def test_an_undrain_through_a_borrower_is_shown_ready_by_every_server_afterwards(
    tmp_path, database_url, database_kind
):
    """A drains the worker it holds (its row: `state` draining); B undrains it through the row
    and A follows (ready). B's next look at the row, and a server started afterwards, show it
    ready too — not `draining` from the row's `state`, which the holder's follow does not rewrite
    (found by the issue 21 review: after an undrain through a borrower, every other server kept
    listing the worker draining and placed nothing on it)."""
    if database_kind != "postgresql":
        pytest.skip("servers share the records (and borrow workers) only on PostgreSQL")
    async with _drained_through_a_undrained_through_b(tmp_path, database_url) as (a, b, ca, cb, ha, hb):
        wa = a.manager.workers
        await wa.others()  # A follows the undrain
        assert ha.state == "ready", (ha.state, ha.reason)
        await b.manager.workers.others()  # B's next look at the row
        assert hb.state == "ready", (hb.state, hb.reason)
        r = await cb.get(f"/v1/workers/{ha.id}")
        assert r.status_code == 200 and r.json()["state"] == "ready", r.text


async def test_reconciliation_leaves_a_runtime_another_server_is_moving_here(
    tmp_path, database_url, database_kind
):
    """On shared records another server may move a sandbox onto a worker this server holds (its
    worker `adopt`, then the record names the new worker): a reconciliation between the two finds
    the runtime while the record still names the old worker. A record changed that lately is not
    an orphan's: the runtime stays."""
    if database_kind != "postgresql":
        pytest.skip("only servers sharing the records move sandboxes under each other")
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    async with FakeAtoll(tmp_path, [w1, w2], api_key=KEY, database_url=database_url, tier_policy=False) as f:
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(f.app), base_url="http://t", headers=hdr
        ) as c:
            r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            sid, held_by = r.json()["id"], r.json()["worker"]
        src, dst = (w1, w2) if held_by == "w1" else (w2, w1)
        # the other server's adopt made it on `dst`; its record still names `src`
        dst.runtimes[sid] = src.runtimes[sid]
        reg = f.manager.workers
        h = reg.handles[reg._by_name[dst.name]]
        await reg.reconcile(h)
        assert sid in dst.runtimes
        # a copy the next pass finds so again is one left behind: dropped then
        await reg.reconcile(h)
        assert sid not in dst.runtimes and sid in src.runtimes


async def test_reconciliation_leaves_a_phase_another_server_is_recording(
    tmp_path, database_url, database_kind
):
    """On shared records another server may have paused a sandbox on a worker this server holds
    (its worker step done) and not yet written the record: a reconciliation between the two must
    not write the change first (the other server's write would then be refused `sandbox_changed`,
    a 409 for a pause or create that happened). A phase the next pass finds again is followed."""
    if database_kind != "postgresql":
        pytest.skip("only servers sharing the records change sandboxes under each other")
    from atoll.core.lifecycle import Phase, Verb

    w = FakeWorker("w1")
    async with FakeAtoll(tmp_path, [w], api_key=KEY, database_url=database_url, tier_policy=False) as f:
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(f.app), base_url="http://t", headers=hdr
        ) as c:
            r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
        other = f.manager.db.get(sid)  # the other server's copy of the record
        assert other is not None and other.state == "running"
        w.runtimes[sid].phase = Phase.CHECKPOINTED  # its pause done on the worker
        reg = f.manager.workers
        h = reg.handles[reg._by_name["w1"]]
        await reg.reconcile(h)
        assert f.manager.db.get(sid).state == "running"
        f.manager.ledger.persist(other, Verb.CHECKPOINT)  # the other server records its pause: no conflict
        assert f.manager.db.get(sid).standby_tier == "disk"
        # a phase nobody records (the worker's own doing, its event missed) is followed a pass later
        w.runtimes[sid].phase = Phase.FAILED
        await reg.reconcile(h)
        assert f.manager.db.get(sid).state == "standby"
        await reg.reconcile(h)
        assert f.manager.db.get(sid).state == "failed"


async def test_a_borrower_lets_go_a_worker_that_said_it_stops(tmp_path, database_url, database_kind):
    """The worker tells its holder it stops (SIGTERM): the holder writes it lost at once; a server
    borrowing it lets it go at its next look (no create is placed there), although the holder heard
    its heartbeat lately."""
    if database_kind != "postgresql":
        pytest.skip("servers share the records (and borrow workers) only on PostgreSQL")
    key = b"k" * 32
    async with (
        FakeAtoll(
            tmp_path / "a", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as a,
        FakeAtoll(
            tmp_path / "b", [], api_key=KEY, database_url=database_url, tier_policy=False, secrets_key=key
        ) as b,
    ):
        pa = free_port()
        ua = f"http://127.0.0.1:{pa}"
        fake = FakeWorker("w1")
        creds = httpapi.Credentials()
        wport = free_port()
        s = worker_settings.WorkerSettings(
            home="/nonexistent", name="w1", server_url=ua, api_key=KEY, heartbeat_s=0.2
        )
        reg = registration.Registration(s, fake, creds, f"http://127.0.0.1:{wport}")  # type: ignore[arg-type]
        async with _serve(httpapi.create_app(fake, creds), wport), _serve(a.app, pa):
            try:
                await reg.register()
                ha = a.manager.workers.handles[reg.worker_id]
                await _until_ready(ha)
                hb = b.manager.workers
                await hb.others()
                h = hb.handles[ha.id]
                assert h.borrowed is not None and h.state == "ready"
                await reg.stopping()
                assert ha.state == "lost"
                await hb.others()
                assert h.borrowed is None and h.state == "lost", (h.state, h.reason)
                r = await b.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
            finally:
                await reg.aclose()


async def test_the_drive_file_verbs_cross_the_seam(cluster):
    """stat, mkdir (optional fields left out and given), attrs and deep listings as JSON both ways."""
    _, c, fake, _, _ = cluster
    assert (await c.post("/v1/drives", json={"name": "d", "size_mb": 16})).status_code == 201
    assert (await c.put("/v1/drives/d/files", params={"path": "/a/f"}, content=b"123")).status_code == 200
    r = await c.post("/v1/drives/d/files/mkdir", params={"path": "/a/m"})
    assert r.status_code == 201 and (r.json()["mode"], r.json()["uid"]) == (0o755, 0)
    r = await c.post("/v1/drives/d/files/mkdir", params={"path": "/p/q"}, json={"parents": True, "gid": 9})
    assert r.status_code == 201 and r.json()["gid"] == 9, r.text
    r = await c.patch("/v1/drives/d/files", params={"path": "/a/f"}, json={"mode": 0o600})
    assert (r.json()["mode"], r.json()["size"], r.json()["target"]) == (0o600, 3, None)
    assert (await c.get("/v1/drives/d/files/stat", params={"path": "/a/f"})).json()["mode"] == 0o600
    r = await c.get("/v1/drives/d/files/list", params={"depth": 2})
    assert [e["path"] for e in r.json()["items"]] == ["/a", "/a/f", "/a/m", "/p", "/p/q"]
    r = await c.get("/v1/drives/d/files/stat", params={"path": "/none"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"

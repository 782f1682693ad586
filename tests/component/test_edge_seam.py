"""The edge's WorkerAPI over the grant path (edge.seam.GrantedWorker) and the grant route's E2B
envd access tokens, over a real control plane (FakeAtoll under uvicorn) and a real worker API
(worker.httpapi over a FakeWorker, registered through its real registration loop): the plain
verbs and the streams answer as the worker does; a key's grant answer carries the sandbox's envd
access token; that token alone gets a grant for its own sandbox (never another's), a wrong one is
401; a verb a grant does not open is refused before anything is sent."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from atoll.core import errors, grants
from atoll.core import worker_api as api
from atoll.core.lifecycle import Tier
from atoll.edge import seam, service
from tests.component.test_worker_protocol import KEY, cluster  # noqa: F401 - the fixture


@pytest.fixture
async def two(cluster):  # noqa: F811
    cp, c, fake, reg, _ = cluster
    edge = service.Edge(str(c.base_url))
    sids = []
    for _ in range(2):
        r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sids.append(r.json()["id"])
    yield cp, c, fake, edge, sids
    await edge.aclose()


def _token(cp, sid: str) -> str:
    return grants.e2b_access_token(grants.e2b_access_key(cp.manager.secrets.key), sid)


async def _grant(c: httpx.AsyncClient, sid: str, auth: str | None) -> httpx.Response:
    headers = {"Authorization": auth} if auth is not None else {}
    async with httpx.AsyncClient(base_url=str(c.base_url), headers=headers, timeout=30) as bare:
        return await bare.post(f"/v1/sandboxes/{sid}/grant")


async def test_a_keys_grant_carries_the_envd_token_and_the_token_alone_opens_its_sandbox(two):
    cp, c, fake, edge, (a, b) = two
    r = await c.post(f"/v1/sandboxes/{a}/grant")
    assert r.status_code == 200, r.text
    tok = r.json()["e2b_access_token"]
    assert tok == _token(cp, a) and tok != _token(cp, b)
    # the token alone: a grant for its sandbox, without the token again in the answer
    r = await _grant(c, a, f"E2B-Access {tok}")
    assert r.status_code == 200, r.text
    assert r.json()["sandbox_id"] == a and r.json()["e2b_access_token"] is None
    assert r.json()["grant"].startswith(a + ".")
    # a wrong token, none, or A's token for B: 401, as the API answers a wrong key
    for sid, auth in ((a, "E2B-Access " + tok[:-2] + "xx"), (a, "E2B-Access"), (b, f"E2B-Access {tok}")):
        r = await _grant(c, sid, auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
        assert "envd access token" in r.json()["error"]["message"]
    # the token opens the grant route and nothing else
    async with httpx.AsyncClient(
        base_url=str(c.base_url), headers={"Authorization": f"E2B-Access {tok}"}, timeout=30
    ) as t:
        for method, path in (("GET", f"/v1/sandboxes/{a}"), ("POST", f"/v1/sandboxes/{a}/exec")):
            r = await t.request(method, path, json={"cmd": "true"})
            assert r.status_code == 401, (path, r.text)


async def test_a_token_of_a_deleted_sandbox_is_404_as_for_a_key(two):
    cp, c, fake, edge, (a, _) = two
    assert (await c.delete(f"/v1/sandboxes/{a}")).status_code in (200, 202, 204)
    r = await _grant(c, a, f"E2B-Access {_token(cp, a)}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found", r.text


@pytest.mark.parametrize("by", ["key", "token"])
async def test_the_granted_worker_serves_the_data_verbs(two, by):
    cp, c, fake, edge, (a, b) = two
    w = (
        seam.seam_for(edge, f"Bearer {KEY}", a)
        if by == "key"
        else seam.seam_for_access_token(edge, _token(cp, a), a)
    )
    assert await w.e2b_access_token() == (_token(cp, a) if by == "key" else "")

    async def body():
        yield b"hello "
        yield b"world"

    assert await w.make_dir(a, "/d") is True
    await w.write_file(a, "/d/f", body(), 11)
    assert fake.runtimes[a].files[b"/d/f"] == b"hello world"
    async with w.read_file(a, "/d/f") as dl:
        assert dl.size == 11 and b"".join([x async for x in dl.chunks]) == b"hello world"
    st = await w.stat_file(a, "/d/f")
    assert (st.type, st.size) == ("file", 11)
    assert [e.name for e in await w.list_files(a, "/d")] == ["f"]
    moved = await w.move_file(a, "/d/f", "/d/g")
    assert moved.path == "/d/g"
    await w.delete_file(a, "/d/g")
    with pytest.raises(errors.FileNotFound):
        await w.stat_file(a, "/d/g")
    # a watch: its first event, then one for a write made while it runs
    async with w.watch_files(a, "/d", False) as events:
        it = aiter(events)
        assert (await anext(it)).type == "ready"
    # processes
    fake.exec_handler = lambda spec: api.ExecResult(0, "out\n", "", 1, False, 0, 0)
    started = await w.start_process(a, api.ExecSpec(cmd="cat", max_output_bytes=1 << 20))
    assert (await w.get_process(a, started.pid)).running
    assert [p.pid for p in await w.list_processes(a)] == [started.pid]
    assert await w.send_stdin(a, started.pid, b"in\n", False) == 3
    async with w.process_output(a, started.pid, 0, False) as events:
        text = "".join([ev.text async for ev in events if isinstance(ev, api.ProcessOutput)])
    assert text.startswith("out\n")
    await w.signal_process(a, started.pid, "TERM")
    assert not (await w.get_process(a, started.pid)).running
    # started and followed in one call (run_process, E2B's Start): the pid first, then its
    # output and its exit; a spec the worker refuses is its error, before any process
    async with w.run_process(a, api.ExecSpec(cmd="cat", max_output_bytes=1 << 20)) as (run, events):
        assert run.pid != started.pid and (await w.get_process(a, run.pid)).running
        it = aiter(events)
        first = await anext(it)
        assert isinstance(first, api.ProcessOutput) and first.text == "out\n"
        fake.end_process(a, run.pid, 3)
        rest = [ev async for ev in it]
    assert isinstance(rest[-1], api.ProcessExit) and rest[-1].exit_code == 3, rest
    fake.fail.add("start_process")
    with pytest.raises(errors.RuntimeFailure, match="fake start_process failure"):
        async with w.run_process(a, api.ExecSpec(cmd="x", max_output_bytes=1)):
            pass
    fake.fail.discard("start_process")
    assert (await w.exec(a, api.ExecSpec(cmd="x", max_output_bytes=1 << 20))).stdout == "out\n"
    # terminals: opened and listed through the grant
    pty = await w.open_pty(a, api.PtySpec(cols=80, rows=24))
    assert [p.pty_id for p in await w.list_ptys(a)] == [pty.pty_id]
    await w.kill_pty(a, pty.pty_id)
    # what a grant does not open is refused before anything is sent; so is another sandbox
    asked = edge.grants.asked
    with pytest.raises(errors.InvalidRequest, match="grant"):
        await w.pause(a, Tier.MEMORY)
    with pytest.raises(errors.InvalidRequest, match="grant"):
        await w.metrics(a)
    with pytest.raises(errors.InvalidRequest, match=b):
        await w.stat_file(b, "/")
    assert edge.grants.asked == asked


async def test_the_servers_refusals_arrive_as_domain_errors(two):
    cp, c, fake, edge, (a, b) = two
    with pytest.raises(errors.Unauthorized):
        await seam.seam_for_access_token(edge, _token(cp, b), a).stat_file(a, "/")
    with pytest.raises(errors.Unauthorized):
        await seam.seam_for(edge, "Bearer wrong", a).stat_file(a, "/")
    with pytest.raises(errors.Unauthorized):
        seam.seam_for_access_token(edge, "", a)
    with pytest.raises(errors.Unauthorized):
        seam.seam_for(edge, "Bearer \u00e9", a)
    # a stale grant (the worker registered again) is asked for again once, as the edge's routes do
    w = seam.seam_for(edge, f"Bearer {KEY}", a)
    await w.stat_file(a, "/")
    key = next(k for k in edge.grants._cache if k[1] == a)
    g = edge.grants._cache[key]
    edge.grants._cache[key] = type(g)(**{**g.__dict__, "grant": g.grant.rsplit(".", 1)[0] + ".forged"})
    asked = edge.grants.asked
    await asyncio.wait_for(w.stat_file(a, "/"), 30)
    assert edge.grants.asked == asked + 1


async def test_request_seams_pick_the_credential_a_request_carries(two):
    cp, c, fake, edge, (a, b) = two
    seam_for = seam.request_seams(edge)

    class Req:
        def __init__(self, **headers: str):
            self.headers = {k.lower().replace("_", "-"): v for k, v in headers.items()}

    tok = _token(cp, a)
    for req in (
        Req(x_access_token=tok, authorization="Basic dXNlcjo="),
        Req(x_api_key=KEY),
        Req(authorization=f"Bearer {KEY}"),
    ):
        assert (await seam_for(req, a).stat_file(a, "/")).type == "dir"
    assert seam_for(Req(x_access_token=tok), a).auth == f"E2B-Access {tok}"
    with pytest.raises(errors.Unauthorized):
        await seam_for(Req(x_access_token=tok), b).stat_file(b, "/")
    with pytest.raises(errors.Unauthorized, match="X-Access-Token"):
        seam_for(Req(authorization="Basic dXNlcjo="), a)


async def test_an_e2b_create_keeps_its_lifecycle_as_compat_and_a_no_resume_grant_leaves_standby_alone(two):
    cp, c, fake, edge, _ = two
    r = await c.post(
        "/v1/sandboxes", json={"idle_timeout_s": 0, "e2b": {"auto_resume": False, "on_timeout": "pause"}}
    )
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    want = {"created_via": "e2b", "auto_resume": False, "on_timeout": "pause"}
    assert r.json()["compat"] == want and r.json()["on_timeout"] == "pause"
    assert r.json()["metadata"] == {}  # not the user's labels
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["compat"] == want
    # E2B's on_timeout follows a PATCH of atoll's
    r = await c.patch(f"/v1/sandboxes/{sid}", json={"on_timeout": "delete"})
    assert r.json()["compat"]["on_timeout"] == "kill", r.text
    # the grant answer carries it; `{"resume": false}` on a running sandbox is an ordinary grant
    r = await c.post(f"/v1/sandboxes/{sid}/grant", json={"resume": False})
    assert r.status_code == 200 and r.json()["compat"]["created_via"] == "e2b", r.text
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})).status_code == 200
    r = await c.post(f"/v1/sandboxes/{sid}/grant", json={"resume": False})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state", r.text
    assert (
        "in standby and this call was asked not to resume it (resume: false)" in r.json()["error"]["message"]
    )
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "standby"
    # the edge's seam asked not to resume: E2B's "paused" error, and the sandbox stays paused
    w = seam.seam_for_access_token(edge, _token(cp, sid), sid, resume=False)
    with pytest.raises(seam.SandboxPaused) as e:
        await w.exec(sid, api.ExecSpec(cmd="true", max_output_bytes=1 << 20))
    assert "was not found: it is paused" in e.value.message and e.value.status == 409
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "standby"
    # without the body (or resume: true) the grant resumes it, as before
    r = await c.post(f"/v1/sandboxes/{sid}/grant")
    assert r.status_code == 200, r.text
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"resume": "no"}, "resume must be true or false"),
        ({"resume": False, "x": 1}, "unknown fields ['x']"),
    ],
)
async def test_a_bad_grant_body_is_400_naming_the_field(two, body, says):
    cp, c, fake, edge, (a, _) = two
    r = await c.post(f"/v1/sandboxes/{a}/grant", json=body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


async def test_e2b_options_that_disagree_with_on_timeout_are_400(two):
    cp, c, fake, edge, _ = two
    r = await c.post("/v1/sandboxes", json={"on_timeout": "delete", "e2b": {"on_timeout": "pause"}})
    assert r.status_code == 400 and "disagree" in r.text, r.text
    r = await c.post("/v1/sandboxes", json={"e2b": {"auto_resume": "yes"}})
    assert r.status_code == 400, r.text

"""User templates, warm pools and fork on the control plane (records, build states, claims, bad
input), over FakeWorkers: what the API answers and what the records say, without runsc."""

from __future__ import annotations

import asyncio

from atoll.core import ids
from atoll.testing import FakeAtoll, FakeWorker
from tests.component.conftest import KEY, create

SPEC = {"name": "web", "from": "base", "run": ["echo hi"], "env": {"A": "1"}, "workdir": "/app"}


async def wait_status(c, name: str, want: str, build_id: str | None = None) -> dict:
    for _ in range(200):
        r = await c.get(f"/v1/templates/{name}")
        assert r.status_code == 200, r.text
        t = r.json()
        if t["status"] == want and (build_id is None or t["build_id"] == build_id):
            return t
        await asyncio.sleep(0.01)
    raise AssertionError(f"template {name} never became {want}: {t}")


async def build(c, spec=SPEC) -> dict:
    r = await c.post("/v1/templates", json=spec)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["name"] == spec["name"] and body["status"] == "building"
    assert ids.is_build_id(body["build_id"])
    return body


async def test_a_build_becomes_current_and_creates_start_from_it(fake):
    c = fake.http
    started = await build(c)
    t = await wait_status(c, "web", "ready")
    assert t["current_build_id"] == started["build_id"] and t["builds"] == [started["build_id"]]
    r = await c.post("/v1/sandboxes", json={"template": "web", "env": {"MINE": "x"}, "idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    sb = r.json()
    assert sb["template"] == "web" and sb["build_id"] == started["build_id"]
    spec = fake.worker.runtimes[sb["id"]].spec
    assert spec.build_id == started["build_id"] and spec.env["MINE"] == "x"
    names = [t["name"] for t in (await c.get("/v1/templates")).json()["items"]]
    assert names == ["base", "web"]


async def test_a_failed_rebuild_leaves_the_previous_build_serving(fake):
    c = fake.http
    first = await build(c)
    await wait_status(c, "web", "ready")
    fake.worker.build_fails = "pip: No matching distribution found for nosuchpkg"
    second = await build(c, {**SPEC, "pip": ["nosuchpkg"]})
    t = await wait_status(c, "web", "failed", second["build_id"])
    assert "No matching distribution" in t["error"]
    assert t["current_build_id"] == first["build_id"]
    sid = await create(c, template="web")
    assert fake.worker.runtimes[sid].spec.build_id == first["build_id"]


async def test_a_template_whose_first_build_failed_shows_what_was_submitted(fake):
    """A tester's failed template showed `"env": {}`: the settings came from the serving build only."""
    c = fake.http
    fake.worker.build_fails = "runsc run failed (exit 128)"
    spec = {**SPEC, "env": {"PATH": "/nonexistent", "A": "1"}, "user": "app", "start": "serve"}
    started = await build(c, spec)
    t = await wait_status(c, "web", "failed", started["build_id"])
    assert t["current_build_id"] is None
    assert (t["env"], t["workdir"], t["user"], t["start"]) == (spec["env"], "/app", "app", "serve"), t
    fake.worker.build_fails = None
    await build(c)  # once a build serves, its settings are the ones shown
    t = await wait_status(c, "web", "ready")
    assert t["current_build_id"] is not None and t["user"] is None and t["start"] is None, t


async def test_one_build_of_a_template_at_a_time(fake):
    c = fake.http
    fake.worker.delay["build"] = 0.5
    await build(c)
    r = await c.post("/v1/templates", json=SPEC)
    assert r.status_code == 409 and r.json()["error"]["code"] == "template_exists", r.text


async def test_a_template_without_a_ready_build_cannot_start_sandboxes(fake):
    c = fake.http
    fake.worker.delay["build"] = 0.5
    await build(c)
    r = await c.post("/v1/sandboxes", json={"template": "web"})
    assert r.status_code == 409 and "no ready build" in r.json()["error"]["message"], r.text
    r = await c.post("/v1/sandboxes", json={"template": "nosuch"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "template_not_found"


async def test_bad_specs_are_refused_at_once(fake):
    c = fake.http
    cases = [
        ({"name": "base"}, "built-in"),
        ({"name": "x", "from": "nosuch"}, "no such template"),
        ({"name": "x", "from": "oci-archive:image.tar"}, "absolute"),
        ({"name": "x", "apt": "jq"}, "apt"),
        ({"name": "x", "bogus": 1}, "bogus"),
        ({"name": "x", "from": "x"}, "itself"),
        ({"name": "Bad Name"}, "name"),
    ]
    for body, words in cases:
        r = await c.post("/v1/templates", json=body)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    r = await c.post(
        "/v1/templates?name=d",
        content=b"FROM base\nRUN true\nEXPOSE 80\n",
        headers={"Content-Type": "text/x-dockerfile"},
    )
    assert r.status_code == 400 and "line 3" in r.json()["error"]["message"], r.text
    r = await c.post("/v1/templates", content=b"FROM base\n", headers={"Content-Type": "text/x-dockerfile"})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    r = await c.post(
        "/v1/templates?name=d", content=b"not a tar", headers={"Content-Type": "application/x-tar"}
    )
    assert r.status_code == 400 and "tar" in r.json()["error"]["message"]
    assert fake.worker.builds == {}  # nothing reached a worker


def _context_tar(*members: tuple[str, str, bytes | str]) -> bytes:
    """(name, kind 'file' | 'sym' | 'hard', data or link target) members."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, value in members:
            m = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(value, bytes)
                m.size = len(value)
                tf.addfile(m, io.BytesIO(value))
            else:
                assert isinstance(value, str)
                m.type, m.linkname = (tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE), value
                tf.addfile(m)
    return buf.getvalue()


async def test_a_hard_link_to_a_symbolic_link_in_a_build_context(fake):
    """A tester's context (h a hard link to s -> /etc/shadow) answered 500 with a traceback in the
    log: h is that link now; a hard link that names nothing of the context is a 400 naming it."""
    c = fake.http
    dockerfile = ("Dockerfile", "file", b"FROM base\nCOPY h /h\n")
    r = await c.post(
        "/v1/templates?name=hl",
        content=_context_tar(dockerfile, ("s", "sym", "/etc/shadow"), ("h", "hard", "s")),
        headers={"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 202, r.text
    build = fake.manager.templates.db.get_build(r.json()["build_id"])
    (step,) = build.spec["steps"]
    assert [(f["path"], f.get("link")) for f in step["files"]] == [("/h", "/etc/shadow")]
    for members, named in (
        ([("h", "hard", "/etc/shadow")], "'h' names '/etc/shadow'"),
        ([("s", "sym", "/etc/shadow"), ("h", "hard", "missing")], "'h' names 'missing'"),
    ):
        r = await c.post(
            "/v1/templates?name=hm",
            content=_context_tar(dockerfile, *members),
            headers={"Content-Type": "application/x-tar"},
        )
        assert r.status_code == 400, r.text
        assert f"hard link {named}" in r.json()["error"]["message"], r.text


async def test_the_server_does_not_say_whether_an_archive_path_exists(fake, tmp_path):
    """FROM oci-archive: names a host path; a missing one was 400 here while an existing one went
    on to the build: the answer told which paths exist. Both are now accepted alike (the worker
    reads the path, and answers every unusable one the same way)."""
    c = fake.http
    existing = tmp_path / "passwd"
    existing.write_text("root:x:0:0:root:/root:/bin/bash\n")
    answers = []
    for name, path in (("a", tmp_path / "nope.tar"), ("b", existing)):
        r = await c.post("/v1/templates", json={"name": name, "from": f"oci-archive:{path}"})
        answers.append((r.status_code, r.json()["status"]))
    assert answers == [(202, "building"), (202, "building")], answers


async def test_deleting_a_template_in_use_is_refused(fake):
    c = fake.http
    await build(c)
    await wait_status(c, "web", "ready")
    sid = await create(c, template="web")
    r = await c.delete("/v1/templates/web")
    assert r.status_code == 409 and r.json()["error"]["code"] == "template_in_use", r.text
    assert sid in r.json()["error"]["message"]
    assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert (await c.delete("/v1/templates/web")).status_code == 204
    assert (await c.get("/v1/templates/web")).status_code == 404
    assert (
        "delete_build",
        next(iter([b for v, b in fake.worker.calls if v == "build"])),
    ) in fake.worker.calls
    assert (await c.delete("/v1/templates/base")).status_code == 400


async def test_build_logs_stream(fake):
    c = fake.http
    started = await build(c)
    r = await c.get(f"/v1/templates/web/builds/{started['build_id']}/logs")
    assert r.status_code == 200 and started["build_id"] in r.text
    r = await c.get("/v1/templates/web/builds/bld-0000000000000000/logs")
    assert r.status_code == 404


async def test_pool_fills_hides_and_is_claimed_with_the_callers_settings(fake):
    c = fake.http
    await build(c)
    await wait_status(c, "web", "ready")
    r = await c.put("/v1/templates/web/pool", json={"min": 2, "max": 3})
    assert r.status_code == 200 and r.json()["min"] == 2 and r.json()["desired"] == 2, r.text
    for _ in range(300):
        pool = (await c.get("/v1/templates/web/pool")).json()
        if pool["ready"] >= 2:
            break
        await asyncio.sleep(0.02)
    assert pool["ready"] == 2, pool
    assert (await c.get("/v1/sandboxes")).json()["items"] == []  # pooled sandboxes are not listed
    pooled = {r.id for r in fake.manager.live() if r.pooled}
    r = await c.post(
        "/v1/sandboxes",
        json={
            "template": "web",
            "env": {"WHO": "me"},
            "metadata": {"team": "a"},
            "cpus": 0.5,
            "idle_timeout_s": 0,
        },
    )
    assert r.status_code == 201, r.text
    sb = r.json()
    assert sb["id"] in pooled and sb["state"] == "running" and sb["metadata"] == {"team": "a"}
    assert ("claim", sb["id"]) in fake.worker.calls
    assert fake.worker.runtimes[sb["id"]].spec.env["WHO"] == "me"
    assert fake.worker.runtimes[sb["id"]].spec.cpus == 0.5
    assert [s["id"] for s in (await c.get("/v1/sandboxes")).json()["items"]] == [sb["id"]]
    assert (await c.get("/v1/templates/web/pool")).json()["claimed"] == 1
    # a create the pool cannot serve (another memory size) restores from the snapshot instead
    r = await c.post("/v1/sandboxes", json={"template": "web", "memory_mb": 256, "idle_timeout_s": 0})
    assert r.status_code == 201 and r.json()["id"] not in pooled
    # in use by claimed sandboxes: refused; pool emptied at 0/0
    assert (await c.delete("/v1/templates/web")).status_code == 409
    assert (await c.put("/v1/templates/web/pool", json={"min": 0, "max": 0})).status_code == 200
    for _ in range(300):
        if not any(r.pooled for r in fake.manager.live()):
            break
        await asyncio.sleep(0.02)
    assert not any(r.pooled for r in fake.manager.live())


async def test_bad_pools_are_refused(fake):
    c = fake.http
    await build(c)
    for body, words in [
        ({"min": 5, "max": 2}, "more than max"),
        ({"min": -1}, "min"),
        ({"min": 1, "max": 1000}, "max"),
        ({"min": 1, "max": 2, "schedule": [{"from": "25:00", "to": "08:00", "min": 1}]}, "HH:MM"),
        ({"min": 1, "max": 2, "schedule": [{"from": "08:00", "to": "20:00", "min": 5}]}, "max"),
        (  # accepted without a word, and never applied
            {"min": 0, "max": 2, "schedule": [{"from": "08:00", "to": "08:00", "min": 2}]},
            "schedule[0] is an empty window: from and to are both '08:00'",
        ),
        ({"min": 1, "max": 2, "size": 3}, "size"),
    ]:
        r = await c.put("/v1/templates/web/pool", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    assert (await c.put("/v1/templates/nosuch/pool", json={"min": 1})).status_code == 404


def test_pool_schedule_floors():
    import datetime as dt

    from atoll.controlplane import pools

    cfg = pools.check({"min": 1, "max": 8, "schedule": [{"from": "08:00", "to": "20:00", "min": 5}]}, 512)
    at = lambda h, m=0: dt.datetime(2026, 12, 1, h, m, tzinfo=dt.UTC)  # noqa: E731
    assert [pools.desired(cfg, at(h)) for h in (7, 8, 19, 20)] == [1, 5, 5, 1]
    night = pools.check({"min": 0, "max": 3, "schedule": [{"from": "22:00", "to": "02:00", "min": 3}]}, 512)
    assert [pools.desired(night, at(h)) for h in (21, 22, 1, 2)] == [0, 3, 3, 0]


async def test_fork_records_copies_and_refuses_bad_counts(fake):
    c = fake.http
    sid = await create(c, metadata={"team": "a"}, env={"E": "1"})
    r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3})
    assert r.status_code == 201, r.text
    items = r.json()["items"]
    assert len({i["id"] for i in items}) == 3 and sid not in {i["id"] for i in items}
    for i in items:
        assert i["state"] == "running" and i["env"] == {"E": "1"}
        assert i["metadata"] == {"team": "a", "atoll.forked_from": sid}
        assert i["id"] in fake.worker.runtimes
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    for body in ({"count": 0}, {"count": 51}, {"count": "3"}, {"n": 1}, [1]):
        r = await c.post(f"/v1/sandboxes/{sid}/fork", json=body)
        assert r.status_code == 400, (body, r.text)
    fake.worker.gate_blockers = ["process 7 (node) watches TCP sockets with epoll"]
    before = len((await c.get("/v1/sandboxes")).json()["items"])
    r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_refused", r.text
    assert "epoll" in r.json()["error"]["message"]
    assert len((await c.get("/v1/sandboxes")).json()["items"]) == before  # no half fork recorded
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


async def test_deleting_a_pooled_template_takes_its_pool_and_keeps_the_server_serving(fake):
    c = fake.http
    await build(c)
    await wait_status(c, "web", "ready")
    assert (await c.put("/v1/templates/web/pool", json={"min": 2, "max": 2})).status_code == 200
    for _ in range(300):
        if (await c.get("/v1/templates/web/pool")).json()["ready"] >= 2:
            break
        await asyncio.sleep(0.02)
    r = await asyncio.wait_for(c.delete("/v1/templates/web"), 10)
    assert r.status_code == 204, r.text
    assert not any(r.pooled for r in fake.manager.live())
    assert (await asyncio.wait_for(c.get("/healthz"), 2)).status_code == 200  # the loop is not starved
    await build(c)  # the same name again: its pool may be set again
    await wait_status(c, "web", "ready")
    assert (await c.put("/v1/templates/web/pool", json={"min": 1, "max": 1})).status_code == 200
    for _ in range(300):
        if (await c.get("/v1/templates/web/pool")).json()["ready"] >= 1:
            break
        await asyncio.sleep(0.02)
    assert (await c.get("/v1/templates/web/pool")).json()["ready"] == 1


async def test_a_failed_fork_whose_parent_runs_on_leaves_it_running(fake):
    from atoll.core import errors

    c = fake.http
    sid = await create(c)

    async def copies_fail(sandbox_id, new_ids):
        raise errors.InsufficientStorage("sandbox's disk cannot hold the copy")

    fake.worker.fork = copies_fail
    r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 507 and r.json()["error"]["code"] == "disk_full", r.text
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert [s["id"] for s in (await c.get("/v1/sandboxes")).json()["items"]] == [sid]


async def test_what_base_has_and_has_not_is_said_truly(fake, tmp_path):
    """`GET /v1/templates/base/builds/bld-x/logs` said base had "no builds, logs or pool of its
    own"; it has a pool (ATOLL_DEFAULT_POOL) and each worker builds it: say where to look."""
    c = fake.http
    r = await c.get("/v1/templates/base/builds/bld-0000000000000000/logs")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "built in" in message and "pool of its own" not in message, message
    assert "GET /v1/templates/base shows its status" in message and "worker's log" in message, message
    assert (await c.get("/v1/templates/base/pool")).status_code == 200
    async with FakeAtoll(tmp_path / "none", [], api_key=KEY) as empty:
        r = await empty.http.get("/v1/templates/base")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
        assert "no usable worker reports it" in r.json()["error"]["message"], r.text


async def test_a_builtin_template_no_worker_offers_is_404_naming_the_setting(fake):
    """Workers that run with ATOLL_E2B_CODE_INTERPRETER=0 report `base` only: the code interpreter's
    template is then not found (not 503 no_worker, which says to wait)."""
    r = await fake.http.get("/v1/templates/code-interpreter-v1")
    assert r.status_code == 404 and r.json()["error"]["code"] == "template_not_found", r.text
    assert "ATOLL_E2B_CODE_INTERPRETER=0" in r.json()["error"]["message"], r.text
    listed = (await fake.http.get("/v1/templates")).json()["items"]
    assert "code-interpreter-v1" not in [t["name"] for t in listed]


async def test_the_builtin_templates_pool_is_the_servers_setting(fake):
    c = fake.http
    r = await c.put("/v1/templates/base/pool", json={"min": 1, "max": 1})
    assert r.status_code == 400, r.text
    assert "built-in" in r.json()["error"]["message"] and "ATOLL_DEFAULT_POOL" in r.json()["error"]["message"]
    r = await c.get("/v1/templates/base/pool")
    assert r.status_code == 200 and (r.json()["min"], r.json()["max"]) == (0, 0), r.text


async def test_a_path_that_finds_nothing_is_refused_naming_path(fake):
    """PATH='' (or one without an absolute directory, or with a newline) used to pass and fail
    later as "runsc run failed"; a Dockerfile's names its line."""
    c = fake.http
    bodies = [
        ("/v1/templates", {"name": "p", "env": {"PATH": ""}}, "''"),
        ("/v1/templates", {"name": "p", "env": {"PATH": "::"}}, "'::'"),
        ("/v1/templates", {"name": "p", "env": {"PATH": "bin:node_modules/.bin"}}, "'bin:node_modules/.bin'"),
        ("/v1/templates", {"name": "p", "env": {"PATH": "/usr/bin\n/bin"}}, "'/usr/bin\\n/bin'"),
        ("/v1/sandboxes", {"env": {"PATH": ""}}, "''"),
        ("/v1/sandboxes", {"env": {"PATH": "/usr/bin\r\n"}}, "'/usr/bin\\r\\n'"),
    ]
    for route, body, value in bodies:
        r = await c.post(route, json=body)
        assert r.status_code == 400, (body, r.text)
        message = r.json()["error"]["message"]
        assert "PATH" in message and value in message, message
        assert "directories joined by ':'" in message, message
    r = await c.post(
        "/v1/templates?name=p",
        content=b'FROM base\nENV A=1\nRUN true\nENV PATH=""\n',
        headers={"Content-Type": "text/x-dockerfile"},
    )
    assert r.status_code == 400, r.text
    assert "Dockerfile line 4: ENV PATH ''" in r.json()["error"]["message"], r.text
    assert fake.worker.builds == {}  # nothing reached a worker
    assert (await c.get("/v1/sandboxes")).json()["items"] == []
    r = await c.post("/v1/templates", json={"name": "p", "env": {"PATH": "/opt/tools/bin:/usr/bin:/bin"}})
    assert r.status_code == 202, r.text  # an absolute PATH is still fine
    # a relative entry beside absolute ones is a shell's business, not a start-up failure
    r = await c.post(
        "/v1/templates", json={"name": "q", "env": {"PATH": "./node_modules/.bin:/usr/bin:/bin"}}
    )
    assert r.status_code == 202, r.text


async def _claim_one(c) -> str:
    for _ in range(300):
        if (await c.get("/v1/templates/web/pool")).json()["ready"] >= 1:
            break
        await asyncio.sleep(0.02)
    r = await c.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def test_a_pools_claimed_count_survives_a_restart_and_goes_with_its_template(tmp_path):
    """`claimed` was counted in memory: a restarted server said 0."""
    worker = FakeWorker()
    async with FakeAtoll(tmp_path, [worker]) as fake:
        c = fake.http
        await build(c)
        await wait_status(c, "web", "ready")
        assert (await c.put("/v1/templates/web/pool", json={"min": 1, "max": 1})).status_code == 200
        first = await _claim_one(c)
        second = await _claim_one(c)
        assert (await c.get("/v1/templates/web/pool")).json()["claimed"] == 2
    async with FakeAtoll(tmp_path, [worker]) as fake:  # the same database: a restart
        c = fake.http
        assert (await c.get("/v1/templates/web/pool")).json()["claimed"] == 2
        await _claim_one(c)
        assert (await c.get("/v1/templates/web/pool")).json()["claimed"] == 3
        # deleting the template deletes its count: a new template of that name starts at 0
        assert (await c.put("/v1/templates/web/pool", json={"min": 0, "max": 0})).status_code == 200
        for s in (await c.get("/v1/sandboxes")).json()["items"]:
            assert (await c.delete(f"/v1/sandboxes/{s['id']}")).status_code in (200, 204)
        for _ in range(300):
            if not any(r.pooled for r in fake.manager.live()):
                break
            await asyncio.sleep(0.02)
        r = await c.delete("/v1/templates/web")
        assert r.status_code in (200, 204), r.text
        await build(c)
        await wait_status(c, "web", "ready")
        assert (await c.get("/v1/templates/web/pool")).json()["claimed"] == 0
    assert first != second

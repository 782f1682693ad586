"""The audit trail at the control plane (in process, fake worker): every mutation recorded with its
key, tenant, action, target and result — refused ones too —, reads not recorded, no secret value,
key or body in any column, GET /v1/audit's filters and signed cursors, bad input, retention, and
the rows still pending written at shutdown."""

from __future__ import annotations

import asyncio
import datetime as dt
import re

import httpx
import pytest
import sqlalchemy as sa

from atoll.controlplane import audit, auth
from atoll.controlplane import settings as settings_mod
from atoll.core import config
from atoll.testing import FakeAtoll
from tests.component.conftest import KEY, create


def _as(fake, key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.AsyncClient(transport=fake.transport, base_url="http://atoll", headers=headers)


async def _trail(fake, **params) -> list[dict]:
    """Every row (following cursors), as GET /v1/audit lists them."""
    out: list[dict] = []
    cursor = None
    while True:
        r = await fake.http.get("/v1/audit", params={**params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        out += r.json()["items"]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return out


def _rows(fake) -> list[audit.AuditRecord]:
    with fake.manager.db.session() as s:
        return list(s.scalars(sa.select(audit.AuditRecord).order_by(audit.AuditRecord.id)))


async def _tenant(c: httpx.AsyncClient, name: str) -> tuple[str, str, str]:
    r = await c.post("/v1/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = await c.post(f"/v1/tenants/{tid}/keys", json={})
    assert r.status_code == 201, r.text
    return tid, r.json()["id"], r.json()["key"]


@pytest.mark.databases
async def test_mutations_are_recorded_with_who_what_target_and_result(fake):
    c = fake.http
    tid, kid, key = await _tenant(c, "acme")
    async with _as(fake, key) as tc:
        r = await tc.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert (await tc.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
        assert (await tc.get(f"/v1/sandboxes/{sid}")).status_code == 200  # a read: not recorded
        assert (await tc.get("/v1/sandboxes")).status_code == 200
        assert (await tc.delete(f"/v1/sandboxes/{sid}")).status_code == 204
        missing = "sb-0000000000000000"
        r = await tc.post(f"/v1/sandboxes/{missing}/pause", json={})
        assert r.status_code == 404, r.text
        failed_rid = r.headers["x-request-id"]
    items = await _trail(fake)
    got = [(i["action"], i["key_id"], i["tenant_id"], i["target"], i["result"]["status"]) for i in items]
    assert got == [
        ("tenant.create", "admin", tid, tid, 201),
        ("key.create", "admin", tid, f"{tid}/{kid}", 201),
        ("sandbox.create", kid, tid, sid, 201),
        ("sandbox.exec", kid, tid, sid, 200),
        ("sandbox.delete", kid, tid, sid, 204),
        ("sandbox.pause", kid, tid, missing, 404),
    ]
    assert items[-1]["result"]["error"] == "sandbox_not_found" and items[-1]["request_id"] == failed_rid
    assert all(i["result"]["error"] is None for i in items[:-1])
    assert all(i["source"] == "127.0.0.1" and i["request_id"].startswith("req_") for i in items)
    ats = [dt.datetime.fromisoformat(i["at"]) for i in items]
    assert ats == sorted(ats) and all(t.tzinfo is not None for t in ats)
    # an admin acting in a tenant (?tenant_id=) is recorded in that tenant
    r = await c.post("/v1/sandboxes", params={"tenant_id": tid}, json={"idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    last = (await _trail(fake))[-1]
    assert (last["action"], last["key_id"], last["tenant_id"]) == ("sandbox.create", "admin", tid)


async def test_an_admins_action_on_a_tenants_resource_is_recorded_in_that_tenant(fake):
    """An admin key naming no tenant (`?tenant_id=` absent) acts on tenant resources found by id
    (a sandbox, a tenant's key) or by name (secrets, volumes: in the `default` tenant then): the
    row carries the tenant of what was acted on, so the tenant's trail lists it."""
    c = fake.http
    tid, kid, key = await _tenant(c, "owned")
    async with _as(fake, key) as tc:
        r = await tc.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
    assert (await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})).status_code == 200
    assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert (await c.delete(f"/v1/keys/{kid}")).status_code == 204
    r = await c.post("/v1/secrets", json={"name": "token", "value": "s3cret-1", "hosts": ["api.example.com"]})
    assert r.status_code == 201, r.text
    r = await c.put("/v1/secrets/token", json={"value": "s3cret-2", "hosts": ["api.example.com"]})
    assert r.status_code == 200, r.text
    assert (await c.delete("/v1/secrets/token")).status_code == 204
    assert (await c.post("/v1/volumes", json={"name": "v1", "size_mb": 64})).status_code == 201
    assert (await c.delete("/v1/volumes/v1")).status_code == 204
    items = await _trail(fake)
    mine = [(i["action"], i["key_id"], i["target"]) for i in await _trail(fake, tenant_id=tid)]
    assert mine == [
        ("tenant.create", "admin", tid),
        ("key.create", "admin", f"{tid}/{kid}"),
        ("sandbox.create", kid, sid),
        ("sandbox.exec", "admin", sid),
        ("sandbox.pause", "admin", sid),
        ("sandbox.delete", "admin", sid),
        ("key.revoke", "admin", kid),
    ]
    by_action = {i["action"]: i["tenant_id"] for i in items}
    for action in ("secret.put", "secret.delete", "volume.create", "volume.delete"):
        assert by_action[action] == "default", (action, items)
    # what targets no tenant resource stays without a tenant
    r = await c.post("/v1/keys", json={"scope": "worker"})
    assert r.status_code == 201, r.text
    assert (await _trail(fake))[-1]["tenant_id"] is None


async def test_refused_attempts_are_recorded(fake):
    c = fake.http
    tid, kid, key = await _tenant(c, "probe")
    async with _as(fake, None) as anon:
        assert (await anon.post("/v1/sandboxes", json={})).status_code == 401
    async with _as(fake, "atk_ak-0000000000000000_" + "A" * 43) as wrong:
        assert (await wrong.delete("/v1/sandboxes/sb-aaaaaaaaaaaaaaaa")).status_code == 401
    async with _as(fake, key) as tc:
        r = await tc.post("/v1/keys", json={"scope": "admin"})
        assert r.status_code == 403, r.text
        assert (await tc.delete(f"/v1/tenants/{tid}")).status_code == 403
    r = await c.post("/v1/keys", json={"scope": "worker"})
    async with _as(fake, r.json()["key"]) as wc:
        assert (await wc.post("/v1/sandboxes", json={})).status_code == 403
    wkid = r.json()["id"]
    items = (await _trail(fake))[2:]  # after the tenant and its key
    got = [(i["action"], i["key_id"], i["tenant_id"], i["target"], i["result"]) for i in items]
    assert got == [
        ("sandbox.create", None, None, None, {"status": 401, "error": "unauthorized"}),
        ("sandbox.delete", None, None, "sb-aaaaaaaaaaaaaaaa", {"status": 401, "error": "unauthorized"}),
        ("key.create", kid, tid, None, {"status": 403, "error": "forbidden"}),
        ("tenant.delete", kid, tid, tid, {"status": 403, "error": "forbidden"}),
        ("key.create", "admin", None, wkid, {"status": 201, "error": None}),
        ("sandbox.create", wkid, None, None, {"status": 403, "error": "forbidden"}),
    ]
    # a route that does not exist is recorded under its method and path
    assert (await c.post("/v1/nothing-here", json={})).status_code == 404
    last = (await _trail(fake))[-1]
    assert last["action"] == "POST /v1/nothing-here" and last["result"] == {
        "status": 404,
        "error": "not_found",
    }


async def test_no_secret_value_key_or_body_is_ever_in_the_trail(fake):
    c = fake.http
    value, value2 = "s3cr3t-value-0123456789-unique", "r0tated-value-9876543210-unique"
    r = await c.post("/v1/secrets", json={"name": "tok", "value": value, "hosts": ["api.example.com"]})
    assert r.status_code == 201, r.text
    r = await c.put("/v1/secrets/tok", json={"value": value2, "hosts": ["api.example.com"]})
    assert r.status_code == 200, r.text
    r = await c.post("/v1/secrets", json={"name": "tok", "value": value, "hosts": ["api.example.com"]})
    assert r.status_code == 409  # a failure whose body echoes nothing either
    keys = []
    for scope in ("admin", "worker"):
        r = await c.post("/v1/keys", json={"scope": scope})
        keys.append(r.json()["key"])
    keys.append((await _tenant(c, "keyed"))[2])
    marker = "body-marker-4242"
    await create(c, env={"MARKER": marker}, metadata={"m": marker})
    async with _as(fake, keys[2]) as tc:  # the new tenant key in use, refused and accepted
        assert (await tc.post("/v1/keys", json={"scope": "admin"})).status_code == 403
        assert (await tc.post("/v1/sandboxes", json={"idle_timeout_s": 0})).status_code == 201
    async with _as(fake, keys[0][:-2] + "xx") as bad:  # a wrong key that looks right
        assert (await bad.delete("/v1/secrets/tok")).status_code == 401
    assert (await c.delete("/v1/secrets/tok")).status_code == 204
    items = await _trail(fake)
    actions = [i["action"] for i in items]
    for a in (
        "secret.create",
        "secret.put",
        "secret.delete",
        "key.create",
        "tenant.create",
        "sandbox.create",
    ):
        assert a in actions
    forbidden = [
        value,
        value2,
        marker,
        KEY,
        *keys,
        *(k[-43:] for k in keys),  # a key's secret part (it may hold "_")
    ]
    assert all(auth.KEY_RE.fullmatch(k.encode()) for k in keys)
    rows = _rows(fake)
    assert len(rows) == len(items) >= 12
    for row in rows:
        for col in audit.AuditRecord.__table__.columns:
            cell = str(getattr(row, col.key))
            for needle in forbidden:
                assert needle not in cell, (col.key, cell)
    # a refused create names nothing (its body is not read); the others name the secret
    assert [i["target"] for i in items if i["action"].startswith("secret.")] == [
        "tok",
        "tok",
        None,
        "tok",
        "tok",
    ]


@pytest.mark.databases
async def test_filters_cursors_and_order(fake):
    c = fake.http
    tid, _, key = await _tenant(c, "pages")
    async with _as(fake, key) as tc:
        for _ in range(7):
            assert (await tc.post("/v1/sandboxes", json={"idle_timeout_s": 0})).status_code == 201
    for _ in range(5):
        await create(c)
    everything = await _trail(fake)
    assert len(everything) == 2 + 7 + 5
    r = await c.get("/v1/audit", params={"limit": 4})
    assert len(r.json()["items"]) == 4 and r.json()["next_cursor"]
    assert await _trail(fake, limit=4) == everything  # pages of 4 add up to the whole, in order
    assert await _trail(fake, limit=1) == everything
    last = await c.get("/v1/audit", params={"limit": len(everything)})
    assert last.json()["next_cursor"] is None
    mine = await _trail(fake, tenant_id=tid, limit=3)
    assert len(mine) == 9 and {i["tenant_id"] for i in mine} == {tid}
    assert len(await _trail(fake, action="sandbox.create")) == 12
    assert len(await _trail(fake, action="sandbox.create", tenant_id=tid)) == 7
    assert [i["action"] for i in await _trail(fake, action="tenant.*")] == ["tenant.create"]
    assert await _trail(fake, action="sandbox") == []
    ats = [i["at"] for i in everything]
    middle = ats[6]
    after = await _trail(fake, **{"from": middle})
    assert after == everything[ats.index(middle) :]  # from is inclusive
    before = await _trail(fake, to=middle)
    assert before == everything[: ats.index(middle)]  # to is exclusive
    naive = dt.datetime.fromisoformat(middle).replace(tzinfo=None).isoformat()
    assert await _trail(fake, **{"from": naive}) == after  # naive = UTC
    plus2 = dt.datetime.fromisoformat(middle).astimezone(dt.timezone(dt.timedelta(hours=2))).isoformat()
    assert await _trail(fake, **{"from": plus2}) == after  # any offset, converted
    # reading the trail added nothing to it
    assert len(await _trail(fake)) == len(everything)


@pytest.mark.parametrize(
    "params, says",
    [
        ({"from": "yesterday"}, "ISO 8601"),
        ({"to": "2026-13-01T00:00:00Z"}, "ISO 8601"),
        ({"to": "9999-12-31T23:59:59-12:00"}, "ISO 8601"),  # out of range in UTC: was a 500
        ({"from": "2026-12-02T00:00:00Z", "to": "2026-12-01T00:00:00Z"}, "after"),
        ({"limit": "0"}, "1 to 1000"),
        ({"limit": "1001"}, "1 to 1000"),
        ({"limit": "ten"}, "1 to 1000"),
        ({"cursor": "garbage"}, "not issued"),
        ({"cursor": "a.b.c"}, "not issued"),
    ],
)
async def test_bad_input(fake, params, says):
    r = await fake.http.get("/v1/audit", params=params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request" and says in r.json()["error"]["message"]


async def test_a_tampered_or_foreign_cursor_is_refused(fake):
    for _ in range(3):
        await create(fake.http)
    cursor = (await fake.http.get("/v1/audit", params={"limit": 1})).json()["next_cursor"]
    body, sig = cursor.split(".")
    forged = audit._b64(audit._unb64(body).replace(b'",', b'",9').replace(b",1]", b",0]"))
    foreign = audit.Cursors(b"\x01" * 32).make(dt.datetime.now(dt.UTC), 1)
    flipped = body[:-1] + ("A" if body[-1] != "A" else "B")
    for bad in (f"{forged}.{sig}", f"{flipped}.{sig}", f"{body}.{sig[:-2]}", foreign, body):
        r = await fake.http.get("/v1/audit", params={"cursor": bad})
        assert r.status_code == 400, (bad, r.text)
        assert "not issued by this server" in r.json()["error"]["message"]
    assert (await fake.http.get("/v1/audit", params={"cursor": cursor})).status_code == 200


async def test_only_admin_keys_read_the_trail(fake):
    _, _, key = await _tenant(fake.http, "nosy")
    async with _as(fake, key) as tc:
        r = await tc.get("/v1/audit")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


@pytest.mark.databases
async def test_retention_prunes_old_rows(fake, monkeypatch):
    log = fake.app.state.audit
    now = dt.datetime.now(dt.UTC)
    row = (None, None, "test.old", None, 200, None, None, None)
    log.record((now - dt.timedelta(days=91), *row))
    log.record((now - dt.timedelta(days=89), None, None, "test.kept", None, 200, None, None, None))
    # the background task writes them and prunes on its first pass (then every PRUNE_S)
    for _ in range(200):  # up to 10 s on a loaded machine
        actions = [r.action for r in _rows(fake)]
        if actions == ["test.kept"]:
            break
        await asyncio.sleep(0.05)
    assert actions == ["test.kept"]
    log.retention = dt.timedelta(days=30)  # ATOLL_AUDIT_RETENTION_DAYS=30
    assert log.prune() == 1 and _rows(fake) == []
    monkeypatch.setattr(audit, "PRUNE_CHUNK", 3)  # a big prune goes in short transactions
    log._write(
        [
            (now - dt.timedelta(days=31 + i), None, None, f"test.{i}", None, 200, None, None, None)
            for i in range(7)
        ]
    )
    log._write([(now - dt.timedelta(days=29), None, None, "test.young", None, 200, None, None, None)])
    assert log.prune() == 7 and [r.action for r in _rows(fake)] == ["test.young"]
    s = settings_mod.load({"ATOLL_AUDIT_RETENTION_DAYS": "30", "ATOLL_HOME": "/tmp/unused"})
    assert s.audit_retention_days == 30
    assert settings_mod.load({"ATOLL_HOME": "/tmp/unused"}).audit_retention_days == 90
    for bad in ("0", "-1", "forever", "36501"):
        with pytest.raises(config.SettingsError, match="ATOLL_AUDIT_RETENTION_DAYS"):
            settings_mod.load({"ATOLL_AUDIT_RETENTION_DAYS": bad, "ATOLL_HOME": "/tmp/unused"})


async def test_rows_pending_at_shutdown_are_written(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as f:
        sid = await create(f.http)
        assert (await f.http.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert [r.action for r in _rows(f)] == ["sandbox.create", "sandbox.delete"]


async def test_every_mutation_route_has_an_action_name(fake):
    """A route added without a name would be recorded as "METHOD /path": give it one in ACTIONS."""
    doc = fake.app.openapi()
    # OpenAPI writes a route's `{snid:path}` as `{snid}`
    named = {(m, re.sub(r":\w+}", "}", p)) for m, p in audit.ACTIONS}
    unnamed = [
        f"{m.upper()} {p}"
        for p, ops in doc["paths"].items()
        for m in ops
        if m.upper() in audit.MUTATIONS and (m.upper(), p) not in named
    ]
    assert unnamed == []
    assert audit.action_name("POST", "/v1/new/{x}") == "POST /v1/new/{x}"


async def test_the_sdk_follows_cursors_to_the_whole_trail(fake, monkeypatch):
    import atoll
    from atoll._client import _base

    tid, _, key = await _tenant(fake.http, "sdk")
    async with _as(fake, key) as tc:
        for _ in range(4):
            assert (await tc.post("/v1/sandboxes", json={"idle_timeout_s": 0})).status_code == 201
    monkeypatch.setattr(_base, "AUDIT_PAGE", 2)  # pages of 2: 6 rows take 3 pages
    async with atoll.AsyncClient("http://atoll", KEY, transport=fake.transport) as client:
        got = await client.audit()
        assert [e.to_dict() for e in got] == await _trail(fake)
        assert [e.action for e in got] == ["tenant.create", "key.create"] + ["sandbox.create"] * 4
        e = got[-1]
        assert (e.tenant_id, e.status, e.error, e.source) == (tid, 201, None, "127.0.0.1")
        assert e.target and e.target.startswith("sb-") and e.key_id and e.key_id.startswith("ak-")
        assert len(await client.audit(limit=3)) == 3
        assert len(await client.audit(tenant_id=tid, action="sandbox.*")) == 4
        since = dt.datetime.fromisoformat(got[2].at)
        assert len(await client.audit(from_=since)) == 4
        assert len(await client.audit(from_=since.replace(tzinfo=None), to=got[4].at)) == 2
        with pytest.raises(atoll.InvalidRequest, match="ISO 8601"):
            await client.audit(from_="last tuesday")
        with pytest.raises(ValueError, match="limit"):
            await client.audit(limit=0)


@pytest.mark.databases
async def test_a_row_the_database_refuses_does_not_hold_back_the_others(fake):
    log = fake.app.state.audit
    now = dt.datetime.now(dt.UTC)
    log.record((now, None, None, "test.first", None, 200, None, None, None))
    log.record((now, None, None, "test.refused", None, None, None, None, None))  # status is NOT NULL
    log.record((now, None, None, "test.last", None, 200, None, None, None))
    await log.flush()
    assert [r.action for r in _rows(fake)] == ["test.first", "test.last"] and log.dropped == 1
    # control characters from the path (PostgreSQL refuses a NUL) are replaced, not stored
    r = await fake.http.post("/v1/%00x%0a/y", json={})
    assert r.status_code == 404
    assert (await _trail(fake))[-1]["action"] == "POST /v1/?x?/y"


async def test_a_request_that_ends_before_its_answer_is_recorded_as_such():
    """A call cancelled before it answered (its client hung up) is a 499 `no_answer`, not a
    success nor a server error."""
    rows: list[tuple] = []

    class Log:
        def record(self, row):
            rows.append(row)

    async def hung_up(scope, receive, send):
        scope["state"]["request_id"] = "req_cut"
        raise asyncio.CancelledError

    layer = audit.AuditMiddleware(hung_up, Log())  # type: ignore[arg-type]
    scope = {"type": "http", "method": "POST", "path": "/v1/sandboxes/sb-aaaaaaaaaaaaaaaa/exec", "state": {}}
    with pytest.raises(asyncio.CancelledError):
        await layer(scope, None, None)
    assert len(rows) == 1
    _, key_id, _, action, target, status, error, rid, source = rows[0]
    assert (action, target, status, error, rid, key_id, source) == (
        "sandbox.exec",
        "sb-aaaaaaaaaaaaaaaa",
        499,
        "no_answer",
        "req_cut",
        None,
        None,
    )


async def test_a_key_pasted_into_a_path_is_redacted(tmp_path):
    """`DELETE /v1/keys/<the key itself>` (an id expected): the row keeps the key's id, never its
    secret; the same for the installation's admin key anywhere in a path."""
    admin = "atoll_" + "Z" * 40
    async with FakeAtoll(tmp_path, api_key=admin) as f:
        r = await f.http.post("/v1/keys", json={"scope": "worker"})
        kid, key = r.json()["id"], r.json()["key"]
        assert (await f.http.delete(f"/v1/keys/{key}")).status_code == 404
        async with _as(f, None) as anon:
            assert (await anon.delete(f"/v1/keys/{key}")).status_code == 401
            assert (await anon.post(f"/v1/{admin}/x", json={})).status_code == 401
        items = (await _trail(f))[1:]
        assert [i["target"] for i in items[:2]] == [f"atk_{kid}_[redacted]"] * 2
        assert items[2]["action"] == "POST /v1/[redacted]/x"
        for row in _rows(f):
            for col in audit.AuditRecord.__table__.columns:
                cell = str(getattr(row, col.key))
                assert key[-43:] not in cell and admin not in cell, cell


@pytest.mark.databases
async def test_cursors_walk_rows_of_one_instant_in_id_order(fake):
    same = dt.datetime.now(dt.UTC)
    rows = [(same, None, None, f"test.{i}", None, 200, None, None, None) for i in range(5)]
    fake.app.state.audit._write(rows)
    fake.app.state.audit._write(
        [(same - dt.timedelta(microseconds=1), None, None, "test.before", None, 200, None, None, None)]
    )
    for limit in (1, 2, 5):
        assert [i["action"] for i in await _trail(fake, limit=limit)] == ["test.before"] + [
            f"test.{i}" for i in range(5)
        ]

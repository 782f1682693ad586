"""Two tenants' real traffic through one installation (issue 20, the security battery).

One `atoll up` for the module, real gVisor sandboxes of tenant A and tenant B, the real ingress
router and egress gateway; test upstreams in a test host namespace (atoll.testing.testnet, the
servers of tests/integration/test_secrets_previews.py: HTTPS on :8443 for api.atoll.test with a
test CA the worker trusts, plain HTTP on :8080, each request recorded):

- preview tokens, signed URLs and preview cookies of A's sandbox open nothing of B's sandbox (and
  the reverse), by header and by host name; B's key neither reads nor changes A's preview settings
  (404, as for a sandbox that does not exist);
- A's secret is never put into B's traffic: B's sandbox sends A's placeholder (an adversary that
  learned it) to the secret's own host, over HTTPS and plain HTTP, also when B has a secret of the
  same name for that host, and the upstream receives the literal placeholder; B cannot bind A's
  secret by name (the answer of a secret that does not exist);
- a key revoked or expiring while a streaming exec and a terminal's WebSocket of a real sandbox are
  open cuts both within a bounded time (auth.Keys.STREAM_CHECK_S for an expiry).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import time

import httpx
import pytest
import websockets

from atoll.core import pki
from atoll.testing import LocalAtoll
from atoll.testing.testnet import TestHost
from tests.conftest import TEMPLATE_CACHE
from tests.integration.test_secrets_previews import UPSTREAM, get, last_seen, seen, serve_web

pytestmark = pytest.mark.integration

VALUE_A = "sk-tenant-a-" + "Ab3" * 8
VALUE_B = "sk-tenant-b-" + "Zx7" * 8
NET = {"allow_out": ["api.atoll.test"]}
NOBODY_SID = "sb-0000000000000000"


@pytest.fixture(scope="module")
def upstream():
    ca, ca_key = pki.new_root_ca("atoll security battery upstream CA")
    cert, key = pki.issue_server(ca, ca_key, ["api.atoll.test", "other.atoll.test"])
    th = TestHost(UPSTREAM, ["{a}", "{b}", "{dir}"])
    os.makedirs(th.dir, exist_ok=True)
    for name, data in (("up.crt", cert + ca), ("up.key", key), ("ca.crt", ca)):
        with open(th.path(name), "wb") as f:
            f.write(data)
    with th:
        th.hosts = th.hosts_file([f"{th.a} api.atoll.test", f"{th.b} other.atoll.test"])
        yield th


@pytest.fixture(scope="module")
def la(upstream, tmp_path_factory):
    atoll = LocalAtoll(
        home=tmp_path_factory.mktemp("atoll-tenants") / "home",
        env={
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_EXTRA_HOSTS": upstream.hosts,
            "ATOLL_UPSTREAM_CA_FILE": upstream.path("ca.crt"),
        },
    )
    atoll.start(timeout=600)
    try:
        yield atoll
    finally:
        atoll.stop(reap=True)


def _client(la, key: str) -> httpx.Client:
    return httpx.Client(base_url=la.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.fixture(scope="module")
def admin(la):
    with httpx.Client(base_url=la.url, headers=la.headers(), timeout=120) as c:
        yield c


def _tenant(admin, name: str) -> tuple[str, str]:
    r = admin.post("/v1/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = admin.post(f"/v1/tenants/{tid}/keys", json={})
    assert r.status_code == 201, r.text
    return tid, r.json()["key"]


@pytest.fixture(scope="module")
def tenants(la, admin):
    """(A's client, B's client): two tenants with a key each; every sandbox they made is deleted."""
    _, key_a = _tenant(admin, "sec-a")
    _, key_b = _tenant(admin, "sec-b")
    with _client(la, key_a) as a, _client(la, key_b) as b:
        yield a, b
        for c in (a, b):
            for sb in c.get("/v1/sandboxes").json()["items"]:
                c.delete(f"/v1/sandboxes/{sb['id']}")


def _make(c: httpx.Client, **body) -> str:
    r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, **body})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _sh(c: httpx.Client, sid: str, cmd: str) -> dict:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_s": 30})
    assert r.status_code == 200, r.text
    return r.json()


def _code(r: httpx.Response) -> tuple[int, str | None]:
    return r.status_code, r.json().get("error", {}).get("code")


# ---- previews ------------------------------------------------------------------------------------
def test_preview_tokens_of_one_tenant_open_nothing_of_another(la, tenants):
    a, b = tenants
    sa, sb = _make(a), _make(b)
    serve_web(a, sa)
    serve_web(b, sb)
    pa = a.get(f"/v1/sandboxes/{sa}/preview/8080").json()
    pb = b.get(f"/v1/sandboxes/{sb}/preview/8080").json()
    assert pa["public"] is False and pb["public"] is False
    route = {sa: {"Atoll-Sandbox-Id": sa, "Atoll-Sandbox-Port": "8080"}}
    route[sb] = {"Atoll-Sandbox-Id": sb, "Atoll-Sandbox-Port": "8080"}
    # each token opens its own sandbox (so a refusal below is the token's, not a broken route) ...
    for sid, pv in ((sa, pa), (sb, pb)):
        r = get(la, {**route[sid], "Atoll-Access-Token": pv["token"]}, "/own")
        assert r.status_code == 200 and r.text.startswith("hello /own"), r.text
    # ... and never the other tenant's: by header, and by host name with SNI
    for sid, theirs in ((sb, pa), (sa, pb)):
        r = get(la, {**route[sid], "Atoll-Access-Token": theirs["token"]}, "/x")
        assert r.status_code == 403 and "hello" not in r.text, r.text
        r = get(la, {"Atoll-Access-Token": theirs["token"]}, "/x", host=f"8080-{sid}.atoll.localhost")
        assert r.status_code == 403 and "hello" not in r.text, r.text
    # A's signed URL (signature and expiry of A's sandbox) on B's sandbox, and the cookie it sets
    signed = pa["signed_url"].split(str(la.ingress_port), 1)[1]
    r = get(la, route[sa], signed)
    assert r.status_code == 200 and "atoll_preview=" in r.headers.get("set-cookie", ""), r.text
    cookie = r.headers["set-cookie"].split(";")[0]
    r = get(la, route[sb], signed)
    assert r.status_code == 403 and "hello" not in r.text, r.text
    r = get(la, {**route[sb], "Cookie": cookie}, "/c")
    assert r.status_code in (401, 403) and "hello" not in r.text, r.text
    r = get(la, {"Cookie": cookie}, "/c", host=f"8080-{sb}.atoll.localhost")
    assert r.status_code in (401, 403) and "hello" not in r.text, r.text
    # B's key cannot read or change A's preview settings: the answers of a missing sandbox
    for method, body in (("GET", None), ("PUT", {"public": True})):
        theirs = b.request(method, f"/v1/sandboxes/{sa}/preview/8080", json=body)
        missing = b.request(method, f"/v1/sandboxes/{NOBODY_SID}/preview/8080", json=body)
        assert _code(theirs) == _code(missing) and theirs.status_code == 404, theirs.text
        assert pa["token"] not in theirs.text
    assert get(la, route[sa], "/still-private").status_code == 401  # the PUT changed nothing
    assert a.get(f"/v1/sandboxes/{sa}/preview/8080").json()["public"] is False


# ---- secrets -------------------------------------------------------------------------------------
def _secret(c: httpx.Client, name: str, value: str) -> None:
    body = {"name": name, "value": value, "hosts": ["api.atoll.test"], "allow_http": True}
    r = c.post("/v1/secrets", json=body)
    assert r.status_code == 201, r.text


def test_a_secret_of_one_tenant_is_never_put_into_anothers_traffic(tenants, upstream):
    a, b = tenants
    _secret(a, "tok", VALUE_A)
    _secret(a, "only-a", VALUE_A)
    _secret(b, "tok", VALUE_B)  # the same name in tenant B: B's own secret
    sa = _make(a, network=NET, secrets={"TOKEN": "tok"})
    sb = _make(b, network=NET, secrets={"TOKEN": "tok"})
    sb_bare = _make(b, network=NET)  # B's sandbox with no secret: nothing is intercepted
    ph_a = _sh(a, sa, "echo $TOKEN")["stdout"].strip()
    ph_b = _sh(b, sb, "echo $TOKEN")["stdout"].strip()
    assert ph_a.startswith("atoll_ph_") and ph_b.startswith("atoll_ph_") and ph_a != ph_b
    # A's own requests get A's value: substitution works here, so its absence below means something
    for scheme, port in (("https", 8443), ("http", 8080)):
        out = _sh(
            a,
            sa,
            f'curl -sS -o /dev/null -w %{{http_code}} -H "X-Key: $TOKEN" {scheme}://api.atoll.test:{port}/a-{scheme}',
        )
        assert out["stdout"] == "200", out
        assert last_seen(upstream, f"/a-{scheme}")["headers"]["x-key"] == VALUE_A
    # B's sandboxes send A's placeholder (learned somehow) next to their own, in a header and the query
    for sid, label in ((sb, "b"), (sb_bare, "bare")):
        for scheme, port in (("https", 8443), ("http", 8080)):
            path = f"/{label}-{scheme}?theirs={ph_a}"
            insecure = (
                "-k " if label == "bare" and scheme == "https" else ""
            )  # not intercepted: upstream's cert
            cmd = (
                f'curl -sS {insecure}-o /dev/null -w %{{http_code}} -H "X-Theirs: {ph_a}" -H "X-Own: $TOKEN" '
                f"'{scheme}://api.atoll.test:{port}{path}'"
            )
            out = _sh(b, sid, cmd)
            assert out["stdout"] == "200", (label, scheme, out)
            rec = last_seen(upstream, f"/{label}-{scheme}")
            assert rec["headers"]["x-theirs"] == ph_a, rec
            assert rec["path"] == path, rec
            if label == "b":
                assert rec["headers"]["x-own"] == VALUE_B, rec  # B's own secret is B's value
    from_b = [r for r in seen(upstream) if r["path"].startswith(("/b-", "/bare-"))]
    assert len(from_b) == 4 and VALUE_A not in json.dumps(from_b)
    # B cannot bind A's secret by name: the answer of a secret that does not exist
    theirs = b.post("/v1/sandboxes", json={"idle_timeout_s": 0, "secrets": {"T": "only-a"}})
    missing = b.post("/v1/sandboxes", json={"idle_timeout_s": 0, "secrets": {"T": "no-such-secret"}})
    assert theirs.status_code in (400, 404) and _code(theirs) == _code(missing), (theirs.text, missing.text)
    assert "only-a" in theirs.text  # the message names what was asked for, nothing of A's
    assert VALUE_A not in theirs.text
    assert b.get("/v1/secrets/only-a").status_code == 404


# ---- keys that stop being valid under an open stream ---------------------------------------------
STREAM = "i=0; while [ $i -lt 600 ]; do echo tick$i; i=$((i+1)); sleep 0.1; done"


async def _stream_until_cut(url: str, key: str, sid: str, started: asyncio.Event) -> float:
    """Run a streaming exec with `key`; the monotonic time its stream ended (cut)."""
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/x-ndjson"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
        try:
            async with c.stream(
                "POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": STREAM, "timeout_s": 60}
            ) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.strip():
                        started.set()
                        assert "exit_code" not in json.loads(line), line  # cut, not finished
        except (httpx.RemoteProtocolError, httpx.ReadError):
            pass
    return time.monotonic()


async def _terminal_until_cut(
    url: str, key: str, sid: str, started: asyncio.Event
) -> tuple[float, int | None]:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
        r = await c.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24})
        assert r.status_code == 201, r.text
        pty_id = r.json()["pty_id"]
    ws_url = url.replace("http://", "ws://") + f"/v1/sandboxes/{sid}/pty/{pty_id}/ws"
    async with websockets.connect(ws_url, additional_headers=headers, open_timeout=60) as ws:
        await ws.send(b"echo opened\n")
        try:
            while True:
                msg = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(msg, bytes) and b"opened" in msg:
                    started.set()
        except websockets.ConnectionClosed as closed:
            return time.monotonic(), closed.rcvd.code if closed.rcvd else None


def test_a_revoked_or_expired_key_cuts_its_open_exec_stream_and_terminal(la, admin):
    tid, _ = _tenant(admin, "sec-keys")
    # one key revoked while its streams run, one that expires under them
    k_rev = admin.post(f"/v1/tenants/{tid}/keys", json={}).json()
    expiry = 8.0
    soon = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=expiry)).isoformat()
    t_issue = time.monotonic()
    k_exp = admin.post(f"/v1/tenants/{tid}/keys", json={"expires_at": soon}).json()
    with _client(la, k_rev["key"]) as c:
        sid = _make(c)

    async def main():
        events = [asyncio.Event() for _ in range(4)]
        jobs = [
            asyncio.ensure_future(_stream_until_cut(la.url, k_rev["key"], sid, events[0])),
            asyncio.ensure_future(_terminal_until_cut(la.url, k_rev["key"], sid, events[1])),
            asyncio.ensure_future(_stream_until_cut(la.url, k_exp["key"], sid, events[2])),
            asyncio.ensure_future(_terminal_until_cut(la.url, k_exp["key"], sid, events[3])),
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
        assert time.monotonic() - t_issue < expiry - 1, "the streams took too long to open"
        assert not any(j.done() for j in jobs)
        t_revoke = time.monotonic()
        assert admin.delete(f"/v1/keys/{k_rev['id']}").status_code == 204
        rev_stream, (rev_term, rev_code) = await asyncio.wait_for(asyncio.gather(jobs[0], jobs[1]), 10)
        cut = (rev_stream - t_revoke, rev_term - t_revoke)
        print("cut after revocation", cut)
        # at once on this server (auth.Keys.revoke cuts them), not at the next watch period
        assert max(cut) < 1.0, cut
        assert rev_code == 1008
        assert not jobs[2].done() and not jobs[3].done()  # the other key's streams run on
        exp_stream, (exp_term, exp_code) = await asyncio.wait_for(asyncio.gather(jobs[2], jobs[3]), 30)
        bound = expiry + 2 * 2.0 + 1.5  # the expiry, two watch periods (auth.Keys.STREAM_CHECK_S), slack
        assert exp_stream - t_issue < bound and exp_term - t_issue < bound, (
            exp_stream - t_issue,
            exp_term - t_issue,
        )
        print("cut after expiry", exp_stream - t_issue - expiry, exp_term - t_issue - expiry)
        assert exp_stream - t_issue > expiry - 1.5  # cut by the expiry, not before it
        assert exp_code == 1008

    asyncio.run(main())
    # both keys are refused now; the sandbox itself is fine for whoever may use it
    for k in (k_rev, k_exp):
        with _client(la, k["key"]) as c:
            assert c.get("/v1/sandboxes").status_code == 401
    assert _sh(admin, sid, "echo fine")["stdout"] == "fine\n"
    assert admin.delete(f"/v1/sandboxes/{sid}").status_code == 204

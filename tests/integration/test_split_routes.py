"""Every REST route once through the split (`atoll server` + a separate `atoll worker`, the session's
`atoll_split` cluster from tests/conftest.py), with real answers checked.

Only tests marked `seam` run in both deployments (tests/conftest.py); this walk is what keeps every
other route honest through the split: each request is matched against the server's own
/openapi.json, and the walk fails if a route in the spec was not called, so a new route must be
added here. Failure modes of the split itself (kills, restarts, lost workers) are test_split.py's."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from websockets.sync.client import connect

from atoll.core import pki, wire, worker_api

pytestmark = pytest.mark.integration

METHODS = ("get", "post", "put", "delete", "patch")


def _routes(spec: dict) -> dict[tuple[str, str], re.Pattern]:
    out = {}
    for path, ops in spec["paths"].items():
        pattern = re.compile("^" + re.sub(r"\{[^/}]+\}", "[^/]+", path) + "$")
        for method in ops:
            if method in METHODS:
                out[(method.upper(), path)] = pattern
    return out


class _Walk:
    """An httpx client that notes which spec route each request it sends was for."""

    def __init__(self, cluster, spec: dict):
        self.routes = _routes(spec)
        self.seen: set[tuple[str, str]] = set()
        self.client = httpx.Client(
            base_url=cluster.url,
            headers=cluster.headers(),
            timeout=300,
            event_hooks={"request": [self._note]},
        )

    def _note(self, request: httpx.Request) -> None:
        hits = [k for k, p in self.routes.items() if k[0] == request.method and p.match(request.url.path)]
        # a literal segment wins over a parameter (/v1/workers/register over /v1/workers/{wid})
        hits.sort(key=lambda k: k[1].count("{"))
        if hits:
            self.seen.add(hits[0])

    def missing(self) -> set[tuple[str, str]]:
        return set(self.routes) - self.seen


def _ok(r: httpx.Response, status: int = 200) -> httpx.Response:
    assert r.status_code == status, (r.request.method, r.request.url.path, r.status_code, r.text[:500])
    return r


def _err(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.request.method, r.request.url.path, r.text[:500])
    assert r.json()["error"]["code"] == code, r.text
    assert "Traceback" not in r.text


def _exec(c: httpx.Client, sid: str, cmd, **kw) -> dict:
    return _ok(c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **kw})).json()


def test_every_route_through_the_split(atoll_split):
    spec = httpx.get(atoll_split.url + "/openapi.json", timeout=60).json()
    w = _Walk(atoll_split, spec)
    c = w.client
    created: list[str] = []
    try:
        # ---- system
        assert _ok(c.get("/healthz")).json()
        assert "atoll_sandboxes" in _ok(c.get("/metrics")).text
        assert "BEGIN CERTIFICATE" in _ok(c.get("/v1/ca.crt")).text
        leases = _ok(c.get("/v1/leases")).json()  # the one server holds the leader lease
        assert [(x["name"], x["holder"], x["this_server"]) for x in leases["items"]] == [
            ("leader", leases["server_id"], True)
        ], leases
        assert _ok(c.get("/v1/whoami")).json() == {"key_id": "admin", "scope": "admin", "tenant_id": None}

        # ---- sandboxes
        sb = _ok(c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"walk": "1"}}), 201).json()
        sid = sb["id"]
        created.append(sid)
        assert sb["state"] == "running" and sb["worker"] == "w0", sb
        assert sid in [
            s["id"] for s in _ok(c.get("/v1/sandboxes", params={"metadata.walk": "1"})).json()["items"]
        ]
        assert _ok(c.get(f"/v1/sandboxes/{sid}")).json()["id"] == sid
        with c.stream("GET", "/v1/sandboxes/watch") as watch:  # the snapshot, up to its `synced` line
            _ok(watch)
            lines = []
            for line in watch.iter_lines():
                lines.append(json.loads(line))
                if lines[-1]["type"] == "synced":
                    break
        assert sid in [x["sandbox"]["id"] for x in lines[:-1]], lines
        patched = _ok(c.patch(f"/v1/sandboxes/{sid}", json={"metadata": {"walk": "2"}})).json()
        assert patched["metadata"] == {"walk": "2"}
        m = _ok(c.get(f"/v1/sandboxes/{sid}/metrics")).json()
        assert m["sandbox_id"] == sid and m["memory_limit_mb"] == sb["memory_mb"], m
        net = _ok(c.put(f"/v1/sandboxes/{sid}/network", json={"allow_out": ["pypi.org:443"]})).json()
        assert net["allow_out"] == ["pypi.org:443"], net
        pv = _ok(c.get(f"/v1/sandboxes/{sid}/preview/8080")).json()
        assert pv["sandbox_id"] == sid and pv["port"] == 8080 and pv["token"], pv
        assert _ok(c.put(f"/v1/sandboxes/{sid}/preview/8080", json={"public": True})).json()["public"] is True

        # ---- the data path apart (atoll edge): a grant for this sandbox's worker
        g = _ok(c.post(f"/v1/sandboxes/{sid}/grant")).json()
        assert g["sandbox_id"] == sid and g["grant"].startswith(sid + ".") and g["worker"]["url"], g

        # ---- exec and process handles
        assert _exec(c, sid, "echo walk")["stdout"] == "walk\n"
        pid = _exec(
            c,
            sid,
            ["python3", "-u", "-c", "import sys; print(sys.stdin.readline().strip().upper())"],
            background=True,
        )["pid"]
        assert pid in [p["pid"] for p in _ok(c.get(f"/v1/sandboxes/{sid}/processes")).json()["items"]]
        assert _ok(c.get(f"/v1/sandboxes/{sid}/processes/{pid}")).json()["running"] is True
        assert (
            _ok(c.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", content=b"hi\n")).json()["written"] == 3
        )
        assert (
            _ok(c.post(f"/v1/sandboxes/{sid}/processes/{pid}/wait", json={"timeout_s": 30})).json()[
                "exit_code"
            ]
            == 0
        )
        out = [
            json.loads(x)
            for x in _ok(c.get(f"/v1/sandboxes/{sid}/processes/{pid}/output")).text.splitlines()
            if x
        ]
        assert "".join(x.get("stdout", "") for x in out) == "HI\n", out
        sleeper = _exec(c, sid, "sleep 600", background=True)["pid"]
        _ok(c.post(f"/v1/sandboxes/{sid}/processes/{sleeper}/signal", json={"signal": "TERM"}))
        assert (
            _ok(c.post(f"/v1/sandboxes/{sid}/processes/{sleeper}/wait", json={"timeout_s": 30})).json()[
                "exit_code"
            ]
            == 143
        )
        _ok(c.delete(f"/v1/sandboxes/{sid}/processes/{sleeper}"), 204)

        # ---- files
        f = f"/v1/sandboxes/{sid}/files"
        _ok(c.put(f, params={"path": "/walk/a.txt"}, content=b"abc"), 204)
        assert _ok(c.get(f, params={"path": "/walk/a.txt"})).content == b"abc"
        assert [i["name"] for i in _ok(c.get(f + "/list", params={"path": "/walk"})).json()["items"]] == [
            "a.txt"
        ]
        assert _ok(c.get(f + "/stat", params={"path": "/walk/a.txt"})).json()["size"] == 3
        assert _ok(c.post(f + "/mkdir", params={"path": "/walk/d"})).json() == {
            "path": "/walk/d",
            "created": True,
        }
        assert (
            _ok(c.post(f + "/move", json={"from": "/walk/a.txt", "to": "/walk/d/b.txt"})).json()["path"]
            == "/walk/d/b.txt"
        )
        assert (
            _ok(c.post(f + "/chmod", json={"path": "/walk/d/b.txt", "mode": "600"})).json()["mode"] == 0o600
        )
        with c.stream("GET", f + "/watch", params={"path": "/walk"}) as r:
            assert r.status_code == 200
            assert json.loads(next(r.iter_lines()))["type"] == "ready"
        tar = _ok(c.get(f + "/tar", params={"path": "/walk"})).content
        assert _ok(c.put(f + "/tar", params={"path": "/walk2"}, content=tar)).json()["files"] == 1
        assert _exec(c, sid, "cat /walk2/d/b.txt")["stdout"] == "abc"
        _ok(c.delete(f, params={"path": "/walk/d/b.txt"}), 204)
        _err(c.get(f, params={"path": "/walk/d/b.txt"}), 404, "file_not_found")

        # ---- terminals (their WebSocket, too: not a REST route, walked here all the same)
        pty_id = _ok(
            c.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24, "cmd": ["cat"]}), 201
        ).json()["pty_id"]
        assert pty_id in [p["pty_id"] for p in _ok(c.get(f"/v1/sandboxes/{sid}/pty")).json()["items"]]
        url = atoll_split.url.replace("http://", "ws://") + f"/v1/sandboxes/{sid}/pty/{pty_id}/ws"
        with connect(url, additional_headers=atoll_split.headers(), open_timeout=60) as ws:
            ws.send(b"typed\r")
            seen = b""
            deadline = time.monotonic() + 30
            while b"typed\r\ntyped\r\n" not in seen:
                msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
                seen += msg if isinstance(msg, bytes) else b""
        _ok(c.delete(f"/v1/sandboxes/{sid}/pty/{pty_id}"), 204)

        # ---- standby and fork
        assert (
            _ok(c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})).json()["standby_tier"]
            == "memory"
        )
        assert _ok(c.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"
        copies = [
            s["id"] for s in _ok(c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1}), 201).json()["items"]
        ]
        created += copies
        assert _exec(c, copies[0], "cat /walk2/d/b.txt")["stdout"] == "abc"

        # ---- named snapshots: kept on the worker, a create from one placed there
        snap = _ok(c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "walk"}), 201).json()
        assert [x["id"] for x in _ok(c.get("/v1/snapshots", params={"name": "walk"})).json()["items"]] == [
            snap["id"]
        ]
        assert _ok(c.get(f"/v1/snapshots/{snap['id']}")).json()["sandbox_id"] == sid
        from_snap = _ok(c.post("/v1/sandboxes", json={"snapshot": "walk", "idle_timeout_s": 0}), 201).json()
        created.append(from_snap["id"])
        assert _exec(c, from_snap["id"], "cat /walk2/d/b.txt")["stdout"] == "abc"
        _ok(c.delete(f"/v1/snapshots/{snap['id']}"), 204)
        _err(c.get(f"/v1/snapshots/{snap['id']}"), 404, "snapshot_not_found")

        # ---- secrets
        _ok(c.post("/v1/secrets", json={"name": "walk", "value": "v1", "hosts": ["x.test"]}), 201)
        assert "walk" in [s["name"] for s in _ok(c.get("/v1/secrets")).json()["items"]]
        assert _ok(c.get("/v1/secrets/walk")).json()["hosts"] == ["x.test"]
        assert _ok(c.put("/v1/secrets/walk", json={"value": "v2", "hosts": ["y.test"]})).json()["hosts"] == [
            "y.test"
        ]
        _ok(c.delete("/v1/secrets/walk"), 204)
        _err(c.get("/v1/secrets/walk"), 404, "secret_not_found")

        # ---- volumes and drives: records here, bytes on the worker
        _ok(c.post("/v1/volumes", json={"name": "walkv", "size_mb": 16}), 201)
        _ok(c.post("/v1/drives", json={"name": "walkd", "size_mb": 16}), 201)
        assert "walkv" in [v["name"] for v in _ok(c.get("/v1/volumes")).json()["items"]]
        assert "walkd" in [v["name"] for v in _ok(c.get("/v1/drives")).json()["items"]]
        assert _ok(c.get("/v1/volumes/walkv")).json()["attached_to"] is None
        assert _ok(c.get("/v1/drives/walkd")).json()["attached_to"] == []
        f = {"path": "/in/a.txt"}
        assert _ok(c.put("/v1/drives/walkd/files", params=f, content=b"drive")).json()["size"] == 5
        assert _ok(c.get("/v1/drives/walkd/files", params=f)).content == b"drive"
        assert [
            e["name"]
            for e in _ok(c.get("/v1/drives/walkd/files/list", params={"path": "/in"})).json()["items"]
        ] == ["a.txt"]
        tar = _ok(c.get("/v1/drives/walkd/tar")).content
        assert _ok(c.put("/v1/volumes/walkv/tar", content=tar)).json()["files"] == 1
        assert len(_ok(c.get("/v1/volumes/walkv/tar")).content) >= 1024
        _ok(c.post("/v1/volumes/walkv/clone", json={"name": "walkv2"}), 201)
        _err(c.post("/v1/drives/walkd/clone", json={"name": "walkd"}), 409, "drive_exists")
        _ok(c.put("/v1/drives/walkd/tar", content=tar))
        made = _ok(
            c.post("/v1/drives/walkd/files/mkdir", params={"path": "/in/d/e"}, json={"parents": True}), 201
        )
        assert made.json()["type"] == "dir"
        got = _ok(
            c.patch("/v1/drives/walkd/files", params={"path": "/in/d"}, json={"mode": 0o700, "uid": 1000})
        )
        assert (got.json()["mode"], got.json()["uid"]) == (0o700, 1000)
        st = _ok(c.get("/v1/drives/walkd/files/stat", params=f)).json()
        assert (st["type"], st["size"]) == ("file", 5) and st["ctime"] > 0
        deep = _ok(c.get("/v1/drives/walkd/files/list", params={"path": "/in", "depth": 3})).json()["items"]
        assert [e["path"] for e in deep] == ["/in/a.txt", "/in/d", "/in/d/e"]
        tok = _ok(c.post("/v1/drives/walkd/token")).json()["token"]
        r = c.get("/v1/drives/walkd/files", params=f, headers={"Authorization": f"E2B-Volume {tok}"})
        assert (r.status_code, r.content) == (200, b"drive")
        _ok(c.delete("/v1/drives/walkd/files", params=f), 204)
        for kind, name in (("volumes", "walkv"), ("volumes", "walkv2"), ("drives", "walkd")):
            _ok(c.delete(f"/v1/{kind}/{name}"), 204)
        _err(c.get("/v1/volumes/walkv"), 404, "volume_not_found")

        # ---- templates: a build on the worker, its log, the pool's settings, the deletion
        bid = _ok(c.post("/v1/templates", json={"name": "walk", "files": {"/w.txt": "w\n"}}), 202).json()[
            "build_id"
        ]
        with c.stream("GET", f"/v1/templates/walk/builds/{bid}/logs") as r:
            assert r.status_code == 200 and "DONE" in "".join(r.iter_text())
        deadline = time.monotonic() + 60
        while (t := _ok(c.get("/v1/templates/walk")).json())["status"] == "building":
            assert time.monotonic() < deadline, t
            time.sleep(0.2)
        assert t["status"] == "ready", t
        assert "walk" in [x["name"] for x in _ok(c.get("/v1/templates")).json()["items"]]
        assert _ok(c.put("/v1/templates/walk/pool", json={"min": 0, "max": 1})).json()["max"] == 1
        assert _ok(c.get("/v1/templates/walk/pool")).json()["max"] == 1
        _ok(c.delete("/v1/templates/walk"), 204)

        # ---- workers: the admin's routes, and the protocol's (which `atoll worker` itself calls
        # all along: registered and heartbeating is what `ready` means)
        [wk] = _ok(c.get("/v1/workers")).json()["items"]
        assert wk["name"] == "w0" and wk["state"] == "ready", wk
        assert _ok(c.get(f"/v1/workers/{wk['id']}")).json()["id"] == wk["id"]
        assert (
            _ok(
                c.post(f"/v1/workers/{wk['id']}/drain", json={"draining": True, "evacuate": False}), 202
            ).json()["state"]
            == "draining"
        )
        assert (
            _ok(c.post(f"/v1/workers/{wk['id']}/drain", json={"draining": False})).json()["state"] == "ready"
        )
        assert "worker" in _ok(c.post(f"/v1/workers/{wk['id']}/reconcile")).json()
        _err(c.delete(f"/v1/workers/{wk['id']}"), 409, "invalid_state")  # only a lost worker goes
        proto = {wire.PROTOCOL_HEADER: str(worker_api.PROTOCOL_VERSION)}
        other_home = wk["installation"][::-1]  # an installation id, not the worker's
        assert other_home != wk["installation"]
        info = {
            "name": "w0",
            "version": "0",
            "protocol": worker_api.PROTOCOL_VERSION,
            "installation": other_home,
            "capacity": {"memory_mb": 1, "cpus": 1, "disk_mb": 1},
        }
        # the name is held by the real worker's home: refused, and nothing is recorded
        _err(
            c.post("/v1/workers/register", json={"url": "http://127.0.0.1:1", "info": info}, headers=proto),
            409,
            "worker_conflict",
        )
        # a worker serving https gets its certificate first: the CSR is checked, the name goes in
        _, csr = pki.new_worker_request("w-tls")
        cert = _ok(
            c.post(
                "/v1/workers/certificate",
                json={"name": "w-tls", "url": "https://127.0.0.1:1", "csr": csr.decode()},
                headers=proto,
            )
        ).json()["certificate"]
        assert pki.worker_names(x509.load_pem_x509_certificate(cert.encode()).public_bytes(Encoding.DER)) == [
            "w-tls"
        ]
        _err(
            c.post(
                "/v1/workers/certificate",
                json={"name": "w-tls", "url": "https://127.0.0.1:1", "csr": "junk"},
                headers=proto,
            ),
            400,
            "invalid_request",
        )
        _err(
            c.post(f"/v1/workers/{wk['id']}/heartbeat", json={"epoch": "stale"}, headers=proto),
            409,
            "worker_not_registered",
        )
        _err(
            c.post(f"/v1/workers/{wk['id']}/stopping", json={"epoch": "stale"}, headers=proto),
            409,
            "worker_not_registered",
        )
        assert _ok(c.get(f"/v1/workers/{wk['id']}")).json()["state"] == "ready"

        # ---- usage: the sandbox's time running, metered by the server from the worker's records
        usage = _ok(c.get("/v1/usage", params={"group_by": "sandbox"})).json()
        assert any(i["sandbox_id"] == sid and i["memory_gb_seconds"] > 0 for i in usage["items"]), usage

        # ---- tenants, keys, the audit trail (admin routes)
        t = _ok(c.post("/v1/tenants", json={"name": "walk-t", "quotas": {"max_running": 1}}), 201).json()
        assert _ok(c.get(f"/v1/tenants/{t['id']}")).json()["name"] == "walk-t"
        assert "walk-t" in [x["name"] for x in _ok(c.get("/v1/tenants")).json()["items"]]
        assert _ok(c.patch(f"/v1/tenants/{t['id']}", json={"quotas": {"max_running": 2}})).json()[
            "quotas"
        ] == {"max_running": 2}
        tk = _ok(c.post(f"/v1/tenants/{t['id']}/keys", json={}), 201).json()
        ak = _ok(c.post("/v1/keys", json={"scope": "worker"}), 201).json()
        assert {tk["id"], ak["id"]} <= {k["id"] for k in _ok(c.get("/v1/keys")).json()["items"]}
        for k in (tk, ak):
            _ok(c.delete(f"/v1/keys/{k['id']}"), 204)
        _ok(c.delete(f"/v1/tenants/{t['id']}"), 204)
        assert any(e["action"].startswith("tenant") for e in _ok(c.get("/v1/audit")).json()["items"])

        # ---- the end of a sandbox
        for s in list(created):
            _ok(c.delete(f"/v1/sandboxes/{s}"), 204)
            created.remove(s)
        _err(c.get(f"/v1/sandboxes/{sid}"), 404, "sandbox_not_found")
    finally:
        for s in created:
            c.delete(f"/v1/sandboxes/{s}")
        c.close()
    assert not w.missing(), (
        f"routes in /openapi.json this walk did not call through the split: {sorted(w.missing())}"
    )

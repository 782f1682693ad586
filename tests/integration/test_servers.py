"""Two `atoll server`s on one PostgreSQL database and a real worker started with `--server A,B`
(issue 21: several servers, a server SIGKILLed mid-operation): the worker joins A; a sandbox is
made through A with a file and a process in it; A is killed while it makes a second sandbox (with
an `Idempotency-Key`: after the placement is recorded, before its 201); the worker moves to B
within a few heartbeats, B takes the leader lease at once (A's process is gone on this machine),
the first sandbox — its file, its process — is served through B, and the create retried on B with
the same key answers exactly one sandbox for it, usable, with no runtime on the worker that no
record owns. Before A is killed, B already serves the
sandbox A made (it calls the worker A holds, with the token A stored sealed) and its own creates
land on that worker."""

from __future__ import annotations

import os
import threading
import time

import httpx
import psycopg
import pytest

from atoll.testing import LocalCluster, LocalServer, LocalWorker, purge
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration


def _ready_on(server: LocalServer, name: str) -> bool:
    try:
        r = httpx.get(server.url + "/v1/workers", headers=server.headers(), timeout=5)
        return any(w["name"] == name and w["state"] == "ready" for w in r.json().get("items", []))
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def _answer(url: str, headers: dict, body: dict) -> httpx.Response | Exception:
    try:
        return httpx.post(url, headers=headers, json=body, timeout=120)
    except httpx.HTTPError as e:
        return e


def _creating(db: psycopg.Connection) -> str | None:
    """The id of a sandbox recorded as `creating`, if any."""
    row = db.execute("SELECT id FROM sandboxes WHERE state = 'creating'").fetchone()
    db.commit()
    return row[0] if row else None


def test_a_killed_server_hands_its_worker_and_sandboxes_to_the_other(tmp_path, postgres):
    if os.geteuid() != 0:
        pytest.skip("atoll worker needs root (run `make test`)")
    url = postgres.create_database("two_servers")
    key_file = tmp_path / "secrets.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    env = {
        "ATOLL_DATABASE_URL": url,
        "ATOLL_SECRETS_KEY_FILE": str(key_file),
        "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
        "ATOLL_HEARTBEAT_S": "1",
    }
    a = LocalServer(tmp_path / "a", env=env)
    b = LocalServer(tmp_path / "b", api_key=a.api_key, env=env)
    worker = None
    sid = None
    try:
        a.start()
        b.start()
        worker = LocalWorker(tmp_path / "w0", f"{a.url},{b.url}", a.api_key, "w0", env=env).start()
        a.wait_healthy(900, lambda: None if worker.exited() is None else f"worker exited: {worker.tail()}")
        deadline = time.monotonic() + 120
        while not _ready_on(a, "w0"):
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(0.2)
        with httpx.Client(base_url=a.url, headers=a.headers(), timeout=300) as ca:
            r = ca.post("/v1/sandboxes", json={"idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            r = ca.post(
                f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo kept > /root/f; sleep 1000 & echo $!"}
            )
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            pid = r.json()["stdout"].strip()
        with httpx.Client(base_url=b.url, headers=b.headers(), timeout=300) as cb:
            # B calls the worker A holds with the token A stored (sealed): the same sandbox is
            # served through either server, and a create through B lands on that worker
            t0 = time.monotonic()
            while True:
                r = cb.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /root/f"})
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
                assert time.monotonic() - t0 < 30, f"B never called the worker A holds: {r.text}"
                time.sleep(0.2)
            assert r.json()["stdout"] == "kept\n", r.text
            assert _ready_on(b, "w0")
            r = cb.post("/v1/sandboxes", json={"idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            other = r.json()["id"]
            with httpx.Client(base_url=a.url, headers=a.headers(), timeout=300) as ca:
                r = ca.post(f"/v1/sandboxes/{other}/exec", json={"cmd": "echo via-a"})
                assert r.status_code == 200 and r.json()["stdout"] == "via-a\n", r.text
            assert cb.delete(f"/v1/sandboxes/{other}").status_code in (200, 204)
        # a create with a key sent to A; A is killed once its record is in the database (placed,
        # the worker asked) and before it answers
        key = {"Idempotency-Key": "made-once"}
        lost: list[object] = []
        first = threading.Thread(
            target=lambda: lost.append(
                _answer(a.url + "/v1/sandboxes", {**a.headers(), **key}, {"idle_timeout_s": 0})
            )
        )
        first.start()
        with psycopg.connect(url) as db:
            deadline = time.monotonic() + 60
            while not (placed := _creating(db)):
                assert first.is_alive() and time.monotonic() < deadline, lost
                time.sleep(0.005)
        a.kill()  # SIGKILL: no stop, no release of its lease, no goodbye to the worker
        first.join(60)
        assert not isinstance(lost[0], httpx.Response), lost  # never answered
        t0 = time.monotonic()
        with httpx.Client(base_url=b.url, headers=b.headers(), timeout=300) as cb:
            while True:
                r = cb.post(
                    f"/v1/sandboxes/{sid}/exec", json={"cmd": f"cat /root/f; kill -0 {pid} && echo alive"}
                )
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
                assert time.monotonic() - t0 < 60, f"the worker did not move to B: {worker.tail()}"
                time.sleep(0.2)
            assert r.json()["stdout"] == "kept\nalive\n", r.text
            moved_s = time.monotonic() - t0
            assert _ready_on(b, "w0")
            while True:  # B runs the background loops now
                leases = cb.get("/v1/leases").json()
                holder = [x for x in leases["items"] if x["name"] == "leader"]
                if holder and holder[0]["this_server"]:
                    break
                assert time.monotonic() - t0 < 30, leases
                time.sleep(0.5)
            print(f"moved to B and served in {moved_s:.1f} s")
            # the create retried on B with its key: the one A placed (or, had the worker not made
            # it yet, one made now), never two
            while (r := cb.post("/v1/sandboxes", json={"idle_timeout_s": 0}, headers=key)).status_code == 503:
                assert time.monotonic() - t0 < 120, r.text
                time.sleep(0.5)
            assert r.status_code == 201 and r.json()["state"] == "running", r.text
            made = r.json()["id"]
            print(f"retried create on B: {'the one A placed' if made == placed else 'made anew'}")
            r = cb.post(f"/v1/sandboxes/{made}/exec", json={"cmd": "echo usable"})
            assert r.status_code == 200 and r.json()["stdout"] == "usable\n", r.text
            again = cb.post("/v1/sandboxes", json={"idle_timeout_s": 0}, headers=key)
            assert again.json()["id"] == made and again.headers.get("Idempotent-Replayed") == "true"
            live = {x["id"] for x in cb.get("/v1/sandboxes").json()["items"]}
            assert live == {sid, made}, live
            (w,) = cb.get("/v1/workers").json()["items"]
            assert w["sandboxes"] == 2, w
            deadline = time.monotonic() + 60  # a runtime no record owns is deleted by reconciliation
            while (held := set(os.listdir(os.path.join(worker.home, "sandboxes")))) != live:
                assert time.monotonic() < deadline, (held, live)
                time.sleep(0.5)
            assert cb.delete(f"/v1/sandboxes/{made}").status_code in (200, 204)
            assert cb.delete(f"/v1/sandboxes/{sid}").status_code in (200, 204)
            sid = None
    finally:
        for p in (a, b):
            p.terminate()
        if worker is not None:
            worker.terminate()
            if sid is not None:
                purge(worker.home)
            LocalCluster.wait_no_sandboxes(worker.home)

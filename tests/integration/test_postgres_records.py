"""`atoll up` with its records in PostgreSQL (ATOLL_DATABASE_URL=postgresql://…): it migrates an
empty database, runs a real sandbox, pauses it to disk and resumes it, and after a restart finds
it again — from PostgreSQL, with no SQLite file in its home."""

from __future__ import annotations

import os

import httpx
import psycopg
import pytest

from atoll.testing import LocalAtoll, purge
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration


def _exec(c: httpx.Client, sid: str, cmd: str) -> dict:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    return r.json()


def _row(url: str, sid: str) -> tuple:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT state, standby_tier FROM sandboxes WHERE id = %s", (sid,)).fetchone()


def test_atoll_up_keeps_its_records_in_postgresql(tmp_path, postgres):
    if os.geteuid() != 0:
        pytest.skip("atoll up needs root (run `make test`)")
    url = postgres.create_database("atoll_up_records")  # empty: `atoll up` runs the migrations
    home = tmp_path / "home"
    la = LocalAtoll(home=home, env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE, "ATOLL_DATABASE_URL": url})
    started = False
    try:
        la.start(timeout=600)
        started = True
        with httpx.Client(base_url=la.url, headers=la.headers(), timeout=300) as c:
            r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"db": "postgresql"}})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            _exec(c, sid, "echo kept > /root/f")
            assert _row(url, sid) == ("running", None)
            r = c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
            assert r.status_code == 200 and r.json()["standby_tier"] == "disk", r.text
            assert _row(url, sid) == ("standby", "disk")
            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
            assert _exec(c, sid, "cat /root/f")["stdout"] == "kept\n"
            assert c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}).status_code == 200
        la.stop(reap=False)
        assert not (home / "atoll.db").exists(), "the records must not go to SQLite"
        la.start(timeout=600)
        with httpx.Client(base_url=la.url, headers=la.headers(), timeout=300) as c:
            got = c.get(f"/v1/sandboxes/{sid}").json()
            assert (got["state"], got["standby_tier"], got["metadata"]) == (
                "standby",
                "disk",
                {"db": "postgresql"},
            )
            assert _exec(c, sid, "cat /root/f")["stdout"] == "kept\n"  # resumed from the disk tier
            assert _row(url, sid) == ("running", None)
    finally:
        if started and la.proc is None:  # reap with a server running
            la.start(timeout=600)
        if la.proc is not None:
            la.stop(reap=True)
        purge(home)  # whatever the API could not delete
        postgres.drop_database("atoll_up_records")

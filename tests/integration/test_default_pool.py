"""The default pool of the built-in `base` template on a real `atoll up` (ATOLL_DEFAULT_POOL=2,
what a fresh installation keeps): it fills with real frozen sandboxes restored from base's
snapshot, a create that names no template claims one, and a create one cannot serve (another
memory size) restores instead. The other fixtures run with ATOLL_DEFAULT_POOL=0 (atoll.testing)."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from atoll.testing import LocalAtoll
from tests.integration.conftest import TEMPLATE_CACHE, client, exec_ok


@pytest.fixture
def pooled(tmp_path):
    la = LocalAtoll(
        home=tmp_path / "home", env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE, "ATOLL_DEFAULT_POOL": "2"}
    )
    la.start(timeout=600)
    yield la
    la.stop(reap=True)  # purges the pool's sandboxes too (they are not listed)


def _wait_pool(c: httpx.Client, pred, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pool = c.get("/v1/templates/base/pool").json()
        if pred(pool):
            return pool
        assert time.monotonic() < deadline, f"the base pool did not get there in {timeout}s: {pool}"
        time.sleep(0.3)


def _on_host(la: LocalAtoll) -> set[str]:
    d = os.path.join(la.home, "sandboxes")
    return set(os.listdir(d)) if os.path.isdir(d) else set()


def _started_how(la: LocalAtoll, sid: str) -> str:
    for line in open(la.log_path):
        if sid in line and "sandbox runtime started" in line:
            return "template image" if "by template image" in line else "cold boot"
    return "unknown"


def _mem_total_mib(c: httpx.Client, sid: str) -> int:
    return int(exec_ok(c, sid, "grep MemTotal /proc/meminfo")["stdout"].split()[1]) // 1024


def test_the_default_pool_fills_and_serves_default_creates(pooled):
    with client(pooled) as c:
        pool = _wait_pool(c, lambda p: p["ready"] == 2)
        assert (pool["min"], pool["max"], pool["memory_mb"], pool["claimed"]) == (2, 2, 512, 0), pool
        assert c.get("/v1/sandboxes").json()["items"] == []  # not listed until claimed
        members = _on_host(pooled)
        assert len(members) == 2, members  # real sandboxes on the host
        for sid in members:  # restored from base's snapshot, like any create
            assert _started_how(pooled, sid) == "template image", sid
        worker = c.get("/v1/workers").json()["items"][0]
        assert worker["allocated"]["memory_mb"] >= 2 * 512, worker  # frozen in RAM: counted

        r = c.post("/v1/sandboxes", json={"env": {"WHO": "me"}, "idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["id"] in members and sb["template"] == "base", (sb, members)
        assert c.get("/v1/templates/base/pool").json()["claimed"] == 1
        assert exec_ok(c, sb["id"], "echo $WHO; hostname")["stdout"] == f"me\n{sb['id']}\n"

        r = c.post("/v1/sandboxes", json={"memory_mb": 320, "idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        other = r.json()["id"]
        assert other not in members
        assert c.get("/v1/templates/base/pool").json()["claimed"] == 1
        # it has its own memory size (the sentry keeps the size it booted with, so a pool member
        # of 512 MB would show 512 + the sentry's overhead)
        assert _mem_total_mib(c, sb["id"]) - _mem_total_mib(c, other) == 512 - 320

        _wait_pool(c, lambda p: p["ready"] == 2)  # refilled after the claim
        assert {s["id"] for s in c.get("/v1/sandboxes").json()["items"]} == {sb["id"], other}

"""A worker SIGKILLed, on real gVisor: `atoll server` + workers w0 and w1 sharing an S3 store
(SeaweedFS on loopback), ATOLL_WORKER_GONE_S=4. On w0: a sandbox with `on_worker_lost: "restore"`,
archived once and resumed (its archive kept in the store) and written to after, and a plain running
one. w0 is SIGKILLed (its PID only; its sandboxes' runsc processes live on, as on a machine cut
off): both show `worker_state: "lost"`, then the plain one fails with the reason and the other runs
on w1 as of its archive. w0 then comes back (same home): its stale copies are deleted, the archive
w1 adopted stays in the store, nothing runs again on w0. One installation for the module."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import httpx
import pytest

from atoll.testing import LocalCluster
from atoll.testing.seaweed import SeaweedFS
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration


def _exec(c: httpx.Client, sid: str, cmd: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return r.json()["stdout"]


def _until(c: httpx.Client, sid: str, test, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sb = c.get(f"/v1/sandboxes/{sid}").json()
        if test(sb):
            return sb
        time.sleep(0.2)
    raise AssertionError(f"sandbox {sid} never got there: {sb}")


def _archive_objects(sw: SeaweedFS, sid: str) -> list[str]:
    """The names under the sandbox's archive prefix in the bucket (through the filer)."""
    req = urllib.request.Request(
        f"{sw.filer_url}/buckets/{sw.bucket}/sandboxes/{sid}/", headers={"Accept": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        entries = json.load(r).get("Entries") or []
    return sorted(os.path.basename(e["FullPath"]) for e in entries)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    with SeaweedFS(str(tmp_path_factory.mktemp("lost-seaweed"))) as sw:
        yield sw


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed):
    root = tmp_path_factory.mktemp("lost")
    env = {
        "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
        **seaweed.env(),
        "ATOLL_WORKER_LOST_S": "3",
        "ATOLL_WORKER_GONE_S": "4",
        "ATOLL_HEARTBEAT_S": "1",
    }
    cl = LocalCluster(root / "cluster", workers=2, env=env)
    cl.start(timeout=900)
    try:
        yield cl
    finally:
        if cl.workers[0].proc is None:  # killed by the test and not back: its sandboxes still run
            cl.workers[0].start()
            cl.workers[0].wait_state("ready", 120)
        cl.stop(reap=True)


def test_a_killed_workers_sandboxes_fail_or_come_back_from_their_archive(cluster, seaweed):
    c = httpx.Client(base_url=cluster.url, headers=cluster.headers(), timeout=300)
    ids = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}
    # both made on w0: w1 cordoned meanwhile
    assert (
        c.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": True, "evacuate": False}).status_code
        == 202
    )
    made = {}
    for name, policy in (("restored", "restore"), ("plain", "fail")):
        r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "on_worker_lost": policy})
        assert r.status_code == 201 and r.json()["worker"] == "w0", r.text
        made[name] = r.json()["id"]
    assert c.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": False}).status_code == 200
    sid = made["restored"]
    c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"}, content=b"archived")
    r = c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "archive", r.text
    assert _exec(c, sid, "cat /root/notes") == "archived"  # resumed on w0: the archive is kept
    assert any(n.endswith(".tar.zst") for n in _archive_objects(seaweed, sid)), _archive_objects(seaweed, sid)
    c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"}, content=b"after the archive")
    assert _exec(c, made["plain"], "echo hi") == "hi\n"

    t0 = time.monotonic()
    cluster.workers[0].kill()  # SIGKILL, this worker's process group only
    sb = _until(c, made["plain"], lambda s: s["worker_state"] == "lost", 30)
    assert sb["state"] == "running", sb  # lost, not gone yet: shown, not changed
    r = c.post(f"/v1/sandboxes/{made['plain']}/exec", json={"cmd": "true"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text

    sb = _until(c, made["plain"], lambda s: s["state"] == "failed", 60)
    assert "worker gone" in sb["failure_reason"] and "'w0'" in sb["failure_reason"], sb
    sb = _until(c, sid, lambda s: s["worker"] == "w1" and s["state"] == "running", 180)
    print(f"killed -> restored on w1 and running: {time.monotonic() - t0:.1f} s")
    assert _exec(c, sid, "cat /root/notes") == "archived"  # as of its archive: the later write is lost

    # w0 comes back: its copies of both are deleted, the archive w1 holds stays
    w0 = cluster.workers[0]
    w0.start()
    w0.wait_state("ready", 120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = set(os.listdir(os.path.join(w0.home, "sandboxes"))) & set(made.values())
        if not left:
            break
        time.sleep(0.5)
    assert not left, f"w0 kept {left}"
    assert any(n.endswith(".tar.zst") for n in _archive_objects(seaweed, sid)), _archive_objects(seaweed, sid)
    assert c.get(f"/v1/sandboxes/{made['plain']}").json()["state"] == "failed"
    sb = c.get(f"/v1/sandboxes/{sid}").json()
    assert (sb["state"], sb["worker"]) == ("running", "w1"), sb
    assert _exec(c, sid, "cat /root/notes") == "archived"
    for s in made.values():
        assert c.delete(f"/v1/sandboxes/{s}").status_code == 204

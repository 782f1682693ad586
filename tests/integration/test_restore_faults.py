"""A worker SIGKILLed while it restores a sandbox (issue 21, faults), on real gVisor: `atoll server`
+ workers w0 and w1 sharing an S3 store (SeaweedFS on loopback). The kill lands while the worker's
`runsc restore` of that sandbox runs (watched for in /proc, not guessed with a sleep). The caller
of the call that resumed it gets 503 worker_unavailable (never a 500), the record never says
`running` on the dead worker (it stays in standby, `worker_state: "lost"`), and:

- disk tier: the worker comes back (same home) and the sandbox is served again, its file intact
  (the worker finishes or undoes the restore it was killed in, worker.runtimes.recovery);
- archive tier, restored on a worker it was moved to: the archive is still in the store, and once
  that worker is removed (`DELETE /v1/workers/{id}`) the other worker adopts it and serves it, its
  file intact; the dead worker, back, drops its stale copy. One installation for the module."""

from __future__ import annotations

import json
import os
import threading
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


def _restoring(sid: str) -> bool:
    """A `runsc … restore …` of this sandbox's container runs on this host."""
    needle = sid[3:].encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"runsc" in argv[0] and b"restore" in argv and any(needle in a for a in argv):
            return True
    return False


def _kill_during_restore(c: httpx.Client, worker, sid: str) -> httpx.Response:
    """Call the standby sandbox (which resumes it) and SIGKILL `worker` once its restore runs;
    returns the call's answer."""
    answer: list[httpx.Response] = []
    call = threading.Thread(
        target=lambda: answer.append(c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /root/notes"}))
    )
    call.start()
    deadline = time.monotonic() + 120
    while not _restoring(sid):
        assert call.is_alive(), f"the call ended before a restore was seen: {answer[0].text}"
        assert time.monotonic() < deadline, "no runsc restore of the sandbox was seen"
        time.sleep(0.002)
    worker.kill()  # SIGKILL, the worker's process group only (runsc restore runs in its own session)
    call.join(120)
    assert not call.is_alive()
    return answer[0]


def _archive_objects(sw: SeaweedFS, sid: str) -> list[str]:
    req = urllib.request.Request(
        f"{sw.filer_url}/buckets/{sw.bucket}/sandboxes/{sid}/", headers={"Accept": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        entries = json.load(r).get("Entries") or []
    return sorted(os.path.basename(e["FullPath"]) for e in entries)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    with SeaweedFS(str(tmp_path_factory.mktemp("restore-seaweed"))) as sw:
        yield sw


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed):
    root = tmp_path_factory.mktemp("restore")
    env = {
        "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
        **seaweed.env(),
        "ATOLL_WORKER_LOST_S": "3",
        "ATOLL_WORKER_GONE_S": "0",  # never settled by time: the tests bring workers back or remove them
        "ATOLL_HEARTBEAT_S": "1",
    }
    cl = LocalCluster(root / "cluster", workers=2, env=env)
    cl.start(timeout=900)
    try:
        yield cl
    finally:
        for w in cl.workers:
            if w.proc is None:  # killed by a test and not back: its sandboxes still run
                w.start()
                w.wait_state("ready", 120)
        cl.stop(reap=True)


def _on(c: httpx.Client, ids: dict, name: str, **body) -> str:
    """A sandbox made on worker `name` (the other one cordoned meanwhile), /root/notes written."""
    other = ids["w1" if name == "w0" else "w0"]
    assert c.post(f"/v1/workers/{other}/drain", json={"draining": True, "evacuate": False}).status_code == 202
    r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, **body})
    assert c.post(f"/v1/workers/{other}/drain", json={"draining": False}).status_code == 200
    assert r.status_code == 201 and r.json()["worker"] == name, r.text
    sid = r.json()["id"]
    assert c.put(
        f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"}, content=sid.encode()
    ).is_success
    return sid


def test_a_worker_killed_during_a_disk_restore_serves_the_sandbox_when_back(cluster):
    c = httpx.Client(base_url=cluster.url, headers=cluster.headers(), timeout=300)
    ids = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}
    sid = _on(c, ids, "w0")
    r = c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "disk", r.text

    r = _kill_during_restore(c, cluster.workers[0], sid)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
    assert r.json()["error"]["retryable"] is True, r.text
    sb = c.get(f"/v1/sandboxes/{sid}").json()
    assert (sb["state"], sb["standby_tier"]) == ("standby", "disk"), sb  # not running on a dead worker
    _until(c, sid, lambda s: s["worker_state"] == "lost", 30)
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text

    w0 = cluster.workers[0]
    w0.start()  # the same home: it finishes (or undoes) the restore it was killed in
    w0.wait_state("ready", 120)
    assert _exec(c, sid, "cat /root/notes") == sid
    sb = c.get(f"/v1/sandboxes/{sid}").json()
    assert (sb["state"], sb["worker"], sb["worker_state"]) == ("running", "w0", "ready"), sb
    w = c.get(f"/v1/workers/{ids['w0']}").json()
    assert w["sandboxes"] == 1, w
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_an_archive_restore_cut_short_leaves_the_archive_for_another_worker(cluster, seaweed):
    c = httpx.Client(base_url=cluster.url, headers=cluster.headers(), timeout=300)
    ids = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}
    sid = _on(c, ids, "w1")  # (w0 restarted just now: its gateway may keep a checkpoint off)
    r = c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "archive", r.text
    # moved to w0 (a drain of w1 hands it over through the store), restored there on its next call
    assert c.post(f"/v1/workers/{ids['w1']}/drain", json={}).status_code == 202
    _until(c, sid, lambda s: s["worker"] == "w0", 120)
    deadline = time.monotonic() + 120
    while (ev := c.get(f"/v1/workers/{ids['w1']}").json()["evacuation"])["state"] == "running":
        assert time.monotonic() < deadline, ev
        time.sleep(0.2)
    assert c.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": False}).status_code == 200
    stored = _archive_objects(seaweed, sid)
    assert any(n.endswith(".tar.zst") for n in stored), stored

    r = _kill_during_restore(c, cluster.workers[0], sid)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
    sb = c.get(f"/v1/sandboxes/{sid}").json()
    assert (sb["state"], sb["standby_tier"], sb["worker"]) == ("standby", "archive", "w0"), sb
    _until(c, sid, lambda s: s["worker_state"] == "lost", 30)
    assert _archive_objects(seaweed, sid) == stored  # the restore cut short took nothing from the store

    # w0 removed for good: w1 adopts the archive and serves the sandbox from it
    assert c.delete(f"/v1/workers/{ids['w0']}").status_code in (200, 204)
    sb = _until(c, sid, lambda s: s["worker"] == "w1", 60)
    assert (sb["state"], sb["standby_tier"]) == ("standby", "archive"), sb
    assert _exec(c, sid, "cat /root/notes") == sid

    # w0 comes back (same home, a new registration): its stale copy is dropped, nothing runs there
    w0 = cluster.workers[0]
    w0.start()
    w0.wait_state("ready", 120)
    deadline = time.monotonic() + 60
    while sid in os.listdir(os.path.join(w0.home, "sandboxes")):
        assert time.monotonic() < deadline, "w0 kept its copy"
        time.sleep(0.5)
    assert not _restoring(sid)
    assert c.get(f"/v1/sandboxes/{sid}").json()["worker"] == "w1"
    workers = {w["name"]: w["sandboxes"] for w in c.get("/v1/workers").json()["items"]}
    assert workers == {"w0": 0, "w1": 1}, workers
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204

"""Drain with evacuation on real gVisor: `atoll server` + workers w0 and w1 sharing an S3 object
store (SeaweedFS on loopback). On w0: a running sandbox whose process counts
in memory (and a file), one in the disk tier, one in the memory tier, and one running an asyncio
(epoll) TCP server, which the checkpoint gate keeps in memory. Draining w0 moves the first three to
w1 — the running one runs on there with its process and its count, the others resume on their
next call with their files — and reports the fourth, still running on w0, never killed. w0 drops
its local copies. Then w1 is drained with no other worker ready: it answers 202, nothing moves,
every sandbox is reported with the reason. With the object store down, a drain leaves a running
sandbox where it is, running on with its process, and says why. A drain the server's restart
interrupted goes on once the new server has its workers back. One installation for the module."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from atoll.controlplane import evacuation
from atoll.testing import LocalCluster
from atoll.testing.seaweed import SeaweedFS
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration

COUNTER = (
    'python3 -c \'import os, time\nx=[0]\nwhile True:\n  x[0]+=1; open("/tmp/beat.tmp","w").write(str(x[0])); '
    'os.replace("/tmp/beat.tmp", "/tmp/beat"); time.sleep(0.1)\' > /dev/null 2>&1 &\necho $!'
)
EPOLL_SERVER = (
    "import asyncio\nasync def main():\n    s = await asyncio.start_server(lambda r, w: None, '0.0.0.0', 8080)\n"
    "    await asyncio.sleep(10**6)\nasyncio.run(main())\n"
)


def _exec(c: httpx.Client, sid: str, cmd: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return r.json()["stdout"]


def _wait_evacuation(c: httpx.Client, wid: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = c.get(f"/v1/workers/{wid}").json()
        if w["evacuation"] and w["evacuation"]["state"] != "running":
            return w
        time.sleep(0.3)
    raise AssertionError(f"the evacuation of {wid} did not end: {w}")


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    with SeaweedFS(str(tmp_path_factory.mktemp("drain-seaweed"))) as sw:
        yield sw


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed):
    root = tmp_path_factory.mktemp("drain")
    env = {
        "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
        **seaweed.env(),  # one S3 store (SeaweedFS on loopback) both workers use
        "ATOLL_WORKER_LOST_S": "10",
        "ATOLL_HEARTBEAT_S": "1",
    }
    cl = LocalCluster(root / "cluster", workers=2, env=env)
    cl.start(timeout=900)
    try:
        yield cl
    finally:
        seaweed.start()  # a test that stopped it: the reaping deletes archives too
        cl.stop(reap=True)


def test_drain_moves_running_and_standby_sandboxes_and_reports_the_gated_one(cluster):
    c = httpx.Client(base_url=cluster.url, headers=cluster.headers(), timeout=300)
    ids = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}
    # everything made on w0: w1 cordoned meanwhile
    r = c.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": True, "evacuate": False})
    assert r.status_code == 202, r.text
    made = {}
    for name in ("running", "disk", "memory", "gated"):
        sb = c.post("/v1/sandboxes", json={"idle_timeout_s": 0}, headers={"Idempotency-Key": f"drain-{name}"})
        assert sb.status_code == 201 and sb.json()["worker"] == "w0", sb.text
        made[name] = sb.json()["id"]
        c.put(f"/v1/sandboxes/{made[name]}/files", params={"path": "/root/notes.txt"}, content=name.encode())
    # a retried create with the same key answers the same sandbox
    again = c.post("/v1/sandboxes", json={"idle_timeout_s": 0}, headers={"Idempotency-Key": "drain-disk"})
    assert again.status_code == 201 and again.json()["id"] == made["disk"], again.text
    pid = _exec(c, made["running"], COUNTER).strip()
    c.put(
        f"/v1/sandboxes/{made['gated']}/files", params={"path": "/srv/aio.py"}, content=EPOLL_SERVER.encode()
    )
    r = c.post(f"/v1/sandboxes/{made['gated']}/exec", json={"cmd": "python3 /srv/aio.py", "background": True})
    assert r.status_code in (200, 201), r.text
    assert (
        c.post(f"/v1/sandboxes/{made['disk']}/pause", json={"tier": "disk"}).json()["standby_tier"] == "disk"
    )
    assert (
        c.post(f"/v1/sandboxes/{made['memory']}/pause", json={"tier": "memory"}).json()["standby_tier"]
        == "memory"
    )
    time.sleep(1.5)  # the counter counts, the epoll server listens
    assert c.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": False}).json()["state"] == "ready"

    before = int(c.get(f"/v1/sandboxes/{made['running']}/files", params={"path": "/tmp/beat"}).text)
    t0 = time.monotonic()
    r = c.post(f"/v1/workers/{ids['w0']}/drain", json={})
    assert r.status_code == 202 and r.json()["state"] == "draining", r.text
    w0 = _wait_evacuation(c, ids["w0"])
    took = time.monotonic() - t0
    ev = w0["evacuation"]
    assert ev["state"] == "done" and ev["moved"] == 3, ev
    [left] = ev["left"]
    assert left["id"] == made["gated"] and "memory tier" in left["reason"] and "epoll" in left["reason"], left
    assert (w0["sandboxes"], w0["evacuated"]) == (1, False), w0
    assert took < 120, took

    views = {k: c.get(f"/v1/sandboxes/{sid}").json() for k, sid in made.items()}
    assert [views[k]["worker"] for k in ("running", "disk", "memory")] == ["w1"] * 3, views
    assert views["running"]["state"] == "running", views["running"]  # resumed there at once
    assert (views["disk"]["state"], views["disk"]["standby_tier"]) == ("standby", "archive")
    assert (views["memory"]["state"], views["memory"]["standby_tier"]) == ("standby", "archive")
    # the gated one was never checkpointed: running on w0, its server alive
    assert (views["gated"]["state"], views["gated"]["worker"]) == ("running", "w0"), views["gated"]
    assert _exec(c, made["gated"], "pgrep -f aio.py >/dev/null && echo alive") == "alive\n"
    # the process kept its memory: the same pid, counting on from where it was
    out = _exec(c, made["running"], f"kill -0 {pid} && cat /tmp/beat && echo && cat /root/notes.txt")
    count, notes = out.split("\n", 1)
    assert int(count) >= before and notes == "running", out
    time.sleep(0.5)
    assert int(c.get(f"/v1/sandboxes/{made['running']}/files", params={"path": "/tmp/beat"}).text) > int(
        count
    )
    for k in ("disk", "memory"):  # resumed on w1 by the call itself
        assert _exec(c, made[k], "cat /root/notes.txt") == k
        assert c.get(f"/v1/sandboxes/{made[k]}").json()["worker"] == "w1"
    # w0 dropped its local copies (the store's objects belong to w1 now)
    w0_dirs = os.listdir(os.path.join(cluster.workers[0].home, "sandboxes"))
    assert made["gated"] in w0_dirs and not {made[k] for k in ("running", "disk", "memory")} & set(w0_dirs)
    # once the gated one is gone, w0 is evacuated
    assert c.delete(f"/v1/sandboxes/{made['gated']}").status_code == 204
    assert c.get(f"/v1/workers/{ids['w0']}").json()["evacuated"] is True

    # w1 is the only worker left to hold them: its drain moves nothing and says why
    r = c.post(f"/v1/workers/{ids['w1']}/drain", json={})
    assert r.status_code == 202, r.text
    w1 = _wait_evacuation(c, ids["w1"])
    assert w1["evacuation"]["moved"] == 0 and w1["sandboxes"] == 3, w1
    reasons = {x["id"]: x["reason"] for x in w1["evacuation"]["left"]}
    assert set(reasons) == {made[k] for k in ("running", "disk", "memory")}
    assert all("no other worker can take it" in why for why in reasons.values()), reasons
    assert _exec(c, made["running"], "cat /root/notes.txt") == "running"  # untouched, still served
    for wid in ids.values():
        assert c.post(f"/v1/workers/{wid}/drain", json={"draining": False}).status_code == 200


def test_with_the_store_down_a_running_sandbox_stays_where_it_is(cluster, seaweed):
    c = httpx.Client(base_url=cluster.url, headers=cluster.headers(), timeout=300)
    ids = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}
    sb = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
    assert sb.status_code == 201, sb.text
    sid, home = sb.json()["id"], sb.json()["worker"]
    pid = _exec(c, sid, COUNTER).strip()
    time.sleep(0.5)
    seaweed.stop()
    try:
        r = c.post(f"/v1/workers/{ids[home]}/drain", json={})
        assert r.status_code == 202, r.text
        t0 = time.monotonic()
        w = _wait_evacuation(c, ids[home])
        print(f"evacuation with the store down: {time.monotonic() - t0:.1f} s: {w['evacuation']}")
        reasons = {x["id"]: x["reason"] for x in w["evacuation"]["left"]}
        assert sid in reasons and "disk tier" in reasons[sid], w["evacuation"]
        view = c.get(f"/v1/sandboxes/{sid}").json()
        assert (view["state"], view["worker"]) == ("running", home), view  # resumed where it was
        before = int(c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/beat"}).text)
        time.sleep(0.5)
        out = _exec(c, sid, f"kill -0 {pid} && cat /tmp/beat")
        assert int(out) > before, out  # the same process, counting on
    finally:
        seaweed.start()
        c.post(f"/v1/workers/{ids[home]}/drain", json={"draining": False})
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_a_drain_goes_on_after_the_server_restarts(cluster):
    """The server stops right after a drain began (SIGTERM: the moves under way finish, the rest
    stays pending in the worker's record); the new server resumes the evacuation once w0 has
    registered again, and it finishes: every sandbox on w1, the running ones running with their
    processes, the others with their files."""
    c = httpx.Client(base_url=cluster.url, headers=cluster.headers(), timeout=300)
    ids = {w["name"]: w["id"] for w in c.get("/v1/workers").json()["items"]}
    r = c.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": True, "evacuate": False})
    assert r.status_code == 202, r.text
    made: list[str] = []
    for _ in range(evacuation.CONCURRENCY + 2):  # more than move at once: some must wait
        sb = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert sb.status_code == 201 and sb.json()["worker"] == "w0", sb.text
        made.append(sb.json()["id"])
        c.put(
            f"/v1/sandboxes/{made[-1]}/files", params={"path": "/root/notes.txt"}, content=made[-1].encode()
        )
    running = made[:2]
    pids = {sid: _exec(c, sid, COUNTER).strip() for sid in running}
    for sid in made[2:]:
        assert c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}).status_code == 200
    assert c.post(f"/v1/workers/{ids['w1']}/drain", json={"draining": False}).status_code == 200
    try:
        r = c.post(f"/v1/workers/{ids['w0']}/drain", json={})
        assert r.status_code == 202, r.text
        started = r.json()["evacuation"]["started_at"]
        cluster.server.terminate()
        cluster.server.start()
        w0 = _wait_evacuation(c, ids["w0"])
        ev = w0["evacuation"]
        assert (ev["state"], ev["moved"], ev["pending"], ev["left"]) == ("done", len(made), 0, []), ev
        assert ev["resumed_at"] is not None and ev["started_at"] == started, ev
        assert (w0["state"], w0["sandboxes"], w0["evacuated"]) == ("draining", 0, True), w0
        for sid in made:
            view = c.get(f"/v1/sandboxes/{sid}").json()
            assert view["worker"] == "w1", view
            if sid in running:
                assert view["state"] == "running", view
                assert _exec(c, sid, f"kill -0 {pids[sid]} && echo alive") == "alive\n"
            assert _exec(c, sid, "cat /root/notes.txt") == sid
    finally:
        c.post(f"/v1/workers/{ids['w0']}/drain", json={"draining": False})
    for sid in made:
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204

"""Standby and resume (memory and disk tiers), the checkpoint gate and the idle policy, on real gVisor."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from tests.integration.conftest import run

pytestmark = pytest.mark.integration

# A long-lived in-memory process: a counter and a loopback TCP echo server with an open connection,
# all on threads (no epoll), so that the sandbox can be checkpointed to disk.
STATEFUL = r"""
import socket, threading, time, os
state = {"n": 0}
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 7777)); srv.listen()
def serve():
    while True:
        c, _ = srv.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()
def handle(c):
    while True:
        d = c.recv(100)
        if not d: return
        state["n"] += 1
        c.sendall(d.upper() + b" %d" % state["n"])
threading.Thread(target=serve, daemon=True).start()
cli = socket.create_connection(("127.0.0.1", 7777))
f = open("/tmp/open-file.txt", "w+")
f.write("kept open")
f.flush()
while True:
    cmd = open("/tmp/ctl").read() if os.path.exists("/tmp/ctl") else ""
    if cmd == "ping":
        os.remove("/tmp/ctl")
        cli.sendall(b"ping")
        reply = cli.recv(100).decode()
        f.seek(0)
        open("/tmp/reply.tmp", "w").write(reply + " " + f.read())
        os.rename("/tmp/reply.tmp", "/tmp/reply")
    time.sleep(0.05)
"""


def _ping(api, sid) -> str:
    out = run(
        api,
        sid,
        "rm -f /tmp/reply; echo -n ping > /tmp/ctl; for i in $(seq 200); do "
        "[ -f /tmp/reply ] && cat /tmp/reply && exit 0; sleep 0.05; done; exit 1",
    )
    assert out["exit_code"] == 0, out
    return out["stdout"]


@pytest.fixture
def stateful(api, sandbox):
    sid = sandbox["id"]
    api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/stateful.py"}, content=STATEFUL.encode())
    r = run(api, sid, "python3 /srv/stateful.py", background=True)
    assert "pid" in r
    time.sleep(1.0)
    assert _ping(api, sid) == "PING 1 kept open"
    run(api, sid, "echo persisted > /root/on-disk.txt; python3 -c 'import time; print(time.time())'")
    return sandbox


def _pause(api, sid, tier):
    r = api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": tier})
    assert r.status_code == 200, r.text
    return r.json()


def _host_time_close(api, sid):
    t = float(run(api, sid, ["python3", "-c", "import time; print(time.time())"])["stdout"])
    assert abs(t - time.time()) < 5, "wall clock inside the sandbox must be correct after resume"


def test_memory_tier_keeps_everything(api, stateful):
    sid = stateful["id"]
    sb = _pause(api, sid, "memory")
    assert (sb["state"], sb["standby_tier"]) == ("standby", "memory")
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "standby", "GET must not resume"
    # Pausing to the tier it is in changes nothing.
    assert _pause(api, sid, "memory")["standby_tier"] == "memory"
    time.sleep(1.5)
    # Exec resumes transparently.
    assert _ping(api, sid) == "PING 2 kept open"
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    _host_time_close(api, sid)


@pytest.mark.seam
def test_disk_tier_keeps_everything(api, stateful, atoll_server):
    sid = stateful["id"]
    sb = _pause(api, sid, "disk")
    assert (sb["state"], sb["standby_tier"], sb["standby_reason"]) == ("standby", "disk", None), sb
    time.sleep(2)
    r = api.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert _ping(api, sid) == "PING 2 kept open"
    assert run(api, sid, "cat /root/on-disk.txt")["stdout"] == "persisted\n"
    _host_time_close(api, sid)
    # memory -> disk moves it; file calls also resume transparently.
    _pause(api, sid, "memory")
    assert _pause(api, sid, "disk")["standby_tier"] == "disk"
    assert (
        api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/on-disk.txt"}).content == b"persisted\n"
    )
    assert _ping(api, sid) == "PING 3 kept open"
    # A disk sandbox cannot be "paused" back to memory without a resume.
    _pause(api, sid, "disk")
    r = api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"


def test_gate_keeps_epoll_server_in_memory(api, sandbox):
    sid = sandbox["id"]
    code = (
        "import asyncio\nasync def main():\n    s = await asyncio.start_server(lambda r, w: None, '0.0.0.0', 8080)\n"
        "    await asyncio.sleep(10**6)\nasyncio.run(main())\n"
    )
    api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/aio.py"}, content=code.encode())
    run(api, sid, "python3 /srv/aio.py", background=True)
    time.sleep(1.5)
    sb = _pause(api, sid, "disk")
    assert (sb["state"], sb["standby_tier"]) == ("standby", "memory"), sb
    assert "epoll" in sb["standby_reason"], sb
    # Still alive and well.
    assert run(api, sid, "echo alive")["stdout"] == "alive\n"


@pytest.mark.seam
def test_concurrent_callers_share_one_resume(api, stateful):
    sid = stateful["id"]
    _pause(api, sid, "disk")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run(api, sid, f"echo {i}"), range(8)))
    assert [r["stdout"] for r in results] == [f"{i}\n" for i in range(8)]
    assert _ping(api, sid) == "PING 2 kept open"


def test_idle_policy_memory_then_disk(api):
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 1, "disk_after_s": 2})
    sid = r.json()["id"]
    try:
        run(api, sid, "echo hi > /root/x")
        seen = set()
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            sb = api.get(f"/v1/sandboxes/{sid}").json()
            seen.add((sb["state"], sb["standby_tier"]))
            if sb["standby_tier"] == "disk":
                break
            time.sleep(0.2)
        assert ("standby", "memory") in seen and ("standby", "disk") in seen, seen
        assert run(api, sid, "cat /root/x")["stdout"] == "hi\n"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_long_foreground_command_is_activity(api):
    sid = api.post("/v1/sandboxes", json={"idle_timeout_s": 1}).json()["id"]
    try:
        r = run(api, sid, "sleep 4; echo done", timeout_s=30)
        assert r["stdout"] == "done\n"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.seam
def test_a_busy_background_process_is_activity(api):
    """A build in the background uses CPU: the worker reports it, the sandbox is not frozen for
    idleness; once it ends, the sandbox goes to standby as usual."""
    sid = api.post("/v1/sandboxes", json={"idle_timeout_s": 1, "disk_after_s": 0}).json()["id"]
    try:
        pid = run(api, sid, ["python3", "-c", "while True: pass"], background=True)["pid"]
        time.sleep(6)
        assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert api.delete(f"/v1/sandboxes/{sid}/processes/{pid}").status_code == 204
        deadline = time.monotonic() + 15
        while api.get(f"/v1/sandboxes/{sid}").json()["state"] != "standby":
            assert time.monotonic() < deadline, "an idle sandbox must go to standby"
            time.sleep(0.2)
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.slow
def test_hundred_standby_cycles(api, stateful):
    sid = stateful["id"]
    for i in range(100):
        tier = "disk" if i % 10 == 9 else "memory"
        _pause(api, sid, tier)
        assert run(api, sid, "cat /root/on-disk.txt")["stdout"] == "persisted\n"
    assert _ping(api, sid) == "PING 2 kept open"
    _host_time_close(api, sid)

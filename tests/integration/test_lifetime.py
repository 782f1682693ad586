"""Lifetimes, live settings, CPU activity and metrics on real gVisor sandboxes (the shared `atoll up`):
a lifetime's end pauses to disk or deletes; a CPU-busy background build is never frozen for
idleness while an idle dev server is; metrics follow what happens inside."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import run

pytestmark = pytest.mark.integration


@pytest.fixture
def make(api):
    """Create sandboxes with the given body; every one is deleted afterwards."""
    made: list[str] = []

    def _make(**body) -> dict:
        r = api.post("/v1/sandboxes", json=body)
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
        return r.json()

    yield _make
    for sid in made:
        api.delete(f"/v1/sandboxes/{sid}")


def _wait(api, sid, pred, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = api.get(f"/v1/sandboxes/{sid}")  # a GET is no activity: it never resumes or counts
        body = r.json() if r.status_code == 200 else {"status": r.status_code}
        if pred(body):
            return body
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {body}"
        time.sleep(0.25)


def test_a_pause_lifetime_ends_on_disk_and_an_exec_resumes_it(api, make):
    sid = make(idle_timeout_s=0, timeout_s=3)["id"]
    run(api, sid, "echo kept > /root/mark")
    body = _wait(api, sid, lambda b: b.get("standby_tier") == "disk", 60)
    assert body["state"] == "standby" and body["expires_at"] is None  # the lifetime is spent
    out = run(api, sid, "cat /root/mark")
    assert out["stdout"] == "kept\n"
    after = api.get(f"/v1/sandboxes/{sid}").json()
    assert after["state"] == "running" and after["expires_at"] is None


def test_a_delete_lifetime_removes_the_sandbox(api, make):
    sid = make(idle_timeout_s=0, timeout_s=2, on_timeout="delete")["id"]
    _wait(api, sid, lambda b: b.get("status") == 404, 30)
    assert all(s["id"] != sid for s in api.get("/v1/sandboxes").json()["items"])


def test_patch_extends_a_lifetime_live(api, make):
    sid = make(idle_timeout_s=0, timeout_s=3, on_timeout="delete")["id"]
    r = api.patch(f"/v1/sandboxes/{sid}", json={"timeout_s": 120})
    assert r.status_code == 200, r.text
    time.sleep(5)  # past the first deadline
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    assert run(api, sid, "echo alive")["stdout"] == "alive\n"


def test_a_busy_background_build_is_not_frozen_but_an_idle_server_is(api, make):
    busy = make(idle_timeout_s=3, disk_after_s=0)["id"]
    idle = make(idle_timeout_s=3, disk_after_s=0)["id"]
    # a "build": pure CPU for much longer than idle_timeout_s, started in the background
    loop = run(api, busy, ["python3", "-c", "while True: pass"], background=True)
    run(api, idle, ["python3", "-m", "http.server", "8000"], background=True)
    frozen = _wait(api, idle, lambda b: b["state"] == "standby", 30)
    assert frozen["standby_tier"] == "memory"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:  # over three idle timeouts without any call
        assert api.get(f"/v1/sandboxes/{busy}").json()["state"] == "running"
        time.sleep(0.5)
    # it was the CPU use that kept it: once the loop ends, it is frozen too
    r = api.delete(f"/v1/sandboxes/{busy}/processes/{loop['pid']}")
    assert r.status_code in (200, 204), r.text
    _wait(api, busy, lambda b: b["state"] == "standby", 30)


def test_metrics_follow_memory_disk_processes_and_cpu(api, make):
    sid = make(idle_timeout_s=0, memory_mb=256)["id"]
    base = api.get(f"/v1/sandboxes/{sid}/metrics")
    assert base.status_code == 200, base.text
    m0 = base.json()
    assert m0["state"] == "running" and m0["memory_limit_mb"] == 256 and m0["disk_limit_mb"] > 0
    assert 0 < m0["memory_used_mb"] <= m0["memory_limit_mb"], m0
    assert 0 <= m0["disk_used_mb"] < m0["disk_limit_mb"] and isinstance(m0["processes"], int)

    run(api, sid, "dd if=/dev/zero of=/root/fifty bs=1M count=50 && sync")
    m1 = api.get(f"/v1/sandboxes/{sid}/metrics").json()
    assert m1["disk_used_mb"] - m0["disk_used_mb"] >= 45, (m0, m1)

    for _ in range(3):
        run(api, sid, "while true; do sleep 1; done", background=True)
    m2 = api.get(f"/v1/sandboxes/{sid}/metrics").json()
    assert m2["processes"] >= m0["processes"] + 3, (m0, m2)

    run(api, sid, ["python3", "-c", "while True: pass"], background=True)
    time.sleep(2.5)  # the CPU share is over the monitor's ~2 s window
    m3 = api.get(f"/v1/sandboxes/{sid}/metrics").json()
    assert m3["cpu_percent"] > 30, m3

    r = api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
    assert r.status_code == 200, r.text
    m4 = api.get(f"/v1/sandboxes/{sid}/metrics").json()
    assert (m4["state"], m4["standby_tier"], m4["cpu_percent"], m4["processes"]) == (
        "standby",
        "memory",
        0,
        None,
    )
    assert m4["memory_used_mb"] > 0 and m4["disk_used_mb"] >= m1["disk_used_mb"] - 1
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "standby"  # not woken


def test_bad_lifetimes_and_metrics_of_unknown_sandboxes(api):
    for body in ({"timeout_s": 0}, {"timeout_s": -3}, {"timeout_s": "x"}, {"on_timeout": "stop"}):
        r = api.post("/v1/sandboxes", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    r = api.get("/v1/sandboxes/sb-zzzzzzzzzzzzzzzz/metrics")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    r = api.patch("/v1/sandboxes/sb-zzzzzzzzzzzzzzzz", json={"timeout_s": 5})
    assert r.status_code == 404


def test_the_sdk_lifetime_connect_update_and_metrics(atoll_server):
    import atoll

    with atoll.Client(atoll_server.url, atoll_server.api_key) as client:
        with pytest.raises(TypeError):
            client.sandboxes.create(timeout=60)
        with client.sandboxes.create(idle_timeout_s=0, timeout_s=600, on_timeout="delete") as sb:
            assert sb.expires_at is not None and sb.on_timeout == "delete"
            sb.pause(tier="memory")
            same = client.sandboxes.connect(sb.id)
            assert same.state == "running"
            same.update(timeout_s=None, metadata={"k": "v"})
            assert same.expires_at is None and same.metadata == {"k": "v"}
            m = same.metrics()
            assert m.state == "running" and 0 < m.memory_used_mb <= m.memory_limit_mb
            assert isinstance(m.processes, int)


def test_metrics_and_patch_through_the_split(atoll_split):
    """The same through `atoll server` + `atoll worker`: the seam verb over the worker protocol."""
    import httpx

    with httpx.Client(base_url=atoll_split.url, headers=atoll_split.headers(), timeout=300) as c:
        r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "timeout_s": 600})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            run(c, sid, "dd if=/dev/zero of=/root/ten bs=1M count=10 && sync")
            m = c.get(f"/v1/sandboxes/{sid}/metrics").json()
            assert m["state"] == "running" and m["disk_used_mb"] >= 10 and m["processes"] >= 0, m
            assert 0 < m["memory_used_mb"] <= m["memory_limit_mb"], m
            r = c.patch(f"/v1/sandboxes/{sid}", json={"timeout_s": None, "on_timeout": "delete"})
            assert r.status_code == 200 and r.json()["expires_at"] is None
            assert c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}).status_code == 200
            m = c.get(f"/v1/sandboxes/{sid}/metrics").json()
            assert (m["standby_tier"], m["processes"], m["cpu_percent"]) == ("disk", None, 0), m
            assert m["disk_used_mb"] >= 10, m  # its writable layer, read on the host
        finally:
            c.delete(f"/v1/sandboxes/{sid}")

"""The control plane in process (real FastAPI app, real SQLite, real lifecycle and policy) over the
fake worker of atoll.testing: locks, shared resumes, pause outcomes, failures, events, the policy."""

from __future__ import annotations

import asyncio
import time

from tests.component.conftest import create


async def _until(pred, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_concurrent_callers_share_one_resume(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).json()[
        "standby_tier"
    ] == "disk"
    worker.delay["restore"] = 0.2
    rs = await asyncio.gather(*[c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}) for _ in range(10)])
    assert all(r.status_code == 200 for r in rs)
    assert [v for v, s in worker.calls if s == sid].count("restore") == 1


async def test_pause_is_refused_while_exec_runs(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.delay["exec"] = 0.3
    ex = asyncio.ensure_future(c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 1"}))
    await asyncio.sleep(0.05)
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_busy"
    assert (await ex).status_code == 200


async def test_delete_waits_for_pause(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.delay["checkpoint"] = 0.2
    p = asyncio.ensure_future(c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}))
    await asyncio.sleep(0.05)
    d = await c.delete(f"/v1/sandboxes/{sid}")
    assert d.status_code == 204
    assert (await p).status_code == 200
    assert (await c.get(f"/v1/sandboxes/{sid}")).status_code == 404

    async def deleted():
        return ("delete", sid) in worker.calls

    await _until(deleted)  # the runtime is removed in the background after the 204
    verbs = [v for v, s in worker.calls if s == sid]
    assert verbs.index("checkpoint") < verbs.index("delete")


async def test_gate_keeps_memory_tier_with_reason(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.gate_blockers = ["process 7 (node) watches TCP sockets with epoll"]
    sb = (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).json()
    assert (sb["state"], sb["standby_tier"]) == ("standby", "memory")
    assert "epoll" in sb["standby_reason"]
    assert ("checkpoint", sid) not in worker.calls
    # from the memory tier, gated again: it stays, with the reason, since the same moment
    since = sb["standby_since"]
    sb = (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).json()
    assert (sb["standby_tier"], sb["standby_since"]) == ("memory", since) and "epoll" in sb["standby_reason"]


async def test_a_freeze_that_times_out_leaves_the_sandbox_running(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.freeze_stuck = True
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "sandbox_busy" and r.json()["error"]["retryable"] is True
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    # frozen, then thawed for a gated disk pause, then the re-freeze fails: the record says running
    worker.freeze_stuck = False
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})).status_code == 200
    worker.gate_blockers = ["process 7 (node) watches TCP sockets with epoll"]
    worker.freeze_stuck = True
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_busy"
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert (sb["state"], sb["standby_tier"]) == ("running", None)
    assert worker.phase(sid) == "running"
    worker.freeze_stuck = False
    assert (await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200


async def test_runtime_failure_marks_failed_with_cause(fake, caplog):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.fail.add("checkpoint")
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_failed"
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert sb["state"] == "failed" and "fake checkpoint failure" in sb["failure_reason"]
    # the internal cause (host paths, runsc's log) is logged, never sent to the caller
    assert "runsc.log" not in r.text and "runsc.log" not in sb["failure_reason"]
    assert any("runsc.log said no" in str(getattr(rec, "detail", "")) for rec in caplog.records)
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"


async def test_a_death_during_a_call_is_sandbox_failed(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.delay["exec"] = 0.2
    call = asyncio.ensure_future(c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}))
    await asyncio.sleep(0.05)
    worker.kill(sid, "stopped by the host's OOM killer")
    r = await call
    assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_failed"
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert sb["state"] == "failed" and "OOM" in sb["failure_reason"]


async def test_a_death_event_fails_the_record_without_any_call(fake):
    """No poll: the worker's SandboxDied event alone marks the record failed, with its cause."""
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.kill(sid, "sandbox was stopped by the host's OOM killer")

    async def failed():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "failed"

    await _until(failed)
    assert "OOM" in (await c.get(f"/v1/sandboxes/{sid}")).json()["failure_reason"]
    assert not [v for v, s in worker.calls if s == sid and v != "create"]


async def test_idle_policy_walks_tiers(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c, idle_timeout_s=0.2, disk_after_s=0.3)

    async def on_disk():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "disk"

    await _until(on_disk, 6)
    verbs = [v for v, s in worker.calls if s == sid]
    assert "freeze" in verbs and "checkpoint" in verbs


async def test_an_open_connection_keeps_an_idle_sandbox_running(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c, idle_timeout_s=0.2)
    worker.open_connections[sid] = 1
    await asyncio.sleep(1.0)
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert ("pause", sid) in worker.calls  # asked, declined: activity
    worker.open_connections[sid] = 0

    async def frozen():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "memory"

    await _until(frozen)


async def test_a_stalled_sandbox_does_not_delay_another_ones_standby(fake):
    """The idle policy used to walk sandboxes one by one, so a stopped agent (a pause hanging) held
    up every other sandbox's standby."""
    c, worker = fake.http, fake.worker
    stuck = [await create(c, idle_timeout_s=0.1, disk_after_s=0.1) for _ in range(3)]
    worker.gate_stalled.update(stuck)
    sid = await create(c, idle_timeout_s=0.2, disk_after_s=0.2)

    async def on_disk():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "disk"

    await _until(on_disk, 6)
    assert all(("pause", s) in worker.calls for s in stuck)  # they were tried, and are still waiting
    for s in stuck:
        assert (await c.get(f"/v1/sandboxes/{s}")).json()["state"] == "running"


async def test_file_limit_and_metrics(fake):
    c = fake.http
    sid = await create(c)
    r = await c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/x"}, content=b"x" * 2048)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    text = (await c.get("/metrics")).text
    assert 'atoll_sandboxes{state="running"} 1.0' in text
    assert 'atoll_lifecycle_duration_seconds_count{outcome="complete",verb="create"} 1.0' in text


async def test_timestamps_are_utc_whether_cached_or_read_back(fake):
    c = fake.http
    sid = await create(c)
    created = (await c.get(f"/v1/sandboxes/{sid}")).json()["created_at"]
    listed = [s for s in (await c.get("/v1/sandboxes")).json()["items"] if s["id"] == sid][0]
    for t in (created, listed["created_at"], listed["updated_at"]):
        assert t.endswith("+00:00"), t
    assert listed["created_at"] == created


async def test_sandboxes_say_which_worker_holds_them(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    ws = (await c.get("/v1/workers")).json()["items"]
    assert [w["name"] for w in ws] == [worker.name] and ws[0]["state"] == "ready"
    assert sb["worker"] == worker.name and sb["worker_id"] == ws[0]["id"]
    assert ws[0]["sandboxes"] == 1 and ws[0]["allocated"]["memory_mb"] == sb["memory_mb"]
    assert ws[0]["capacity"]["memory_mb"] == worker.capacity.memory_mb
    assert (await c.get(f"/v1/workers/{ws[0]['id']}")).json()["name"] == worker.name
    assert (await c.get("/v1/workers/wk-0000000000000000")).json()["error"]["code"] == "worker_not_found"
    r = await c.get("/v1/workers/bad")
    assert r.status_code == 400 and "wk-" in r.json()["error"]["message"]


async def test_a_busy_sandbox_the_worker_reports_is_not_frozen_for_idleness(fake):
    """SandboxActivity events (the worker sees its processes use CPU) count as activity."""
    from atoll.core import worker_api as api

    c, worker = fake.http, fake.worker
    # twice the idle timeout of activity every 0.1 s: without the events it would be in standby
    # after 1.5 s; the margin is for a loaded machine, whose loop can lag a few hundred ms (a 0.3 s
    # timeout failed a CI run with five test processes)
    sid = await create(c, idle_timeout_s=1.5)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:
        worker.emit(api.SandboxActivity(sid, "80% of a CPU"))
        await asyncio.sleep(0.1)
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"

    async def frozen():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "memory"

    await _until(frozen)


async def test_a_failed_disk_resume_keeps_the_sandbox_in_standby_and_is_retried(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    worker.fail.add("restore")
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "resume_failed" and err["retryable"] is True
    assert "try 1 of 3" in err["message"] and "fake restore failure" in err["message"]
    assert "runsc.log" not in r.text  # the internal cause is only logged
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert (sb["state"], sb["standby_tier"]) == ("standby", "disk"), sb
    assert "fake restore failure" in sb["resume_error"] and sb["failure_reason"] is None
    assert worker.phase(sid) == "checkpointed"
    # the next call tries again, and a resume that works clears the error
    worker.fail.discard("restore")
    r = await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/x"})
    assert r.status_code == 404, r.text  # resumed; the file is simply not there
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert (sb["state"], sb["resume_error"]) == ("running", None), sb
    assert [v for v, s in worker.calls if s == sid].count("restore") == 2


async def test_three_failed_disk_resumes_in_a_row_fail_the_sandbox_and_keep_its_files(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    worker.fail.add("restore")
    for n in (1, 2):
        r = await c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 503 and f"try {n} of 3" in r.json()["error"]["message"], r.text
    r = await c.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_failed", r.text
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert sb["state"] == "failed", sb
    assert "in 3 tries" in sb["failure_reason"] and "kept" in sb["failure_reason"], sb
    assert worker.phase(sid) == "checkpointed"  # nothing removed until the delete
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
    assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 204

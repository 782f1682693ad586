"""A hypothesis state machine walks the control plane (real app, records, lifecycle) over the fake
worker: whatever the order of creates, pauses, resumes, execs, deletes, deaths, vanished runtimes,
gate refusals and reconciliations, no answer is a 5xx, every record's status is what its runtime
shows, and after a reconciliation no runtime lacks a record and no live record lacks a runtime."""

from __future__ import annotations

import asyncio
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from atoll.core.lifecycle import FAILED, PUBLIC_STATUS, status
from atoll.testing import FakeAtoll


class ControlPlaneOverFake(RuleBasedStateMachine):
    sandboxes = Bundle("sandboxes")

    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.fake = FakeAtoll(tempfile.mkdtemp(prefix="atoll-sm-"), tier_policy=False)
        self.run(self.fake.start())
        self.c = self.fake.http
        self.worker = self.fake.worker

    def run(self, aw):
        return self.loop.run_until_complete(aw)

    def call(self, method, path, **kw):
        r = self.run(self.c.request(method, path, **kw))
        assert r.status_code < 500 or r.json()["error"]["code"] == "runtime_error", r.text
        return r

    def teardown(self):
        self.run(self.fake.stop())
        self.loop.close()

    @rule(target=sandboxes)
    def create(self):
        r = self.call("POST", "/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201
        return r.json()["id"]

    @rule(sid=sandboxes, tier=st.sampled_from(["memory", "disk", "archive"]))
    def pause(self, sid, tier):
        r = self.call("POST", f"/v1/sandboxes/{sid}/pause", json={"tier": tier})
        assert r.status_code in (200, 404, 409), r.text

    @rule(sid=sandboxes)
    def resume(self, sid):
        assert self.call("POST", f"/v1/sandboxes/{sid}/resume").status_code in (200, 404, 409)

    @rule(sid=sandboxes)
    def exec(self, sid):
        r = self.call("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code in (200, 404, 409), r.text
        if r.status_code == 200:
            assert self.call("GET", f"/v1/sandboxes/{sid}").json()["state"] == "running"

    @rule(sid=consumes(sandboxes))
    def delete(self, sid):
        assert self.call("DELETE", f"/v1/sandboxes/{sid}").status_code in (204, 404)
        self.run(asyncio.sleep(0.01))  # the runtime goes in the background
        assert self.call("GET", f"/v1/sandboxes/{sid}").status_code == 404

    @rule(sid=sandboxes)
    def die(self, sid):
        rt = self.worker.runtimes.get(sid)
        if rt is not None and rt.phase.value not in ("failed", "deleting"):
            self.worker.kill(sid)
            self.run(asyncio.sleep(0.01))  # the event arrives
            assert self.call("GET", f"/v1/sandboxes/{sid}").json()["state"] == "failed"

    @rule(sid=sandboxes)
    def vanish(self, sid):
        self.worker.vanish(sid)

    @rule(on=st.booleans())
    def gate(self, on):
        self.worker.gate_blockers = ["an epoll server"] if on else []

    @rule(down=st.booleans())
    def object_store(self, down):
        (self.worker.fail.add if down else self.worker.fail.discard)("archive")

    @rule()
    def reconcile(self):
        handle = next(iter(self.fake.manager.workers.handles.values()))
        self.run(self.fake.manager.workers.reconcile(handle))
        live = {r.id for r in self.fake.manager.live()}
        assert set(self.worker.runtimes) <= live, "a runtime without a live record survived reconciliation"
        for rec in self.fake.manager.live():
            if rec.state != "failed":
                assert rec.id in self.worker.runtimes, (
                    "a live record without a runtime survived reconciliation"
                )

    @invariant()
    def records_match_runtimes(self):
        for rec in self.fake.manager.live():
            rt = self.worker.runtimes.get(rec.id)
            current = status(rec.state, rec.standby_tier)
            if rt is None or current == FAILED:
                continue  # vanished (until reconciled), or final
            assert PUBLIC_STATUS[rt.phase] in (current, FAILED), (rec.id, current, rt.phase)


TestControlPlaneOverFake = ControlPlaneOverFake.TestCase
TestControlPlaneOverFake.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

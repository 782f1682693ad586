"""Host task pressure, owned by the worker (worker.pressure): near the host pids limit the user
processes are killed, busy or not; an idle sandbox past a quarter of it is checkpointed and restored
in place (a fresh sentry) and keeps running; calls wait for a compaction that is due. Stubs stand in
for the guest agent and the tiers; the runtime records are real files."""

from __future__ import annotations

import asyncio

import pytest

from atoll.core.lifecycle import Phase, Step
from atoll.worker import cgroups, pressure
from atoll.worker.guest import Gate
from atoll.worker.runtime import RuntimeStore


class StubGuest:
    def __init__(self):
        self.calls = []
        self.gate_ok = True

    async def kill_all(self, sid):
        self.calls.append(("kill_all", sid))

    async def gate(self, sid):
        self.calls.append(("gate", sid))
        return Gate(self.gate_ok, [] if self.gate_ok else ["a TCP connection"])


class StubTiers:
    def __init__(self, shares):
        self.calls = []
        self.shares = shares

    async def checkpoint(self, rt):
        self.calls.append(("checkpoint", rt.sandbox_id))
        await asyncio.sleep(0.05)

    async def restore(self, rt):
        self.calls.append(("restore", rt.sandbox_id))
        self.shares[rt.sandbox_id] = 0.02  # a fresh sentry


@pytest.fixture
def env(tmp_path, monkeypatch):
    store = RuntimeStore(str(tmp_path), "abc123")
    shares: dict[str, float] = {}
    sids = ["sb-0000000000000001", "sb-0000000000000002"]
    for sid in sids:
        rt = store.new(sid, template="base", memory_mb=512, cpus=1, env={}, disk_mb=64)
        store.advance(rt, Step.BOOTED)
        shares[sid] = 0.0
    by_cgroup = {store.get(sid).cgroup("abc123"): sid for sid in sids}
    monkeypatch.setattr(cgroups, "pids_usage", lambda cg: (int(shares[by_cgroup[cg]] * 9216), 9216))
    guest, tiers = StubGuest(), StubTiers(shares)
    busy: set[str] = set()
    locks: dict[str, asyncio.Lock] = {}
    p = pressure.Pressure(
        store,
        guest,
        tiers,
        "abc123",  # type: ignore[arg-type]
        idle=lambda sid: sid not in busy,
        lock=lambda sid: locks.setdefault(sid, asyncio.Lock()),
    )
    return p, store, guest, tiers, shares, busy, sids


async def _settle():
    for _ in range(10):
        await asyncio.sleep(0.02)


async def test_near_the_limit_user_processes_die_then_the_sandbox_is_compacted(env):
    p, store, guest, tiers, shares, busy, (sid, calm) = env
    shares[sid], shares[calm] = 0.9, 0.2
    busy.add(sid)  # busy or not: the kill happens
    p.check(sid)
    p.check(calm)
    await _settle()
    assert guest.calls == [("kill_all", sid)]
    assert sid in p.compact_due and not tiers.calls
    p.check(sid)  # within RELIEF_EVERY_S: no second kill
    await _settle()
    assert guest.calls.count(("kill_all", sid)) == 1
    busy.discard(sid)
    await p.before_call(sid)  # the next call waits for the compaction that is due
    assert tiers.calls == [("checkpoint", sid), ("restore", sid)]
    assert store.get(sid).phase == Phase.RUNNING
    assert not [c for c in tiers.calls if c[1] == calm]


async def test_an_idle_sandbox_past_a_quarter_is_compacted_when_the_gate_allows(env):
    p, store, guest, tiers, shares, busy, (sid, _) = env
    shares[sid] = 0.3
    busy.add(sid)
    p.check(sid)
    await _settle()
    assert not tiers.calls  # busy: left alone
    busy.discard(sid)
    guest.gate_ok = False
    p.check(sid)
    await _settle()
    assert ("gate", sid) in guest.calls and not tiers.calls
    p.check(sid)  # gated: retried only after COMPACT_RETRY_S
    await _settle()
    assert guest.calls.count(("gate", sid)) == 1
    p._compact_retry.clear()
    guest.gate_ok = True
    p.check(sid)
    await _settle()
    assert tiers.calls == [("checkpoint", sid), ("restore", sid)]


async def test_a_call_during_a_compaction_waits_for_it(env):
    p, store, guest, tiers, shares, busy, (sid, _) = env
    shares[sid] = 0.3
    p.check(sid)
    await asyncio.sleep(0.01)
    assert p._compacting
    await p.before_call(sid)
    assert tiers.calls == [("checkpoint", sid), ("restore", sid)]

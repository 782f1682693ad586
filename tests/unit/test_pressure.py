"""Host task pressure, owned by the worker (worker.pressure): near the host pids limit the user
processes are killed, busy or not and whatever holds the sandbox's lock, and again only while the
count still grows; a checkpoint (a compaction) is only ever made of a settled sandbox — idle, its
host tasks not growing, no kill for a while — and that is checked again after a slow gate. Stubs
stand in for the guest agent and the tiers, a fake clock for time; the runtime records are real."""

from __future__ import annotations

import asyncio

import pytest

from atoll.core import errors
from atoll.core.lifecycle import Phase, Step
from atoll.worker.host import cgroups
from atoll.worker.runtimes import pressure
from atoll.worker.runtimes.guest import Gate
from atoll.worker.runtimes.runtime import RuntimeStore


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class StubGuest:
    def __init__(self):
        self.calls = []
        self.gate_ok = True
        self.gate_delay = 0.0
        self.during_gate = None

    async def kill_all(self, sid):
        self.calls.append(("kill_all", sid))

    async def gate(self, sid):
        self.calls.append(("gate", sid))
        if self.during_gate is not None:
            self.during_gate()
        await asyncio.sleep(self.gate_delay)
        return Gate(self.gate_ok, [] if self.gate_ok else ["a TCP connection"])


class StubTiers:
    def __init__(self, shares):
        self.calls = []
        self.shares = shares
        self.restore_fails = False

    async def checkpoint(self, rt):
        self.calls.append(("checkpoint", rt.sandbox_id))
        await asyncio.sleep(0.05)

    async def restore(self, rt):
        self.calls.append(("restore", rt.sandbox_id))
        if self.restore_fails:
            rt.phase = Phase.CHECKPOINTED
            raise errors.ResumeFailed("restoring it failed: the agent did not answer")
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
    clock = Clock()
    monkeypatch.setattr(pressure, "_now", clock)
    guest, tiers = StubGuest(), StubTiers(shares)
    busy: set[str] = set()
    locks: dict[str, asyncio.Lock] = {}
    events = []
    p = pressure.Pressure(
        store,
        guest,  # type: ignore[arg-type]
        tiers,  # type: ignore[arg-type]
        "abc123",
        idle=lambda sid: sid not in busy,
        lock=lambda sid: locks.setdefault(sid, asyncio.Lock()),
        emit=events.append,
    )
    return p, store, guest, tiers, shares, busy, sids, clock, locks, events


async def _settle():
    for _ in range(10):
        await asyncio.sleep(0.01)


async def _passes(p, sid, clock, n: int, every: float = 0.5):
    for _ in range(n):
        p.check(sid)
        await _settle()
        clock.now += every


async def test_near_the_limit_the_user_processes_die_even_while_a_step_holds_the_lock(env):
    p, store, guest, tiers, shares, busy, (sid, calm), clock, locks, _ = env
    shares[sid], shares[calm] = 0.55, 0.2
    busy.add(sid)
    await locks.setdefault(sid, asyncio.Lock()).acquire()  # a compaction's gate, a pause: held
    await _passes(p, sid, clock, 1)
    shares[sid] = 0.61
    p.check(sid)
    p.check(calm)
    await _settle()
    assert guest.calls == [("kill_all", sid)]
    # within RELIEF_EVERY_S: no second kill, however it grows
    for share in (0.64, 0.67, 0.7, 0.72):
        shares[sid] = share
        await _passes(p, sid, clock, 1)
    assert guest.calls.count(("kill_all", sid)) == 1
    # later and still growing: killed again; later and no longer growing: left alone
    shares[sid] = 0.75
    await _passes(p, sid, clock, 1)
    assert guest.calls.count(("kill_all", sid)) == 2
    clock.now += pressure.RELIEF_EVERY_S
    await _passes(p, sid, clock, 6)
    assert guest.calls.count(("kill_all", sid)) == 2
    assert not tiers.calls  # and never a checkpoint meanwhile


async def test_a_count_that_sits_past_the_limit_is_no_reason_to_kill(env):
    """Host tasks a burst left behind (a compaction the gate refuses, say) stay; only growth kills."""
    p, store, guest, tiers, shares, busy, (sid, _), clock, locks, _ = env
    busy.add(sid)
    shares[sid] = 0.7
    await _passes(p, sid, clock, 10)
    assert not guest.calls
    shares[sid] = 0.72
    await _passes(p, sid, clock, 1)
    assert guest.calls == [("kill_all", sid)]


async def test_no_checkpoint_while_host_tasks_grow_or_soon_after_a_kill(env):
    p, store, guest, tiers, shares, busy, (sid, _), clock, locks, _ = env
    # a fork bomb left running by a command that returned: idle, but growing
    for share in (0.26, 0.3, 0.34, 0.38, 0.42, 0.46, 0.5):
        shares[sid] = share
        await _passes(p, sid, clock, 1)
    assert not tiers.calls and ("gate", sid) not in guest.calls
    shares[sid] = 0.62
    await _passes(p, sid, clock, 1)
    assert ("kill_all", sid) in guest.calls
    assert "just killed" in p.relieved_recently(sid)
    await _passes(p, sid, clock, int(pressure.RELIEF_QUIET_S / 0.5) - 2)  # flat, but not long enough
    assert not tiers.calls
    await _passes(p, sid, clock, 4)
    assert tiers.calls == [("checkpoint", sid), ("restore", sid)]
    assert p.relieved_recently(sid) is None


async def test_a_settled_idle_sandbox_past_a_quarter_is_compacted_when_the_gate_allows(env):
    p, store, guest, tiers, shares, busy, (sid, _), clock, locks, _ = env
    shares[sid] = 0.3
    busy.add(sid)
    await _passes(p, sid, clock, 6)
    assert not tiers.calls  # busy: left alone
    busy.discard(sid)
    guest.gate_ok = False
    await _passes(p, sid, clock, 1)
    assert ("gate", sid) in guest.calls and not tiers.calls
    await _passes(p, sid, clock, 2)  # gated: retried only after COMPACT_RETRY_S
    assert guest.calls.count(("gate", sid)) == 1
    clock.now += pressure.COMPACT_RETRY_S
    guest.gate_ok = True
    await _passes(p, sid, clock, 3)  # watched long enough again, then compacted
    assert tiers.calls == [("checkpoint", sid), ("restore", sid)]
    assert store.get(sid).phase == Phase.RUNNING


async def test_growth_during_a_slow_gate_stops_the_compaction(env):
    p, store, guest, tiers, shares, busy, (sid, _), clock, locks, _ = env
    shares[sid] = 0.3

    def bomb_starts():  # the agent answers the gate late, and processes multiply meanwhile
        shares[sid] = 0.45
        clock.now += 1.0

    guest.during_gate = bomb_starts
    guest.gate_delay = 0.05
    await _passes(p, sid, clock, 4)
    await asyncio.sleep(0.1)
    assert guest.calls.count(("gate", sid)) == 1
    assert not tiers.calls, "a checkpoint of a sandbox whose processes multiply can kill it"


async def test_a_call_during_a_compaction_waits_for_it(env):
    p, store, guest, tiers, shares, busy, (sid, _), clock, locks, _ = env
    shares[sid] = 0.3
    guest.gate_delay = 0.05
    for _ in range(4):
        p.check(sid)
        clock.now += 0.5
    assert p._compacting
    await p.before_call(sid)
    assert tiers.calls == [("checkpoint", sid), ("restore", sid)]


async def test_a_compaction_whose_restore_failed_tells_the_control_plane(env):
    p, store, guest, tiers, shares, busy, (sid, _), clock, locks, events = env
    shares[sid] = 0.3
    tiers.restore_fails = True
    await _passes(p, sid, clock, 4)
    await asyncio.sleep(0.1)
    assert [(e.sandbox_id, e.phase) for e in events] == [(sid, Phase.CHECKPOINTED)]
    assert "did not answer" in events[0].reason

"""A disk resume on the worker (worker.tiers), with stubs for runsc, `ip` and the guest agent and real
runtime records: the re-address after a checkpoint never lands once a restore has begun (the cause
of issue 17's lost sandbox: an address on eth0 after runsc took it over makes the host refuse the
agent's port), and a restore that fails at any step is undone — the sandbox checkpointed again, its
image kept — and raises ResumeFailed. And a disk pause whose last gate, asked right before runsc
would save, finds a blocker that came up after the first gate stays in the memory tier, nothing
checkpointed (a failed checkpoint kills the sandbox)."""

from __future__ import annotations

import asyncio

import pytest

from atoll.core import errors
from atoll.core.lifecycle import Phase, Step, Tier
from atoll.worker.host import cgroups, netns, runsc
from atoll.worker.runtimes.guest import Gate
from atoll.worker.runtimes.runtime import RuntimeStore
from atoll.worker.runtimes.tiers import Tiers

SID = "sb-0000000000000001"


class Host:
    """What the stubs did, in order: ("readdress start"|"readdress end"|"runsc restore"|…, detail)."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []
        self.readdress_delays: list[float] = []
        self.restore_error: errors.AtollError | None = None
        self.agent_error: errors.AtollError | None = None
        self.discarded: list[str] = []


class StubGuest:
    def __init__(self, host):
        self.host = host

    async def close(self, sid):
        pass

    async def identify_when_ready(self, sid, generation, cpus, timeout, log_path, *, alive=None):
        assert alive is None or alive()
        if self.host.agent_error is not None:
            raise self.host.agent_error


class StubLiveness:
    def __init__(self):
        self.watched = []

    def exited(self, sid):
        return asyncio.Event()

    def watch(self, rt):
        self.watched.append(rt.generation)

    def failed(self, sid, cause):
        raise AssertionError(f"a failed restore must not fail the sandbox: {cause}")


class StubSandboxes:
    install_id = "abc123"
    runsc_root = "/nonexistent"

    def __init__(self, host):
        self.host = host

    def write_bundle(self, rt, lower=None):
        pass

    def limit_cpu(self, rt):
        pass

    async def discard_container(self, cid, cg):
        self.host.discarded.append(cid)
        self.host.events.append(("discard", cid))


class StubSnapshots:
    class Snap:
        dir = "/nonexistent/snapshot"

    def __init__(self):
        self.discards = 0

    def committed(self, sid):
        return self.Snap()

    def checked(self, sid):
        return self.Snap()

    async def verify(self, snap):
        pass

    async def discard(self, sid):
        self.discards += 1


@pytest.fixture
def tiers(tmp_path, monkeypatch):
    host = Host()
    store = RuntimeStore(str(tmp_path), "abc123")
    rt = store.new(SID, template="base", memory_mb=512, cpus=1, env={}, disk_mb=64)
    store.advance(rt, Step.BOOTED)
    store.advance(rt, Step.BEGIN_CHECKPOINT)
    store.advance(rt, Step.COMMIT_CHECKPOINT)

    async def readdress(name):
        delay = host.readdress_delays.pop(0) if host.readdress_delays else 0.0
        host.events.append(("readdress start", name))
        await asyncio.sleep(delay)
        host.events.append(("readdress end", name))

    async def restore(root, bundle, cid, image, log):
        host.events.append(("runsc restore", cid))
        await asyncio.sleep(0.01)
        if host.restore_error is not None:
            raise host.restore_error

    monkeypatch.setattr(netns, "readdress", readdress)
    monkeypatch.setattr(runsc, "restore", restore)
    monkeypatch.setattr(runsc, "sandbox_pid", lambda root, cid: 4242)
    monkeypatch.setattr(runsc, "pid_alive", lambda pid: pid == 4242)
    spawned: list[asyncio.Task] = []
    t = Tiers(
        store,
        StubGuest(host),  # type: ignore[arg-type]
        StubLiveness(),  # type: ignore[arg-type]
        StubSandboxes(host),  # type: ignore[arg-type]
        StubSnapshots(),  # type: ignore[arg-type]
        lambda aw: spawned.append(asyncio.ensure_future(aw)),
    )
    return t, store.get(SID), host


def _no_readdress_after_runsc(events) -> None:
    """Once runsc restore has started, no `ip` may still be adding eth0's address."""
    started = [i for i, (what, _) in enumerate(events) if what == "runsc restore"]
    assert started, events
    in_flight = 0
    for i, (what, _) in enumerate(events):
        in_flight += {"readdress start": 1, "readdress end": -1}.get(what, 0)
        if i >= started[0]:
            assert in_flight == 0 and what not in ("readdress start", "readdress end"), events


async def test_a_slow_readdress_after_the_checkpoint_cannot_land_during_a_restore(tiers):
    t, rt, host = tiers
    # the background re-address (after the old container's delete) is slow, as `ip` is under load
    host.readdress_delays = [0.3, 0.0]
    background = asyncio.ensure_future(t._discard_after_checkpoint(rt, "old-cid", "old-cg"))
    await asyncio.sleep(0.05)  # it is inside `ip` now
    await t.restore(rt)
    await background
    _no_readdress_after_runsc(host.events)
    assert rt.phase == Phase.RUNNING and rt.generation == 1


async def test_a_readdress_that_waited_for_a_restore_does_nothing(tiers):
    t, rt, host = tiers
    # the restore's own re-address is slow; the background one comes while it runs
    host.readdress_delays = [0.2, 0.0]
    restoring = asyncio.ensure_future(t.restore(rt))
    await asyncio.sleep(0.05)
    await t._discard_after_checkpoint(rt, "old-cid", "old-cg")
    await restoring
    _no_readdress_after_runsc(host.events)
    assert [w for w, _ in host.events].count("readdress start") == 1


@pytest.mark.parametrize("step", ["runsc", "agent"])
async def test_a_failed_restore_is_undone_and_the_sandbox_stays_checkpointed(tiers, step):
    t, rt, host = tiers
    failure = errors.RuntimeFailure("it broke", detail="runsc log: the cause")
    if step == "runsc":
        host.restore_error = failure
    else:
        host.agent_error = failure
    with pytest.raises(errors.ResumeFailed) as info:
        await t.restore(rt)
    assert "it broke" in info.value.message and info.value.detail == "runsc log: the cause"
    assert info.value.retryable and info.value.status == 503
    assert rt.phase == Phase.CHECKPOINTED and rt.sentry_pid is None
    assert host.discarded == [rt.cid]  # the half-restored container is gone
    assert t.snapshots.discards == 0  # the image is kept
    assert t.runtimes.load(SID).phase == Phase.CHECKPOINTED  # on disk too
    # the next try restores into the next generation
    host.restore_error = host.agent_error = None
    await t.restore(rt)
    assert rt.phase == Phase.RUNNING and rt.generation == 2


async def test_a_cancelled_restore_is_undone_too(tiers):
    t, rt, host = tiers
    host.readdress_delays = [0.0]
    restoring = asyncio.ensure_future(t.restore(rt))
    while not any(w == "runsc restore" for w, _ in host.events):
        await asyncio.sleep(0.001)
    restoring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await restoring
    assert rt.phase == Phase.CHECKPOINTED and host.discarded == [rt.cid]


class GatedGuest(StubGuest):
    """The first gate finds nothing; the last one (after the channel's reset) finds `final`."""

    def __init__(self, host, final: Gate):
        super().__init__(host)
        self.final = final
        self.calls: list[str] = []

    async def close(self, sid, ended=None):
        self.calls.append("close")

    async def gate(self, sid):
        self.calls.append("gate")
        return Gate(True, [])

    async def final_gate(self, sid, ended):
        self.calls.append("final_gate")
        return self.final

    def unseal(self, sid):
        self.calls.append("unseal")


class QuietEdge:
    async def quiesce(self, sid):
        return 0


async def test_a_blocker_found_by_the_last_gate_keeps_the_sandbox_in_memory(tmp_path, monkeypatch):
    host = Host()
    store = RuntimeStore(str(tmp_path), "abc123")
    rt = store.new(SID, template="base", memory_mb=512, cpus=1, env={}, disk_mb=64)
    store.advance(rt, Step.BOOTED)
    frozen: list[str] = []
    monkeypatch.setattr(cgroups, "set_cpu_limit", lambda cg, cpus: None)
    monkeypatch.setattr(cgroups, "freeze", lambda cg: frozen.append(cg))

    async def no_checkpoint(*args, **kwargs):
        raise AssertionError("runsc checkpoint must not run after the last gate refused")

    monkeypatch.setattr(runsc, "start_checkpoint", no_checkpoint)
    blocker = "TCP connection 10.99.0.2:5000 -> 10.99.0.1:41234 (ESTABLISHED) ... cannot be checkpointed"
    guest = GatedGuest(host, Gate(False, [blocker]))
    sandboxes = StubSandboxes(host)
    sandboxes.edge = QuietEdge()  # type: ignore[attr-defined]
    t = Tiers(
        store,
        guest,  # type: ignore[arg-type]
        StubLiveness(),  # type: ignore[arg-type]
        sandboxes,  # type: ignore[arg-type]
        StubSnapshots(),  # type: ignore[arg-type]
        lambda aw: None,
    )
    outcome = await t.pause(rt, Tier.DISK)
    assert outcome.tier == Tier.MEMORY and blocker in (outcome.reason or ""), outcome
    assert guest.calls == ["gate", "close", "final_gate", "unseal"]
    assert frozen and rt.phase == Phase.FROZEN

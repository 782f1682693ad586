"""worker.runtimes.edge.Edge.quiesce, its gateway process replaced by a stand-in: a gateway started
moments ago may still accept what waited in the backlogs of the sandboxes it got in its start's
replay (no checkpoint of those for SETTLED_S), but a sandbox attached to the running gateway had
no backlog it did not accept: it is quiesced at once (a disk pause right after a start is not kept
in the memory tier)."""

from __future__ import annotations

import socket
import time

from atoll.worker.runtimes import edge as edge_mod


def _edge(monkeypatch, started_ago: float) -> edge_mod.Edge:
    e = edge_mod.Edge([], None)
    chan = object()
    monkeypatch.setattr(e.child, "running", lambda: chan)
    e.child.started_at = time.monotonic() - started_ago
    calls = []

    async def call_on(c, op, fds=(), timeout=0.0, **fields):
        assert c is chan
        calls.append((op, fields["sid"]))
        return {"busy": 0, "reset": 0}

    monkeypatch.setattr(e, "_call_on", call_on)
    e.calls = calls  # type: ignore[attr-defined]
    return e


def _held(handed_at: float | None) -> edge_mod._Held:
    a, b = socket.socketpair()
    return edge_mod._Held(a, b, {}, handed_at=handed_at)


async def test_a_sandbox_from_the_replay_waits_for_the_gateway_to_settle(monkeypatch):
    e = _edge(monkeypatch, started_ago=0.1)
    e._held["sb-old"] = _held(None)  # given to this process with the others at its start
    assert await e.quiesce("sb-old") is None
    assert e.calls == []  # type: ignore[attr-defined]
    e.child.started_at = time.monotonic() - edge_mod.SETTLED_S - 0.1
    assert await e.quiesce("sb-old") == 0
    await e.aclose()


async def test_a_sandbox_attached_to_the_running_gateway_is_quiesced_at_once(monkeypatch):
    e = _edge(monkeypatch, started_ago=0.1)
    e._held["sb-new"] = _held(time.monotonic())
    assert await e.quiesce("sb-new") == 0
    assert e.calls == [("quiesce", "sb-new")]  # type: ignore[attr-defined]
    # the gateway started again since: it got the sandbox in the replay, and waits again
    e.child.started_at = time.monotonic() + 0.001
    assert await e.quiesce("sb-new") is None
    await e.aclose()

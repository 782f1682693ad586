"""A drain's evacuation as the worker's record keeps it (controlplane.evacuation `Evacuation.record`
and `from_record`): a round trip through JSON keeps every field a resumed evacuation needs, and a
record this server cannot read is ignored rather than raised."""

from __future__ import annotations

import json

import pytest

from atoll.controlplane.evacuation import Evacuation


def test_a_record_survives_a_json_round_trip():
    ev = Evacuation(
        "wk-0000000000000001",
        pending=["sb-b", "sb-c"],
        moved=["sb-a"],
        left={"sb-d": "kept in the memory tier: 1 TCP connection(s) open"},
        was_running=["sb-a", "sb-b"],
        pool_members_dropped=2,
        started_at=1_765_000_000.25,
        resumed_at=1_765_000_060.5,
    )
    ev.stop = ev.closing = True  # in-process flags: never kept
    rec = json.loads(json.dumps(ev.record()))
    assert rec["started_at"] == "2025-12-06T05:46:40.250000+00:00" and rec["finished_at"] is None
    assert "stop" not in rec and "closing" not in rec and "task" not in rec
    back = Evacuation.from_record(ev.worker_id, rec)
    assert back is not None
    for name in ("worker_id", "state", "pending", "moved", "left", "was_running", "pool_members_dropped"):
        assert getattr(back, name) == getattr(ev, name), name
    assert back.started_at == pytest.approx(ev.started_at) and back.resumed_at == pytest.approx(ev.resumed_at)
    assert back.finished_at is None and not back.stop and not back.closing and back.task is None
    assert back.view() == ev.view()
    assert back.view()["pending"] == 2 and back.view()["moved"] == 1
    assert back.view()["left"] == [{"id": "sb-d", "reason": ev.left["sb-d"]}]


def test_a_finished_record_keeps_its_end():
    ev = Evacuation("wk-0000000000000001", state="done", moved=["sb-a"], finished_at=1_765_000_100.0)
    back = Evacuation.from_record(ev.worker_id, ev.record())
    assert back is not None and back.state == "done" and back.finished_at == pytest.approx(1_765_000_100.0)


def test_an_older_record_without_the_newer_fields_reads():
    back = Evacuation.from_record("wk-x", {"state": "running", "started_at": "2026-12-06T01:00:00+00:00"})
    assert back is not None and (back.pending, back.moved, back.left, back.was_running) == ([], [], {}, [])
    assert back.resumed_at is None and back.pool_members_dropped == 0


@pytest.mark.parametrize(
    "rec",
    [
        "running",
        [],
        {"state": "exploded"},
        {"state": "running", "started_at": "yesterday"},
        {"state": "running", "left": ["sb-a"]},
        {"state": "running", "pool_members_dropped": "many"},
    ],
)
def test_an_unreadable_record_is_ignored(rec, caplog):
    assert Evacuation.from_record("wk-x", rec) is None
    assert "unreadable" in caplog.text
    assert Evacuation.from_record("wk-x", None) is None

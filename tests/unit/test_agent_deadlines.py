"""The guest agent's one deadline thread (`deadlines.Deadlines`, background commands' timeouts):
calls run once their delay has passed, in deadline order whatever the order they were scheduled
in; a cancelled one never runs; a failing call does not stop the others; cancelled entries do not
pile up."""

from __future__ import annotations

import threading
import time

from atoll.guest.agent import deadlines


def _until(check, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.005)
    return check()


def test_calls_run_in_deadline_order_and_a_cancelled_one_never_runs():
    d = deadlines.Deadlines()
    ran: list[str] = []
    lock = threading.Lock()

    def note(name: str) -> None:
        with lock:
            ran.append(name)

    late = d.call_later(0.4, note, "late")
    gone = d.call_later(0.2, note, "cancelled")
    early = d.call_later(0.1, note, "early")  # earlier than the one the thread sleeps for: it is woken
    gone.cancel()
    assert d.pending() == 2
    assert _until(lambda: len(ran) == 2)
    time.sleep(0.3)  # the cancelled one's time is long past
    assert ran == ["early", "late"]
    assert d.pending() == 0
    late.cancel()  # after it ran: nothing happens
    early.cancel()
    assert d.pending() == 0


def test_a_failing_call_does_not_stop_the_thread():
    d = deadlines.Deadlines()
    ran = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    d.call_later(0, boom)
    d.call_later(0.05, ran.set)
    assert ran.wait(5)


def test_cancelled_entries_are_dropped_not_kept_until_their_time():
    d = deadlines.Deadlines()
    entries = [d.call_later(3600, lambda: None) for _ in range(200)]
    for e in entries[:150]:
        e.cancel()
    assert d.pending() == 50
    assert len(d._heap) < 200  # tidied once half of it was cancelled
    for e in entries[150:]:
        e.cancel()
    assert d.pending() == 0

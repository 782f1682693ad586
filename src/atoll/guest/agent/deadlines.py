"""One thread for every background process's deadline (`timeout_s`): `call_later(delay, fn, *args)`
runs `fn` on that thread once `delay` seconds have passed, unless the handle it returns is
cancelled first.

Why not `threading.Timer`: each starts a thread and waits for it to run, ~2.6 ms inside this
gVisor (ptrace platform; bench/bench_agent_parts.py, start + cancel p50), paid by every E2B
`commands.run` (the SDK always sends a deadline) while the command starts. Here scheduling is a
heap push under a lock (~1 us with its cancel, the same bench), and the thread is woken only when
the new deadline is the earliest. The thread starts with the first deadline and then sleeps in a condition wait without a
timeout while there is none (an idle sandbox uses no CPU).

Used by `handlers_exec` (a background command's timeout; the reaper in `processes` cancels it when
the process exits, `kill_process` when it is removed).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import typing

from .common import log

_TIDY_AT = 64  # cancelled entries are dropped from the heap once they are this many and half of it


class Deadline:
    """A scheduled call; `cancel()` makes sure it does not run (if it has not started)."""

    __slots__ = ("at", "fn", "args", "cancelled", "_owner")

    def __init__(self, owner: Deadlines, at: float, fn: typing.Callable, args: tuple) -> None:
        self._owner = owner
        self.at = at
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self._owner._cancel(self)


class Deadlines:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._cancelled = 0
        self._thread: threading.Thread | None = None

    def call_later(self, delay: float, fn: typing.Callable, *args) -> Deadline:
        entry = Deadline(self, time.monotonic() + max(0.0, delay), fn, args)
        with self._cond:
            heapq.heappush(self._heap, (entry.at, next(self._order), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is entry:  # earlier than what the thread sleeps for
                self._cond.notify()
        return entry

    def pending(self) -> int:
        """How many calls are scheduled and not cancelled (for tests)."""
        with self._cond:
            return len(self._heap) - self._cancelled

    def _cancel(self, entry: Deadline) -> None:
        with self._cond:
            if entry.cancelled or entry.fn is None:  # cancelled already, or run (or running)
                return
            entry.cancelled = True
            self._cancelled += 1
            if self._cancelled >= _TIDY_AT and self._cancelled * 2 >= len(self._heap):
                self._heap = [item for item in self._heap if not item[2].cancelled]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                    self._cancelled -= 1
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                entry = heapq.heappop(self._heap)[2]
                fn, args = entry.fn, entry.args
                entry.fn, entry.args = None, ()  # run: a later cancel() is a no-op
                self._cond.release()
                try:
                    fn(*args)
                except Exception as e:  # a deadline's failure must not end the others
                    log(f"a deadline's call failed: {e!r}")
                finally:
                    self._cond.acquire()


DEADLINES = Deadlines()
"""The agent's one scheduler (a module global, as the thread pool in `handlers_exec` is)."""

"""The agent's thread pool: `pool.submit(fn, *args)` runs a job on a reused daemon thread.

Used by `__main__` (one job per accepted connection) and `handlers_exec` (reading what a finished
command's leftover descendants still write). Parked threads block on a futex, which checkpoints fine.
"""

from __future__ import annotations

import queue
import threading

from .common import format_exc, log

MAX_IDLE_THREADS = 8


class ThreadPool:
    """Reusable daemon threads for pipe readers and connections (thread creation costs ~10 syscalls).

    Threads are started on demand, never queued behind busy ones; up to MAX_IDLE_THREADS finished
    ones stay parked (blocked on a futex, which checkpoints fine) for the next job.
    """

    def __init__(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn, *args) -> None:
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1
        self._jobs.put((fn, args))
        if not reuse:
            try:
                threading.Thread(target=self._work, daemon=True).start()
            except RuntimeError as e:  # can't start new thread: the job waits for the next free one
                log(f"cannot start a thread ({e}); the job waits for a busy thread to finish")
                with self._lock:
                    self._idle -= 1  # that thread will take the queued job instead of parking

    def _work(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                fn(*args)
            except BaseException:
                log("background job failed:\n" + format_exc())
            fn = args = None
            with self._lock:
                if self._idle >= MAX_IDLE_THREADS:
                    return
                self._idle += 1


pool = ThreadPool()

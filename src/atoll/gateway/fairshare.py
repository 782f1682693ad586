"""Fair shares of the gateway's parsing work: no sandbox can take more than its part of the CPU.

Relaying bytes costs the gateway almost nothing (splice, gateway.splice); parsing HTTP does (plain
HTTP is relayed request by request so that each request's Host is checked, and intercepted HTTPS
is decrypted and parsed). A sandbox that sends 1-byte chunks on 64 connections makes the gateway
parse a message per byte. So every parse is measured (CPU seconds of this thread) and charged to
its sandbox's bucket; a sandbox whose bucket is empty waits before its connections read again —
it is slowed, never cut, and the process and the other sandboxes go on.

The buckets refill together at CAPACITY CPU seconds per second, split evenly among the sandboxes
that parsed in the last ACTIVE_S (one busy sandbox alone may use all of it; two get half each),
and hold at most BURST seconds, so a quiet sandbox's first requests are never delayed.
Called by gateway.httprelay (charge, wait) and gateway.egress (one Shares per gateway process).
"""

from __future__ import annotations

import asyncio
import time

CAPACITY = 0.25
"""CPU seconds per second all sandboxes' parsing may use together (a quarter of a core: under the
flood of bench_flood the whole gateway process then uses about half a core)."""
BURST = 0.05
"""What a bucket holds at most (50 ms of parsing, then the sandbox runs at its share)."""
ACTIVE_S = 1.0
MAX_WAIT_S = 1.0
"""A connection waits at most this long at once (then it parses a little and waits again)."""


class Bucket:
    """One sandbox's parsing allowance."""

    def __init__(self, shares: Shares):
        self._shares = shares
        self.tokens = BURST
        self.stamp = time.monotonic()
        self.last_charge = 0.0
        self.spent = 0.0
        """CPU seconds this sandbox's parsing used in all (reported, for the benchmark)."""
        self.waited = 0.0
        """Seconds its connections were held back in all."""

    def _refill(self, now: float) -> None:
        rate = self._shares.rate(now)
        self.tokens = min(BURST, self.tokens + (now - self.stamp) * rate)
        self.stamp = now

    def charge(self, cpu_s: float) -> None:
        now = time.monotonic()
        self._refill(now)
        self.tokens -= cpu_s
        self.spent += cpu_s
        if now - self.last_charge > ACTIVE_S / 4:
            self.last_charge = now
            self._shares.touch(self, now)

    async def wait(self) -> None:
        """Return when the bucket is not in debt (at once, nearly always)."""
        while True:
            now = time.monotonic()
            self._refill(now)
            if self.tokens >= 0:
                return
            delay = min(MAX_WAIT_S, -self.tokens / max(self._shares.rate(now), 1e-6))
            self.waited += delay
            await asyncio.sleep(delay)


class Shares:
    """The buckets of one gateway process."""

    def __init__(self, capacity: float = CAPACITY):
        self.capacity = capacity
        self._active: dict[int, float] = {}

    def bucket(self) -> Bucket:
        return Bucket(self)

    def touch(self, bucket: Bucket, now: float) -> None:
        self._active[id(bucket)] = now
        if len(self._active) > 64:
            self._prune(now)

    def _prune(self, now: float) -> None:
        for k, t in list(self._active.items()):
            if now - t > ACTIVE_S:
                del self._active[k]

    def rate(self, now: float) -> float:
        """Each active sandbox's refill rate now."""
        n = sum(1 for t in self._active.values() if now - t <= ACTIVE_S)
        return self.capacity / max(1, n)


class Meter:
    """Measures a parse (CPU time of this thread) and charges it: `with meter: ...`."""

    __slots__ = ("bucket", "_t0")

    def __init__(self, bucket: Bucket | None):
        self.bucket = bucket
        self._t0 = 0.0

    def __enter__(self) -> Meter:
        self._t0 = time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bucket is not None:
            self.bucket.charge(time.thread_time() - self._t0)

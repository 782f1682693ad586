"""Writes the records database could not take when they were due (PostgreSQL restarting, its
network cut), retried in the background until it can — so a step that already happened on a
worker (a sandbox started) or a key that must be settled is not left half-recorded.

`UNAVAILABLE` is the exception tuple that means "the database cannot be reached now"; `later()`
tries an operation again every RETRY_S for up to GIVE_UP_S. Called by controlplane.lifecycle
(the start of a sandbox made while the database went away) and controlplane.idempotency (settling
a key)."""

from __future__ import annotations

import asyncio
import logging
import time
import typing

from atoll.controlplane import db as dbm

log = logging.getLogger(__name__)

UNAVAILABLE = dbm.UNAVAILABLE
RETRY_S = 0.5
GIVE_UP_S = 600.0


class NotYet(Exception):
    """Raised by an operation that waits for another one first (tried again, like an outage)."""


_pending: set[asyncio.Task] = set()


def later(what: str, op: typing.Callable[[], None]) -> None:
    """Do `op` now; when the database cannot be reached, keep trying in the background."""
    try:
        op()
        return
    except (*UNAVAILABLE, NotYet) as e:
        cause = dbm.cause(e) if not isinstance(e, NotYet) else str(e)
        log.warning("could not %s now (%s); retrying until the database takes it", what, cause)

    async def retry() -> None:
        deadline = time.monotonic() + GIVE_UP_S
        while time.monotonic() < deadline:
            await asyncio.sleep(RETRY_S)
            try:
                op()
            except (*UNAVAILABLE, NotYet):
                continue
            except Exception:  # noqa: BLE001 - log it; nothing else would
                log.exception("could not %s", what)
                return
            log.info("did %s once the database was back", what)
            return
        log.error("gave up trying to %s after %.0f s", what, GIVE_UP_S)

    task = asyncio.ensure_future(retry())
    _pending.add(task)
    task.add_done_callback(_pending.discard)

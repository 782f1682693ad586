"""The watchdog of one open call through the edge: a frozen worker, a revoked key or a sandbox
that moved ends the call with a clear error instead of leaving it waiting for ever.

Every WATCH_S while the call is open it asks (edge.upstream):
- the server, through `Grants.check` (at most every REVALIDATE_S per key and sandbox, shared by
  every call): a refusal (the key revoked, the sandbox deleted) ends the call with the server's
  error; a sandbox that moved to another worker or failed ends it with `503 worker_unavailable`;
  a server that cannot be reached ends nothing (the data path outlives the server);
- the worker, when nothing came from it for WATCH_S or the server says it is lost: its liveness
  probe (`Workers.alive`). A worker that does not answer within PROBE_TIMEOUT_S ends the call with
  `503 worker_unavailable` (retryable). A quiet stream of a live worker (a followed process that
  prints nothing, a watch of a still directory, an idle terminal) is never cut: only a worker that
  does not answer is.

The call is ended by the first way that applies: a wait for the answer's head is cancelled
(`asyncio.timeout` rescheduled to now), a body being read has its connection aborted
(`http11.Response.abort`), a terminal has its tunnel closed (`on_cut`). No task runs for a call
shorter than WATCH_S (a timer only). Used by edge.service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing

from atoll.core import errors
from atoll.edge import upstream
from atoll.shared import http11

log = logging.getLogger(__name__)

WATCH_S = 5.0
"""How often an open call is looked after, and how long a quiet one waits before its worker is probed."""


class Watch:
    """The watchdog of one call (see the module docstring); `close` it when the call ends."""

    def __init__(
        self, grants: upstream.Grants, workers: upstream.Workers, auth: str, sid: str, g: upstream.Grant
    ):
        self._grants, self._workers = grants, workers
        self._auth, self._sid, self._g = auth, sid, g
        self.seen = time.monotonic()
        """When something last came from the worker."""
        self.cut: errors.AtollError | None = None
        """Why the watchdog ended the call (None: it did not)."""
        self.on_cut: typing.Callable[[], None] | None = None
        self._cutter: asyncio.Timeout | None = None
        self._response: http11.Response | None = None
        self._task: asyncio.Task | None = None
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(WATCH_S, self._wake)

    @contextlib.asynccontextmanager
    async def head(self) -> typing.AsyncIterator[None]:
        """Around the wait for the worker's answer: a cut ends it with the watchdog's error."""
        try:
            async with asyncio.timeout(None) as cutter:
                self._cutter = cutter
                try:
                    yield
                finally:
                    self._cutter = None
        except TimeoutError:
            if self.cut is None:
                raise
            raise self.cut from None

    def attach(self, r: http11.Response) -> None:
        """Watch the answer's body: each chunk counts as the worker's sign of life; a cut aborts
        its connection and the reader gets the watchdog's error."""
        self._response = r
        r.wrap_body(self._touching)

    async def _touching(self, chunks: typing.AsyncIterator[bytes]) -> typing.AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                self.seen = time.monotonic()
                yield chunk
        except http11.ChannelError:
            if self.cut is not None:
                raise self.cut from None
            raise

    def _wake(self) -> None:
        self._handle = None
        self._task = asyncio.ensure_future(self._look())

    async def _look(self) -> None:
        try:
            why = await self._verdict()
        except Exception as e:  # noqa: BLE001 - a watchdog that fails must not end the call
            log.warning("the edge's watchdog failed", extra={"sandbox_id": self._sid, "detail": repr(e)})
            why = None
        if why is not None:
            self._cut(why)
        elif self._task is not None:  # not closed meanwhile
            self._handle = self._loop.call_later(WATCH_S, self._wake)

    async def _verdict(self) -> errors.AtollError | None:
        g = self._g
        try:
            verdict = await self._grants.check(self._auth, self._sid, g)
        except upstream.Passed as p:
            return p.error()
        if verdict is upstream.Verdict.MOVED:
            return errors.Unavailable(
                f"sandbox {self._sid} is no longer on worker {g.worker_name!r} (it moved or failed); "
                "the call through the edge was ended — retry it",
                retryable=True,
            )
        if verdict is upstream.Verdict.LOST or time.monotonic() - self.seen >= WATCH_S:
            if not await self._workers.alive(g):
                return errors.Unavailable(
                    f"worker {g.worker_name!r} ({g.url}), which holds sandbox {self._sid}, did not answer "
                    f"the edge's liveness probe within {upstream.PROBE_TIMEOUT_S:g} s (frozen or overloaded); "
                    "the call was ended — retry in a few seconds",
                    retryable=True,
                )
        return None

    def _cut(self, why: errors.AtollError) -> None:
        log.warning("edge call ended: %s", why.message, extra={"sandbox_id": self._sid})
        self.cut = why
        if self._cutter is not None:
            self._cutter.reschedule(self._loop.time())
        if self._response is not None:
            self._response.abort()
        if self.on_cut is not None:
            with contextlib.suppress(Exception):
                self.on_cut()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()

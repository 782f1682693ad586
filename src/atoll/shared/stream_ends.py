"""Streams a pause may end: a sandbox's process output follows and file watches, registered while
they are open, so that `pause(…, end_streams=True)` can end them with a last marker event
(core.worker_api.ProcessEnded, a FileEvent of type `ended`) instead of being refused as busy.

E2B's pause succeeds with process streams open: they end and the processes run on after
`connect` (docs/e2b-compat.md §6.4). Used by worker.service.node.Node and testing.FakeWorker, the
two implementations of the seam's `pause`.
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from atoll.core import worker_api as api

T = typing.TypeVar("T")

REASON = "paused"


class StreamEnds:
    """The endable streams of every sandbox, by sandbox id."""

    def __init__(self) -> None:
        self._open: dict[str, set[asyncio.Event]] = {}

    def count(self, sandbox_id: str) -> int:
        return len(self._open.get(sandbox_id, ()))

    def end(self, sandbox_id: str) -> int:
        """Ask every open stream of the sandbox to end; returns how many were asked."""
        ends = self._open.get(sandbox_id, set())
        for ev in ends:
            ev.set()
        return len(ends)

    def _forget(self, sandbox_id: str, ended: asyncio.Event) -> None:
        ends = self._open.get(sandbox_id)
        if ends is not None:
            ends.discard(ended)
            if not ends:
                del self._open[sandbox_id]

    async def _until_ended(
        self, sandbox_id: str, events: AsyncIterator[T], marker: Callable[[], T]
    ) -> AsyncGenerator[T, None]:
        ended = asyncio.Event()
        self._open.setdefault(sandbox_id, set()).add(ended)
        it = aiter(events)
        stop = asyncio.ensure_future(ended.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(anext(it))
                await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                if nxt.done():
                    try:
                        item = nxt.result()
                    except StopAsyncIteration:
                        return
                    nxt = None
                    yield item
                    continue
                self._forget(sandbox_id, ended)  # ended: no longer open, whenever it is closed
                yield marker()
                return
        finally:
            self._forget(sandbox_id, ended)
            stop.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt

    def process_output(
        self, sandbox_id: str, offset: int, events: AsyncIterator[api.ProcessEvent]
    ) -> AsyncGenerator[api.ProcessEvent, None]:
        """A follow of a process's output that a pause may end with ProcessEnded at the offset
        reached. The caller closes it (`aclose`) when it is done with it."""
        at = offset

        async def seen() -> AsyncIterator[api.ProcessEvent]:
            nonlocal at
            async for ev in events:
                if not isinstance(ev, api.ProcessExit):
                    at = ev.offset
                yield ev

        return self._until_ended(sandbox_id, seen(), lambda: api.ProcessEnded(REASON, at))

    def watch(
        self, sandbox_id: str, path: api.FilePath, events: AsyncIterator[api.FileEvent]
    ) -> AsyncGenerator[api.FileEvent, None]:
        """A watch that a pause may end with an `ended` event."""
        shown = path.decode("utf-8", "replace") if isinstance(path, bytes) else path
        return self._until_ended(sandbox_id, events, lambda: api.FileEvent("ended", shown, True))

"""Bytes moved between two endpoints, and "the first of these to end ends them all": the one relay
loop of atoll's in-Python byte streams.

`pump(read, write)` copies until `read` gives b"" (the peer's end). `first_ends(*coros)` runs
coroutines as tasks until the first of them returns or raises, cancels the others, waits for them,
and gives back the tasks that ended on their own (a caller that cares reads their exceptions).

Used by the worker's port tunnel (`worker.service.tunnel`: a tunnel connection <-> a sandbox's
port), the ingress router (`ingress.router`: an upgraded preview connection), the terminal
WebSocket (`controlplane.routes_pty`) and the "unless the client hangs up" waits of both HTTP APIs
(`unless_disconnected`). The egress gateway moves its bytes in the kernel instead
(`gateway.splice`). Pure asyncio; imports no process.
"""

from __future__ import annotations

import asyncio
import contextlib
import typing

READ = 256 * 1024
"""The most one read asks for."""

Read = typing.Callable[[int], typing.Awaitable[bytes]]
Write = typing.Callable[[bytes], typing.Awaitable[object]]


async def pump(read: Read, write: Write, size: int = READ) -> None:
    """Copy what `read` gives to `write` until `read` gives b""."""
    while True:
        data = await read(size)
        if not data:
            return
        await write(data)


async def first_ends(*coros: typing.Awaitable[object]) -> list[asyncio.Future]:
    """Run `coros` until the first ends (returns or raises); cancel and await the others (also
    when the caller is cancelled). The tasks that ended on their own, in the order given."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [t for t in tasks if not t.cancelled()]


Receive = typing.Callable[[], typing.Awaitable[typing.Mapping[str, typing.Any]]]


async def unless_disconnected(receive: Receive, aw: typing.Awaitable, gone: Exception) -> typing.Any:
    """Await `aw` unless the HTTP client hangs up first (`receive`: the ASGI request's, as
    Starlette's `request.receive`): then cancel it and raise `gone`, instead of letting it run on
    unobserved (a cancelled exec kills the command)."""
    task = asyncio.ensure_future(aw)

    async def hangup() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hangup())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise gone
        return task.result()
    finally:
        watcher.cancel()

"""atoll.shared.relay: `pump` copies until the end of its source; `first_ends` stops every other
direction when one ends (and when its caller is cancelled), and reports the ones that ended."""

from __future__ import annotations

import asyncio

import pytest

from atoll.shared import relay


async def test_pump_copies_until_the_end():
    chunks = [b"ab", b"c", b""]
    got: list[bytes] = []

    async def read(n: int) -> bytes:
        return chunks.pop(0)

    async def write(data: bytes) -> None:
        got.append(data)

    await relay.pump(read, write)
    assert got == [b"ab", b"c"] and chunks == []


async def test_first_to_end_cancels_the_other():
    other_cancelled = asyncio.Event()

    async def quick() -> str:
        return "done"

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            other_cancelled.set()
            raise

    ended = await relay.first_ends(quick(), forever())
    assert [t.result() for t in ended] == ["done"]
    assert other_cancelled.is_set()


async def test_an_exception_ends_it_and_is_reported():
    async def broken() -> None:
        raise OSError("reset")

    ended = await relay.first_ends(asyncio.sleep(3600), broken())
    assert len(ended) == 1 and isinstance(ended[0].exception(), OSError)


async def test_cancelling_the_caller_cancels_every_direction():
    started = asyncio.Event()
    cancelled = []

    async def forever(name: str) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    outer = asyncio.ensure_future(relay.first_ends(forever("a"), forever("b")))
    await started.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert sorted(cancelled) == ["a", "b"]

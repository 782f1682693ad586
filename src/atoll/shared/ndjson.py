"""Newline-delimited JSON read from a byte stream: the one line splitter every stream of atoll uses.

A line ends at b"\\n" only. JSON strings may carry U+2028, U+2029 and U+0085 raw (atoll writes
UTF-8, not \\u escapes), and `str.splitlines` and httpx's `iter_lines` end a line at each of
them, so a file named with one of those characters would cut an event in two. Blank lines are
keep-alives and are skipped; a last line without its newline is still a line.

Used by the worker (`worker.runtimes.guest`: the agent's exec, process and watch streams), the
control plane (`controlplane.remote_worker`: the worker's streams) and the SDK (`atoll._client`:
exec, process output and watch streams). Pure: no I/O, stdlib only.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator


class Splitter:
    """Cuts the chunks of a stream into lines: `feed` each chunk, then `end` once."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete, non-blank lines `chunk` finishes (without their newline)."""
        parts = (self._pending + chunk).split(b"\n")
        self._pending = parts.pop()
        return [line for line in parts if line.strip()]

    def end(self) -> list[bytes]:
        """The last line, if the stream ended without a newline after it."""
        rest, self._pending = self._pending, b""
        return [rest] if rest.strip() else []


async def alines(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The non-blank lines of an asynchronous stream of byte chunks. Closed (or ended), it closes
    `chunks` when that is an asynchronous generator: one left to the garbage collector costs the
    event loop a wake-up and a task of its own (asyncio's finaliser hook)."""
    splitter = Splitter()
    try:
        async for chunk in chunks:
            for line in splitter.feed(chunk):
                yield line
        for line in splitter.end():
            yield line
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # still being read elsewhere: ends with its reader
                await aclose()


def lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The non-blank lines of a stream of byte chunks (the synchronous twin of `alines`)."""
    splitter = Splitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.end()

"""Where a command's output goes: `Capture` keeps a bounded head and tail of each stream for a plain
exec answer, `Stream` sends it as ndjson chunks as it arrives, and `drain_leftovers` reads and drops
what a command's leftover descendants still write once the exec has answered.

Used by `handlers_exec`; both sinks take `add(kind, data)` / `end(kind)` with kind "stdout"/"stderr".
"""

from __future__ import annotations

import codecs
import os
import select

from .common import dumps
from .connection import Conn
from .execspec import DEFAULT_CAPTURE

PIPE_READ = 1 << 16  # one read() from a command's pipe


class Capture:
    """Non-streaming output: the first half and the last half of `limit` bytes of each stream.

    Memory stays within `limit` bytes per stream (plus one pipe read) whatever the command writes:
    the head fills first, then the tail keeps only the latest bytes. What falls between is counted
    and replaced in the answer by a marker naming the number of bytes dropped.
    """

    def __init__(self, limit: int = DEFAULT_CAPTURE) -> None:
        self.head_limit = limit - limit // 2
        self.tail_limit = limit // 2
        self.head = {"stdout": bytearray(), "stderr": bytearray()}
        self.tail = {"stdout": bytearray(), "stderr": bytearray()}
        self.total = {"stdout": 0, "stderr": 0}

    def add(self, kind: str, data: bytes) -> None:
        self.total[kind] += len(data)
        head = self.head[kind]
        room = self.head_limit - len(head)
        if room > 0:
            head += data[:room]
            data = data[room:]
        if not data or not self.tail_limit:
            return
        tail = self.tail[kind]
        if len(data) >= self.tail_limit:
            tail[:] = data[-self.tail_limit :]
        else:
            tail += data
            excess = len(tail) - self.tail_limit
            if excess > 0:
                del tail[:excess]  # cheap: bytearray drops a prefix by moving its start

    def end(self, kind: str) -> None:
        pass

    def result(self, kind: str) -> tuple[str, int]:
        """The stream's text for the answer and how many of its bytes were left out."""
        head, tail = bytes(self.head[kind]), bytes(self.tail[kind])
        dropped = self.total[kind] - len(head) - len(tail)
        if not dropped:
            return (head + tail).decode("utf-8", "replace"), 0
        # Cut at character boundaries: an incomplete UTF-8 sequence at the head's end and
        # continuation bytes at the tail's start are dropped rather than shown as U+FFFD.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        head_text = decoder.decode(head)
        pending = len(decoder.getstate()[0])
        skip = 0
        while skip < min(3, len(tail)) and 0x80 <= tail[skip] < 0xC0:
            skip += 1
        dropped += pending + skip
        tail_text = tail[skip:].decode("utf-8", "replace")
        marker = (
            f"\n…[atoll: {dropped} bytes of {kind} truncated here; the first {len(head) - pending} and "
            f"the last {len(tail) - skip} bytes are kept. Stream the output (Accept: application/x-ndjson), "
            "redirect it to a file, or raise max_output_bytes to get more]…\n"
        )
        return head_text + marker + tail_text, dropped


class Stream:
    """Streaming output: one ndjson line per piece, decoded incrementally."""

    def __init__(self, conn: Conn):
        self.conn = conn
        self.decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("stdout", "stderr")}

    def add(self, kind: str, data: bytes) -> None:
        text = self.decoders[kind].decode(data)
        if text:
            self.conn.write_chunk(dumps({kind: text}) + b"\n")

    def end(self, kind: str) -> None:
        self.add_final(kind)

    def add_final(self, kind: str) -> None:
        text = self.decoders[kind].decode(b"", final=True)
        if text:
            self.conn.write_chunk(dumps({kind: text}) + b"\n")


def drain_leftovers(files: list) -> None:
    """Read and drop what a command's leftover descendants still write to its pipes, until EOF.

    Closing the pipes instead would kill such a descendant (`server &` started without redirection)
    with SIGPIPE on its next write.
    """
    poller = select.poll()
    by_fd = {f.fileno(): f for f in files}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    while by_fd:
        for fd, _ in poller.poll():
            try:
                data = os.read(fd, PIPE_READ)
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                by_fd.pop(fd).close()

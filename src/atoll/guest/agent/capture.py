"""Where a command's output goes: `Capture` keeps the head of each stream for a plain exec answer,
`Stream` sends it as ndjson chunks as it arrives, and `drain_leftovers` reads and drops what a
command's leftover descendants still write once the exec has answered.

Used by `handlers_exec`; both sinks take `add(kind, data)` / `end(kind)` with kind "stdout"/"stderr".
"""

from __future__ import annotations

import codecs
import os
import select

from .common import dumps
from .connection import Conn

PIPE_READ = 1 << 16  # one read() from a command's pipe
MAX_CAPTURE = 64 << 20  # per stream, non-streaming exec


class Capture:
    """Non-streaming output: the head of each stream, up to MAX_CAPTURE bytes."""

    def __init__(self) -> None:
        self.parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.size = {"stdout": 0, "stderr": 0}
        self.dropped = {"stdout": 0, "stderr": 0}

    def add(self, kind: str, data: bytes) -> None:
        room = MAX_CAPTURE - self.size[kind]
        if len(data) > room:
            self.dropped[kind] += len(data) - max(room, 0)
            data = data[: max(room, 0)]
        if data:
            self.parts[kind].append(data)
            self.size[kind] += len(data)

    def end(self, kind: str) -> None:
        pass

    def text(self, kind: str) -> str:
        text = b"".join(self.parts[kind]).decode("utf-8", "replace")
        if self.dropped[kind]:
            text += f"…[truncated {self.dropped[kind]} bytes]"
        return text


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

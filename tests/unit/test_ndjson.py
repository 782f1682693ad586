"""atoll.shared.ndjson, the one line splitter of every stream: lines end at b"\\n" only (a JSON
string may carry U+2028/U+0085 raw), in any split of the chunks; blank lines are skipped and a
last line without its newline still counts."""

from __future__ import annotations

import asyncio
import json

from atoll.shared import ndjson

EVENTS = [{"path": "a\u2028b\u0085c\u2029d", "type": "create"}, {"stdout": "x\r\ny"}, {"exit_code": 0}]
STREAM = b"".join(json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in EVENTS)


def test_every_split_of_the_stream_gives_the_same_lines():
    for size in range(1, len(STREAM) + 1):
        chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
        assert [json.loads(line) for line in ndjson.lines(chunks)] == EVENTS


def test_async_twin_and_a_last_line_without_newline():
    async def chunks():
        yield STREAM
        yield b'{"tail": 1}'

    async def collect():
        return [json.loads(line) async for line in ndjson.alines(chunks())]

    assert asyncio.run(collect()) == [*EVENTS, {"tail": 1}]


def test_blank_and_whitespace_lines_are_keepalives():
    splitter = ndjson.Splitter()
    assert splitter.feed(b"\n  \n{}") == []
    assert splitter.end() == [b"{}"]
    assert splitter.end() == []

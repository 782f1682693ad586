"""atoll.shared.ipc: messages, calls and descriptors between atoll's own processes, on socketpairs.

The channel carries the egress gateway's and the ingress router's sockets, so these check what
they rely on: replies match their calls, errors come back typed, sockets arrive usable and owned by
the receiver, big messages are fragmented, a peer that goes away ends calls in flight, and a child
process that dies is started again."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys

import pytest

from atoll.shared import ipc


async def _pair(handler=None, on_event=None):
    a, b = ipc.pair()
    left = ipc.Channel(a, name="left")
    right = ipc.Channel(b, handler=handler, on_event=on_event, name="right")
    left.start()
    right.start()
    return left, right


async def test_calls_get_their_own_replies_even_out_of_order():
    async def handler(msg, fds):
        await asyncio.sleep(msg["delay"])
        return {"echo": msg["n"]}

    left, right = await _pair(handler)
    try:
        replies = await asyncio.gather(*(left.call("echo", n=n, delay=(5 - n) / 100) for n in range(5)))
        assert [r["echo"] for r, _ in replies] == list(range(5))
    finally:
        await left.aclose()
        await right.aclose()


async def test_errors_come_back_typed_and_os_errors_keep_their_errno():
    async def handler(msg, fds):
        if msg["op"] == "bad":
            raise ipc.CallError("invalid_request", "bad thing", None)
        if msg["op"] == "refused":
            raise ConnectionRefusedError("nothing listens")
        raise OSError(errno.EMFILE, "Too many open files")

    left, right = await _pair(handler)
    try:
        with pytest.raises(ipc.CallError) as e:
            await left.call("bad")
        assert (e.value.code, e.value.message) == ("invalid_request", "bad thing")
        with pytest.raises(ipc.CallError) as e:
            await left.call("refused")
        assert e.value.code == "refused"
        with pytest.raises(ipc.CallError) as e:
            await left.call("emfile")
        assert e.value.code == "os_error" and e.value.errno == errno.EMFILE
    finally:
        await left.aclose()
        await right.aclose()


async def test_sockets_travel_both_ways_and_work_on_arrival():
    got: list[socket.socket] = []

    async def handler(msg, fds):
        got.extend(fds)
        x, y = socket.socketpair()
        fds[0].sendall(b"from the other side")
        return {"n": len(fds)}, [x]

    left, right = await _pair(handler)
    mine, theirs = socket.socketpair()
    try:
        reply, back = await left.call("take", fds=[theirs])
        theirs.close()  # the channel sent a copy: ours can go
        assert reply["n"] == 1 and len(back) == 1
        assert mine.recv(100) == b"from the other side"
        back[0].close()
    finally:
        for s in (mine, *got):
            s.close()
        await left.aclose()
        await right.aclose()


async def test_a_large_message_is_fragmented_and_whole_on_arrival():
    async def handler(msg, fds):
        return {"size": len(msg["blob"])}

    left, right = await _pair(handler)
    try:
        blob = "x" * (3 * 1024 * 1024 + 17)
        reply, _ = await left.call("big", blob=blob)
        assert reply["size"] == len(blob)
    finally:
        await left.aclose()
        await right.aclose()


async def test_events_need_no_reply_and_keep_their_order():
    seen: list[int] = []
    left, right = await _pair(on_event=lambda m: seen.append(m["n"]))
    try:
        for n in range(100):
            left.event(n=n)
        for _ in range(100):
            if len(seen) == 100:
                break
            await asyncio.sleep(0.01)
        assert seen == list(range(100))
    finally:
        await left.aclose()
        await right.aclose()


async def test_a_peer_that_goes_away_ends_the_calls_in_flight():
    async def handler(msg, fds):
        await asyncio.sleep(30)

    left, right = await _pair(handler)
    call = asyncio.ensure_future(left.call("slow", timeout=None))
    await asyncio.sleep(0.05)
    await right.aclose()
    with pytest.raises(ipc.ChannelClosed):
        await asyncio.wait_for(call, 5)
    assert left.closed.is_set()
    with pytest.raises(ipc.ChannelClosed):
        left.send({"t": "event"})
    await left.aclose()


CHILD = r"""
import asyncio, socket, sys
from atoll.shared import ipc
async def main():
    async def handler(msg, fds):
        if msg["op"] == "die":
            asyncio.get_running_loop().call_later(0.05, sys.exit, 3)
        return {"pid": __import__("os").getpid()}
    ch = ipc.Channel(socket.socket(fileno=int(sys.argv[1])), handler=handler)
    ch.start()
    await ch.closed.wait()
asyncio.run(main())
"""


async def test_a_child_that_dies_is_started_again_and_told_what_it_must_know():
    starts: list[int] = []

    async def on_start(chan: ipc.Channel) -> None:
        reply, _ = await chan.call("hello")
        starts.append(reply["pid"])

    child = ipc.Child(
        "test child",
        lambda fd, _extra: [sys.executable, "-c", CHILD, str(fd)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        on_start=on_start,
    )
    await child.start(20)
    try:
        first = child.pid
        assert starts == [first]
        chan = child.running()
        assert chan is not None
        await chan.call("die")  # answered, then the child exits with status 3
        await asyncio.wait_for(chan.closed.wait(), 5)
        for _ in range(200):
            if len(starts) == 2 and child.running() is not None:
                break
            await asyncio.sleep(0.05)
        assert len(starts) == 2 and starts[1] != first and child.restarts == 1
    finally:
        await child.aclose()
    assert child.proc is not None and child.proc.returncode is not None

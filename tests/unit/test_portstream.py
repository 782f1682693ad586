"""atoll.shared.portstream: a SocketPort used by two tasks at once from the start (a terminal's reader and
writer) makes one transport, not two racing for the same socket; detach hands the socket over only
before that; read_line takes nothing past its newline."""

from __future__ import annotations

import asyncio
import socket

from atoll.shared import portstream


async def test_concurrent_first_use_makes_one_transport_and_loses_no_byte():
    for _ in range(20):
        ours, theirs = socket.socketpair()
        port = portstream.SocketPort(ours)
        theirs.sendall(b"x" * 50000)

        async def read_all(p: portstream.SocketPort) -> bytes:
            got = b""
            while len(got) < 50000:
                got += await p.read(4096)
            return got

        reader = asyncio.ensure_future(read_all(port))
        await port.write(b"ping")  # the writer's first use races the reader's
        assert await asyncio.wait_for(reader, 5) == b"x" * 50000
        assert theirs.recv(10) == b"ping"
        assert port.detach() is None  # streams exist: the socket is theirs now
        port.close()
        theirs.close()


async def test_detach_before_use_hands_the_socket_over():
    ours, theirs = socket.socketpair()
    port = portstream.SocketPort(ours)
    sock = port.detach()
    assert sock is ours and port.closed and port.detach() is None
    sock.close()
    theirs.close()


async def test_read_line_leaves_what_follows_for_the_next_reader():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.sendall(b"OK\nfirst bytes of the sandbox")
    assert await portstream.read_line(ours) == b"OK\n"
    assert ours.recv(100) == b"first bytes of the sandbox"
    theirs.sendall(b"x" * 3000)
    try:
        await portstream.read_line(ours, limit=2048)
        raise AssertionError("no line in 2048 bytes must be refused")
    except ValueError:
        pass
    ours.close()
    theirs.close()

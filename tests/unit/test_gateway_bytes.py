"""gateway.egress's byte counters: the sandbox side's TCP_INFO (received = out of the sandbox,
acknowledged = into it), read live by `stats` and added to the counters once when the connection
is reset. Over a real loopback connection (the gateway's side plays the sandbox's peer)."""

from __future__ import annotations

import asyncio

from atoll.gateway import egress


async def test_a_connection_s_bytes_are_counted_once_at_its_reset():
    accepted: asyncio.Queue = asyncio.Queue()

    async def on_conn(reader, writer):
        await accepted.put((reader, writer))

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # "sandbox" is the program; the gateway holds the accepted side
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", port)
        g_reader, g_writer = await accepted.get()
        s_writer.write(b"o" * 3000)  # out of the sandbox
        await s_writer.drain()
        assert len(await g_reader.readexactly(3000)) == 3000
        g_writer.write(b"i" * 70_000)  # into the sandbox
        await g_writer.drain()
        assert len(await s_reader.readexactly(70_000)) == 70_000
        await asyncio.sleep(0.05)  # the last ACK
        counters = egress.Counters()
        conn = egress._Conn(g_writer, counters=counters)
        assert egress._tcp_bytes(g_writer) == (70_000, 3000)
        egress._reset(g_writer, conn)
        egress._reset(g_writer, conn)  # a second reset adds nothing
        assert (counters.bytes_in, counters.bytes_out) == (70_000, 3000)
        await asyncio.sleep(0.01)  # the abort closes the socket on the loop's next turn
        assert egress._tcp_bytes(g_writer) == (0, 0)  # why the bytes are read before the reset
        s_writer.close()
    finally:
        server.close()
        await server.wait_closed()

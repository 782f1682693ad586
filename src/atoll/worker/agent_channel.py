"""The worker's HTTP/1.1 channel to one sandbox's guest agent, opened inside that sandbox's host-side netns.

Sockets are created on a dedicated thread that enters the host-side namespace with setns(2) and
leaves again (a socket keeps the namespace it was born in), then driven on the event loop by the
shared HTTP/1.1 client (atoll.http11: asyncio streams and h11, ~1 ms less per exec and per resume
ping than httpx). Connections are kept alive and reused.

Every socket has SO_LINGER 0 and TCP_NODELAY: when the worker closes a connection it sends an RST,
so no TIME_WAIT endpoint ever lands inside the sandbox (this runsc cannot checkpoint one). Before a
disk checkpoint the worker calls `abort_all()`.
Called by worker.guest.
"""

from __future__ import annotations

import asyncio
import socket

from atoll import http11
from atoll.worker import netns

MAX_ANSWER_BYTES = http11.MAX_ANSWER_BYTES
ChannelError = http11.ChannelError
AnswerTooLarge = http11.AnswerTooLarge
Response = http11.Response


class AgentChannel(http11.Channel):
    """HTTP/1.1 client bound to one sandbox's guest agent (sockets born in its host-side netns)."""

    def __init__(self, ns_name: str, ip: str, port: int):
        super().__init__(ip, port)
        self._ns_path = netns.path(netns.host_side(ns_name))

    async def make_socket(self) -> socket.socket:
        return await asyncio.get_running_loop().run_in_executor(
            netns.ns_thread, netns.socket_in, self._ns_path
        )

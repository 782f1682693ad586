"""The worker's HTTP/1.1 channel to one sandbox's guest agent, opened inside that sandbox's host-side netns.

Sockets are created on a dedicated thread that enters the host-side namespace with setns(2) and
leaves again (a socket keeps the namespace it was born in), then driven on the event loop by the
shared HTTP/1.1 client (atoll.shared.http11: asyncio streams and h11, ~1 ms less per exec and per resume
ping than httpx). Connections are kept alive and reused.

Every socket has SO_LINGER 0 and TCP_NODELAY: when the worker closes a connection it sends an RST,
so no TIME_WAIT endpoint ever lands inside the sandbox (this runsc cannot checkpoint one). Before a
disk checkpoint the worker calls `abort_all()`.
Called by worker.guest.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from atoll.core import errors
from atoll.shared import http11
from atoll.worker.host import netns

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = http11.MAX_ANSWER_BYTES
ChannelError = http11.ChannelError
AnswerTooLarge = http11.AnswerTooLarge
Response = http11.Response


STRAY_CHECK_AFTER_S = 1.0


class AgentChannel(http11.Channel):
    """HTTP/1.1 client bound to one sandbox's guest agent (sockets born in its host-side netns).

    The agent never refuses a connection once it runs (its listener is restored with it), but the
    host kernel does when eth0 holds an address while gVisor runs the sandbox (an `ip` that landed
    after runsc took the interface over). Connections refused for STRAY_CHECK_AFTER_S
    get that address removed (netns.drop_stray_address) and one more try; a sandbox still booting
    refuses for less than that and costs nothing."""

    def __init__(self, ns_name: str, ip: str, port: int):
        super().__init__(ip, port)
        self._ns_name = ns_name
        self._ns_path = netns.path(netns.host_side(ns_name))
        self._refused_since: float | None = None
        self.ended: errors.AtollError | None = None
        """Why the worker closed this channel on purpose (the sandbox deleted or checkpointed), for
        the calls it cut: set by guest.GuestAgents.close."""

    async def make_socket(self) -> socket.socket:
        return await asyncio.get_running_loop().run_in_executor(
            netns.ns_thread, netns.socket_in, self._ns_path
        )

    async def _connect(self) -> http11._Conn:
        try:
            conn = await super()._connect()
        except http11.ConnectFailed as e:
            if not isinstance(e.__cause__, ConnectionRefusedError):
                raise
            now = time.monotonic()
            if self._refused_since is None:
                self._refused_since = now
            if now - self._refused_since < STRAY_CHECK_AFTER_S:
                raise
            self._refused_since = now  # checked: not again for a while
            if not await netns.drop_stray_address(self._ns_name):
                raise
            log.warning("removed a stray address from eth0 of %s (it made the host refuse)", self._ns_name)
            conn = await super()._connect()
        self._refused_since = None
        return conn

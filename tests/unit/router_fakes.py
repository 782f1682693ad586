"""A stand-in for the ingress router's backend, shared by the router's unit tests."""

from __future__ import annotations

import asyncio
import socket

from atoll.core import preview
from atoll.ingress import router as router_mod
from atoll.shared import portstream


class Backend:
    """Previews: every request granted, connected to the stand-in for the sandbox's port."""

    def __init__(self, port: int):
        self.port = port
        self.targets: list[preview.Target] = []

    async def admit(self, target, token, expires, sig, cookie):
        self.targets.append(target)
        return router_mod.Grant("public")

    async def ready(self, target):
        return None

    async def connect(self, target):
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        return portstream.SocketPort(sock)

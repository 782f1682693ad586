"""The ingress router's process, seen from the control plane: started, kept running, answered.

`atoll server` and `atoll up` bind ATOLL_INGRESS_HOST:ATOLL_INGRESS_PORT themselves (a port in use is
their start-up error), then start `python -m atoll.ingress` (ingress.service) with that socket and a
channel (atoll.shared.ipc), give it its TLS certificate, and answer what it asks with
controlplane.previews: `admit` (token, signed URL, cookie, public port; then resume a sandbox in
standby — concurrent requests share one resume — all in one round trip per request), `ready` (the
same resume, for a WebSocket's messages) and `connect` — the connection into the
sandbox's port the worker opens (WorkerAPI.open_port), whose socket is handed to the router
(PortStream.detach), so preview bytes never cross the API's event loop. With E2B's API served, `e2b`
({host, port, tls}: where the edge child listens) lets the router relay E2B_DOMAIN mode's hosts
there (`api.{domain}`, `49983-{sid}.{domain}`, `49999-{sid}.{domain}`). If the router process dies
it is started again with the same socket. Stopping the server stops it; sandboxes keep running.
Called by controlplane.main (build, start) and atoll.up.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

from atoll.controlplane import previews as previews_mod
from atoll.core import config, errors, preview
from atoll.shared import ipc

log = logging.getLogger(__name__)


def _target(raw: object) -> preview.Target:
    if not isinstance(raw, dict):
        raise ipc.CallError("invalid_request", "a target is {sandbox_id, port}")
    return preview.Target(str(raw.get("sandbox_id", "")), int(raw.get("port", 0)))


class IngressHost:
    def __init__(
        self,
        previews: previews_mod.Previews,
        *,
        host: str,
        port: int,
        domain: str,
        tls: dict,
        trusted_proxies: tuple[str, ...] = (),
        e2b: dict | None = None,
        log_format: str = "text",
        log_level: str = "INFO",
    ):
        self.previews = previews
        self.host, self.port = host, port
        self.tls = tls
        cfg = {
            "domain": domain,
            "trusted_proxies": list(trusted_proxies),
            "e2b": e2b,
            "log_format": log_format,
            "log_level": log_level,
        }
        self.sock: socket.socket | None = None
        self.child = ipc.Child(
            "ingress router",
            lambda fd, extra: [
                sys.executable,
                "-m",
                "atoll.ingress",
                "--channel",
                str(fd),
                "--listen",
                str(extra[0]),
            ],
            env={**os.environ, "ATOLL_INGRESS_CONFIG": json.dumps(cfg)},
            extra_fds=lambda: [self.sock.fileno()] if self.sock is not None else [],
            on_start=self._configure,
            handler=self.handle,
        )

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def bind(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # a connection that sends no byte (no ClientHello) is never handed to the router
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 10)
            sock.bind((self.host, self.port))
            sock.listen(1024)
        except OSError as e:
            sock.close()
            raise config.SettingsError(
                f"the ingress router cannot listen on {self.host}:{self.port} ({e.strerror}); "
                "set ATOLL_INGRESS_PORT to a free port"
            ) from None
        self.sock = sock

    async def start(self) -> None:
        if self.sock is None:
            self.bind()
        await self.child.start()

    async def _configure(self, chan: ipc.Channel) -> None:
        await chan.call("tls", timeout=20, **self.tls)

    async def stats(self) -> dict:
        chan = self.child.running()
        if chan is None:
            return {}
        reply, _ = await chan.call("stats", timeout=5)
        return {k: reply[k] for k in ("requests", "refused", "evicted") if k in reply}

    async def handle(self, msg: dict, fds: list[socket.socket]):
        for s in fds:
            s.close()
        op = msg.get("op")
        try:
            target = _target(msg.get("target"))
            if op == "admit":
                grant = self.previews.authorize(
                    target, msg.get("token"), msg.get("expires"), msg.get("sig"), msg.get("cookie")
                )
                await self.previews.ready(target)
                return {"via": grant.via, "cookie": grant.cookie, "max_age": grant.max_age}
            if op == "ready":
                await self.previews.ready(target)
                return {}
            if op == "connect":
                port = await self.previews.connect(target)
                sock = port.detach()
                if sock is None:
                    port.close()
                    raise errors.RuntimeFailure(
                        "the connection into the sandbox cannot be handed to the router"
                    )
                return {}, [sock]
        except errors.AtollError as e:
            raise ipc.CallError(e.code, e.message) from None
        raise ipc.CallError("invalid_request", f"unknown operation {op!r}")

    async def aclose(self) -> None:
        await self.child.aclose()
        if self.sock is not None:
            self.sock.close()
            self.sock = None

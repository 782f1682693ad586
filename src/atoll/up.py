"""`atoll up`: the control plane and one local worker in one process, with embedded defaults.

The worker (worker.service.node.Node) runs in-process and is the control plane's worker `local`, reached
through the same seam as a remote one (core.worker_api), without HTTP. Start-up: the worker
prepares the host and reattaches to the sandboxes a previous run left (they kept running: runsc
lives in its own sessions), the control plane adopts it (records reconciled with its inventory,
orphans removed) before the API serves, and the `base` template is prepared in the background
(`/healthz` answers 200 once it is). Stopping never stops a sandbox. Called by the CLI
(`atoll up`) and atoll.testing.

The worker's seam is also served on a loopback listener of its own (`SeamListener`: the worker's
HTTP API, worker.service.httpapi, on 127.0.0.1 at ATOLL_UP_WORKER_PORT or a free port, and its
port tunnel for terminals) with a random token made at each start, and the worker object gets that
`url` and `token`. Only the grant route (controlplane.routes_grant) uses them: the edge (`atoll
edge`, the E2B edge) then reaches `atoll up`'s sandboxes with grants as it does a split
installation's; every call of the server itself stays in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import socket
import sys
import typing

import uvicorn

from atoll.controlplane import main as server_main
from atoll.controlplane import settings as server_settings
from atoll.core import config
from atoll.shared import entry
from atoll.worker.service import httpapi
from atoll.worker.service import node as node_mod
from atoll.worker.service import settings as worker_settings
from atoll.worker.service.tunnel import Tunnel

log = logging.getLogger("atoll.up")

LISTEN_HOST = "127.0.0.1"


def worker_port(env: typing.Mapping[str, str] = os.environ) -> int:
    """ATOLL_UP_WORKER_PORT: the loopback port `atoll up` serves its worker's seam on (grants, the
    edge); 0 or unset = a free port."""
    raw = env.get("ATOLL_UP_WORKER_PORT", "").strip() or "0"
    if not (raw.isascii() and raw.isdigit()) or not 0 <= int(raw) <= 65535:
        raise config.SettingsError(
            f"ATOLL_UP_WORKER_PORT {raw[:40]!r} is not a port (0-65535; 0 = a free one)"
        )
    return int(raw)


def load(port: int | None = None, home: str | None = None, host: str | None = None, slots: int | None = None):
    s = server_settings.load(port=port, home=home, host=host)
    w = worker_settings.load(home=s.home, name="local", slots=slots)
    return s, w, worker_port()


class _QuietServer(uvicorn.Server):
    """uvicorn inside a process that already serves: the signals stay the API server's."""

    @contextlib.contextmanager
    def capture_signals(self) -> typing.Iterator[None]:
        yield


class SeamListener:
    """The in-process worker's seam on loopback (worker.service.httpapi and its port tunnel), with
    a token of this run; sets the worker's `url`, `token` and `tunnel_port`."""

    def __init__(self, worker: typing.Any, port: int = 0, host: str = LISTEN_HOST):
        """`worker`: the Node (a FakeWorker in tests)."""
        self.worker, self.port, self.host = worker, port, host
        self.creds = httpapi.Credentials()
        self.tunnel: Tunnel | None = None
        self.server: _QuietServer | None = None
        self._serving: asyncio.Task | None = None
        self.sock: socket.socket | None = None

    def bind(self) -> None:
        """Take the port (before anything starts: a port in use is a start-up error naming it)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise config.SettingsError(
                f"ATOLL_UP_WORKER_PORT {self.port} on {self.host} {why}; pick another (0 = a free one)"
            ) from None
        sock.listen(1024)
        sock.setblocking(False)
        self.sock = sock

    async def start(self) -> str:
        """Serve on the bound port and give the worker its URL and token; the URL."""
        if self.sock is None:
            self.bind()
        sock = self.sock
        assert sock is not None
        token = secrets.token_urlsafe(32)
        self.creds.set(token)
        self.tunnel = Tunnel(self.worker, lambda: self.creds.tunnel, grant_key=lambda: self.creds.token)
        tunnel_port = await self.tunnel.start(self.host)
        self.server = _QuietServer(
            uvicorn.Config(
                httpapi.create_app(self.worker, self.creds),
                log_config=None,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=3,
                timeout_keep_alive=3600,
            )
        )
        self._serving = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        url = f"http://{self.host}:{sock.getsockname()[1]}"
        self.worker.url, self.worker.token, self.worker.tunnel_port = url, token, tunnel_port
        log.info("local worker's seam listening on %s (tunnel port %d) for grants", url, tunnel_port)
        return url

    async def aclose(self) -> None:
        if self.server is not None and self._serving is not None:
            hub = getattr(self.worker, "hub", None)
            if hub is not None:
                hub.close()  # end its event streams: uvicorn would wait for them
            self.server.should_exit = True
            with contextlib.suppress(BaseException):
                await self._serving
        if self.tunnel is not None:
            await self.tunnel.aclose()
        if self.sock is not None:
            self.sock.close()


async def serve(s: server_settings.ServerSettings, w: worker_settings.WorkerSettings, port: int = 0) -> int:
    worker = node_mod.Node(w)
    try:
        worker.claim_home()
    except node_mod.HomeInUse as e:
        print(f"atoll: {e.message}", file=sys.stderr)
        return 2
    listener = SeamListener(worker, port)
    try:
        listener.bind()
    except config.SettingsError as e:
        print(f"atoll: invalid setting: {e}", file=sys.stderr)
        return 2
    manager, tiers, app = server_main.build(s)

    async def attach() -> None:
        await worker.start()
        await listener.start()
        await manager.workers.attach_local(worker)

    async def detach() -> None:
        await listener.aclose()
        await worker.aclose()

    await server_main.serve_api(
        s,
        manager,
        tiers,
        app,
        up="atoll",
        down="atoll stopped; sandboxes keep running and are reattached by the next `atoll up`",
        local=(attach, detach),
    )
    return 0


def main(
    port: int | None = None, home: str | None = None, host: str | None = None, slots: int | None = None
) -> None:
    s, w, seam_port = entry.settings_or_exit(
        "atoll", lambda: load(port=port, home=home, host=host, slots=slots)
    )
    entry.start(
        "atoll", s, log, needs_root=f"the local worker needs root ({entry.ROOT_FOR})", worker=w.redacted()
    )
    entry.run(serve(s, w, seam_port))

"""`atoll worker --server URL --name NAME`: one worker process, registered with a control plane.

Loads the worker's settings, prepares the host and reattaches to the sandboxes of its home
(worker.node), serves the worker API (worker.httpapi) on `--listen` (a free loopback port by
default; over TLS when the server is https://, with the certificate it gets from the installation
CA before registering, worker.registration.Identity), and registers and heartbeats
(worker.registration). SIGINT/SIGTERM stop the worker, never
its sandboxes: the server is told it stops (shown lost), and the next `atoll worker` with the same
name and home takes them back. The stop is finished — the server told, the tunnel and channels
closed, deletions waited for, the installation's empty parent cgroups removed — before the process
ends by the signal it got (uvicorn re-raises it as soon as it stops serving, which used to kill the
process before any of that ran). Exit status 2 for a bad setting or a refusal no retry can fix.
Called by the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import typing

import uvicorn

from atoll.core import config
from atoll.shared import entry
from atoll.worker.host import storage
from atoll.worker.service import httpapi, node, registration
from atoll.worker.service import settings as settings_mod
from atoll.worker.service.tunnel import Tunnel

log = logging.getLogger("atoll.worker")


class _Server(uvicorn.Server):
    """uvicorn, ending the worker's event streams as soon as shutdown begins (uvicorn would wait
    for those long-lived answers until its graceful timeout), and keeping the stop signal it caught
    for after the worker's own clean-up (`caught`), instead of re-raising it when serving ends."""

    def __init__(self, config: uvicorn.Config, on_shutdown: typing.Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self.caught: list[int] = []

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> typing.Iterator[None]:
        with super().capture_signals():
            yield
            self.caught = list(self._captured_signals)
            self._captured_signals.clear()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only then, and
    # without it every answer (headers, then body) waited ~40 ms for a delayed ACK (measured)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(s: settings_mod.WorkerSettings, caught: list[int] | None = None) -> int:
    """Run the worker until it is stopped; the exit status. The stop signals caught are appended
    to `caught`, for the caller to re-raise once the event loop is closed."""
    storage.private_dir(s.home)
    worker = node.Node(s)
    try:
        worker.claim_home()
        sock = _bind(*s.listen)
    except node.HomeInUse as e:
        print(f"atoll worker: {e.message}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"atoll worker: cannot listen on {s.listen[0]}:{s.listen[1]} ({e.strerror}); choose another "
            "address or port with --listen HOST:PORT (port 0 = a free one)",
            file=sys.stderr,
        )
        return 2
    await worker.start()
    creds = httpapi.Credentials()
    app = httpapi.create_app(worker, creds)
    host, port = sock.getsockname()[:2]
    tunnel = Tunnel(worker, lambda: creds.tunnel, grant_key=lambda: creds.token)
    worker.tunnel_port = await tunnel.start(host)
    identity = registration.Identity(s) if s.server_url and s.server_url.startswith("https://") else None
    scheme = "https" if identity is not None else "http"
    url = s.advertise or f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"
    server = _Server(
        # the server keeps its connections to the worker alive for as long as it likes
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=3,
            lifespan="off",
            timeout_keep_alive=3600,
            # over TLS: the certificate the installation CA gives it before it registers
            ssl_context_factory=(lambda _c, _d: identity.context) if identity is not None else None,
        ),
        worker.hub.close,
    )
    reg = registration.Registration(s, worker, creds, url, identity)
    status = 0

    async def join() -> None:
        nonlocal status
        try:
            await reg.run()
        except registration.Fatal as e:
            print(f"atoll worker: {e}", file=sys.stderr, flush=True)
            log.error("worker.refused: %s", e)
            status = 2
            server.should_exit = True

    log.info(
        "worker %s listening on %s (home %s), joining %s",
        s.name,
        url,
        s.home,
        ",".join(s.server_urls) or s.server_url,
    )
    joining = asyncio.ensure_future(join())
    try:
        await server.serve(sockets=[sock])
    finally:
        joining.cancel()
        with contextlib.suppress(BaseException):
            await joining
        await reg.stopping()
        await reg.aclose()
        await tunnel.aclose()
        await worker.aclose()
        log.info("worker stopped; its sandboxes keep running and are taken back by the next `atoll worker`")
        if caught is not None:
            caught.extend(server.caught)
    return status


def main(
    server: str | None = None,
    name: str | None = None,
    home: str | None = None,
    listen: str | None = None,
    advertise: str | None = None,
    ca_file: str | None = None,
    slots: int | None = None,
) -> None:
    s = entry.settings_or_exit(
        "atoll worker", lambda: _load(server, name, home, listen, advertise, ca_file, slots)
    )
    entry.start("atoll worker", s, log, needs_root=f"needs root ({entry.ROOT_FOR})")
    caught: list[int] = []
    entry.run(serve(s, caught), caught)


def _load(server, name, home, listen, advertise, ca_file=None, slots=None) -> settings_mod.WorkerSettings:
    s = settings_mod.load(
        home=home, name=name, server=server, listen=listen, advertise=advertise, ca_file=ca_file, slots=slots
    )
    if not s.server_url:
        raise config.SettingsError(
            "--server URL (or ATOLL_SERVER_URL) is required: the control plane to join"
        )
    if not s.api_key:
        raise config.SettingsError(
            "ATOLL_API_KEY is required: a `worker` key (`atoll key create --scope worker`), or the server's "
            "admin key (deprecated), which the worker presents when it registers"
        )
    return s

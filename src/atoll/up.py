"""`atoll up`: the control plane and one local worker in one process, with embedded defaults.

The worker (worker.node.Node) runs in-process and is the control plane's worker `local`, reached
through the same seam as a remote one (core.worker_api), without HTTP. Start-up: the worker
prepares the host and reattaches to the sandboxes a previous run left (they kept running: runsc
lives in its own sessions), the control plane adopts it (records reconciled with its inventory,
orphans removed) before the API serves, and the `base` template is prepared in the background
(`/healthz` answers 200 once it is). Stopping never stops a sandbox. Called by the CLI
(`atoll up`) and atoll.testing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys

import uvicorn

from atoll.controlplane import main as server_main
from atoll.controlplane import settings as server_settings
from atoll.core import config
from atoll.shared import logconfig
from atoll.worker.service import node as node_mod
from atoll.worker.service import settings as worker_settings

log = logging.getLogger("atoll.up")


def load(port: int | None = None, home: str | None = None, host: str | None = None):
    s = server_settings.load(port=port, home=home, host=host)
    w = worker_settings.load(home=s.home, name="local")
    return s, w


async def serve(s: server_settings.ServerSettings, w: worker_settings.WorkerSettings) -> int:
    worker = node_mod.Node(w)
    try:
        worker.claim_home()
    except node_mod.HomeInUse as e:
        print(f"atoll: {e.message}", file=sys.stderr)
        return 2
    manager, tiers, app = server_main.build(s)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await manager.start()
        await server_main.start_ingress(app, s)
        await worker.start()
        await manager.workers.attach_local(worker)
        running = asyncio.ensure_future(tiers.run())
        app.state.ctx.started = True
        log.info("atoll is up on http://%s:%d (home %s)", s.host, s.port, s.home)
        try:
            yield
        finally:
            running.cancel()
            await app.state.ingress.aclose()
            await tiers.aclose()
            await manager.stop()
            await worker.aclose()
            log.info("atoll stopped; sandboxes keep running and are reattached by the next `atoll up`")

    app.router.lifespan_context = lifespan
    await uvicorn.Server(server_main.uvicorn_config(app, s)).serve()
    return 0


def main(port: int | None = None, home: str | None = None, host: str | None = None) -> None:
    try:
        s, w = load(port=port, home=home, host=host)
    except config.SettingsError as e:
        print(f"atoll: invalid setting: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logconfig.configure(s.log_format, s.log_level)
    if os.geteuid() != 0:
        print(
            "atoll: the local worker needs root (runsc, mounts, network namespaces, cgroups); run as root",
            file=sys.stderr,
        )
        raise SystemExit(2)
    log.info("starting atoll", extra={"settings": s.redacted(), "worker": w.redacted()})
    raise SystemExit(asyncio.run(serve(s, w)))

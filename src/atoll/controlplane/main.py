"""`atoll server`: the control plane alone; workers join it with `atoll worker --server URL`.

Loads the server's settings, opens the records, and serves the public API (controlplane.app) with
the tier policy beside it. Workers known from earlier runs are shown `lost` until they register
again. SIGINT/SIGTERM stop the server, never a sandbox. Called by the CLI; `atoll up` shares
`admin_key` and `build`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys

import uvicorn

from atoll import logconfig
from atoll.controlplane import app as app_mod
from atoll.controlplane import db, lifecycle, metrics, policy
from atoll.controlplane import settings as settings_mod
from atoll.core import config

log = logging.getLogger("atoll.server")


def admin_key(s: settings_mod.ServerSettings) -> str:
    """ATOLL_API_KEY if set; otherwise the saved key, or a new one printed once and saved."""
    if s.api_key:
        return s.api_key
    path = os.path.join(s.home, "admin.key")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    key = "atoll_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    print(
        f"atoll: generated admin API key (saved to {path}; shown once):\n  {key}", file=sys.stderr, flush=True
    )
    return key


def build(s: settings_mod.ServerSettings):
    """The manager, its tier policy and the app (the caller starts and serves them)."""
    os.makedirs(s.home, mode=0o700, exist_ok=True)
    os.chmod(s.home, 0o700)
    key = admin_key(s)
    database = db.open_database(s.database_url)
    m = metrics.Metrics()
    manager = lifecycle.SandboxManager(
        database,
        m,
        lost_after_s=s.lost_after_s,
        reconcile_s=s.reconcile_s,
        default_network=s.default_network,
    )
    m.bind_state_counts(manager.counts)
    app = app_mod.create_app(
        manager,
        api_key=key,
        max_file_bytes=s.max_file_mb * 1024 * 1024,
        max_exec_output_bytes=s.max_exec_output_kb * 1024,
    )
    return manager, policy.TierPolicy(manager), app


def uvicorn_config(app, s: settings_mod.ServerSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=3,
        lifespan="on",
    )


async def serve(s: settings_mod.ServerSettings) -> None:
    manager, tiers, app = build(s)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await manager.start()
        running = asyncio.ensure_future(tiers.run())
        app.state.ctx.started = True
        log.info("atoll server is up on http://%s:%d (home %s); waiting for workers", s.host, s.port, s.home)
        try:
            yield
        finally:
            running.cancel()
            await tiers.aclose()
            await manager.stop()
            log.info("atoll server stopped; workers and their sandboxes keep running")

    app.router.lifespan_context = lifespan
    await uvicorn.Server(uvicorn_config(app, s)).serve()


def main(port: int | None = None, home: str | None = None, host: str | None = None) -> None:
    try:
        s = settings_mod.load(port=port, home=home, host=host)
    except config.SettingsError as e:
        print(f"atoll server: invalid setting: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logconfig.configure(s.log_format, s.log_level)
    log.info("starting atoll server", extra={"settings": s.redacted()})
    asyncio.run(serve(s))

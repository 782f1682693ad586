"""`atoll up`: the control plane and one local worker in one process, with embedded defaults.

Loads settings, configures logging, opens the SQLite records, reattaches to the sandboxes a previous
run left (they kept running: runsc lives in its own sessions), and serves the API with uvicorn until
SIGINT/SIGTERM. Stopping never stops a sandbox. Called by the CLI (`atoll up`) and atoll.testing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys

import uvicorn

from atoll import settings as settings_mod
from atoll.controlplane import api, db, lifecycle, metrics
from atoll.worker import service as workersvc
from atoll.worker import storage

log = logging.getLogger("atoll.up")

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS}
        if extras:
            base += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return base


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


def admin_key(s: settings_mod.Settings) -> str:
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


def build(s: settings_mod.Settings):
    """Assemble manager + app (the caller runs them)."""
    storage.private_dir(s.home)  # 0700 before anything is written there (Worker.start fixes the rest)
    key = admin_key(s)
    database = db.open_database(s.database_url)
    worker = workersvc.Worker(
        workersvc.WorkerSettings(
            home=s.home,
            template_dir=s.template_dir,
            debian_mirror=s.debian_mirror,
            template_snapshots=s.template_snapshots,
        )
    )
    m = metrics.Metrics()
    manager = lifecycle.SandboxManager(database, worker, m)
    m.bind_state_counts(manager.counts)
    app = api.create_app(
        manager,
        api_key=key,
        max_file_bytes=s.max_file_mb * 1024 * 1024,
        max_exec_output_bytes=s.max_exec_output_kb * 1024,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await manager.start()
        log.info("atoll is up on http://%s:%d (home %s)", s.host, s.port, s.home)
        try:
            yield
        finally:
            await manager.stop()
            log.info("atoll stopped; sandboxes keep running and are reattached by the next `atoll up`")

    app.router.lifespan_context = lifespan
    return manager, app


async def serve(s: settings_mod.Settings) -> None:
    _manager, app = build(s)
    config = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    await uvicorn.Server(config).serve()


def main(port: int | None = None, home: str | None = None, host: str | None = None) -> None:
    try:
        s = settings_mod.load(port=port, home=home, host=host)
    except settings_mod.SettingsError as e:
        print(f"atoll: invalid setting: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(s.log_format, s.log_level)
    if os.geteuid() != 0:
        print(
            "atoll: the local worker needs root (runsc, mounts, network namespaces, cgroups); run as root",
            file=sys.stderr,
        )
        raise SystemExit(2)
    log.info("starting atoll", extra={"settings": s.redacted()})
    asyncio.run(serve(s))

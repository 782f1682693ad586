"""`atoll server`: the control plane alone; workers join it with `atoll worker --server URL`.

Loads the server's settings, opens the records, the secret store and the installation's CA, and
serves the public API (controlplane.app; over HTTPS with ATOLL_TLS_NAMES or ATOLL_TLS_CERT_FILE) with the tier policy, and starts the ingress router (preview
URLs, ATOLL_INGRESS_PORT) in a process beside it (controlplane.ingress_host), and the edge serving
E2B's API (ATOLL_E2B_PORT) in another (controlplane.edge_host). Workers known from earlier runs are shown `lost` until they register
again. SIGINT/SIGTERM stop the server, never a sandbox. Called by the CLI; `atoll up` shares
`admin_key` and `build`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import ssl
import sys
import typing

import uvicorn

from atoll.controlplane import app as app_mod
from atoll.controlplane import (
    db,
    edge_host,
    ingress_host,
    lifecycle,
    metering,
    metrics,
    policy,
    previews,
    routes_pty,
)
from atoll.controlplane import secrets as secrets_mod
from atoll.controlplane import settings as settings_mod
from atoll.controlplane.authority import Authority
from atoll.core import config
from atoll.shared import entry

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
    try:
        database = db.open_database(s.database_url)
    except db.DatabaseUnavailable as e:  # unreachable, login refused, ...: say so, no traceback
        print(f"atoll: {e} (ATOLL_DATABASE_URL)", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    m = metrics.Metrics()
    secrets_key = secrets_mod.load_key(s.home, s.secrets_key_file)
    authority = Authority.open(s.home)
    manager = lifecycle.SandboxManager(
        database,
        m,
        lost_after_s=s.lost_after_s,
        gone_after_s=s.gone_after_s,
        reconcile_s=s.reconcile_s,
        default_network=s.default_network,
        secrets=secrets_mod.SecretStore(database, secrets_key),
        authority=authority,
        default_pool=s.default_pool,
        lease_ttl_s=s.lease_ttl_s,
    )
    m.bind_state_counts(manager.counts)
    meter = metering.Meter(manager, m, prices=s.prices)
    backend = previews.Previews(manager, previews.preview_key(secrets_key), s.preview_domain, s.ingress_port)
    app = app_mod.create_app(
        manager,
        api_key=key,
        max_file_bytes=s.max_file_mb * 1024 * 1024,
        max_exec_output_bytes=s.max_exec_output_kb * 1024,
        previews=backend,
        audit_retention_days=s.audit_retention_days,
    )
    app.state.api_tls = api_tls(s, authority)
    app.state.ingress = ingress_host.IngressHost(
        backend,
        host=s.ingress_host,
        port=s.ingress_port,
        domain=s.preview_domain,
        tls=ingress_tls(s, authority),
        trusted_proxies=s.trusted_proxies,
        # E2B_DOMAIN mode's hosts go to E2B's port (the edge child below), over loopback
        e2b=edge_host.reach(s.e2b_host, s.e2b_port, app.state.api_tls is not None) if s.e2b_port else None,
        log_format=s.log_format,
        log_level=s.log_level,
    )
    app.state.meter = meter
    app.state.edge = None
    if s.e2b_port:
        app.state.edge = edge_host.EdgeHost(
            manager,
            host=s.e2b_host,
            port=s.e2b_port,
            api_url=edge_host.loopback_url(s.host, s.port, app.state.api_tls is not None),
            ca_file=os.path.join(s.home, "ca", "root.crt") if app.state.api_tls is not None else None,
            token_key_hex=edge_host.token_key(secrets_key),
            internet=s.e2b_internet,
            pause_tier=s.e2b_pause_tier,
            sandbox_domain=s.e2b_domain,
            tls=app.state.api_tls,
            log_format=s.log_format,
            log_level=s.log_level,
        )
    manager.workers.worker_tls = authority.worker_client_context()
    return manager, policy.TierPolicy(manager), app


def api_tls(s: settings_mod.ServerSettings, authority: Authority) -> tuple[str, str] | None:
    """The API's certificate and key files when it serves HTTPS: the operator's
    (ATOLL_TLS_CERT_FILE / ATOLL_TLS_KEY_FILE, checked here so a bad pair stops the start), or one
    from the installation's CA for ATOLL_TLS_NAMES; None: plain HTTP."""
    if s.tls_cert_file and s.tls_key_file:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(s.tls_cert_file, s.tls_key_file)
        except (ssl.SSLError, OSError) as e:
            raise config.SettingsError(
                f"ATOLL_TLS_CERT_FILE / ATOLL_TLS_KEY_FILE cannot be used: {e}"
            ) from None
        return s.tls_cert_file, s.tls_key_file
    if s.tls_names:
        return authority.api_cert_files(s.home, list(s.tls_names))
    return None


def ingress_tls(s: settings_mod.ServerSettings, authority: Authority) -> dict:
    """The ingress router's TLS, as its process is given it: the operator's certificate (files,
    checked here so a bad one stops the start), or one from the installation's CA for *.{domain},
    {domain}, localhost and the loopback address (PEM)."""
    if s.ingress_cert_file and s.ingress_key_file:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(s.ingress_cert_file, s.ingress_key_file)
        except (ssl.SSLError, OSError) as e:
            raise config.SettingsError(
                f"ATOLL_INGRESS_CERT_FILE / ATOLL_INGRESS_KEY_FILE cannot be used: {e}"
            ) from None
        return {"cert_file": s.ingress_cert_file, "key_file": s.ingress_key_file}
    cert, key = authority.server_cert(
        [f"*.{s.preview_domain}", s.preview_domain, "localhost"], ["127.0.0.1", "::1"]
    )
    return {"pem": (cert + authority.root_pem + key).decode()}


async def start_edge(app, s: settings_mod.ServerSettings) -> None:
    """Bind E2B's port (a port in use stops the start with SettingsError naming ATOLL_E2B_PORT)
    and start the edge process serving it (controlplane.edge_host); nothing when it is off."""
    edge = getattr(app.state, "edge", None)
    if edge is None:
        return
    await edge.start()
    log.info("E2B API on %s://%s:%d (E2B_API_URL and E2B_SANDBOX_URL)", edge.scheme, s.e2b_host, s.e2b_port)


async def start_ingress(app, s: settings_mod.ServerSettings) -> None:
    """Bind the router's port (a port in use stops the start with SettingsError) and start its
    process (controlplane.ingress_host)."""
    await app.state.ingress.start()
    log.info(
        "preview URLs on https://{port}-{sandbox_id}.%s:%d/ (ingress router on %s:%d)",
        s.preview_domain,
        s.ingress_port,
        s.ingress_host,
        s.ingress_port,
    )


def uvicorn_config(app, s: settings_mod.ServerSettings) -> uvicorn.Config:
    tls = getattr(app.state, "api_tls", None)
    return uvicorn.Config(
        app,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        host=s.host,
        port=s.port,
        log_config=None,
        access_log=False,
        ws_max_size=routes_pty.MAX_MESSAGE_BYTES,
        timeout_graceful_shutdown=3,
        lifespan="on",
    )


Hook = typing.Callable[[], typing.Awaitable[None]]


async def serve_api(
    s: settings_mod.ServerSettings,
    manager: lifecycle.SandboxManager,
    tiers: policy.TierPolicy,
    app,
    *,
    up: str,
    down: str,
    local: tuple[Hook, Hook] | None = None,
) -> None:
    """Serve the public API until a stop signal: the records, the ingress router, then `local`'s
    start (`atoll up`'s worker, attached before the API answers), the tier policy; at the stop
    the same in reverse. `up`/`down` are logged when it is up and when it has stopped."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await manager.start()
        await start_ingress(app, s)
        await start_edge(app, s)
        if local is not None:
            await local[0]()
        running = asyncio.ensure_future(tiers.run())
        meter = getattr(app.state, "meter", None)
        if meter is not None:
            meter.start()
        app.state.ctx.started = True
        scheme = "https" if getattr(app.state, "api_tls", None) else "http"
        log.info("%s is up on %s://%s:%d (home %s)", up, scheme, s.host, s.port, s.home)
        try:
            yield
        finally:
            running.cancel()
            if meter is not None:
                await meter.aclose()
            await app.state.ingress.aclose()
            if getattr(app.state, "edge", None) is not None:
                await app.state.edge.aclose()
            await tiers.aclose()
            await app.state.audit.aclose()
            await manager.stop()
            if local is not None:
                await local[1]()
            log.info(down)

    app.router.lifespan_context = lifespan
    edge = getattr(app.state, "edge", None)
    if edge is not None:  # bound before serving: a port in use is a clear start-up error
        try:
            edge.bind()
        except config.SettingsError as e:
            print(f"{up}: invalid setting: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    await uvicorn.Server(uvicorn_config(app, s)).serve()


async def serve(s: settings_mod.ServerSettings) -> None:
    manager, tiers, app = build(s)
    await serve_api(
        s,
        manager,
        tiers,
        app,
        up="atoll server",
        down="atoll server stopped; workers and their sandboxes keep running",
    )


def main(port: int | None = None, home: str | None = None, host: str | None = None) -> None:
    s = entry.settings_or_exit("atoll server", lambda: settings_mod.load(port=port, home=home, host=host))
    entry.start("atoll server", s, log)
    entry.run(serve(s))

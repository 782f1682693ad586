"""Typed settings of the control plane (`atoll server`, and the control-plane half of `atoll up`).

Precedence, highest first: command-line flag, `ATOLL_*` environment variable, built-in default
(core.config). Validated at start-up (a bad value stops atoll with a message naming the variable);
logged redacted. Called by controlplane.main and atoll.up.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from atoll.controlplane import db, metering, pools
from atoll.core import config, errors, netpolicy

MAX_EXEC_OUTPUT_KB = 65536  # the guest agent keeps at most 64 MiB per stream


@dataclass
class ServerSettings:
    host: str
    """ATOLL_HOST (`--host`): address the API listens on (default 127.0.0.1)."""
    port: int
    """ATOLL_PORT (`--port`): API port (default 7080)."""
    home: str
    """ATOLL_HOME (`--home`): state directory (records, admin key; default /var/lib/atoll as root)."""
    api_key: str | None
    """ATOLL_API_KEY: admin API key; generated and saved to $ATOLL_HOME/admin.key when unset."""
    database_url: str
    """ATOLL_DATABASE_URL: where the records are: `sqlite:///PATH` (default SQLite at
    $ATOLL_HOME/atoll.db) or `postgresql://USER:PASSWORD@HOST:PORT/DATABASE` (held here as the
    SQLAlchemy URL with its driver, `postgresql+psycopg://`; logged with the password hidden)."""
    max_file_mb: int
    """ATOLL_MAX_FILE_MB: largest file body accepted by PUT …/files (default 4096)."""
    max_exec_output_kb: int
    """ATOLL_MAX_EXEC_OUTPUT_KB: KiB of each output stream kept in a non-streamed exec answer (its
    first and last halves; default 1024, at most 65536); also the upper bound of a call's
    max_output_bytes. Streamed exec output is not limited."""
    lost_after_s: float
    """ATOLL_WORKER_LOST_S: a worker without a heartbeat for this long is shown `lost` (default 15)."""
    gone_after_s: float
    """ATOLL_WORKER_GONE_S: a worker `lost` for this long is treated as gone for its sandboxes
    (controlplane.lost_workers: archive-tier ones move to another worker, `on_worker_lost:
    "restore"` ones come back from their last archive, the others fail); default 300, 0 = never."""
    reconcile_s: float
    """ATOLL_RECONCILE_S: seconds between reconciliations of the records with each worker's inventory."""
    log_format: str
    """ATOLL_LOG_FORMAT: 'text' (default) or 'json'."""
    log_level: str
    """ATOLL_LOG_LEVEL: logging level (default INFO)."""
    default_network: dict = field(default_factory=dict)
    """ATOLL_NETWORK_ALLOW_OUT / ATOLL_NETWORK_DENY_OUT (comma-separated entries): the egress policy
    of a sandbox created without `network` (default: none, no way out)."""
    ingress_port: int = 0
    """ATOLL_INGRESS_PORT: port of the ingress router (preview URLs, TLS; default the API port + 1)."""
    ingress_host: str = "127.0.0.1"
    """ATOLL_INGRESS_HOST: address the ingress router listens on (default: ATOLL_HOST)."""
    preview_domain: str = "atoll.localhost"
    """ATOLL_PREVIEW_DOMAIN: preview URLs are https://{port}-{sandbox_id}.{domain} (default atoll.localhost)."""
    ingress_cert_file: str | None = None
    """ATOLL_INGRESS_CERT_FILE / ATOLL_INGRESS_KEY_FILE: the router's certificate chain and key (PEM);
    default: one for *.{domain} from the installation's CA ($ATOLL_HOME/ca/root.crt)."""
    ingress_key_file: str | None = None
    trusted_proxies: tuple[str, ...] = ()
    """ATOLL_TRUSTED_PROXIES: comma-separated addresses or CIDRs of reverse proxies in front of the
    ingress router; a connection from one counts against the client its X-Forwarded-For names
    (the right-most address that is not a trusted proxy), not against the proxy (default: none, every peer is the client)."""
    default_pool: int = 2
    """ATOLL_DEFAULT_POOL: sandboxes of the built-in `base` template (default memory size) kept
    restored and frozen for creates that name no template (its pool's `min` and `max`; default 2,
    0 keeps none). They count against their worker's memory."""
    secrets_key_file: str | None = None
    """ATOLL_SECRETS_KEY_FILE: the 32-byte key secrets are sealed with (default $ATOLL_HOME/secrets.key,
    made at first start)."""
    prices: dict = field(default_factory=lambda: dict(metering.DEFAULT_PRICES))
    """ATOLL_PRICES: the price sheet of GET /v1/usage's `cost` — a JSON object, or the path of a
    file holding one, of prices per unit of each usage field (fields left out keep
    metering.DEFAULT_PRICES)."""
    metrics_public: bool = False
    """ATOLL_METRICS_PUBLIC: 1 serves /metrics (per-tenant usage labels) without a key; default 0,
    an admin key. Read by controlplane.app when it is imported."""

    lease_ttl_s: float = 15.0
    """ATOLL_LEASE_TTL_S: how long the `leader` lease (controlplane.leases: which of several servers
    on one database runs the background loops) lasts unrenewed; renewed every third of it, taken
    over this long after its holder died (default 15, 0.5-300)."""

    audit_retention_days: int = 90
    """ATOLL_AUDIT_RETENTION_DAYS: days the audit trail (GET /v1/audit) keeps a row (default 90,
    1-36500); older rows are deleted hourly."""

    e2b_port: int = 0
    """ATOLL_E2B_PORT: port of E2B's API (the `e2b` SDKs' E2B_API_URL and E2B_SANDBOX_URL), served
    by the edge, a child process (controlplane.edge_host); default the API port + 2; 0 or `off`:
    not served."""
    e2b_host: str = "127.0.0.1"
    """ATOLL_E2B_HOST: address E2B's API listens on (default: ATOLL_HOST)."""
    e2b_internet: bool = True
    """ATOLL_E2B_INTERNET: `allow` (default, E2B's own default) or `deny`: the egress policy of a
    sandbox created through E2B's API without `allow_internet_access` (allow: `*`)."""
    e2b_pause_tier: str = "memory"
    """ATOLL_E2B_PAUSE_TIER: standby tier of E2B's `pause()` (memory, disk or archive; default
    memory, which the tier policy moves on to disk as usual)."""
    e2b_domain: str | None = None
    """ATOLL_E2B_DOMAIN: the `domain` of E2B's create/connect/detail answers, from which the SDKs
    build their sandbox hosts `https://{port}-{id}.{domain}` (get_host, 2.8.1's run_code, envd
    when E2B_SANDBOX_URL is unset), served by the ingress router. Default
    `{ATOLL_PREVIEW_DOMAIN}:{ATOLL_INGRESS_PORT}` (no port when it is 443); a DOMAIN[:PORT] when a
    forward in front of the router changes them (e.g. 443 → the router); `off`: null (the SDKs
    fall back to their E2B_DOMAIN)."""
    e2b_volume_mb: int = 1024
    """ATOLL_E2B_VOLUME_MB: size of the drive E2B's `Volume.create` makes (checked here at start-up;
    the E2B edge child reads it from the environment it inherits)."""

    tls_cert_file: str | None = None
    """ATOLL_TLS_CERT_FILE / ATOLL_TLS_KEY_FILE: serve the API over HTTPS with this certificate
    chain and key (PEM). Workers on other machines verify it with --ca-file (the CA that issued
    it) or the system trust store."""
    tls_key_file: str | None = None
    tls_names: tuple[str, ...] = ()
    """ATOLL_TLS_NAMES: comma-separated DNS names and IP addresses the API is reached at; serve it
    over HTTPS with a certificate for them from the installation's CA ($ATOLL_HOME/ca/root.crt,
    also GET /v1/ca.crt: what a worker's --ca-file holds). Ignored when ATOLL_TLS_CERT_FILE is
    set. Default: none, plain HTTP (fit for loopback only)."""

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file or self.tls_names)

    def redacted(self) -> dict:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        d["database_url"] = db.redact(self.database_url)
        return d


def load(
    env: Mapping[str, str] | None = None,
    *,
    port: int | None = None,
    home: str | None = None,
    host: str | None = None,
) -> ServerSettings:
    env = os.environ if env is None else env
    port_v = config.port(config.integer(env, "ATOLL_PORT", 7080, flag=port), "flag --port or ATOLL_PORT")
    home_v = config.home(home, env)
    host_v = host or env.get("ATOLL_HOST", "127.0.0.1")
    ingress_v = config.port(
        config.integer(env, "ATOLL_INGRESS_PORT", port_v + 1 if port_v < 65535 else port_v - 1),
        "ATOLL_INGRESS_PORT",
    )
    if ingress_v == port_v:
        raise config.SettingsError(f"ATOLL_INGRESS_PORT={ingress_v} is the API's port too; give it another")
    e2b_v = _e2b_port(env, port_v, ingress_v)
    cert, key = env.get("ATOLL_INGRESS_CERT_FILE") or None, env.get("ATOLL_INGRESS_KEY_FILE") or None
    if (cert is None) != (key is None):
        raise config.SettingsError("give both ATOLL_INGRESS_CERT_FILE and ATOLL_INGRESS_KEY_FILE, or neither")
    tls_cert, tls_key = env.get("ATOLL_TLS_CERT_FILE") or None, env.get("ATOLL_TLS_KEY_FILE") or None
    if (tls_cert is None) != (tls_key is None):
        raise config.SettingsError("give both ATOLL_TLS_CERT_FILE and ATOLL_TLS_KEY_FILE, or neither")
    for var, path in (
        ("ATOLL_INGRESS_CERT_FILE", cert),
        ("ATOLL_INGRESS_KEY_FILE", key),
        ("ATOLL_TLS_CERT_FILE", tls_cert),
        ("ATOLL_TLS_KEY_FILE", tls_key),
    ):
        if path is not None and not os.path.isfile(path):
            raise config.SettingsError(f"{var}={path!r} is not a file")
    return ServerSettings(
        host=host_v,
        port=port_v,
        home=home_v,
        api_key=env.get("ATOLL_API_KEY") or None,
        database_url=_database_url(
            env.get("ATOLL_DATABASE_URL") or f"sqlite:///{os.path.join(home_v, 'atoll.db')}"
        ),
        max_file_mb=config.integer(env, "ATOLL_MAX_FILE_MB", 4096, lo=1),
        max_exec_output_kb=config.integer(
            env,
            "ATOLL_MAX_EXEC_OUTPUT_KB",
            1024,
            lo=1,
            hi=MAX_EXEC_OUTPUT_KB,
            what="KiB per output stream of a non-streamed exec",
        ),
        lost_after_s=config.number(env, "ATOLL_WORKER_LOST_S", 15.0, lo=1, hi=30),
        gone_after_s=config.number(env, "ATOLL_WORKER_GONE_S", 300.0, lo=0, hi=30 * 86400),
        reconcile_s=config.number(env, "ATOLL_RECONCILE_S", 30.0, lo=1, hi=3600),
        log_format=config.choice(env, "ATOLL_LOG_FORMAT", "text", ("text", "json")),
        log_level=config.choice(
            env, "ATOLL_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), upper=True
        ),
        default_network=_default_network(env),
        ingress_port=ingress_v,
        ingress_host=env.get("ATOLL_INGRESS_HOST") or host_v,
        preview_domain=_domain(env.get("ATOLL_PREVIEW_DOMAIN") or "atoll.localhost"),
        ingress_cert_file=os.path.abspath(cert) if cert else None,
        ingress_key_file=os.path.abspath(key) if key else None,
        trusted_proxies=_trusted_proxies(env.get("ATOLL_TRUSTED_PROXIES", "")),
        default_pool=config.integer(
            env,
            "ATOLL_DEFAULT_POOL",
            2,
            lo=0,
            hi=pools.MAX_POOL,
            what="the size of the `base` pool; 0 turns it off",
        ),
        lease_ttl_s=config.number(env, "ATOLL_LEASE_TTL_S", 15.0, lo=0.5, hi=300),
        audit_retention_days=config.integer(
            env, "ATOLL_AUDIT_RETENTION_DAYS", 90, lo=1, hi=36500, what="days the audit trail keeps a row"
        ),
        secrets_key_file=os.path.abspath(env["ATOLL_SECRETS_KEY_FILE"])
        if env.get("ATOLL_SECRETS_KEY_FILE")
        else None,
        prices=_prices(env.get("ATOLL_PRICES", "")),
        metrics_public=config.boolean(env, "ATOLL_METRICS_PUBLIC", False),
        e2b_port=e2b_v,
        e2b_host=env.get("ATOLL_E2B_HOST") or host_v,
        e2b_internet=config.choice(env, "ATOLL_E2B_INTERNET", "allow", ("allow", "deny")) == "allow",
        e2b_pause_tier=config.choice(env, "ATOLL_E2B_PAUSE_TIER", "memory", ("memory", "disk", "archive")),
        e2b_domain=_e2b_domain(env.get("ATOLL_E2B_DOMAIN", ""), env, ingress_v),
        e2b_volume_mb=config.integer(env, "ATOLL_E2B_VOLUME_MB", 1024, lo=1, hi=16 * 1024 * 1024, what="MiB"),
        tls_cert_file=os.path.abspath(tls_cert) if tls_cert else None,
        tls_key_file=os.path.abspath(tls_key) if tls_key else None,
        tls_names=_tls_names(env.get("ATOLL_TLS_NAMES", "")),
    )


def _database_url(raw: str) -> str:
    try:
        return db.engine_url(raw.strip())
    except db.BadDatabaseURL as e:
        raise config.SettingsError(f"ATOLL_DATABASE_URL={e}") from None


def _tls_names(raw: str) -> tuple[str, ...]:
    """ATOLL_TLS_NAMES: DNS names (letters, digits, '-', '.') and IP addresses."""
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    for n in names:
        try:
            ipaddress.ip_address(n)
            continue
        except ValueError:
            pass
        labels = n.rstrip(".").split(".")
        if len(n) > 253 or not all(
            label and len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii()
            for label in labels
        ):
            raise config.SettingsError(
                f"ATOLL_TLS_NAMES: {n!r} is neither an IP address nor a DNS name; list the names and "
                "addresses workers reach this server at, comma-separated (e.g. atoll.example.com,10.0.0.5)"
            )
    return names


def _prices(raw: str) -> dict:
    try:
        return metering.load_prices(raw)
    except errors.InvalidRequest as e:
        raise config.SettingsError(e.message) from None


def _trusted_proxies(raw: str) -> tuple[str, ...]:
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        try:
            out.append(str(ipaddress.ip_network(entry, strict=False)))
        except ValueError:
            raise config.SettingsError(
                f"ATOLL_TRUSTED_PROXIES entry {entry!r} is not an address or CIDR (e.g. 10.0.0.5 or "
                "10.0.0.0/24, comma-separated)"
            ) from None
    return tuple(out)


def _domain(raw: str) -> str:
    name = netpolicy.normalize_name(raw)
    if name is None or "." not in name and name != "localhost":
        raise config.SettingsError(
            f"ATOLL_PREVIEW_DOMAIN={raw!r} is not a DNS domain; preview URLs are {{port}}-{{sandbox_id}}.DOMAIN"
        )
    return name


def _e2b_domain(raw: str, env: Mapping[str, str], ingress: int) -> str | None:
    raw = raw.strip()
    if raw.lower() == "off":
        return None
    if not raw:
        name = _domain(env.get("ATOLL_PREVIEW_DOMAIN") or "atoll.localhost")
        return name if ingress == 443 else f"{name}:{ingress}"
    host, sep, port = raw.rpartition(":") if ":" in raw else (raw, "", "")
    name = netpolicy.normalize_name(host)
    bad_port = sep and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)
    if name is None or ("." not in name and name != "localhost") or bad_port:
        raise config.SettingsError(
            f"ATOLL_E2B_DOMAIN={raw!r} is not DOMAIN or DOMAIN:PORT (the SDKs' sandbox hosts are "
            "https://{port}-{sandbox_id}.DOMAIN[:PORT]); `off` answers no domain"
        )
    return f"{name}:{int(port)}" if sep else name


def _default_network(env: Mapping[str, str]) -> dict:
    body = {
        key: [e.strip() for e in env.get(var, "").split(",") if e.strip()]
        for key, var in (("allow_out", "ATOLL_NETWORK_ALLOW_OUT"), ("deny_out", "ATOLL_NETWORK_DENY_OUT"))
    }
    try:
        return netpolicy.parse(body, "ATOLL_NETWORK_ALLOW_OUT/ATOLL_NETWORK_DENY_OUT").to_wire()
    except errors.InvalidRequest as e:
        raise config.SettingsError(e.message) from None


def _e2b_port(env: Mapping[str, str], api: int, ingress: int) -> int:
    """ATOLL_E2B_PORT: default the API port + 2 (- 2 at the top of the range); 0 or `off`: none."""
    raw = (env.get("ATOLL_E2B_PORT") or "").strip()
    if raw.lower() in ("off", "0"):
        return 0
    if raw:
        try:
            v = int(raw)
        except ValueError:
            raise config.SettingsError(
                f"ATOLL_E2B_PORT={raw!r} is not a port; give 1-65535, or 0 / off to serve no E2B API"
            ) from None
        v = config.port(v, "ATOLL_E2B_PORT; 0 or off: no E2B API")
    else:
        v = api + 2 if api <= 65533 else api - 2
    for other, name in (
        (api, "the API's port (ATOLL_PORT)"),
        (ingress, "the ingress router's (ATOLL_INGRESS_PORT)"),
    ):
        if v == other:
            raise config.SettingsError(
                f"ATOLL_E2B_PORT={v}{'' if raw else ' (the API port + 2)'} is {name} too; give it another, or off"
            )
    return v

"""Typed settings of a worker (`atoll worker`, and the local worker of `atoll up`).

Precedence, highest first: command-line flag, `ATOLL_*` environment variable, built-in default
(core.config). Validated at start-up; logged redacted. Called by worker.main and atoll.up.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from atoll.core import config, errors, ids, netpolicy, pki
from atoll.worker.host import objectstore


@dataclass
class WorkerSettings:
    home: str
    """ATOLL_HOME (`--home`): this worker's state: sandboxes, runsc state, snapshots, images. Several
    workers on one machine need one home each; a server may share its home with one worker."""
    name: str = "local"
    """`--name`: the worker's name at the server (a restart under the same name and home takes its
    sandboxes back)."""
    server_url: str | None = None
    """`--server` (ATOLL_SERVER_URL): the control plane to register with (None in `atoll up`); the
    first of `server_urls`."""
    server_urls: tuple[str, ...] = ()
    """`--server URL1,URL2,…`: several servers sharing one database; the worker registers with
    one at a time and moves to the next when its heartbeats stop reaching it (worker.service.
    registration)."""
    api_key: str | None = None
    """ATOLL_API_KEY: the `worker` key (or the admin key, deprecated) the worker presents when it
    registers."""
    ca_file: str | None = None
    """`--ca-file` (ATOLL_CA_FILE): the installation CA (the server's `GET /v1/ca.crt`, its
    `$ATOLL_HOME/ca/root.crt`) the worker trusts for an https:// server; without it, the system
    trust store. A --server that is not on a loopback address must be https://."""
    listen: tuple[str, int] = ("127.0.0.1", 0)
    """`--listen` (ATOLL_WORKER_LISTEN): HOST:PORT the worker's API listens on; port 0 = a free one."""
    advertise: str | None = None
    """`--advertise` (ATOLL_WORKER_ADVERTISE): the URL the server calls the worker at (default
    http://<listen address>:<port>)."""
    template_dir: str | None = None
    """ATOLL_TEMPLATE_DIR: template layer cache (default <home>/templates); may be shared."""
    debian_mirror: str = "http://deb.debian.org/debian"
    """ATOLL_DEBIAN_MIRROR: mirror mmdebstrap builds template layers from."""
    default_disk_mb: int = 4096
    """Disk quota of a sandbox's writable layer when the caller gives none."""
    default_memory_mb: int = 512
    slots: int = 0
    """`--slots` (ATOLL_WORKER_SLOTS): the most sandboxes holding this worker's resources —
    creating, running or frozen in the memory tier, warm-pool members included — the server places
    on it; disk and archive standby take none (they hold no memory or CPU). 0 (default): no limit,
    memory and CPU are overcommitted as placement sees fit. Reported in its capacity at
    registration: a change takes a restart."""
    """The memory size whose template image is made at start-up."""
    template_snapshots: bool = True
    """ATOLL_TEMPLATE_SNAPSHOTS: create sandboxes by restoring a checkpoint of a booted template
    sandbox ('1', default) or boot each cold ('0')."""
    test_image_cache: str | None = None
    """ATOLL_TEST_IMAGE_CACHE (test suites only): a directory where the installations of this host
    share built-in templates' start-up snapshots, copied in and out, never shared in place
    (worker.images.image_cache); unset (default): each home makes its own."""
    code_interpreter: bool = True
    """ATOLL_E2B_CODE_INTERPRETER: the built-in template `code-interpreter-v1` (a Jupyter kernel for
    E2B's run_code) is offered and built in the background after `base` ('1', default); '0' offers
    `base` only."""
    heartbeat_s: float = 3.0
    """ATOLL_HEARTBEAT_S: seconds between heartbeats to the server."""
    reconcile_s: float = 30.0
    """ATOLL_RECONCILE_S: seconds between reconciliation passes over the host."""
    usage_every_s: float = 5.0
    """ATOLL_USAGE_EVERY_S: seconds between usage reports (CPU, standby image and store bytes) to
    the control plane's meter; tests shorten it."""
    log_format: str = "text"
    """ATOLL_LOG_FORMAT: 'text' or 'json'."""
    log_level: str = "INFO"
    """ATOLL_LOG_LEVEL: logging level."""
    extra_hosts: str | None = None
    """ATOLL_EXTRA_HOSTS: a hosts-format file the egress gateway resolves names from, after the
    worker's /etc/hosts and before its resolver (names it holds are never forwarded)."""
    egress_source: str | None = None
    """ATOLL_EGRESS_SOURCE: the local IPv4 address all sandbox egress leaves from (default: the
    route's own)."""
    upstream_ca_file: str | None = None
    """ATOLL_UPSTREAM_CA_FILE: PEM certificates the egress gateway trusts, besides the system's,
    when it re-encrypts intercepted HTTPS to a secret's host (a private CA upstream; tests)."""

    build_allow_out: tuple[str, ...] = ()
    """ATOLL_BUILD_ALLOW_OUT: the egress of template build steps (apt, pip, run), comma-separated
    policy entries (default: the Debian mirror's host, PyPI and npm)."""
    pip_index_url: str | None = None
    """ATOLL_PIP_INDEX_URL: the package index pip steps install from (default: PyPI)."""
    apt_sources: str | None = None
    """ATOLL_APT_SOURCES: sources.list lines apt steps use instead of the template's own (a local
    mirror; `deb [trusted=yes] http://10.0.0.5/debian bookworm main`); never written into a layer."""
    build_ca_file: str | None = None
    """ATOLL_BUILD_CA_FILE: CA certificates build steps trust for HTTPS (default: this host's
    system bundle, so that a registry reached through a TLS-inspecting proxy verifies)."""
    filer_url: str | None = None
    """ATOLL_FILER_URL: a SeaweedFS filer (`http://HOST:PORT[.GRPC_PORT]`) that serves drives, so
    that sandboxes on every worker configured with it share them (worker.host.stores)."""
    sandbox_ca_file: str | None = None
    """ATOLL_SANDBOX_CA_FILE: CA certificates every sandbox created here trusts besides its
    template's, added to its trust store with the installation CA (core of worker.host.trust);
    `host` means this host's system bundle. Default: none (read once at start)."""
    build_step_timeout_s: float = 1800.0
    """ATOLL_BUILD_STEP_TIMEOUT_S: the longest one apt, pip or run step of a template build may
    take (its build sandbox included); past it the build fails naming the step."""
    build_timeout_s: float = 3600.0
    """ATOLL_BUILD_TIMEOUT_S: the longest a whole template build may take, its snapshot included;
    past it the build fails naming what it was doing."""

    archive_dir: str | None = None
    """ATOLL_ARCHIVE_DIR: where the archive tier keeps sandboxes when no object store is configured
    (default <home>/archive): the embedded store (worker.host.objectstore.LocalStore)."""
    s3: objectstore.S3Config | None = None
    """ATOLL_S3_ENDPOINT, ATOLL_S3_BUCKET, ATOLL_S3_ACCESS_KEY, ATOLL_S3_SECRET_KEY, ATOLL_S3_REGION
    (default us-east-1): the S3-compatible object store of the archive tier (all four of the first
    or none); logged without the keys."""

    disk_budget_gb: float | None = None
    """ATOLL_DISK_BUDGET_GB: the most the sandboxes may take on this worker's disk (checkpoint and
    upper images); over it, the longest-idle disk-tier sandboxes move to the archive tier (running
    ones are never touched). Default: no budget."""

    layer_cache_ttl_s: float = 7 * 86400.0
    """ATOLL_LAYER_CACHE_TTL_S: a template layer no build or sandbox of this installation stacks
    and no mounted overlay uses goes from the layer cache once unused this long (default 7 days;
    worker.images.layer_gc). Installations sharing the template directory keep their layers by
    using them within it."""
    layer_cache_gb: float | None = None
    """ATOLL_LAYER_CACHE_GB: the most the layer cache may hold; over it, layers nothing uses go
    least recently used first (never one used in the last 10 minutes). Default: no cap."""

    BUILD_CA_NAME = "build-ca.crt"

    def build_env(self) -> dict[str, str]:
        """Variables of build-step sandboxes only (never a template's own environment)."""
        env: dict[str, str] = {}
        if self.pip_index_url:
            env["PIP_INDEX_URL"] = self.pip_index_url
            if self.pip_index_url.startswith("http://"):
                env["PIP_TRUSTED_HOST"] = urllib.parse.urlsplit(self.pip_index_url).hostname or ""
        if self.build_ca_file:
            ca = "/opt/atoll/" + self.BUILD_CA_NAME
            for var in (
                "PIP_CERT",
                "SSL_CERT_FILE",
                "REQUESTS_CA_BUNDLE",
                "CURL_CA_BUNDLE",
                "NODE_EXTRA_CA_CERTS",
                "GIT_SSL_CAINFO",
            ):
                env[var] = ca
        return env

    @property
    def hosts_files(self) -> list[str]:
        return ["/etc/hosts", *([self.extra_hosts] if self.extra_hosts else [])]

    def redacted(self) -> dict:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        d["s3"] = self.s3.redacted() if self.s3 else None
        return d

    @property
    def templates(self) -> str:
        return self.template_dir or os.path.join(self.home, "templates")


def load(
    env: Mapping[str, str] | None = None,
    *,
    home: str | None = None,
    name: str | None = None,
    server: str | None = None,
    listen: str | None = None,
    advertise: str | None = None,
    ca_file: str | None = None,
    slots: int | None = None,
) -> WorkerSettings:
    env = os.environ if env is None else env
    home_v = config.home(home, env)
    name_v = name if name is not None else env.get("ATOLL_WORKER_NAME") or "local"
    if not ids.is_worker_name(name_v):
        raise config.SettingsError(
            f"worker name {name_v!r} is not valid; use 1-64 letters, digits, '-', '_' or '.', starting "
            "with a letter or digit (--name or ATOLL_WORKER_NAME)"
        )
    servers_v = tuple(
        u.strip().rstrip("/") for u in (server or env.get("ATOLL_SERVER_URL") or "").split(",") if u.strip()
    )
    for u in servers_v:
        _check_server_url(u)
    if len({u.split("://", 1)[0] for u in servers_v}) > 1:
        raise config.SettingsError(
            f"--server {','.join(servers_v)} mixes http:// and https:// servers; give them all one scheme"
        )
    if len(set(servers_v)) != len(servers_v):
        raise config.SettingsError(f"--server {','.join(servers_v)} names a server twice")
    server_v = servers_v[0] if servers_v else None
    ca_v = ca_file or env.get("ATOLL_CA_FILE") or None
    ca_source = "--ca-file" if ca_file else "$ATOLL_CA_FILE"  # where it came from, for messages
    if ca_v is not None and not (server_v or "").startswith("https://"):
        raise config.SettingsError(
            f"a CA file is given ({ca_source}) but the server URL {server_v!r} is not https://; "
            "start the server with ATOLL_TLS_NAMES and give --server https://…"
        )
    listen_v = config.host_port(listen or env.get("ATOLL_WORKER_LISTEN") or "127.0.0.1:0", "--listen")
    advertise_v = advertise or env.get("ATOLL_WORKER_ADVERTISE") or None
    if advertise_v is not None and not advertise_v.startswith(("http://", "https://")):
        raise config.SettingsError(
            f"advertised URL {advertise_v!r} must start with http:// or https:// (--advertise)"
        )
    if (
        advertise_v is not None
        and (server_v or "").startswith("https://")
        and advertise_v.startswith("http://")
    ):
        raise config.SettingsError(
            f"advertised URL {advertise_v!r} is http:// while the server is https://: a worker that "
            "joins over TLS serves its API over TLS too; give --advertise https://HOST:PORT"
        )
    return WorkerSettings(
        home=home_v,
        name=name_v,
        server_url=server_v,
        server_urls=servers_v,
        api_key=env.get("ATOLL_API_KEY") or None,
        ca_file=_ca_file(ca_v, "ATOLL_CA_FILE", source=ca_source) if ca_v else None,
        listen=listen_v,
        advertise=advertise_v.rstrip("/") if advertise_v else None,
        template_dir=os.path.abspath(env["ATOLL_TEMPLATE_DIR"]) if env.get("ATOLL_TEMPLATE_DIR") else None,
        debian_mirror=env.get("ATOLL_DEBIAN_MIRROR", "http://deb.debian.org/debian"),
        template_snapshots=config.boolean(env, "ATOLL_TEMPLATE_SNAPSHOTS", True),
        test_image_cache=os.path.abspath(env["ATOLL_TEST_IMAGE_CACHE"])
        if env.get("ATOLL_TEST_IMAGE_CACHE")
        else None,
        code_interpreter=config.boolean(env, "ATOLL_E2B_CODE_INTERPRETER", True),
        heartbeat_s=config.number(env, "ATOLL_HEARTBEAT_S", 3.0, lo=0.2, hi=60),
        reconcile_s=config.number(env, "ATOLL_RECONCILE_S", 30.0, lo=1, hi=3600),
        usage_every_s=config.number(env, "ATOLL_USAGE_EVERY_S", 5.0, lo=0.5, hi=60),
        log_format=config.choice(env, "ATOLL_LOG_FORMAT", "text", ("text", "json")),
        log_level=config.choice(
            env, "ATOLL_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), upper=True
        ),
        extra_hosts=_extra_hosts(env.get("ATOLL_EXTRA_HOSTS") or None),
        egress_source=_ipv4(env.get("ATOLL_EGRESS_SOURCE") or None, "ATOLL_EGRESS_SOURCE"),
        upstream_ca_file=_ca_file(env.get("ATOLL_UPSTREAM_CA_FILE") or None),
        build_allow_out=_build_allow_out(env),
        pip_index_url=_url(env.get("ATOLL_PIP_INDEX_URL") or None, "ATOLL_PIP_INDEX_URL"),
        apt_sources=env.get("ATOLL_APT_SOURCES") or None,
        build_ca_file=_ca_file(env["ATOLL_BUILD_CA_FILE"], "ATOLL_BUILD_CA_FILE")
        if env.get("ATOLL_BUILD_CA_FILE")
        else (SYSTEM_CA if os.path.exists(SYSTEM_CA) else None),
        sandbox_ca_file=_sandbox_ca_file(env.get("ATOLL_SANDBOX_CA_FILE") or None),
        filer_url=_filer_url(env.get("ATOLL_FILER_URL") or None),
        **_build_timeouts(env),
        archive_dir=os.path.abspath(env["ATOLL_ARCHIVE_DIR"]) if env.get("ATOLL_ARCHIVE_DIR") else None,
        s3=_s3(env),
        disk_budget_gb=config.number(env, "ATOLL_DISK_BUDGET_GB", 0.0, lo=0, hi=1024 * 1024) or None,
        layer_cache_ttl_s=config.number(
            env, "ATOLL_LAYER_CACHE_TTL_S", 7 * 86400.0, lo=0, hi=10 * 365 * 86400
        ),
        layer_cache_gb=config.number(env, "ATOLL_LAYER_CACHE_GB", 0.0, lo=0, hi=1024 * 1024) or None,
        slots=config.integer(
            env,
            "ATOLL_WORKER_SLOTS",
            0,
            lo=0,
            hi=MAX_SLOTS,
            flag=slots,
            flag_name="--slots",
            what="--slots: 0 means no limit",
        ),
    )


def _check_server_url(url: str | None) -> None:
    """--server: http(s)://HOST[:PORT]; plain http:// only to a loopback address (the link carries
    the worker's key and token, and every sandbox's bytes)."""
    if url is None:
        return
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise config.SettingsError(f"server URL {url!r} must be http(s)://HOST[:PORT] (--server)")
    if parts.scheme == "http" and not config.is_loopback_url(url):
        raise config.SettingsError(
            f"--server {url} is plain http:// to {parts.hostname}, which is not a loopback address: "
            "the worker's key and every sandbox's traffic would cross the network in the clear. Start "
            f"the server with ATOLL_TLS_NAMES={parts.hostname} (or ATOLL_TLS_CERT_FILE / "
            "ATOLL_TLS_KEY_FILE), give --server https://…, and --ca-file PATH with its installation CA "
            "(GET /v1/ca.crt, or $ATOLL_HOME/ca/root.crt on the server)"
        )


S3_VARS = ("ATOLL_S3_ENDPOINT", "ATOLL_S3_BUCKET", "ATOLL_S3_ACCESS_KEY", "ATOLL_S3_SECRET_KEY")


def _s3(env: Mapping[str, str]) -> objectstore.S3Config | None:
    """The archive tier's S3 store: all of S3_VARS, or none of them (the local archive directory)."""
    given = {v: env.get(v) or "" for v in S3_VARS}
    if not any(given.values()):
        return None
    missing = [v for v, x in given.items() if not x]
    if missing:
        raise config.SettingsError(
            f"{', '.join(missing)} not set while {', '.join(v for v in S3_VARS if v not in missing)} "
            "are: the archive tier's object store needs all four (or none, for the local directory "
            "ATOLL_ARCHIVE_DIR)"
        )
    endpoint = _url(given["ATOLL_S3_ENDPOINT"], "ATOLL_S3_ENDPOINT") or ""
    bucket = given["ATOLL_S3_BUCKET"]
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise config.SettingsError(
            f"ATOLL_S3_BUCKET={bucket!r} is not a valid bucket name: use 3-63 lower-case letters, "
            "digits, '.' or '-', starting and ending with a letter or digit"
        )
    return objectstore.S3Config(
        endpoint=endpoint.rstrip("/"),
        bucket=bucket,
        access_key=given["ATOLL_S3_ACCESS_KEY"],
        secret_key=given["ATOLL_S3_SECRET_KEY"],
        region=env.get("ATOLL_S3_REGION") or "us-east-1",
    )


SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
MAX_SLOTS = 100_000
"""The largest --slots (the server refuses more at registration too: controlplane.workers)."""
DEFAULT_BUILD_HOSTS = ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org")


def _url(value: str | None, var: str) -> str | None:
    if value is None:
        return None
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise config.SettingsError(f"{var}={value!r} is not an http(s) URL")
    return value


def _filer_url(value: str | None) -> str | None:
    if value is None:
        return None
    from atoll.worker.host.stores import parse_filer_url

    try:
        parse_filer_url(value)
    except ValueError as e:
        raise config.SettingsError(str(e)) from None
    return value


def _build_allow_out(env: Mapping[str, str]) -> tuple[str, ...]:
    """ATOLL_BUILD_ALLOW_OUT, or the package indexes this worker is configured with."""
    raw = env.get("ATOLL_BUILD_ALLOW_OUT")
    if raw is not None:
        entries = tuple(e.strip() for e in raw.split(",") if e.strip())
    else:
        hosts = [
            urllib.parse.urlsplit(env.get("ATOLL_DEBIAN_MIRROR", "http://deb.debian.org/debian")).hostname
        ]
        if env.get("ATOLL_PIP_INDEX_URL"):
            hosts.append(urllib.parse.urlsplit(env["ATOLL_PIP_INDEX_URL"]).hostname)
        entries = tuple(dict.fromkeys(h for h in (*hosts, *DEFAULT_BUILD_HOSTS) if h))
    try:
        netpolicy.from_wire({"allow_out": list(entries)})
    except errors.InvalidRequest as e:
        raise config.SettingsError(f"ATOLL_BUILD_ALLOW_OUT: {e.message}") from None
    return entries


def _build_timeouts(env: Mapping[str, str]) -> dict[str, float]:
    """ATOLL_BUILD_STEP_TIMEOUT_S and ATOLL_BUILD_TIMEOUT_S: seconds, 1 to a week; a step may not
    be allowed longer than the whole build."""
    week = 7 * 86400.0
    step = config.number(env, "ATOLL_BUILD_STEP_TIMEOUT_S", 1800.0, lo=1, hi=week)
    whole = config.number(env, "ATOLL_BUILD_TIMEOUT_S", 3600.0, lo=1, hi=week)
    if step > whole:
        raise config.SettingsError(
            f"ATOLL_BUILD_STEP_TIMEOUT_S={step:g} is longer than ATOLL_BUILD_TIMEOUT_S={whole:g} (the "
            "whole build's limit, 3600 by default); lower the step limit or raise the build's"
        )
    return {"build_step_timeout_s": step, "build_timeout_s": whole}


MAX_CA_FILE = 8 * 1024 * 1024
_CA_USE = {
    "ATOLL_CA_FILE": "The worker trusts it for the server's certificate (--ca-file)",
    "ATOLL_UPSTREAM_CA_FILE": "The egress gateway trusts it when it re-encrypts intercepted HTTPS",
    "ATOLL_BUILD_CA_FILE": "Build steps trust it for HTTPS (pip, curl, git)",
    "ATOLL_SANDBOX_CA_FILE": (
        "Every sandbox made here would get it in its trust store, where one bad certificate breaks "
        "HTTPS (Python's ssl refuses the whole bundle)"
    ),
}


def _ca_file(path: str | None, var: str = "ATOLL_UPSTREAM_CA_FILE", source: str | None = None) -> str | None:
    """An operator's PEM file of certificates: readable, and every certificate block in it one
    whole certificate (core.pki.check_certificates), or a SettingsError naming the variable, the
    file, the bad block and how to fix it. `source`: where a file that may come from a flag or
    from `var` came from (`--ca-file` or `$ATOLL_CA_FILE`), named instead of the variable."""
    if path is None:
        return None
    path = os.path.abspath(path)
    where = f"the CA file {path!r} (from {source})" if source else f"{var}={path!r}"
    drop = "leave out --ca-file" if source == "--ca-file" else f"unset {var}"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CA_FILE + 1)
    except OSError as e:
        raise config.SettingsError(f"{where} cannot be read: {e.strerror}") from None
    if len(data) > MAX_CA_FILE:
        raise config.SettingsError(
            f"{where} is larger than {MAX_CA_FILE // 2**20} MiB; a CA file holds certificates only"
        )
    try:
        pki.check_certificates(data.decode("ascii", errors="replace"))
    except ValueError as e:
        raise config.SettingsError(
            f"{where}: {e}. {_CA_USE[var]}. Fix or remove that block (each block from "
            "-----BEGIN CERTIFICATE----- to -----END CERTIFICATE----- must be one whole certificate, "
            f"as `openssl x509 -in CERT.pem` prints it), or {drop}"
        ) from None
    return path


def _sandbox_ca_file(value: str | None) -> str | None:
    if value is None:
        return None
    if value.strip().lower() == "host":
        if not os.path.exists(SYSTEM_CA):
            raise config.SettingsError(
                f"ATOLL_SANDBOX_CA_FILE=host names this host's system bundle, but {SYSTEM_CA} does not "
                "exist; install ca-certificates or name a PEM file"
            )
        value = SYSTEM_CA  # checked like any file: every sandbox gets it
    return _ca_file(value, "ATOLL_SANDBOX_CA_FILE")


def _extra_hosts(path: str | None) -> str | None:
    if path is None:
        return None
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise config.SettingsError(
            f"ATOLL_EXTRA_HOSTS={path!r} is not a file; it must name a hosts-format file (ADDRESS NAME...)"
        )
    return path


def _ipv4(value: str | None, var: str) -> str | None:
    if value is None:
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise config.SettingsError(f"{var}={value!r} is not an IPv4 address of this host") from None

"""The secret store: values sealed at rest, bound to the hosts they may be sent to.

`POST /v1/secrets {name, value, hosts}` seals the value (core.secretbox, AES-256-GCM) with the
installation's secrets key — `$ATOLL_HOME/secrets.key` (made at first start, mode 0600), or the
file the operator names in ATOLL_SECRETS_KEY_FILE — and stores only the sealed text. No answer ever
carries a value. A sandbox created with `secrets: {ENV: name}` gets a random placeholder in ENV
(`placeholders`); its worker's egress gateway swaps the placeholder for the value in requests to
the secret's hosts (core.worker_api.SecretBinding) — on a connection to an address the host
resolves to, and over plain HTTP only when the secret says `allow_http` (gateway.placeholders). Replacing or deleting a secret reaches every
live sandbox bound to it (controlplane.lifecycle pushes the new bindings).
Called by controlplane.routes_secrets and controlplane.lifecycle.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets as pysecrets
import stat

from atoll.controlplane import db as dbm
from atoll.controlplane.schemas import iso
from atoll.core import config, errors, netpolicy, secretbox
from atoll.core import worker_api as api

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_VALUE_BYTES = 64 * 1024
MAX_HOSTS = 64
MAX_PER_SANDBOX = 64
PLACEHOLDER_PREFIX = "atoll_ph_"
RESERVED_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "SHELL",
        "PWD",
        "HOSTNAME",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
    }
)
"""Variables a placeholder must not replace: the sandbox's programs or atoll's CA depend on them."""


def load_key(home: str, path: str | None) -> bytes:
    """The secrets key: the operator's file (it must exist, be 32 bytes — raw, hex or base64 — and
    not be readable by others), or `$ATOLL_HOME/secrets.key`, made at first start."""
    if path:
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                raw = f.read(4096)
        except OSError as e:
            raise config.SettingsError(
                f"ATOLL_SECRETS_KEY_FILE {path!r} cannot be read: {e.strerror}"
            ) from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise config.SettingsError(
                f"ATOLL_SECRETS_KEY_FILE {path!r} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it"
            )
        key = _decode_key(raw)
        if key is None:
            raise config.SettingsError(
                f"ATOLL_SECRETS_KEY_FILE {path!r} must hold a 32-byte key (raw, 64 hex digits or base64); "
                "make one with: head -c 32 /dev/urandom > FILE"
            )
        return key
    p = os.path.join(home, "secrets.key")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        with open(p, "rb") as f:
            key = _decode_key(f.read(4096))
        if key is None:
            raise config.SettingsError(f"{p} does not hold a 32-byte key; restore it from a backup") from None
        return key
    key = secretbox.new_key()
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    return key


def _decode_key(raw: bytes) -> bytes | None:
    if len(raw) == secretbox.KEY_BYTES:
        return raw
    text = raw.strip()
    for decode in (bytes.fromhex, lambda t: base64.b64decode(t, validate=True)):
        try:
            key = decode(text.decode("ascii"))
        except (ValueError, binascii.Error, UnicodeDecodeError):
            continue
        if len(key) == secretbox.KEY_BYTES:
            return key
    return None


def check_name(name: object, where: str = "name") -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise errors.InvalidRequest(
            f"{where} {name!r} is not a valid secret name: 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_value(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise errors.InvalidRequest("value must be a non-empty string")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise errors.InvalidRequest(
            f"value is {len(value.encode())} bytes; a secret holds at most {MAX_VALUE_BYTES}"
        )
    if not value.isascii():
        raise errors.InvalidRequest(
            "value must be ASCII (it goes into HTTP header values and query strings as it is); "
            "encode it first (e.g. base64) if the API it is for expects that"
        )
    bad = next((c for c in value if c in "\r\n\x00" or (ord(c) < 32 and c != "\t") or ord(c) == 127), None)
    if bad is not None:
        raise errors.InvalidRequest(
            f"value contains the control character {bad!r}; a secret goes into HTTP header values and "
            "query strings, where control characters are not allowed"
        )
    return value


def check_hosts(hosts: object) -> list[str]:
    if not isinstance(hosts, list) or not hosts:
        raise errors.InvalidRequest(
            "hosts must be a non-empty list of the host names the secret may be sent to "
            "(api.example.com, *.example.com)"
        )
    if len(hosts) > MAX_HOSTS:
        raise errors.InvalidRequest(f"hosts has {len(hosts)} entries; at most {MAX_HOSTS}")
    out: list[str] = []
    for h in hosts:
        if not isinstance(h, str):
            raise errors.InvalidRequest(f"hosts entry {h!r} is not a string")
        wild = h.startswith("*.")
        name = netpolicy.normalize_name(h[2:] if wild else h)  # None for an address, too
        if name is None:
            raise errors.InvalidRequest(
                f"hosts entry {h!r} is not a host name: give a DNS name (api.example.com) or a wildcard "
                "(*.example.com); addresses and ports are not accepted (the secret follows the name the "
                "request is for, its TLS SNI or HTTP Host)"
            )
        norm = ("*." if wild else "") + name
        if norm not in out:
            out.append(norm)
    return out


def new_placeholder() -> str:
    return PLACEHOLDER_PREFIX + pysecrets.token_hex(16)


class SecretStore:
    def __init__(self, database: dbm.Database, key: bytes):
        self.db = database
        self._key = secretbox.check_key(key, "the secrets key")

    @property
    def key(self) -> bytes:
        """The installation's secrets key (controlplane.auth derives the API keys' hash key from it)."""
        return self._key

    def create(
        self, tenant: str, body: object, *, replace: bool = False, name: str | None = None
    ) -> dbm.SecretRecord:
        if not isinstance(body, dict):
            raise errors.InvalidRequest("the body must be a JSON object {name, value, hosts}")
        unknown = set(body) - {"name", "value", "hosts", "allow_http"}
        if unknown:
            raise errors.InvalidRequest(
                f"unknown field(s) {sorted(unknown)}; a secret has name, value, hosts and allow_http"
            )
        allow_http = body.get("allow_http", False)
        if not isinstance(allow_http, bool):
            raise errors.InvalidRequest(f"allow_http must be true or false, not {allow_http!r}")
        name = check_name(name if name is not None else body.get("name"))
        if replace and "name" in body and body["name"] != name:
            raise errors.InvalidRequest(f"the body's name {body['name']!r} is not the path's {name!r}")
        value = check_value(body.get("value"))
        hosts = check_hosts(body.get("hosts"))
        sealed = secretbox.seal(self._key, value, f"{tenant}/{name}")
        rec = self.db.get_secret(tenant, name)
        if rec is not None and not replace:
            raise errors.Conflict(
                f"a secret named {name!r} exists; PUT /v1/secrets/{name} replaces it, DELETE removes it",
                code="secret_exists",
            )
        if rec is None and replace:
            raise errors.SecretNotFound(f"no secret named {name!r}; create it with POST /v1/secrets")
        now = dbm.utcnow()
        if rec is None:
            rec = dbm.SecretRecord(
                tenant_id=tenant,
                name=name,
                hosts=hosts,
                sealed=sealed,
                allow_http=allow_http,
                created_at=now,
                updated_at=now,
            )
        else:
            rec.hosts, rec.sealed, rec.allow_http, rec.updated_at = hosts, sealed, allow_http, now
        self.db.put_secret(rec)
        return rec

    def get(self, tenant: str, name: str) -> dbm.SecretRecord:
        rec = self.db.get_secret(tenant, check_name(name))
        if rec is None:
            raise errors.SecretNotFound(f"no secret named {name!r}; GET /v1/secrets lists them")
        return rec

    def list(self, tenant: str | None) -> list[dbm.SecretRecord]:
        """A tenant's secrets (None: every tenant's, for an admin)."""
        return self.db.secrets(tenant)

    def delete(self, tenant: str, name: str) -> None:
        self.get(tenant, name)
        self.db.delete_secret(tenant, name)

    def placeholders(self, tenant: str, body: object, env: dict[str, str]) -> dict[str, dict[str, str]]:
        """A create's `secrets: {ENV: name}`, checked, with a fresh placeholder for each
        variable: {ENV: {"secret": name, "placeholder": "atoll_ph_…"}}."""
        if body is None:
            return {}
        if not isinstance(body, dict):
            raise errors.InvalidRequest("secrets must be an object {ENV_NAME: secret_name}")
        if len(body) > MAX_PER_SANDBOX:
            raise errors.InvalidRequest(f"secrets has {len(body)} entries; at most {MAX_PER_SANDBOX}")
        out: dict[str, dict[str, str]] = {}
        for var, name in body.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
                raise errors.InvalidRequest(
                    f"secrets key {var!r} is not an environment variable name (letters, digits and '_')"
                )
            if var in env:
                raise errors.InvalidRequest(f"{var!r} is in both env and secrets; give it in one of them")
            if var in RESERVED_ENV or var.startswith("ATOLL_"):
                raise errors.InvalidRequest(
                    f"secrets key {var!r} is a variable the sandbox's programs or atoll rely on; give the "
                    "secret another variable name"
                )
            check_name(name, f"secrets.{var}")
            if self.db.get_secret(tenant, name) is None:
                raise errors.InvalidRequest(
                    f"secrets.{var} names the secret {name!r}, which does not exist; create it first "
                    "(POST /v1/secrets, client.secrets.create, atoll secret create)"
                )
            out[var] = {"secret": name, "placeholder": new_placeholder()}
        return out

    def bindings(self, tenant: str, bound: dict[str, dict[str, str]] | None) -> tuple[api.SecretBinding, ...]:
        """The bindings a sandbox's worker needs: each placeholder with its current value and
        hosts (a secret deleted since is left out: its placeholder then stays as it is)."""
        out = []
        for entry in (bound or {}).values():
            rec = self.db.get_secret(tenant, entry["secret"])
            if rec is None:
                continue
            value = secretbox.unseal(self._key, rec.sealed, f"{tenant}/{rec.name}")
            out.append(
                api.SecretBinding(
                    placeholder=entry["placeholder"],
                    value=value,
                    hosts=tuple(rec.hosts),
                    allow_http=bool(rec.allow_http),
                )
            )
        return tuple(out)


def view(rec: dbm.SecretRecord) -> dict:
    return {
        "name": rec.name,
        "tenant_id": rec.tenant_id,
        "hosts": list(rec.hosts),
        "allow_http": bool(rec.allow_http),
        "created_at": iso(rec.created_at),
        "updated_at": iso(rec.updated_at),
    }

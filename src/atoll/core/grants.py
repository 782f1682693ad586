"""Short-lived data grants: what lets a process that holds no worker token (the edge, `atoll edge`)
call one sandbox's data verbs on its worker directly, so that exec, file and process-output bytes
do not pass through the server that answered the control call.

A grant is `<sandbox_id>.<expires unix s>.<scope>.<mac>`, mac = base64url(HMAC-SHA256(worker
token, "atoll-grant-v1\\n<sandbox_id>\\n<expires>\\n<scope>")) without padding. The server mints
it (it knows the token of every worker it calls, held or borrowed); the worker checks it with its
own current token, so a grant minted before the worker registered again (a new token) is refused,
and nothing but the one sandbox's data verbs opens with it (`DATA_PATH`). It is a bearer
credential for `TTL_S` seconds: whoever holds it may run commands in that sandbox until then.

E2B's envd access token (`X-Access-Token`, `envdAccessToken`) is a longer-lived credential of the
same reach: base64url(HMAC-SHA256(k_e2b, "e2b-envd/<sandbox_id>")), where k_e2b is derived from the
installation's secrets key (`e2b_access_key`) in memory and never stored. The grant route takes it
as `Authorization: E2B-Access <token>` in place of an API key (it opens that one sandbox only) and
answers it to a caller with a key, so the E2B edge can hand it to the SDK.

A drive token (E2B's volume token, `Authorization: E2B-Volume <token>`) opens one drive's file
routes (`/v1/drives/{name}/files…`, `DRIVE_FILES_PATH`) and nothing else: `<tenant_id>.<mac>`,
mac = base64url(HMAC-SHA256(k_e2b, "e2b-volume/<tenant>/<name>/<created unix s>")). The drive's
creation time makes it one drive's: a drive deleted and made again under the same name has another.
Pure; used by controlplane.routes_grant and controlplane.app (minting, the access token),
worker.service.httpapi (checking) and e2b.control.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from atoll.core import errors, ids

TTL_S = 60
"""How long a grant is good for."""
SCOPE = "data"
"""The one scope there is: the sandbox's data verbs (exec, processes, files, terminals)."""
SCHEME = "Grant"
"""The Authorization scheme a grant travels in: `Authorization: Grant <grant>`."""
MAX_LEN = 200
E2B_ACCESS_SCHEME = "E2B-Access"
"""The Authorization scheme of the grant route that carries an envd access token instead of a key."""

E2B_VOLUME_SCHEME = "E2B-Volume"
"""The Authorization scheme of a drive token (the drive's file routes only)."""
DRIVE_FILES_PATH = re.compile(r"/v1/drives/(?P<name>[^/]+)/files(?:/list|/stat|/mkdir)?")
"""The public paths a drive token opens: its drive's file routes."""
GRANT_PORTS = (49990,)
"""The sandbox ports a grant opens through the worker's port tunnel: the code interpreter service
(atoll.guest.interpreter.PORT) that the E2B edge relays `/execute` and `/contexts` to. Any other
port is reached through the ingress router with its own preview rules."""

DATA_PATH = re.compile(
    r"^/sandboxes/(?P<sid>[^/]+)/(?:exec|processes(?:/.*)?|files(?:/.*)?|pty(?:/.*)?|alive"
    + "".join(f"|ports/{p}" for p in GRANT_PORTS)
    + ")$"
)
"""The worker-protocol paths (after its prefix) a grant opens: one sandbox's exec, processes,
files and terminals, `ports/<p>` for the ports of GRANT_PORTS (the worker's port tunnel), and
`alive` (the edge's liveness probe of the worker, which touches nothing) — not its lifecycle,
network, secrets, metrics, other ports, nor anything of the worker."""


def _mac(token: str | bytes, sandbox_id: str, expires: int, scope: str) -> str:
    key = token if isinstance(token, bytes) else token.encode()
    msg = f"atoll-grant-v1\n{sandbox_id}\n{expires}\n{scope}".encode()
    return base64.urlsafe_b64encode(hmac.new(key, msg, hashlib.sha256).digest()).rstrip(b"=").decode()


def mint(
    token: str | bytes, sandbox_id: str, now: float, ttl_s: int = TTL_S, scope: str = SCOPE
) -> tuple[str, int]:
    """A grant for `sandbox_id`'s data verbs, good until now + ttl_s: (grant, expires unix s)."""
    expires = int(now) + int(ttl_s)
    return f"{sandbox_id}.{expires}.{scope}.{_mac(token, sandbox_id, expires, scope)}", expires


def verify(token: str | bytes | None, grant: str, path: str, now: float) -> str:
    """The sandbox id of a valid `grant` presented for worker-protocol `path` (after the prefix);
    Unauthorized, saying why, if it is malformed, forged or minted with another token, expired,
    for another sandbox, or `path` is not a data verb."""
    m = DATA_PATH.match(path)
    if m is None:
        raise errors.Unauthorized(
            f"a grant opens only a sandbox's data verbs (exec, processes, files, terminals), not {path[:100]!r}"
        )
    parts = grant.strip().split(".")
    if len(grant) > MAX_LEN or len(parts) != 4 or not parts[1].isdigit():
        raise errors.Unauthorized("malformed grant: expected <sandbox_id>.<expires>.<scope>.<mac>")
    sid, expires_s, scope, mac = parts
    if token is None:
        raise errors.Unauthorized("this worker has not registered yet; it accepts no grant")
    if scope != SCOPE or not ids.SANDBOX_ID_RE.match(sid):
        raise errors.Unauthorized(f"malformed grant: unknown scope {scope[:20]!r} or sandbox id {sid[:40]!r}")
    if not hmac.compare_digest(mac.encode(), _mac(token, sid, int(expires_s), scope).encode()):
        raise errors.Unauthorized(
            "the grant was not minted with this worker's current token (forged, or minted before the "
            "worker registered again); ask the server for a new one (POST /v1/sandboxes/{id}/grant)"
        )
    if int(expires_s) <= now:
        raise errors.Unauthorized(
            f"the grant expired {int(now) - int(expires_s)} s ago; ask the server for a new one "
            "(POST /v1/sandboxes/{id}/grant)"
        )
    if sid != m.group("sid"):
        raise errors.Unauthorized(f"the grant is for sandbox {sid}, not for {m.group('sid')[:40]!r}")
    return sid


def e2b_access_key(secrets_key: bytes) -> bytes:
    """k_e2b: the key envd access tokens are made with, derived from the installation's secrets key
    (every server of the installation derives the same; nothing stores it)."""
    return hmac.new(secrets_key, b"atoll e2b envd access key v1", hashlib.sha256).digest()


def e2b_access_token(key: bytes, sandbox_id: str) -> str:
    """The sandbox's envd access token (`X-Access-Token`): base64url HMAC-SHA256 of its id."""
    mac = hmac.new(key, b"e2b-envd/" + sandbox_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def check_e2b_access_token(key: bytes, sandbox_id: str, given: str | None) -> bool:
    """Whether `given` is `sandbox_id`'s envd access token (a constant-time compare)."""
    return given is not None and hmac.compare_digest(
        e2b_access_token(key, sandbox_id).encode(), given.strip().encode("utf-8", "replace")
    )


def drive_token(key: bytes, tenant_id: str, name: str, created_unix: int) -> str:
    """The token of drive `name` of `tenant_id` made at `created_unix` (see the module's text)."""
    msg = f"e2b-volume/{tenant_id}/{name}/{int(created_unix)}".encode()
    mac = base64.urlsafe_b64encode(hmac.new(key, msg, hashlib.sha256).digest()).rstrip(b"=").decode()
    return f"{tenant_id}.{mac}"


def drive_token_tenant(token: str) -> str | None:
    """The tenant a drive token names (None: not a token's shape); check it with check_drive_token."""
    tenant, dot, mac = token.strip().partition(".")
    return tenant if dot and mac and len(token) <= MAX_LEN else None


def check_drive_token(key: bytes, tenant_id: str, name: str, created_unix: int, given: str) -> bool:
    """Whether `given` is the token of that drive (a constant-time compare)."""
    want = drive_token(key, tenant_id, name, created_unix)
    return hmac.compare_digest(want.encode(), given.strip().encode("utf-8", "replace"))

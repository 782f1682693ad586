"""Preview URLs on the control plane's side: the ingress router's backend, and the URLs handed out.

`Previews` answers the router (ingress.router.Backend): who may reach a sandbox's port (its public
ports, its token, a signed URL or the cookie one earns), wakes the sandbox when it is in standby
(the manager's resume: concurrent requests share one) and opens the connection into it through
its worker (WorkerAPI.open_port). `describe` makes what `GET /v1/sandboxes/{id}/preview/{port}`
returns: the URL, the token, a signed URL and whether the port is public (stored in the sandbox's
record, `previews.public`).
Called by controlplane.main (the router's backend) and controlplane.routes_sandboxes.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from atoll.controlplane.manager_view import Manager
from atoll.core import errors, preview
from atoll.core.lifecycle import State
from atoll.ingress.router import Grant

SIGNED_URL_S = 3600
MAX_SIGNED_URL_S = 7 * 86400


def preview_key(secrets_key: bytes) -> bytes:
    """The key tokens and signed URLs are made with, derived from the installation's secrets key
    (so one file to keep, and a new secrets key invalidates every preview token)."""
    return hmac.new(secrets_key, b"atoll preview key v1", hashlib.sha256).digest()


class Previews:
    def __init__(self, manager: Manager, key: bytes, domain: str, ingress_port: int):
        self.manager = manager
        self.key = key
        self.domain = domain
        self.ingress_port = ingress_port

    def _record(self, sid: str):
        rec = self.manager.get(sid)  # SandboxNotFound for an unknown or deleted sandbox
        if rec.state == State.DELETED:
            raise errors.SandboxNotFound(f"sandbox {sid} was deleted")
        return rec

    def public_ports(self, rec) -> list[int]:
        return sorted(int(p) for p in (rec.previews or {}).get("public", []))

    # ---- the router's backend ----------------------------------------------------------------
    def authorize(
        self,
        target: preview.Target,
        token: str | None,
        expires: str | None,
        sig: str | None,
        cookie: str | None,
    ) -> Grant:
        rec = self._record(target.sandbox_id)
        if target.port in self.public_ports(rec):
            return Grant("public")
        if token is not None:
            if preview.token_ok(self.key, rec.id, token):
                return Grant("token")
            raise errors.PermissionDenied(
                f"the Atoll-Access-Token sent is not sandbox {rec.id}'s token; GET "
                f"/v1/sandboxes/{rec.id}/preview/{target.port} gives it"
            )
        now = time.time()
        if expires is not None or sig is not None:
            why = preview.signature_ok(self.key, target, expires or "", sig or "", now)
            if why is not None:
                raise errors.PermissionDenied(f"{why} (port {target.port} of sandbox {rec.id})")
            assert expires is not None and sig is not None
            return Grant("signed", cookie=f"{expires}.{sig}", max_age=max(0, int(expires) - int(now)))
        if cookie:
            exp, _, csig = cookie.partition(".")
            if preview.signature_ok(self.key, target, exp, csig, now) is None:
                return Grant("cookie")
        raise errors.Unauthorized(
            f"port {target.port} of sandbox {rec.id} is private: send the header Atoll-Access-Token "
            f"(GET /v1/sandboxes/{rec.id}/preview/{target.port} gives the token and a signed URL), or make "
            f'the port public (PUT /v1/sandboxes/{rec.id}/preview/{target.port} {{"public": true}})'
        )

    async def ready(self, target: preview.Target) -> None:
        rec = self._record(target.sandbox_id)
        if rec.state == State.FAILED:
            raise errors.Conflict(
                f"sandbox {rec.id} has failed ({rec.failure_reason}); its previews answer no more",
                code="invalid_state",
            )
        await self.manager.resume(rec.id)

    async def connect(self, target: preview.Target):
        rec = self._record(target.sandbox_id)
        return await self.manager.worker(rec).open_port(rec.id, target.port)

    # ---- the API's side ------------------------------------------------------------------------
    def describe(self, sid: str, port: int, expires_in_s: float | None = None) -> dict:
        rec = self._record(sid)
        try:
            preview.check_port(port)
        except preview.BadTarget as e:
            raise errors.InvalidRequest(str(e)) from None
        ttl = SIGNED_URL_S if expires_in_s is None else expires_in_s
        if not 1 <= ttl <= MAX_SIGNED_URL_S:
            raise errors.InvalidRequest(
                f"expires_in_s {expires_in_s!r} is out of range: give 1 to {MAX_SIGNED_URL_S} seconds"
            )
        expires = int(time.time() + ttl)
        url = preview.url(self.domain, self.ingress_port, rec.id, port)
        return {
            "sandbox_id": rec.id,
            "port": port,
            "url": url,
            "token": preview.token(self.key, rec.id),
            "public": port in self.public_ports(rec),
            "signed_url": url + "?" + preview.signed_query(self.key, rec.id, port, expires),
            "expires_at": expires,
            "headers": {"Atoll-Sandbox-Id": rec.id, "Atoll-Sandbox-Port": str(port)},
        }

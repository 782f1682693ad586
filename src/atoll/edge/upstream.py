"""What stands behind the edge: the API server's grants, kept and re-checked, and one kept-alive
channel per worker, with a liveness probe.

`Grants` asks the server `POST /v1/sandboxes/{id}/grant` with the caller's own `Authorization`
header and keeps the answer per (SHA-256 of the header, sandbox) until GRANT_MARGIN_S before it
expires. A kept grant is re-checked with the server at most every REVALIDATE_S: the next call after
that asks `GET /v1/sandboxes/{id}` with the caller's header (cheap: a read, not audited, nothing
resumed or minted), so a revoked key, a deleted sandbox or another tenant's sandbox is refused
within REVALIDATE_S; a sandbox that moved, sleeps or whose worker is lost has its grant asked
for anew (the grant route resumes it, or answers the server's own error). A server that cannot be
reached does not stop calls with a kept grant (it is asked again after REVALIDATE_S). Checks of the
same key and sandbox share one request. A grant asked for with an envd access token (`E2B-Access`,
the E2B edge through edge.seam) is not re-checked: the server takes that token on the grant route
only, and it is revoked only with its sandbox, whose worker then refuses the grant (404).

`Workers` holds one http11 channel per worker URL (TLS checked against the CA file, certificate
naming the worker, when it is https://) and probes a worker's liveness (`GET …/sandboxes/{id}/alive`
with the grant: answered by the worker's event loop, the sandbox untouched; any answer within
PROBE_TIMEOUT_S counts), one probe per worker at a time, a success kept for ALIVE_KEEP_S.
Pure of routes; used by edge.service and edge.watchdog.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import json
import logging
import ssl
import time
import typing
import urllib.parse

import httpx

from atoll.core import errors, grants, pki, wire
from atoll.core import worker_api as api
from atoll.shared import http11

log = logging.getLogger(__name__)

PREFIX = "/worker/v1"
GRANT_MARGIN_S = 10.0
"""A cached grant is used until this long before it expires (a call may take a while to arrive)."""
REVALIDATE_S = 5.0
"""A kept grant is re-checked with the server when it was last checked longer ago than this: the
bound on how long a revoked key (or a deleted sandbox) keeps working through the edge."""
CHECK_TIMEOUT_S = 5.0
"""A re-check the server does not answer within this long counts as "the server cannot be asked"."""
PROBE_TIMEOUT_S = 5.0
"""A worker that does not answer its liveness probe within this long is taken to be frozen."""
ALIVE_KEEP_S = 2.0
MAX_CACHED = 10_000


class Passed(Exception):
    """The server's own refusal of a grant, answered to the client as it came."""

    def __init__(self, status: int, body: bytes, content_type: str):
        self.status, self.body, self.content_type = status, body, content_type

    def error(self) -> errors.AtollError:
        """The refusal as the domain error (for a stream already answering, or a terminal)."""
        try:
            obj = json.loads(self.body)
        except ValueError:
            obj = None
        return wire.error_from_body(self.status, obj, f"the API server refused the call ({self.status})")


class Verdict(enum.Enum):
    """What the server says of a kept grant's sandbox."""

    OK = "ok"
    UNKNOWN = "unknown"
    """The server could not be asked (down, or answered something unexpected): keep going."""
    ASLEEP = "asleep"
    """In standby or being created: a new call needs a new grant (which resumes it)."""
    LOST = "lost"
    """Its worker is lost to the server (no heartbeats): probe the worker."""
    MOVED = "moved"
    """Another worker holds it now, or it failed: the kept grant leads nowhere."""


@dataclasses.dataclass(frozen=True)
class Grant:
    sandbox_id: str
    worker_id: str
    worker_name: str
    url: str
    tunnel_port: int
    grant: str
    expires_at: int
    defaults: dict
    e2b_access_token: str = ""
    """The sandbox's envd access token (core.grants.e2b_access_token), when the grant was asked
    for with an API key (the E2B edge answers it as `envdAccessToken`); else ""."""
    compat: dict | None = None
    """The sandbox's `compat` (E2B's auto-resume, kept from an E2B create); None: none."""


def _verdict(g: Grant, d: typing.Any) -> Verdict:
    if not isinstance(d, dict):
        return Verdict.UNKNOWN
    if d.get("worker_id") != g.worker_id or d.get("state") == "failed":
        return Verdict.MOVED
    if d.get("worker_state") == "lost":
        return Verdict.LOST
    if d.get("state") != "running":
        return Verdict.ASLEEP
    return Verdict.OK


class Grants:
    """Grants from the server, cached per (sha256 of the caller's Authorization, sandbox) and
    re-checked every REVALIDATE_S."""

    def __init__(self, server_url: str, verify: ssl.SSLContext | bool, transport: typing.Any = None):
        self.server_url = server_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.server_url, verify=verify, timeout=60, transport=transport
        )
        self._cache: dict[tuple[str, str], Grant] = {}
        self._checked: dict[tuple[str, str], tuple[float, Verdict]] = {}
        self._checking: dict[tuple[str, str], asyncio.Future] = {}
        self.asked = 0
        """Grants asked of the server (a test and the bench read it)."""
        self.checks = 0
        """Re-checks of kept grants sent to the server."""

    @staticmethod
    def _key(auth: str, sid: str) -> tuple[str, str]:
        return hashlib.sha256(auth.encode()).hexdigest(), sid

    def drop(self, auth: str, sid: str) -> None:
        key = self._key(auth, sid)
        self._cache.pop(key, None)
        self._checked.pop(key, None)

    async def get(self, auth: str, sid: str, resume: bool = True) -> Grant:
        """A grant for a new call: the kept one while it is good and the server still says so
        (asked every REVALIDATE_S), else a new one; Passed for the server's refusal. `resume=False`
        asks the server not to resume a sandbox in standby (it answers 409 invalid_state: the
        E2B port's envd calls to a paused sandbox without auto-resume)."""
        key = self._key(auth, sid)
        g = self._cache.get(key)
        if g is not None and g.expires_at - GRANT_MARGIN_S > time.time():
            if await self.check(auth, sid, g) in (Verdict.OK, Verdict.UNKNOWN):
                return g
        return await self._ask(auth, sid, key, resume)

    async def check(self, auth: str, sid: str, g: Grant) -> Verdict:
        """What the server says of `g`'s sandbox for this caller, asked at most every
        REVALIDATE_S (one request shared by every call that waits for it); Passed (the grant
        dropped) when it refuses the key or the sandbox."""
        if not auth[:7].lower() == "bearer ":
            # an envd access token (`E2B-Access`, the E2B edge): the server takes it on the grant
            # route only, and it is revoked only with its sandbox (whose worker then answers 404)
            return Verdict.OK
        key = self._key(auth, sid)
        seen = self._checked.get(key)
        if seen is not None and time.monotonic() - seen[0] < REVALIDATE_S:
            return seen[1]
        fut = self._checking.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._check(auth, sid, g, key))
            self._checking[key] = fut
            fut.add_done_callback(lambda _: self._checking.pop(key, None))
        return await asyncio.shield(fut)

    async def _check(self, auth: str, sid: str, g: Grant, key: tuple[str, str]) -> Verdict:
        self.checks += 1
        try:
            r = await self._http.get(
                f"/v1/sandboxes/{sid}", headers={"Authorization": auth}, timeout=CHECK_TIMEOUT_S
            )
        except httpx.HTTPError as e:
            log.info(
                "the edge could not re-check a grant with the server; the kept one is used",
                extra={"sandbox_id": sid, "detail": repr(e)[:200]},
            )
            verdict = Verdict.UNKNOWN
        else:
            if r.status_code != 200:
                if r.status_code in (401, 403, 404):
                    self.drop(auth, sid)
                    raise Passed(r.status_code, r.content, r.headers.get("content-type", "application/json"))
                verdict = Verdict.UNKNOWN  # a 5xx: the server is not sure either
            else:
                try:
                    verdict = _verdict(g, r.json())
                except ValueError:
                    verdict = Verdict.UNKNOWN
        if key in self._cache:
            self._checked[key] = (time.monotonic(), verdict)
        return verdict

    async def _ask(self, auth: str, sid: str, key: tuple[str, str], resume: bool = True) -> Grant:
        self.asked += 1
        now = time.time()
        try:
            r = await self._http.post(
                f"/v1/sandboxes/{sid}/grant",
                headers={"Authorization": auth},
                json=None if resume else {"resume": False},
            )
        except httpx.HTTPError as e:
            raise errors.Unavailable(
                f"the edge cannot reach the API server at {self.server_url} to authorize this call "
                f"({type(e).__name__}: {str(e)[:200]}); nothing was sent to the sandbox — retry once the "
                "server is back (or, for a certificate that does not verify, give --ca-file the installation CA)"
            ) from None
        if r.status_code != 200:
            self.drop(auth, sid)
            raise Passed(r.status_code, r.content, r.headers.get("content-type", "application/json"))
        try:
            d = r.json()
            w = d["worker"]
            g = Grant(
                sid,
                w["id"],
                w.get("name", ""),
                w["url"],
                int(w.get("tunnel_port") or 0),
                d["grant"],
                int(d["expires_at"]),
                d["defaults"],
                str(d.get("e2b_access_token") or ""),
                d.get("compat") if isinstance(d.get("compat"), dict) else None,
            )
        except (ValueError, KeyError, TypeError):
            raise errors.RuntimeFailure(
                f"the API server at {self.server_url} answered the grant route with something unexpected; "
                "is it an atoll server of the same version?"
            ) from None
        if len(self._cache) >= MAX_CACHED:
            for k, v in list(self._cache.items()):
                if v.expires_at - GRANT_MARGIN_S <= now:
                    self._cache.pop(k, None)
                    self._checked.pop(k, None)
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
                self._checked.clear()
        self._cache[key] = g
        self._checked[key] = (time.monotonic(), Verdict.OK)
        return g

    async def aclose(self) -> None:
        await self._http.aclose()


class Workers:
    """One kept-alive channel per worker URL (TLS checked against the CA file, certificate naming
    the worker, when it is https://), and their liveness."""

    def __init__(self, ca_file: str | None):
        self._tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._channels: dict[str, http11.Channel] = {}
        self._alive_at: dict[str, float] = {}
        self._probing: dict[str, asyncio.Future] = {}

    def channel(self, g: Grant) -> http11.Channel:
        ch = self._channels.get(g.url)
        if ch is not None:
            return ch
        parsed = urllib.parse.urlsplit(g.url)
        if not parsed.hostname or not parsed.port or parsed.scheme not in ("http", "https"):
            raise errors.RuntimeFailure(f"the server named a worker URL the edge cannot use: {g.url!r}")
        if parsed.scheme == "https":
            if self._tls is None:
                raise errors.Unavailable(
                    f"worker {g.worker_name!r} serves https ({g.url}) but this edge has no CA to check it: "
                    "start it with --ca-file (the server's GET /v1/ca.crt)"
                )
            name = g.worker_name
            ch = http11.Channel(
                parsed.hostname,
                parsed.port,
                tls=self._tls,
                check_peer=lambda der: pki.check_worker_certificate(der, name),
            )
        else:
            ch = http11.Channel(parsed.hostname, parsed.port)
        self._channels[g.url] = ch
        return ch

    async def alive(self, g: Grant) -> bool:
        """Whether `g`'s worker answers a probe within PROBE_TIMEOUT_S (one probe per worker at a
        time; a success is kept for ALIVE_KEEP_S)."""
        at = self._alive_at.get(g.url)
        if at is not None and time.monotonic() - at < ALIVE_KEEP_S:
            return True
        fut = self._probing.get(g.url)
        if fut is None:
            fut = asyncio.ensure_future(self._probe(g))
            self._probing[g.url] = fut
            fut.add_done_callback(lambda _: self._probing.pop(g.url, None))
        return await asyncio.shield(fut)

    async def _probe(self, g: Grant) -> bool:
        headers = {
            "Authorization": f"{grants.SCHEME} {g.grant}",
            wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION),
        }
        try:
            await self.channel(g).request(
                "GET", f"{PREFIX}/sandboxes/{g.sandbox_id}/alive", headers=headers, timeout=PROBE_TIMEOUT_S
            )
        except (http11.ChannelError, errors.AtollError) as e:
            log.warning(
                "worker %r did not answer the edge's liveness probe", g.worker_name, extra={"detail": repr(e)}
            )
            return False
        self._alive_at[g.url] = time.monotonic()
        return True

    async def aclose(self) -> None:
        for ch in self._channels.values():
            await ch.aclose()

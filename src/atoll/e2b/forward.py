"""Forwarding E2B's control calls to atoll's REST API: the caller's key (`api_key`), a route's JSON
body (`read_body`), the E2B port's `Settings`, and `Forwarder` — one kept-alive channel to the
API, a call forwarded with the caller's key (`call`, an error turned into E2B's shape), a page of a
list, a sandbox, its envd access token.

Used by e2b.app (`ControlAPI`, the control routes, is a Forwarder) and e2b.volumes (the volume
routes, handed the app's Forwarder), so that neither imports the other.
"""

from __future__ import annotations

import binascii
import contextlib
import dataclasses
import json
import ssl
import typing
import urllib.parse

from starlette.requests import Request

from atoll.core import inputs
from atoll.e2b import control
from atoll.shared import http11

MAX_BODY_BYTES = 1024 * 1024
E2B_KEY_PREFIX = "e2b_"


def api_key(request: Request) -> str:
    """The atoll key the caller sent as `X-API-KEY` (an `e2b_<hex>` spelling decoded); 401 else."""
    raw = request.headers.get("x-api-key", "").strip()
    if not raw:
        raise control.E2BError(
            401, "missing API key: set E2B_API_KEY to an atoll API key (sent as X-API-KEY)"
        )
    if raw.startswith(E2B_KEY_PREFIX):
        try:
            raw = bytes.fromhex(raw[len(E2B_KEY_PREFIX) :]).decode("ascii")
        except (ValueError, UnicodeDecodeError, binascii.Error):
            raise control.E2BError(
                401,
                "invalid API key: an e2b_… key must be e2b_ followed by the hex of an atoll key's "
                "characters (python -c \"print('e2b_' + KEY.encode().hex())\")",
            ) from None
    if not (raw.isascii() and raw.isprintable()):
        raise control.E2BError(
            401, "invalid API key: an atoll key is printable ASCII (check what was pasted)"
        )
    return raw


async def read_body(request: Request, optional: bool = True) -> dict:
    """A control route's JSON object body (at most MAX_BODY_BYTES; {} when empty and `optional`)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise control.E2BError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        if optional:
            return {}
        raise control.E2BError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise control.E2BError(400, "the request body is not JSON") from None
    if not isinstance(data, dict):
        raise control.E2BError(400, f"the request body must be a JSON object, not {inputs.json_kind(data)}")
    return data


@dataclasses.dataclass
class Settings:
    api_url: str
    """atoll's REST API (loopback), where every control call is forwarded."""
    verify: ssl.SSLContext | bool = True
    """TLS check of an https api_url: an ssl.SSLContext (the installation CA), or True (the
    system's roots)."""
    token_key: bytes | None = None
    """k_e2b, the key of the envd access tokens (ATOLL_E2B_TOKEN_KEY, hex, given by the server to
    its edge child; core.grants.e2b_access_key): tokens are made and checked here. None (a
    standalone `atoll edge`): the grant route makes and checks them."""
    internet: bool = True
    """E2B's `allow_internet_access` default (ATOLL_E2B_INTERNET=deny makes it False)."""
    pause_tier: str = "memory"
    """The standby tier of an E2B pause (ATOLL_E2B_PAUSE_TIER)."""
    volume_mb: int = 1024
    """The size of a volume `Volume.create` makes (ATOLL_E2B_VOLUME_MB; e2b.volumes)."""
    domain: str | None = None
    """The `domain` of the create/connect/detail answers (ATOLL_E2B_DOMAIN, `{preview domain}:{ingress
    port}` by default): the SDKs build their sandbox hosts `{port}-{id}.{domain}` from it — get_host,
    the code interpreter 2.8.1's URL, and envd when E2B_SANDBOX_URL is unset — which the ingress
    router relays back here. None: null (the SDKs use their E2B_DOMAIN)."""


def channel(api_url: str, verify: ssl.SSLContext | bool) -> http11.Channel:
    u = urllib.parse.urlsplit(api_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"the API's URL {api_url!r} is not http(s)://HOST:PORT")
    port = u.port or (443 if u.scheme == "https" else 80)
    if u.scheme == "http":
        return http11.Channel(u.hostname, port)
    ctx = verify if isinstance(verify, ssl.SSLContext) else ssl.create_default_context()
    if verify is False:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return http11.Channel(u.hostname, port, tls=ctx)


class Answer(typing.NamedTuple):
    """atoll's answer to a forwarded call."""

    status_code: int
    headers: dict[str, str]
    content: bytes

    def json(self) -> typing.Any:
        return json.loads(self.content)


class Forwarder:
    """One kept-alive HTTP/1.1 channel to atoll's API (shared.http11: ~1 ms a call less than
    httpx's pool) and what the E2B routes do with it: forward a call with the caller's key, turn
    atoll's error into E2B's, read a page, a sandbox, its envd access token."""

    def __init__(self, settings: Settings):
        self.s = settings
        self.api = channel(settings.api_url, settings.verify)

    async def aclose(self) -> None:
        await self.api.aclose()

    # ---- one forwarded call ------------------------------------------------------------------------
    async def call(
        self,
        key: str,
        method: str,
        path: str,
        *,
        json_body: typing.Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200, 201, 204),
        passthrough: tuple[int, ...] = (),
    ) -> Answer:
        """atoll's answer to one call with the caller's key; an error status (other than
        `passthrough`) raises control.E2BError with E2B's body."""
        h = {"Authorization": f"Bearer {key}", **(headers or {})}
        try:
            r = await self.api.request(
                method, path, json=json_body, params=params or None, headers=h, timeout=600
            )
        except http11.ChannelError as e:
            unknown = not isinstance(e, http11.ConnectFailed) and method != "GET"
            status, body, hdrs = control.error(
                503,
                "api_unreachable",
                f"atoll's API at {self.s.api_url} did not answer ({str(e)[:200]}); "
                + (
                    "the call may have taken effect: look before repeating it" if unknown else "retry shortly"
                ),
                retryable=True,
                outcome_unknown=unknown,
            )
            raise control.E2BError(status, body["message"], hdrs) from None
        answer = Answer(r.status_code, r.headers, r.content)
        if r.status_code in ok or r.status_code in passthrough:
            return answer
        raise self.failed(answer, method)

    @staticmethod
    def failed(r: Answer, method: str) -> control.E2BError:
        code, message, retryable = (
            "error",
            r.content.decode(errors="replace")[:500] or f"HTTP {r.status_code}",
            False,
        )
        with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
            err = r.json()["error"]
            code, message, retryable = str(err["code"]), str(err["message"]), bool(err.get("retryable"))
        # an atoll 5xx whose retry makes no sense on a POST: the outcome is not known
        unknown = method != "GET" and r.status_code >= 500 and not retryable
        status, body, headers = control.error(
            r.status_code, code, message, retryable=retryable, outcome_unknown=unknown
        )
        if "retry-after" in r.headers and headers.get("Should-Retry") == "true":
            headers["Retry-After"] = r.headers["retry-after"]
        return control.E2BError(status, body["message"], headers)

    async def page(self, key: str, path: str, params: dict[str, str]) -> tuple[dict, dict[str, str] | None]:
        """One page of an atoll list for an E2B list: its body and the `x-next-token` header of the
        next. A token atoll refuses is named as E2B's SDKs call it (`nextToken`, not `cursor`)."""
        r = await self.call(key, "GET", path, params=params, passthrough=(400,))
        if r.status_code == 400:
            failed = self.failed(r, "GET")
            token = params.get("cursor")
            if token and "cursor" in failed.message:
                shown = token[:40] + ("…" if len(token) > 40 else "")
                raise control.E2BError(
                    400,
                    f"invalid_request: nextToken {shown!r} is not one this server handed out for this "
                    "list (it is changed, cut short, made up or another list's); pass the x-next-token "
                    "of the previous page exactly, or leave nextToken out to start from the first page",
                )
            raise failed
        page = r.json()
        return page, ({"x-next-token": page["next_cursor"]} if page.get("next_cursor") else None)

    async def sandbox(self, key: str, sid: str) -> dict:
        r = await self.call(key, "GET", f"/v1/sandboxes/{sid}")
        sb = r.json()
        if sb.get("state") in ("failed", "deleted"):
            why = sb.get("failure_reason") or "it was deleted"
            raise control.E2BError(404, f"sandbox {sid} was not found: it failed ({why}); create another")
        return sb

    async def access_token(self, key: str, sid: str) -> str | None:
        """The sandbox's envd access token: made here when this process holds k_e2b (the edge
        child of `atoll server` / `atoll up`: ATOLL_E2B_TOKEN_KEY), else the grant route's
        `e2b_access_token` (a standalone `atoll edge`)."""
        if self.s.token_key:
            return self.local_token(sid)
        r = await self.call(key, "POST", f"/v1/sandboxes/{sid}/grant", passthrough=(409,))
        if r.status_code == 200:
            return r.json().get("e2b_access_token") or None
        return None

    def local_token(self, sid: str) -> str | None:
        return control.access_token(self.s.token_key, sid) if self.s.token_key else None

    def _answer(self, sb: dict, token: str | None) -> dict:
        out = control.sandbox(sb, token=token or "", domain=self.s.domain)
        if token is None:
            out.pop("envdAccessToken")
        return out

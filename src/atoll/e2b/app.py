"""The E2B port (`ATOLL_E2B_PORT`): E2B's control API and envd, served for the unmodified `e2b` SDKs
(2.31 and 2.63; docs/e2b-compat.md §2, §6.3).

- **Control routes** (`X-API-KEY`): `POST /v2/sandboxes` and `/sandboxes`, `…/{id}/connect` (and
  2.31's `/sandboxes/{id}/resume`), `GET /sandboxes/{id}`, `GET /v2/sandboxes` and `/sandboxes`
  (paged, `x-next-token`), `DELETE /sandboxes/{id}`, `POST …/timeout`, `…/pause`, `…/fork`,
  `PUT …/network`, `GET …/metrics`, named snapshots (`POST …/snapshots`, `GET /snapshots`,
  `DELETE /templates/{snapshot id}`; a create's `templateID` may name one, §6.5). Each is translated
  with e2b.control and forwarded to atoll's REST API over loopback with `Authorization: Bearer
  <the X-API-KEY value>` (also in its `e2b_<hex>` spelling, §1 finding 11), so the API keeps every
  rule (keys, tenants, quotas, audit, idempotency); its answer is translated back.
- **envd** (e2b.envd_routes, chosen by the `E2b-Sandbox-Id` header): `GET /health` (204 running, 502 paused or
  unknown — never resumes), and the Connect RPC services `filesystem.Filesystem`
  (e2b.envd_files) and `process.Process` (e2b.envd_process, when present) over the seam object
  `seam_for(request, sandbox_id)` returns (a grant-authenticated client of the worker's seam
  routes, given by the process that serves this app). Without `seam_for` they answer 502.
- **The code interpreter** (e2b.interpreter, `E2b-Sandbox-Port: 49999`): `POST /execute` and
  `/contexts…`, relayed to the service inside a `code-interpreter-v1` sandbox.
- **E2B_DOMAIN mode**: the answers' `domain` (Settings.domain) names the ingress router, which
  relays `api.{domain}` and `{49983|49999}-{id}.{domain}` here with the headers above set from
  the host (ingress.router), so the same routes serve both modes.

Every error is `{"code": <status>, "message": str}` (what both SDKs parse), with `Should-Retry`
on 5xx/429 (`false` whenever a POST may have taken effect). Served by edge.service (the edge
process; `atoll up`/`atoll server` start it as a child, controlplane.edge_host).
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import secrets
import ssl
import typing
import urllib.parse

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from atoll.core import ids, inputs
from atoll.e2b import control, envd_routes, interpreter, volumes
from atoll.shared import http11

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
PAUSE_BUSY_RETRY_S = 5.0
"""A pause refused because a call that is not a stream is in flight (atoll's 409 sandbox_busy: a file
transfer, a foreground command) is tried again for this long before answering 503 (E2B reads a 409
on pause as "already paused", §6.4). Open process streams and watches do not refuse it: the pause
ends them (`end_streams`)."""
E2B_KEY_PREFIX = "e2b_"


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


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


def _sid(request: Request) -> str:
    sid = request.path_params["sid"]
    if not ids.SANDBOX_ID_RE.match(sid):
        raise control.E2BError(
            404, f"sandbox {sid[:80]!r} was not found (atoll sandbox ids are sb- and 16 letters/digits)"
        )
    return sid


async def _body(request: Request, optional: bool = True) -> dict:
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


def _timeout(body: dict, *, required: bool) -> int | None:
    v = body.get("timeout")
    if v is None:
        if required:
            raise control.E2BError(400, "timeout is required: seconds from now (1 to 2592000)")
        return None
    return control.timeout_seconds(v, "timeout")


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


def _channel(api_url: str, verify: ssl.SSLContext | bool) -> http11.Channel:
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


class ControlAPI:
    """The control routes over one kept-alive HTTP/1.1 channel to atoll's API (shared.http11:
    ~1 ms a call less than httpx's pool)."""

    def __init__(self, settings: Settings):
        self.s = settings
        self.api = _channel(settings.api_url, settings.verify)

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
        raise self._failed(answer, method)

    @staticmethod
    def _failed(r: Answer, method: str) -> control.E2BError:
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
            failed = self._failed(r, "GET")
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

    # ---- routes -------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        key = api_key(request)
        body = await _body(request)
        plan = control.create_request(body, internet=self.s.internet)
        snapshot = await self.snapshot_for(key, body.get("templateID"))
        if snapshot is not None:  # a create from a named snapshot: its template is the snapshot's
            del plan.body["template"]
            plan.body["snapshot"] = snapshot
        headers = {}
        if request.headers.get("idempotency-key"):
            headers["Idempotency-Key"] = request.headers["idempotency-key"]
        r = await self.call(key, "POST", "/v1/sandboxes", json_body=plan.body, headers=headers)
        sb = r.json()
        token = await self.access_token(key, sb["id"])
        return JSONResponse(self._answer(sb, token), status_code=201)

    async def connect(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        body = await _body(request)
        # 2.31's connect always sends it; 2.63's may leave it out (then the SDK's 300 s)
        timeout = _timeout(body, required=False) or control.DEFAULT_TIMEOUT_S
        sb = await self.sandbox(key, sid)
        status = 200
        if sb.get("state") == "standby":
            sb = (await self.call(key, "POST", f"/v1/sandboxes/{sid}/resume")).json()
            status = 201
        until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=timeout)
        ends = control._parse(sb.get("expires_at"))
        # a resumed sandbox gets the timeout; a running one only a later end (E2B: "only grows")
        if status == 201 or (ends is not None and until > ends):
            r = await self.call(key, "PATCH", f"/v1/sandboxes/{sid}", json_body={"timeout_s": timeout})
            sb = r.json()
        token = await self.access_token(key, sid)
        return JSONResponse(self._answer(sb, token), status_code=status)

    async def get(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        sb = await self.sandbox(key, sid)
        token = self.local_token(sid)
        out = control.sandbox_detail(sb, token=token or "", domain=self.s.domain)
        if token is None:
            out.pop("envdAccessToken")
        return JSONResponse(out)

    async def list(self, request: Request) -> Response:
        key = api_key(request)
        query = control.list_query(request.query_params)
        page, headers = await self.page(key, "/v1/sandboxes", dict(query))
        items = [control.listed_sandbox(sb) for sb in page.get("items") or []]
        return JSONResponse(items, headers=headers)

    async def kill(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        await self.call(key, "DELETE", f"/v1/sandboxes/{sid}")
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        timeout = _timeout(await _body(request, optional=False), required=True)
        await self.call(key, "PATCH", f"/v1/sandboxes/{sid}", json_body={"timeout_s": timeout})
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        await _body(request)  # memory / requireHealthyGuest: atoll always keeps memory (§6.2)
        sb = await self.sandbox(key, sid)
        if sb.get("state") == "standby":
            raise control.E2BError(409, f"sandbox {sid} is already paused; Sandbox.connect() resumes it")
        deadline = asyncio.get_running_loop().time() + PAUSE_BUSY_RETRY_S
        while True:
            r = await self.call(
                key,
                "POST",
                f"/v1/sandboxes/{sid}/pause",
                # E2B's pause ends process streams and watches (Connect `canceled`) rather than
                # waiting for them; other calls in flight (a file transfer) are waited for below
                json_body={"tier": self.s.pause_tier, "end_streams": True},
                passthrough=(409,),
            )
            if r.status_code != 409:
                return Response(status_code=204)
            failed = self._failed(r, "POST")
            busy = "sandbox_busy" in failed.message
            if not busy:
                raise failed
            if asyncio.get_running_loop().time() > deadline:
                raise control.E2BError(
                    503,
                    f"sandbox {sid} could not be paused: a call into it (a file transfer or command) "
                    f"was still in progress after {PAUSE_BUSY_RETRY_S:.0f} s; retry",
                    {"Should-Retry": "true", "Retry-After": "1"},
                )
            await asyncio.sleep(0.25)

    async def metrics(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        r = await self.call(key, "GET", f"/v1/sandboxes/{sid}/metrics")
        return JSONResponse(control.metrics(r.json()))

    async def fork(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        body = await _body(request)
        timeout = _timeout(body, required=False)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 20:
            raise control.E2BError(400, f"count must be a whole number from 1 to 20, not {count!r}")
        r = await self.call(key, "POST", f"/v1/sandboxes/{sid}/fork", json_body={"count": count})
        out = []
        for copy in r.json().get("items") or []:
            if timeout is not None:
                copy = (
                    await self.call(
                        key, "PATCH", f"/v1/sandboxes/{copy['id']}", json_body={"timeout_s": timeout}
                    )
                ).json()
            out.append({"sandbox": self._answer(copy, await self.access_token(key, copy["id"]))})
        return JSONResponse(out, status_code=201)

    async def network(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        body = await _body(request, optional=False)
        internet = body.pop("allow_internet_access", None)
        if internet is not None and not isinstance(internet, bool):
            raise control.E2BError(400, f"allow_internet_access must be true or false, not {internet!r}")
        policy = control.network_policy(body, self.s.internet if internet is None else internet)
        await self.call(key, "PUT", f"/v1/sandboxes/{sid}/network", json_body=policy)
        return Response(status_code=204)

    async def create_snapshot(self, request: Request) -> Response:
        """E2B's create_snapshot: atoll's named snapshot; a name used already is given to the new
        snapshot (E2B points the name at the new state; atoll's `replace`)."""
        key = api_key(request)
        sid = _sid(request)
        body = await _body(request)
        name, memory = body.get("name"), body.get("memory", True)
        if name is not None and not isinstance(name, str):
            raise control.E2BError(400, f"name must be a string, not {type(name).__name__}")
        if memory is None:
            memory = True
        if not isinstance(memory, bool):
            raise control.E2BError(400, f"memory must be true or false, not {memory!r}")
        r = await self.call(
            key,
            "POST",
            f"/v1/sandboxes/{sid}/snapshots",
            # E2B pauses the sandbox for the snapshot: its process streams end (as for pause)
            json_body={"name": name or None, "memory": memory, "replace": bool(name), "end_streams": True},
            passthrough=(403,),
        )
        if r.status_code == 403:  # quota_exceeded (max_snapshots / max_snapshot_gb): E2B's shape,
            failed = self._failed(r, "POST")  # with the E2B SDK's way to make room
            raise control.E2BError(
                403,
                failed.message + " (with the e2b SDK: Sandbox.list_snapshots() and "
                "Sandbox.delete_snapshot(snapshot_id))",
                failed.headers,
            )
        return JSONResponse(control.snapshot_info(r.json()), status_code=201)

    async def list_snapshots(self, request: Request) -> Response:
        key = api_key(request)
        q = request.query_params
        params = {
            atoll: q[e2b]
            for e2b, atoll in (
                ("sandboxID", "sandbox_id"),
                ("name", "name"),
                ("limit", "limit"),
                ("nextToken", "cursor"),
            )
            if q.get(e2b)
        }
        page, headers = await self.page(key, "/v1/snapshots", params)
        return JSONResponse([control.snapshot_info(s) for s in page.get("items") or []], headers=headers)

    async def delete_snapshot(self, request: Request) -> Response:
        """`DELETE /templates/{id}` deletes a snapshot when the id is one; templates are not
        deleted through E2B (404)."""
        key = api_key(request)
        ref = request.path_params["snapshot_id"]
        if not ids.is_snapshot_id(ref):
            raise control.E2BError(
                404, f"snapshot {ref[:80]!r} was not found (templates are not deleted through E2B)"
            )
        r = await self.call(key, "DELETE", f"/v1/snapshots/{ref}", passthrough=(404,))
        if r.status_code == 404:
            raise control.E2BError(404, f"snapshot {ref} was not found")
        return Response(status_code=204)

    async def snapshot_for(self, key: str, ref: object) -> str | None:
        """The caller's snapshot a create's `templateID` names (its id, or its name), or None
        when it names none (then it is a template name). `base`, the default template, and the
        template aliases are never looked up."""
        if not isinstance(ref, str) or not ref or ref == "base" or ref in control.TEMPLATE_ALIASES:
            return None
        if ids.is_snapshot_id(ref):
            r = await self.call(key, "GET", f"/v1/snapshots/{ref}", passthrough=(404,))
            if r.status_code == 404:  # shaped like a snapshot id: no template is named so
                raise control.E2BError(404, f"snapshot {ref} was not found (deleted, or not yours)")
            return ref
        # by name, looked up in the tenant the key acts in (`default` for an admin key, whose list
        # would span every tenant), as the create resolves it; 400: not a snapshot name at all
        r = await self.call(
            key, "GET", "/v1/snapshots/" + urllib.parse.quote(ref, safe=""), passthrough=(400, 404)
        )
        return ref if r.status_code == 200 else None


def create_app(
    settings: Settings,
    *,
    seam_for: envd_routes.SeamFor | None = None,
    state_of: envd_routes.StateOf | None = None,
    fallback: typing.Any = None,
) -> typing.Any:
    """The E2B port's ASGI app. `fallback` (an ASGI app) serves `/v1/…` paths (the native edge
    routes, when the process has them); other unknown paths answer 404 in E2B's shape."""
    c = ControlAPI(settings)
    envd = envd_routes.Envd(settings.token_key, seam_for, state_of)
    code = interpreter.Interpreter(envd)
    sb = "/sandboxes/{sid}"
    routes = [
        Route("/v2/sandboxes", c.create, methods=["POST"]),
        Route("/sandboxes", c.create, methods=["POST"]),
        Route("/v2/sandboxes", c.list, methods=["GET"]),
        Route("/sandboxes", c.list, methods=["GET"]),
        Route("/v2" + sb + "/connect", c.connect, methods=["POST"]),
        Route(sb + "/connect", c.connect, methods=["POST"]),
        Route(sb + "/resume", c.connect, methods=["POST"]),
        Route(sb, c.get, methods=["GET"]),
        Route(sb, c.kill, methods=["DELETE"]),
        Route(sb + "/timeout", c.set_timeout, methods=["POST"]),
        Route(sb + "/pause", c.pause, methods=["POST"]),
        Route(sb + "/metrics", c.metrics, methods=["GET"]),
        Route(sb + "/fork", c.fork, methods=["POST"]),
        Route(sb + "/network", c.network, methods=["PUT"]),
        Route(sb + "/snapshots", c.create_snapshot, methods=["POST"]),
        Route("/snapshots", c.list_snapshots, methods=["GET"]),
        Route("/templates/{snapshot_id:path}", c.delete_snapshot, methods=["DELETE"]),
        Route("/health", envd.health, methods=["GET"]),
        *volumes.Volumes(c, settings.volume_mb).routes(),
    ]

    async def not_served(request: Request, exc: Exception) -> Response:
        return error_response(404, f"{request.method} {request.url.path} is not served by atoll's E2B API")

    async def failed(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, control.E2BError)
        return error_response(exc.status, exc.message, exc.headers)

    async def crashed(request: Request, exc: Exception) -> Response:
        rid = "e2b_" + secrets.token_hex(8)
        log.error("E2B request failed", exc_info=exc, extra={"path": request.url.path, "request_id": rid})
        return error_response(
            500, f"internal error in atoll's E2B edge; its log has it as {rid}", {"Should-Retry": "false"}
        )

    inner = Starlette(
        routes=routes,
        exception_handlers={control.E2BError: failed, 404: not_served, 405: not_served, Exception: crashed},
    )

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, c)
            return
        if scope["type"] != "http":
            if fallback is not None:
                await fallback(scope, receive, send)
            return
        path = scope.get("path", "")
        started = False

        async def tracked(msg) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            if path.startswith(envd_routes.ENVD_PREFIXES) or path == envd_routes.ENVD_FILES:
                await envd.rpc(scope, receive, tracked)
            elif interpreter.wants(scope):
                await code.handle(scope, receive, tracked)
            elif path.startswith("/v1/") and fallback is not None:
                await fallback(scope, receive, tracked)
            else:
                await inner(scope, receive, tracked)
        except control.E2BError as e:
            if not started:
                await error_response(e.status, e.message, e.headers)(scope, receive, send)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            if not started:  # (once started, Starlette's handler answered and logged it)
                rid = "e2b_" + secrets.token_hex(8)
                log.exception("E2B request failed", extra={"path": path, "request_id": rid})
                await error_response(
                    500,
                    f"internal error in atoll's E2B edge; its log has it as {rid}",
                    {"Should-Retry": "false"},
                )(scope, receive, send)

    app.control = c  # type: ignore[attr-defined]
    return app


async def _lifespan(receive, send, c: ControlAPI) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await c.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return

"""The E2B port (`ATOLL_E2B_PORT`): E2B's control API and envd, served for the unmodified `e2b` SDKs
(2.31 and 2.63; docs/e2b-compat.md §2, §6.3).

- **Control routes** (`X-API-KEY`): `POST /v2/sandboxes` and `/sandboxes`, `…/{id}/connect` (and
  2.31's `/sandboxes/{id}/resume`), `GET /sandboxes/{id}`, `GET /v2/sandboxes` and `/sandboxes`
  (paged, `x-next-token`), `DELETE /sandboxes/{id}`, `POST …/timeout`, `…/pause`, `…/fork`,
  `PUT …/network`, `GET …/metrics`, named snapshots (`POST …/snapshots`, `GET /snapshots`,
  `DELETE /templates/{snapshot id}`; a create's `templateID` may name one, §6.5). Each is translated
  with e2b.control and forwarded (e2b.forward) to atoll's REST API over loopback with
  `Authorization: Bearer <the X-API-KEY value>` (also in its `e2b_<hex>` spelling, §1 finding 11), so the API keeps every
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
import datetime as dt
import logging
import secrets
import typing
import urllib.parse

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from atoll.core import ids
from atoll.e2b import control, envd_routes, forward, interpreter, volumes
from atoll.e2b.forward import Settings, api_key

log = logging.getLogger(__name__)

PAUSE_BUSY_RETRY_S = 5.0
"""A pause refused because a call that is not a stream is in flight (atoll's 409 sandbox_busy: a file
transfer, a foreground command) is tried again for this long before answering 503 (E2B reads a 409
on pause as "already paused", §6.4). Open process streams and watches do not refuse it: the pause
ends them (`end_streams`)."""


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def _sid(request: Request) -> str:
    sid = request.path_params["sid"]
    if not ids.SANDBOX_ID_RE.match(sid):
        raise control.E2BError(
            404, f"sandbox {sid[:80]!r} was not found (atoll sandbox ids are sb- and 16 letters/digits)"
        )
    return sid


def _timeout(body: dict, *, required: bool) -> int | None:
    v = body.get("timeout")
    if v is None:
        if required:
            raise control.E2BError(400, "timeout is required: seconds from now (1 to 2592000)")
        return None
    return control.timeout_seconds(v, "timeout")


class ControlAPI(forward.Forwarder):
    """The control routes, each forwarded to atoll's API over the Forwarder's channel."""

    # ---- routes -------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        key = api_key(request)
        body = await forward.read_body(request)
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
        body = await forward.read_body(request)
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
        timeout = _timeout(await forward.read_body(request, optional=False), required=True)
        await self.call(key, "PATCH", f"/v1/sandboxes/{sid}", json_body={"timeout_s": timeout})
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        key = api_key(request)
        sid = _sid(request)
        await forward.read_body(request)  # memory / requireHealthyGuest: atoll always keeps memory (§6.2)
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
            failed = self.failed(r, "POST")
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
        body = await forward.read_body(request)
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
        body = await forward.read_body(request, optional=False)
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
        body = await forward.read_body(request)
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
            failed = self.failed(r, "POST")  # with the E2B SDK's way to make room
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

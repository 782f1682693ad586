"""The worker's own HTTP API: the seam's verbs (core.worker_api) for the control plane, under
`/worker/v1`, served by `atoll worker` on a loopback port (`--listen`).

Only the server that registered this worker may call it: every request must carry
`Authorization: Bearer <token>` with the token that server issued at the latest registration (401
otherwise; none is accepted before the first registration) and `Atoll-Protocol` of this version
(409 incompatible_protocol otherwise). Errors are the public envelope, so the server rebuilds the
same domain error. Lifecycle steps are not cancelled when the server hangs up (a half-made
sandbox helps nobody; the server reconciles later); an exec is (the command is killed).
Built by worker.main over a worker.node.Node.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import typing

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from atoll.core import errors, wire
from atoll.core import worker_api as api
from atoll.core.lifecycle import Tier

log = logging.getLogger(__name__)

PREFIX = "/worker/v1"
NDJSON = "application/x-ndjson"
MAX_BODY = 1024 * 1024
EVENT_PING_S = 15.0


class Credentials:
    """The token of the current registration (set by worker.registration)."""

    def __init__(self) -> None:
        self.token: bytes | None = None

    def set(self, token: str) -> None:
        self.token = token.encode()


def _dumps(obj: typing.Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _answer(obj: typing.Any, status: int = 200) -> Response:
    return Response(
        _dumps(obj),
        status_code=status,
        media_type="application/json",
        headers={wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)},
    )


def _error(e: errors.AtollError) -> Response:
    return _answer(wire.error_body(e), e.status)


async def _body(request: Request, tp: typing.Any, what: str) -> typing.Any:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise errors.PayloadTooLarge(f"{what} is over {MAX_BODY} bytes")
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise errors.InvalidRequest(f"{what} is not JSON") from None
    return wire.load(tp, data, what) if tp is not None else data


def _path(request: Request) -> api.FilePath:
    q = request.query_params
    if "path_b64" in q:
        try:
            return base64.b64decode(q["path_b64"], validate=True)
        except (ValueError, binascii.Error):
            raise errors.InvalidPath("path_b64 is not base64") from None
    path = q.get("path")
    if not path:
        raise errors.InvalidPath("query parameter 'path' is required")
    return path


async def _unless_disconnected(request: Request, aw: typing.Awaitable) -> typing.Any:
    task = asyncio.ensure_future(aw)

    async def hangup() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hangup())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise errors.InvalidRequest("the server disconnected; the command was stopped")
        return task.result()
    finally:
        watcher.cancel()


def create_app(node: api.WorkerAPI, creds: Credentials) -> FastAPI:
    app = FastAPI(title="atoll worker", docs_url=None, redoc_url=None, openapi_url=None)
    steps: set[asyncio.Task] = set()

    async def shielded(aw: typing.Awaitable) -> typing.Any:
        """A lifecycle step runs to its end even when the server hangs up."""
        task = asyncio.ensure_future(aw)
        steps.add(task)
        task.add_done_callback(steps.discard)
        return await asyncio.shield(task)

    async def guard(scope, receive, send, inner):
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        headers = dict(scope["headers"])
        try:
            wire.check_protocol(
                headers.get(wire.PROTOCOL_HEADER.lower().encode(), b"").decode() or None, "the server"
            )
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if (
                creds.token is None
                or scheme.lower() != b"bearer"
                or not hmac.compare_digest(token.strip(), creds.token)
            ):
                raise errors.Unauthorized(
                    "this worker accepts calls only from the server it registered with (wrong or missing worker token)"
                )
        except errors.AtollError as e:
            return await _error(e)(scope, receive, send)
        try:
            await inner(scope, receive, send)
        except Exception:  # noqa: BLE001 - never a traceback to the server
            log.exception("worker API request failed", extra={"path": scope.get("path")})
            await _error(errors.AtollError("internal error in the worker; its log has the traceback"))(
                scope, receive, send
            )

    @app.exception_handler(errors.AtollError)
    async def atoll_error(request: Request, exc: errors.AtollError):
        if exc.status >= 500 or exc.detail:
            log.log(
                logging.ERROR if exc.status == 500 else logging.INFO,
                "worker call failed: %s",
                exc.message,
                extra={"path": request.url.path, "detail": exc.detail},
            )
        return _error(exc)

    # ---- lifecycle --------------------------------------------------------------------------------
    @app.get(PREFIX + "/info")
    async def info():
        return _answer(wire.dump(await node.info()))

    @app.get(PREFIX + "/inventory")
    async def inventory():
        return _answer(wire.dump(await node.inventory()))

    @app.post(PREFIX + "/reconcile")
    async def reconcile():
        return _answer(wire.dump(await node.reconcile()))

    @app.post(PREFIX + "/sandboxes")
    async def create(request: Request):
        spec = await _body(request, api.SandboxSpec, "sandbox spec")
        return _answer(wire.dump(await shielded(node.create(spec))))

    @app.post(PREFIX + "/sandboxes/{sid}/pause")
    async def pause(request: Request, sid: str):
        body = await _body(request, None, "pause request")
        try:
            tier = Tier(body.get("tier", "memory"))
        except ValueError:
            raise errors.InvalidRequest(f"unknown tier {body.get('tier')!r}") from None
        outcome = await shielded(node.pause(sid, tier, only_if_idle=bool(body.get("only_if_idle"))))
        return _answer(wire.dump(outcome))

    @app.post(PREFIX + "/sandboxes/{sid}/resume")
    async def resume(sid: str):
        return _answer(wire.dump(await shielded(node.resume(sid))))

    @app.delete(PREFIX + "/sandboxes/{sid}")
    async def delete(sid: str):
        await shielded(node.delete(sid))
        return Response(status_code=204, headers={wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)})

    # ---- exec and processes -----------------------------------------------------------------------
    @app.post(PREFIX + "/sandboxes/{sid}/exec")
    async def exec_(request: Request, sid: str):
        spec = await _body(request, api.ExecSpec, "exec spec")
        if NDJSON not in request.headers.get("accept", ""):
            result = await _unless_disconnected(request, node.exec(sid, spec))
            return _answer(wire.dump(result))
        stream = node.exec_stream(sid, spec)
        events = await stream.__aenter__()

        async def body() -> typing.AsyncIterator[bytes]:
            try:
                async for ev in events:
                    yield _dumps(wire.dump_exec_event(ev)) + b"\n"
            except errors.AtollError as e:
                yield _dumps(wire.error_body(e)) + b"\n"
            finally:
                await stream.__aexit__(None, None, None)

        return StreamingResponse(
            body(), media_type=NDJSON, headers={wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)}
        )

    @app.post(PREFIX + "/sandboxes/{sid}/processes")
    async def start_process(request: Request, sid: str):
        spec = await _body(request, api.ExecSpec, "exec spec")
        return _answer(wire.dump(await node.start_process(sid, spec)))

    @app.get(PREFIX + "/sandboxes/{sid}/processes")
    async def list_processes(sid: str):
        return _answer(wire.dump(list(await node.list_processes(sid)), list[api.ProcessInfo]))

    @app.delete(PREFIX + "/sandboxes/{sid}/processes/{pid}")
    async def kill_process(sid: str, pid: int):
        await node.kill_process(sid, pid)
        return Response(status_code=204, headers={wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)})

    # ---- files ------------------------------------------------------------------------------------
    @app.get(PREFIX + "/sandboxes/{sid}/files")
    async def read_file(request: Request, sid: str):
        reading = node.read_file(sid, _path(request))
        download = await reading.__aenter__()

        async def body() -> typing.AsyncIterator[bytes]:
            try:
                async for chunk in download.chunks:
                    yield chunk
            finally:
                await reading.__aexit__(None, None, None)

        headers = {wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)}
        if download.size is not None:
            headers["Content-Length"] = str(download.size)
        return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)

    @app.put(PREFIX + "/sandboxes/{sid}/files")
    async def write_file(request: Request, sid: str):
        declared = request.headers.get("content-length")

        async def chunks() -> typing.AsyncIterator[bytes]:
            async for chunk in request.stream():
                if chunk:
                    yield chunk

        size = int(declared) if declared and declared.isdigit() else None
        await node.write_file(sid, _path(request), chunks(), size)
        return Response(status_code=204, headers={wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)})

    @app.get(PREFIX + "/sandboxes/{sid}/files/list")
    async def list_files(request: Request, sid: str):
        return _answer(wire.dump(list(await node.list_files(sid, _path(request))), list[api.FileEntry]))

    @app.delete(PREFIX + "/sandboxes/{sid}/files")
    async def delete_file(request: Request, sid: str):
        await node.delete_file(sid, _path(request))
        return Response(status_code=204, headers={wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)})

    # ---- events -----------------------------------------------------------------------------------
    @app.get(PREFIX + "/events")
    async def events():
        async def body() -> typing.AsyncIterator[bytes]:
            stream = node.events()
            nxt: asyncio.Task | None = None
            try:
                while True:
                    nxt = nxt or asyncio.ensure_future(anext(stream))
                    done, _ = await asyncio.wait({nxt}, timeout=EVENT_PING_S)
                    if not done:  # a ping keeps idle connections honest (a dead peer shows up)
                        yield b'{"kind":"ping"}\n'
                        continue
                    try:
                        ev = nxt.result()
                    except StopAsyncIteration:
                        return
                    nxt = None
                    yield _dumps(wire.dump_event(ev)) + b"\n"
            finally:
                if nxt is not None:
                    nxt.cancel()
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(
            body(), media_type=NDJSON, headers={wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)}
        )

    class Guard:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            await guard(scope, receive, send, self.inner)

    app.add_middleware(Guard)
    return app

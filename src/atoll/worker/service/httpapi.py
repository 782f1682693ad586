"""The worker's own HTTP API: the seam's verbs (core.worker_api) for the control plane, under
`/worker/v1`, served by `atoll worker` on a loopback port (`--listen`).

Only the server that registered this worker may call it: every request must carry
`Authorization: Bearer <token>` with the token that server issued at the latest registration (401
otherwise; none is accepted before the first registration) and `Atoll-Protocol` of this version
(409 incompatible_protocol otherwise). The one exception is the edge (`atoll edge`): a sandbox's
data verbs (exec, processes, files, terminals) also open with `Authorization: Grant <grant>`, a
short-lived grant for that sandbox the server minted with this worker's current token
(core.grants); any other verb, another sandbox, an expired or stale grant is 401. Errors are the public envelope, so the server rebuilds the
same domain error. Lifecycle steps are not cancelled when the server hangs up (a half-made
sandbox helps nobody; the server reconciles later); an exec is (the command is killed).
Plain Starlette routes (no OpenAPI, no dependency injection: ~0.1 ms less per call than FastAPI).
Built by worker.main over a worker.node.Node (atoll's tests also serve a FakeWorker with it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import time
import typing

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from atoll.core import errors, grants, seam, wire
from atoll.core import worker_api as api
from atoll.shared import relay

log = logging.getLogger(__name__)

PREFIX = seam.PREFIX
NDJSON = "application/x-ndjson"
MAX_BODY = 1024 * 1024
EVENT_PING_S = 15.0


class Credentials:
    """The token of the current registration (set by worker.registration)."""

    def __init__(self) -> None:
        self.token: bytes | None = None
        self.tunnel: bytes | None = None
        """What the port tunnel accepts (core.wire.tunnel_token of the token)."""

    def set(self, token: str) -> None:
        self.token = token.encode()
        self.tunnel = wire.tunnel_token(token).encode()


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


async def _body(request: Request, tp: typing.Any, what: str, secret: bool = False) -> typing.Any:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise errors.PayloadTooLarge(f"{what} is over {MAX_BODY} bytes")
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):
        raise errors.InvalidRequest(f"{what} is not JSON (or nested too deeply)") from None
    if not isinstance(data, dict):
        raise errors.InvalidRequest(f"{what} must be a JSON object")
    if tp is None:
        return data
    try:
        return wire.load(tp, data, what)
    except errors.RuntimeFailure as e:  # here it is the caller's malformed request, not a peer's bug
        if secret:  # no detail: it would quote the values
            raise errors.InvalidRequest(f"malformed {what}") from None
        raise errors.InvalidRequest(f"malformed {what}: {e.detail or e.message}"[:1000]) from None


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


def _named_path(request: Request, name: str) -> api.FilePath:
    """A path in query parameter `name` (or `<name>_b64`, its bytes)."""
    q = request.query_params
    if f"{name}_b64" in q:
        try:
            return base64.b64decode(q[f"{name}_b64"], validate=True)
        except (ValueError, binascii.Error):
            raise errors.InvalidPath(f"{name}_b64 is not base64") from None
    path = q.get(name)
    if not path:
        raise errors.InvalidPath(f"query parameter {name!r} is required")
    return path


async def _unless_disconnected(request: Request, aw: typing.Awaitable) -> typing.Any:
    return await relay.unless_disconnected(
        request.receive, aw, errors.InvalidRequest("the server disconnected; the command was stopped")
    )


def _table_route(node: api.WorkerAPI, verb: seam.Verb, shielded, proto: dict[str, str]) -> Route:
    """The route of one plain verb of core.seam's table: its arguments read from where the table
    says, the node's method called by name, the answer written as the table says."""

    async def handle(request: Request) -> Response:
        kwargs: dict[str, typing.Any] = {}
        fields: dict | None = None
        what = f"{verb.name.replace('_', ' ')} request"
        for a in verb.args:
            if a.where == "path":
                kwargs[a.name] = request.path_params[a.name]
            elif a.where == "body":
                kwargs[a.name] = await _body(request, a.type, what, secret=a.secret)
            elif a.where == "field":
                if fields is None:
                    fields = await _body(request, None, what)
                if a.wire_name not in fields and not a.required:
                    kwargs[a.name] = a.default
                    continue
                kwargs[a.name] = _load(a, fields.get(a.wire_name), what)
            elif a.where == "query":
                raw = request.query_params.get(a.wire_name, "")
                if a.type is bool:
                    kwargs[a.name] = raw == "1"
                elif raw.isdigit():
                    kwargs[a.name] = int(raw)
                else:
                    raise errors.InvalidRequest(f"{a.wire_name} must be an integer >= 0, got {raw[:20]!r}")
            elif a.where == "file":
                kwargs[a.name] = _named_path(request, a.wire_name)
            elif a.where == "raw":
                data = bytearray()
                async for chunk in request.stream():
                    data += chunk
                    if len(data) > api.MAX_STDIN_BYTES:
                        raise errors.PayloadTooLarge(f"the request body is over {api.MAX_STDIN_BYTES} bytes")
                kwargs[a.name] = bytes(data)
        call = getattr(node, verb.name)(**kwargs)
        if verb.step:
            result = await shielded(call)
        elif verb.cancel_on_hangup:
            result = await _unless_disconnected(request, call)
        else:
            result = await call
        if verb.answer is None:
            return Response(status_code=204, headers=proto)
        if verb.answer_key:
            return _answer({verb.answer_key: wire.dump(result, verb.answer)})
        return _answer(wire.dump(result, verb.answer))

    path = seam.PREFIX + verb.path
    for a in verb.args:
        if a.where == "path" and a.type is int:
            path = path.replace("{" + a.name + "}", "{" + a.name + ":int}")
    return Route(path, handle, methods=[verb.method])


def _load(arg: seam.Arg, value: typing.Any, what: str) -> typing.Any:
    try:
        return wire.load(arg.type, value, what)
    except errors.RuntimeFailure as e:  # here it is the caller's malformed request, not a peer's bug
        if arg.secret:  # no detail: it would quote the values
            raise errors.InvalidRequest(f"malformed {arg.wire_name} in the {what}") from None
        raise errors.InvalidRequest(
            f"malformed {arg.wire_name} in the {what}: {e.detail or e.message}"[:1000]
        ) from None


def create_app(node: api.WorkerAPI, creds: Credentials) -> Starlette:
    steps: set[asyncio.Task] = set()
    proto = {wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)}

    async def shielded(aw: typing.Awaitable) -> typing.Any:
        """A lifecycle step runs to its end even when the server hangs up."""
        task = asyncio.ensure_future(aw)
        steps.add(task)
        task.add_done_callback(steps.discard)
        return await asyncio.shield(task)

    def no_content() -> Response:
        return Response(status_code=204, headers=proto)

    # ---- lifecycle --------------------------------------------------------------------------------
    # ---- templates, pools, fork ---------------------------------------------------------------------
    async def build_log(request: Request) -> Response:
        reading = node.build_log(request.path_params["bid"])
        chunks_in = await reading.__aenter__()

        async def chunks() -> typing.AsyncIterator[bytes]:
            try:
                async for chunk in chunks_in:
                    yield chunk
            finally:
                await reading.__aexit__(None, None, None)

        return StreamingResponse(chunks(), media_type="text/plain; charset=utf-8", headers=proto)

    # ---- exec and processes -----------------------------------------------------------------------
    async def ndjson_stream(
        opening: typing.AsyncContextManager[typing.AsyncIterator[typing.Any]],
        dump: typing.Callable[[typing.Any], dict],
    ) -> Response:
        """An answer of NDJSON lines, one per event of the stream `opening` opens (opened before
        the headers go, so a refusal is an error answer); an error mid-way is the last line."""
        events = await opening.__aenter__()

        async def lines() -> typing.AsyncIterator[bytes]:
            try:
                async for ev in events:
                    yield _dumps(dump(ev)) + b"\n"
            except errors.AtollError as e:
                yield _dumps(wire.error_body(e)) + b"\n"
            finally:
                await opening.__aexit__(None, None, None)

        return StreamingResponse(lines(), media_type=NDJSON, headers=proto)

    async def download_stream(
        opening: typing.AsyncContextManager[api.FileDownload], media_type: str
    ) -> Response:
        """An answer of the bytes of the download `opening` opens (opened before the headers go,
        so a refusal is an error answer; Content-Length when its size is known), closed when the
        answer ends or the server hangs up."""
        download = await opening.__aenter__()

        async def chunks() -> typing.AsyncIterator[bytes]:
            try:
                async for chunk in download.chunks:
                    yield chunk
            finally:
                await opening.__aexit__(None, None, None)

        headers = dict(proto)
        if download.size is not None:
            headers["Content-Length"] = str(download.size)
        return StreamingResponse(chunks(), media_type=media_type, headers=headers)

    async def exec_(request: Request) -> Response:
        sid = request.path_params["sid"]
        spec = await _body(request, api.ExecSpec, "exec spec")
        if NDJSON not in request.headers.get("accept", ""):
            return _answer(wire.dump(await _unless_disconnected(request, node.exec(sid, spec))))
        return await ndjson_stream(node.exec_stream(sid, spec), wire.dump_exec_event)

    # ---- terminals (attach_pty goes through worker.tunnel) ------------------------------------------
    # process handles (issue 9)
    def _pid(request: Request) -> tuple[str, int]:
        return request.path_params["sid"], request.path_params["pid"]

    async def process_output(request: Request) -> Response:
        q = request.query_params
        offset = q.get("offset", "0")
        if not offset.isdigit():
            raise errors.InvalidRequest(f"offset must be an integer >= 0, got {offset!r}")
        reading = node.process_output(*_pid(request), int(offset), q.get("follow") == "1")
        return await ndjson_stream(reading, wire.dump_process_event)

    async def run_process(request: Request) -> Response:
        """A background process started and followed: `{pid, log_path}` (ProcessStarted) as the
        first line, then the lines of its output follow (refusals before it started: an error
        answer)."""
        spec = await _body(request, api.ExecSpec, "exec spec")
        opening = node.run_process(request.path_params["sid"], spec)
        started, events = await opening.__aenter__()

        async def lines() -> typing.AsyncIterator[bytes]:
            try:
                yield _dumps(wire.dump(started)) + b"\n"
                async for ev in events:
                    yield _dumps(wire.dump_process_event(ev)) + b"\n"
            except errors.AtollError as e:
                yield _dumps(wire.error_body(e)) + b"\n"
            finally:
                await opening.__aexit__(None, None, None)

        return StreamingResponse(lines(), media_type=NDJSON, headers=proto)

    # ---- files ------------------------------------------------------------------------------------
    async def read_file(request: Request) -> Response:
        reading = node.read_file(request.path_params["sid"], _path(request))
        return await download_stream(reading, "application/octet-stream")

    async def write_file(request: Request) -> Response:
        declared = request.headers.get("content-length")

        async def chunks() -> typing.AsyncIterator[bytes]:
            async for chunk in request.stream():
                if chunk:
                    yield chunk

        size = int(declared) if declared and declared.isdigit() else None
        await node.write_file(request.path_params["sid"], _path(request), chunks(), size)
        return no_content()

    # ---- files, issue 9 ----------------------------------------------------------------------------
    async def watch_files(request: Request) -> Response:
        recursive = request.query_params.get("recursive", "0") == "1"
        watching = node.watch_files(request.path_params["sid"], _path(request), recursive)
        events = await watching.__aenter__()

        async def lines() -> typing.AsyncIterator[bytes]:
            nxt: asyncio.Future | None = None
            try:
                while True:
                    nxt = nxt or asyncio.ensure_future(anext(events))
                    done, _ = await asyncio.wait({nxt}, timeout=EVENT_PING_S)
                    if not done:  # a blank line: a control plane that went away shows up
                        yield b"\n"
                        continue
                    try:
                        ev = nxt.result()
                    except StopAsyncIteration:
                        return
                    except errors.AtollError as e:
                        yield _dumps(wire.error_body(e)) + b"\n"
                        return
                    nxt = None
                    yield _dumps(wire.dump(ev)) + b"\n"
            finally:
                if nxt is not None:
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                await watching.__aexit__(None, None, None)

        return StreamingResponse(lines(), media_type=NDJSON, headers=proto)

    async def write_tar(request: Request) -> Response:
        declared = request.headers.get("content-length")

        async def chunks() -> typing.AsyncIterator[bytes]:
            async for chunk in request.stream():
                if chunk:
                    yield chunk

        size = int(declared) if declared and declared.isdigit() else None
        written = await node.write_tar(request.path_params["sid"], _path(request), chunks(), size)
        return _answer(wire.dump(written))

    async def read_tar(request: Request) -> Response:
        reading = node.read_tar(request.path_params["sid"], _path(request))
        return await download_stream(reading, "application/x-tar")

    # ---- volumes and drives (issue 19) -------------------------------------------------------------
    def _store(request: Request) -> tuple[str, str]:
        return request.path_params["kind"], request.path_params["name"]

    async def _upload(request: Request) -> tuple[typing.AsyncIterator[bytes], int | None]:
        declared = request.headers.get("content-length")

        async def chunks() -> typing.AsyncIterator[bytes]:
            async for chunk in request.stream():
                if chunk:
                    yield chunk

        return chunks(), int(declared) if declared and declared.isdigit() else None

    async def read_store_file(request: Request) -> Response:
        return await download_stream(
            node.read_store_file(*_store(request), _path(request)), "application/octet-stream"
        )

    async def write_store_file(request: Request) -> Response:
        chunks, size = await _upload(request)
        return _answer(wire.dump(await node.write_store_file(*_store(request), _path(request), chunks, size)))

    async def read_store_tar(request: Request) -> Response:
        return await download_stream(node.read_store_tar(*_store(request)), "application/x-tar")

    async def write_store_tar(request: Request) -> Response:
        chunks, size = await _upload(request)
        return _answer(wire.dump(await node.write_store_tar(*_store(request), chunks, size)))

    async def alive(request: Request) -> Response:
        """The edge's liveness probe (`atoll edge`'s watchdog, with a grant): answered by this
        process's event loop without touching the sandbox, so a frozen worker shows up."""
        return no_content()

    # ---- events -----------------------------------------------------------------------------------
    async def events(request: Request) -> Response:
        async def lines() -> typing.AsyncIterator[bytes]:
            stream = node.events()
            nxt: asyncio.Future | None = None
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

        return StreamingResponse(lines(), media_type=NDJSON, headers=proto)

    sb = PREFIX + "/sandboxes/{sid}"
    routes = [_table_route(node, verb, shielded, proto) for verb in seam.VERBS]
    routes += [  # streams: written by hand (core.seam.HAND_WRITTEN)
        Route(PREFIX + "/events", events, methods=["GET"]),
        Route(PREFIX + "/builds/{bid}/log", build_log, methods=["GET"]),
        Route(sb + "/exec", exec_, methods=["POST"]),
        Route(sb + "/alive", alive, methods=["GET"]),
        Route(sb + "/processes/{pid:int}/output", process_output, methods=["GET"]),
        Route(sb + "/processes/run", run_process, methods=["POST"]),
        Route(sb + "/files", read_file, methods=["GET"]),
        Route(sb + "/files", write_file, methods=["PUT"]),
        Route(sb + "/files/watch", watch_files, methods=["GET"]),
        Route(sb + "/files/tar", write_tar, methods=["PUT"]),
        Route(sb + "/files/tar", read_tar, methods=["GET"]),
        Route(PREFIX + "/stores/{kind}/{name}/files", read_store_file, methods=["GET"]),
        Route(PREFIX + "/stores/{kind}/{name}/files", write_store_file, methods=["PUT"]),
        Route(PREFIX + "/stores/{kind}/{name}/tar", read_store_tar, methods=["GET"]),
        Route(PREFIX + "/stores/{kind}/{name}/tar", write_store_tar, methods=["PUT"]),
    ]

    async def atoll_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, errors.AtollError)
        if exc.status >= 500 or exc.detail:
            log.log(
                logging.ERROR if exc.status == 500 else logging.INFO,
                "worker call failed: %s",
                exc.message,
                extra={"path": request.url.path, "detail": exc.detail},
            )
        return _error(exc)

    async def not_found(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        e = errors.AtollError(
            f"{request.method} {request.url.path} is not a route of the worker protocol",
            code="method_not_allowed" if code == 405 else "not_found",
        )
        return _error(e)

    app = Starlette(
        routes=routes, exception_handlers={errors.AtollError: atoll_error, 404: not_found, 405: not_found}
    )

    async def guard(scope, receive, send, inner):
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        headers = dict(scope["headers"])
        try:
            # the token first: a caller without it learns nothing, not even the protocol version
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            path = scope.get("path", "")
            if scheme.lower() == grants.SCHEME.lower().encode():
                # the edge: one sandbox's data verbs, with a grant the server minted (core.grants)
                grants.verify(
                    creds.token, token.decode("ascii", "replace"), path.removeprefix(PREFIX), time.time()
                )
            elif (
                creds.token is None
                or scheme.lower() != b"bearer"
                or not hmac.compare_digest(token.strip(), creds.token)
            ):
                raise errors.Unauthorized(
                    "this worker accepts calls only from the server it registered with (wrong or missing worker token)"
                )
            wire.check_protocol(
                headers.get(wire.PROTOCOL_HEADER.lower().encode(), b"").decode() or None, "the server"
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

    class Guard:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            await guard(scope, receive, send, self.inner)

    app.add_middleware(Guard)
    return app

"""The edge's one way to a worker, and what every route of the edge reads from a request.

`Base.call` sends one call of a sandbox's data verbs to the worker that holds it, with a grant
from edge.upstream.Grants (asked for again once when the worker refuses it before doing anything),
under an edge.watchdog.Watch (a frozen worker, a revoked key, a sandbox that moved end the call);
`Base.lines` relays an NDJSON answer line by line in the API's shapes. The request helpers check
the caller's key header, the sandbox id, a pid and a JSON body as the API does (core.inputs).
Pure of routes; the base of edge.files, edge.terminals and edge.service.Edge.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import typing

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from atoll.core import errors, grants, ids, inputs, wire
from atoll.core import worker_api as api
from atoll.edge import upstream, watchdog
from atoll.shared import http11, ndjson

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
PREFIX = "/worker/v1"
NOT_HERE = {401: None, 404: "sandbox_not_found", 409: "invalid_state"}
"""Worker answers that mean "ask the server again": a stale grant; a sandbox that moved or sleeps."""


def dumps(obj: typing.Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def auth(request: Request) -> str:
    return checked_auth(request.headers.get("authorization", ""))


def checked_auth(auth: str) -> str:
    """The caller's Authorization header, to pass on to the server: `Bearer <key>`, the key in
    printable ASCII (as every atoll key is); else 401 saying so, before anything is sent."""
    if not auth.lower().startswith("bearer ") or not auth[7:].strip():
        raise errors.Unauthorized(
            "missing API key: send Authorization: Bearer <key>, the same key the API takes "
            "(the edge asks the API server whether it may reach this sandbox)"
        )
    if not (auth.isascii() and auth.isprintable()):
        raise errors.Unauthorized("invalid API key: an atoll key is printable ASCII (check what was pasted)")
    return auth


def sid(request: Request) -> str:
    sid = request.path_params["sid"]
    if not ids.SANDBOX_ID_RE.match(sid):
        raise errors.InvalidRequest(
            f"{sid[:60]!r} is not a sandbox id (sb- and 16 lower-case letters/digits)"
        )
    return sid


def pid(request: Request) -> int:
    return inputs.pid(request.path_params["pid"])


async def json_body(request: Request, optional: bool = False) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit():
        inputs.check_json_size(int(declared), declared=True)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        inputs.check_json_size(len(raw))
    data = inputs.json_object(raw)
    if data is None:
        if optional:
            return {}
        raise errors.InvalidRequest("the request body is empty; send a JSON object")
    return data


def line(raw: bytes, render: typing.Callable[[dict], dict]) -> bytes:
    """One NDJSON line from the worker in the API's shape (its `{"error"}` lines as they are)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise errors.RuntimeFailure("a malformed line arrived from the worker")
    return dumps(obj if "error" in obj else render(obj)) + b"\n"


def _broke(e: http11.ChannelError, g: upstream.Grant, method: str, sub: str) -> errors.Unavailable:
    """503 for a call to `g`'s worker that broke, saying what is known of its outcome (as the
    server's seam does, controlplane.remote_worker): not connected, or a read (a GET, a wait), changed
    nothing and may be retried; a PUT or DELETE cut off once sent may be repeated (same end state);
    a POST cut off once sent (an exec, a signal, stdin) may have been carried out, so it is not
    retryable — repeating it may do it twice."""
    where = f"worker {g.worker_name!r} at {g.url}"
    if isinstance(e, http11.ConnectFailed):
        return errors.Unavailable(
            f"{where} cannot be reached from the edge ({type(e).__name__}); the call did not reach it, "
            "so nothing about the sandbox changed — retry in a few seconds",
            detail=repr(e),
        )
    if method in ("GET", "HEAD") or sub.endswith("/wait"):
        return errors.Unavailable(
            f"{where} stopped answering the edge ({type(e).__name__}) during a call that only reads; "
            "nothing about the sandbox changed — retry in a few seconds",
            detail=repr(e),
        )
    return errors.Unavailable(
        f"{where} stopped answering the edge ({type(e).__name__}) after the call was sent: its outcome "
        "is unknown — it may have been carried out, in whole or in part. Check the sandbox before "
        "repeating the call",
        detail=repr(e),
        retryable=method in ("PUT", "DELETE"),
    )


class Base:
    """The grant cache, the worker channels and the one way to a worker, under the edge's routes."""

    def __init__(self, server_url: str, ca_file: str | None = None, transport: typing.Any = None):
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.server_url = server_url.rstrip("/")
        self.grants = upstream.Grants(server_url, verify, transport)
        self.workers = upstream.Workers(ca_file)

    @contextlib.asynccontextmanager
    async def call(
        self,
        auth: str,
        sid: str,
        method: str,
        sub: str,
        *,
        timeout: float | None = 30.0,
        headers: dict[str, str] | None = None,
        replayable: bool = True,
        resume: bool = True,
        **kw: typing.Any,
    ) -> typing.AsyncIterator[http11.Response]:
        """The worker's answer (status < 400, body unread) to `method` /sandboxes/{sid}/{sub}, with
        a grant. A stale grant or a sandbox not there (refused before the worker did anything) is
        asked for again once when the request can be sent again (`replayable`: JSON or bytes held;
        a streamed upload is not, and is then a retryable 503). `timeout` bounds the wait for the
        answer's head (None: a command's, as long as it runs). `resume=False`: a sandbox in
        standby is not resumed for the call (409 invalid_state, edge.upstream.Grants.get)."""
        served = False
        for attempt in (0, 1):
            g = await self.grants.get(auth, sid, resume)
            sent = {
                "Authorization": f"{grants.SCHEME} {g.grant}",
                wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION),
                **(headers or {}),
            }
            retry = False
            watch = watchdog.Watch(self.grants, self.workers, auth, sid, g)
            try:
                async with contextlib.AsyncExitStack() as stack:
                    async with watch.head():
                        r = await stack.enter_async_context(
                            self.workers.channel(g).stream(
                                method, f"{PREFIX}/sandboxes/{sid}/{sub}", headers=sent, timeout=timeout, **kw
                            )
                        )
                    if r.status_code >= 400:
                        body = await r.aread()
                        try:
                            obj = json.loads(body)
                        except ValueError:
                            obj = None
                        code = (obj or {}).get("error", {}).get("code") if isinstance(obj, dict) else None
                        if r.status_code in NOT_HERE and NOT_HERE[r.status_code] in (None, code):
                            self.grants.drop(auth, sid)
                            if attempt == 1 or not replayable:  # a streamed upload cannot be sent again
                                raise errors.Unavailable(
                                    f"sandbox {sid}'s worker refused the edge's grant (it registered again, "
                                    "or the sandbox moved or sleeps); the call was not carried out — retry",
                                    retryable=True,
                                )
                            retry = True
                        else:
                            raise wire.error_from_body(
                                r.status_code, obj, f"worker {g.worker_name!r} answered {r.status_code}"
                            )
                    else:
                        served = True
                        watch.attach(r)
                        yield r
                        return
            except http11.ChannelError as e:
                if watch.cut is not None:
                    raise watch.cut from None
                self.grants.drop(auth, sid)
                if attempt == 0 and not served and isinstance(e, http11.ConnectFailed):
                    continue
                raise _broke(e, g, method, sub) from None
            finally:
                watch.close()
            if retry:
                continue
        raise errors.Unavailable(
            f"sandbox {sid}'s worker could not be reached by the edge; retry in a few seconds"
        )

    async def call_json(self, auth: str, sid: str, method: str, sub: str, **kw: typing.Any) -> typing.Any:
        async with self.call(auth, sid, method, sub, **kw) as r:
            body = await r.aread()
        return json.loads(body) if body else None

    async def lines(
        self,
        auth: str,
        sid: str,
        method: str,
        sub: str,
        render: typing.Callable[[dict], dict],
        **kw: typing.Any,
    ) -> Response:
        """An NDJSON answer relayed line by line from the worker, each line rendered in the API's
        shape; opened before the headers go (a refusal is an ordinary error answer), a break after
        that is an in-band `{"error"}` line."""
        opening = self.call(auth, sid, method, sub, timeout=None, **kw)
        r = await opening.__aenter__()

        async def body() -> typing.AsyncIterator[bytes]:
            splitter = ndjson.Splitter()
            try:
                async for chunk in r.aiter_raw():
                    got = splitter.feed(chunk)
                    if not got and not chunk.strip():
                        yield b"\n"  # the worker's keep-alive, passed on: a client that left shows up
                    for raw in got:
                        yield line(raw, render)
                for raw in splitter.end():
                    yield line(raw, render)
            except Exception as e:  # noqa: BLE001 - the headers are sent: report it in-band
                code, message = (
                    (e.code, e.message)
                    if isinstance(e, errors.AtollError)
                    else ("worker_unavailable", "the stream from the sandbox's worker broke")
                )
                log.warning("edge stream broke: %s", message, extra={"sandbox_id": sid, "detail": repr(e)})
                yield dumps({"error": {"code": code, "message": message}}) + b"\n"
            finally:
                await opening.__aexit__(None, None, None)

        return StreamingResponse(body(), media_type=NDJSON)

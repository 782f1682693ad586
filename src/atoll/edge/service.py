"""`atoll edge`: the API's sandbox data routes, relayed straight to the worker holding the sandbox.

For each call it needs a grant (core.grants): it asks the server `POST /v1/sandboxes/{id}/grant`
with the caller's own `Authorization` header (so the server checks the key, its tenant and the
sandbox exactly as for any call, and resumes a sandbox in standby), keeps the answer per (hash of
the header, sandbox) until GRANT_MARGIN_S before it expires, and sends the call to the worker's URL
with `Authorization: Grant <grant>`. A worker that answers 401 (the grant is stale: it registered
again), 404 sandbox_not_found or 409 invalid_state (the sandbox moved or sleeps) before anything
was relayed has the grant dropped and a new one asked for, once. The server's refusals (401 for a
wrong key, 404 for another tenant's sandbox, …) reach the client as the server gave them.

Served here, in the API's request and answer shapes: POST …/exec (plain, `Accept:
application/x-ndjson` streamed, `background`), GET …/processes/{pid} and …/output (NDJSON),
POST …/stdin, …/signal, …/wait and DELETE …/processes/{pid}; GET/PUT/DELETE …/files, GET
…/files/stat and …/files/list (paths checked as the API does: core.filepaths); POST …/pty,
DELETE …/pty/{id} and the terminal WebSocket …/pty/{id}/ws (through the worker's port tunnel, its
`ATOLL-PTY` hello carrying the grant; shared.ptyrelay relays it as the API does). Anything else
answers 404 with an error naming the API server's URL (the edge is not a proxy for control calls). Over an https://
worker URL the worker's certificate is checked against `--ca-file` and must name that worker.
Uses shared.http11 (worker calls), shared.ndjson, shared.relay; httpx for the server's grant route.
Called by cli.main (`atoll edge`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import secrets
import socket
import ssl
import sys
import time
import typing
import urllib.parse

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from atoll.core import errors, filepaths, grants, ids, pki, signals, wire
from atoll.core import worker_api as api
from atoll.guest.agent import ptyframes
from atoll.shared import http11, logconfig, ndjson, portstream, ptyrelay, relay

log = logging.getLogger(__name__)

DEFAULT_PORT = 7082
GRANT_MARGIN_S = 10.0
"""A cached grant is used until this long before it expires (a call may take a while to arrive)."""
MAX_CACHED = 10_000
MAX_JSON_BYTES = 1024 * 1024
NDJSON = "application/x-ndjson"
PREFIX = "/worker/v1"
EXEC_FIELDS = frozenset(
    {"cmd", "cwd", "env", "timeout_s", "background", "user", "max_output_bytes", "stdin", "shell"}
)
PTY_FIELDS = frozenset({"cols", "rows", "term", "cmd", "cwd", "env", "user"})
NOT_HERE = {401: None, 404: "sandbox_not_found", 409: "invalid_state"}
"""Worker answers that mean "ask the server again": a stale grant; a sandbox that moved or sleeps."""


class Passed(Exception):
    """The server's own refusal of a grant, answered to the client as it came."""

    def __init__(self, status: int, body: bytes, content_type: str):
        self.status, self.body, self.content_type = status, body, content_type


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


class Grants:
    """Grants from the server, cached per (sha256 of the caller's Authorization, sandbox)."""

    def __init__(self, server_url: str, verify: ssl.SSLContext | bool, transport: typing.Any = None):
        self.server_url = server_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.server_url, verify=verify, timeout=60, transport=transport
        )
        self._cache: dict[tuple[str, str], Grant] = {}
        self.asked = 0
        """Grants asked of the server (a test and the bench read it)."""

    @staticmethod
    def _key(auth: str, sid: str) -> tuple[str, str]:
        return hashlib.sha256(auth.encode()).hexdigest(), sid

    def drop(self, auth: str, sid: str) -> None:
        self._cache.pop(self._key(auth, sid), None)

    async def get(self, auth: str, sid: str) -> Grant:
        key = self._key(auth, sid)
        now = time.time()
        g = self._cache.get(key)
        if g is not None and g.expires_at - GRANT_MARGIN_S > now:
            return g
        self.asked += 1
        try:
            r = await self._http.post(f"/v1/sandboxes/{sid}/grant", headers={"Authorization": auth})
        except httpx.HTTPError as e:
            raise errors.Unavailable(
                f"the edge cannot reach the API server at {self.server_url} to authorize this call "
                f"({type(e).__name__}: {str(e)[:200]}); nothing was sent to the sandbox — retry once the "
                "server is back (or, for a certificate that does not verify, give --ca-file the installation CA)"
            ) from None
        if r.status_code != 200:
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
            )
        except (ValueError, KeyError, TypeError):
            raise errors.RuntimeFailure(
                f"the API server at {self.server_url} answered the grant route with something unexpected; "
                "is it an atoll server of the same version?"
            ) from None
        if len(self._cache) >= MAX_CACHED:
            for k, v in list(self._cache.items()):
                if v.expires_at - GRANT_MARGIN_S <= now:
                    del self._cache[k]
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
        self._cache[key] = g
        return g

    async def aclose(self) -> None:
        await self._http.aclose()


class Workers:
    """One kept-alive channel per worker URL (TLS checked against the CA file, certificate naming
    the worker, when it is https://)."""

    def __init__(self, ca_file: str | None):
        self._tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._channels: dict[str, http11.Channel] = {}

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

    async def aclose(self) -> None:
        for ch in self._channels.values():
            await ch.aclose()


def _error_answer(e: errors.AtollError, rid: str) -> JSONResponse:
    body = {"error": {"code": e.code, "message": e.message, "request_id": rid, "retryable": e.retryable}}
    return JSONResponse(body, status_code=e.status, headers={"X-Request-Id": rid})


def _dumps(obj: typing.Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _auth(request: Request) -> str:
    return _checked_auth(request.headers.get("authorization", ""))


def _checked_auth(auth: str) -> str:
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


def _sid(request: Request) -> str:
    sid = request.path_params["sid"]
    if not ids.SANDBOX_ID_RE.match(sid):
        raise errors.InvalidRequest(
            f"{sid[:60]!r} is not a sandbox id (sb- and 16 lower-case letters/digits)"
        )
    return sid


def _pid(request: Request) -> int:
    pid = request.path_params["pid"]
    if not (pid.isascii() and pid.isdigit()) or not 0 < int(pid) <= 1 << 31:
        raise errors.InvalidRequest(
            f"pid {pid!r} is not a positive integer; list processes with GET …/processes"
        )
    return int(pid)


def _flag(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("0", "false", "no", ""):
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    raise errors.InvalidRequest(f"{name} must be 1 or 0 (true or false), got {value!r}")


async def _json_body(request: Request, optional: bool = False) -> dict:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_JSON_BYTES:
            raise errors.PayloadTooLarge(
                f"request body is over {MAX_JSON_BYTES} bytes, the limit of JSON bodies"
            )
    if not raw.strip():
        if optional:
            return {}
        raise errors.InvalidRequest("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise errors.InvalidRequest("the request body is not JSON") from None
    if not isinstance(data, dict):
        raise errors.InvalidRequest("the request body must be a JSON object")
    return data


class Edge:
    """The edge's routes over its grant cache and worker channels."""

    def __init__(self, server_url: str, ca_file: str | None = None, transport: typing.Any = None):
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.server_url = server_url.rstrip("/")
        self.grants = Grants(server_url, verify, transport)
        self.workers = Workers(ca_file)

    # ---- the one way to a worker ------------------------------------------------------------------
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
        **kw: typing.Any,
    ) -> typing.AsyncIterator[http11.Response]:
        """The worker's answer (status < 400, body unread) to `method` /sandboxes/{sid}/{sub}, with
        a grant. A stale grant or a sandbox not there (refused before the worker did anything) is
        asked for again once when the request can be sent again (`replayable`: JSON or bytes held;
        a streamed upload is not, and is then a retryable 503). `timeout` bounds the wait for the
        answer's head (None: a command's, as long as it runs)."""
        served = False
        for attempt in (0, 1):
            g = await self.grants.get(auth, sid)
            sent = {
                "Authorization": f"{grants.SCHEME} {g.grant}",
                wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION),
                **(headers or {}),
            }
            retry = False
            try:
                async with self.workers.channel(g).stream(
                    method, f"{PREFIX}/sandboxes/{sid}/{sub}", headers=sent, timeout=timeout, **kw
                ) as r:
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
                        yield r
                        return
            except http11.ChannelError as e:
                self.grants.drop(auth, sid)
                if attempt == 0 and not served and isinstance(e, http11.ConnectFailed):
                    continue
                raise errors.Unavailable(
                    f"worker {g.worker_name!r} cannot be reached at {g.url} from the edge ({type(e).__name__}); "
                    "retry in a few seconds",
                    detail=repr(e),
                ) from None
            if retry:
                continue
        raise errors.Unavailable(
            f"sandbox {sid}'s worker could not be reached by the edge; retry in a few seconds"
        )

    async def call_json(self, auth: str, sid: str, method: str, sub: str, **kw: typing.Any) -> typing.Any:
        async with self.call(auth, sid, method, sub, **kw) as r:
            body = await r.aread()
        return json.loads(body) if body else None

    # ---- exec -------------------------------------------------------------------------------------
    async def exec_(self, request: Request) -> Response:
        auth, sid = _auth(request), _sid(request)
        req = await _json_body(request)
        unknown = sorted(set(req) - EXEC_FIELDS)
        if unknown:
            raise errors.InvalidRequest(f"unknown field(s) in the exec request: {', '.join(unknown)}")
        if "cmd" not in req:
            raise errors.InvalidRequest("the exec request needs 'cmd' (a shell string or an argv list)")
        g = await self.grants.get(auth, sid)
        cap = int(g.defaults.get("max_output_bytes") or 0)
        asked = req.get("max_output_bytes")
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise errors.InvalidRequest(f"max_output_bytes must be an integer >= 1, got {asked!r}")
        if isinstance(asked, int) and cap and asked > cap:
            raise errors.InvalidRequest(
                f"max_output_bytes={asked} is above this server's limit of {cap} bytes per stream "
                "(ATOLL_MAX_EXEC_OUTPUT_KB); ask for less, or stream the output (Accept: application/x-ndjson)"
            )
        spec = {
            "cmd": req["cmd"],
            "max_output_bytes": asked or cap or None,
            "cwd": req.get("cwd"),
            "env": req.get("env"),
            "timeout_s": req.get("timeout_s"),
            "user": req.get("user") or g.defaults.get("user"),
            "stdin": req.get("stdin"),
            "shell": req.get("shell") or g.defaults.get("shell"),
        }
        try:
            spec = wire.dump(
                wire.load(api.ExecSpec, {k: v for k, v in spec.items() if v is not None}, "exec request")
            )
        except errors.RuntimeFailure as e:
            raise errors.InvalidRequest(f"malformed exec request: {e.detail or e.message}"[:1000]) from None
        if req.get("background"):
            return JSONResponse(await self.call_json(auth, sid, "POST", "processes", json=spec))
        if NDJSON in request.headers.get("accept", ""):
            return await self._lines(
                auth, sid, "POST", "exec", _exec_line, json=spec, headers={"Accept": NDJSON}
            )
        result = await relay.unless_disconnected(
            request.receive,
            self.call_json(auth, sid, "POST", "exec", json=spec, timeout=None),
            errors.InvalidRequest("the client disconnected; the command was stopped"),
        )
        return JSONResponse(result)

    async def _lines(
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
            try:
                async for line in ndjson.alines(r.aiter_raw()):
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        obj = None
                    if not isinstance(obj, dict):
                        raise errors.RuntimeFailure("a malformed line arrived from the worker")
                    yield _dumps(obj if "error" in obj else render(obj)) + b"\n"
            except Exception as e:  # noqa: BLE001 - the headers are sent: report it in-band
                code, message = (
                    (e.code, e.message)
                    if isinstance(e, errors.AtollError)
                    else ("worker_unavailable", "the stream from the sandbox's worker broke")
                )
                log.warning("edge stream broke: %s", message, extra={"sandbox_id": sid, "detail": repr(e)})
                yield _dumps({"error": {"code": code, "message": message}}) + b"\n"
            finally:
                await opening.__aexit__(None, None, None)

        return StreamingResponse(body(), media_type=NDJSON)

    # ---- processes --------------------------------------------------------------------------------
    async def process_output(self, request: Request) -> Response:
        auth, sid, pid = _auth(request), _sid(request), _pid(request)
        offset = request.query_params.get("offset", "0")
        if not (offset.isascii() and offset.isdigit()):
            raise errors.InvalidRequest(
                f"offset {offset!r} is not a byte offset (an integer >= 0); use 0 or an offset from an earlier line"
            )
        follow = _flag(request.query_params.get("follow"), "follow")
        params = {"offset": str(int(offset)), "follow": "1" if follow else "0"}
        return await self._lines(auth, sid, "GET", f"processes/{pid}/output", _process_line, params=params)

    async def get_process(self, request: Request) -> Response:
        auth, sid, pid = _auth(request), _sid(request), _pid(request)
        return JSONResponse(await self.call_json(auth, sid, "GET", f"processes/{pid}"))

    async def kill_process(self, request: Request) -> Response:
        auth, sid, pid = _auth(request), _sid(request), _pid(request)
        await self.call_json(auth, sid, "DELETE", f"processes/{pid}")
        return Response(status_code=204)

    async def send_stdin(self, request: Request) -> Response:
        auth, sid, pid = _auth(request), _sid(request), _pid(request)
        eof = _flag(request.query_params.get("eof"), "eof")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > api.MAX_STDIN_BYTES:
                raise errors.PayloadTooLarge(
                    f"stdin body exceeds {api.MAX_STDIN_BYTES} bytes, the most one call carries; send it in parts"
                )
        answer = await self.call_json(
            auth,
            sid,
            "POST",
            f"processes/{pid}/stdin",
            params={"eof": "1" if eof else "0"},
            content=bytes(data),
            timeout=None,  # a process that does not read for 30 s is the worker's to report
            headers={"Content-Type": "application/octet-stream"},
        )
        return JSONResponse({"written": answer["written"], "eof": eof})

    async def signal_process(self, request: Request) -> Response:
        auth, sid, pid = _auth(request), _sid(request), _pid(request)
        req = await _json_body(request)
        if set(req) != {"signal"} or not isinstance(req["signal"], str | int):
            raise errors.InvalidRequest('the signal request is {"signal": NAME}, e.g. {"signal": "INT"}')
        name = signals.normalize(req["signal"])
        await self.call_json(auth, sid, "POST", f"processes/{pid}/signal", json={"signal": name})
        return JSONResponse(await self.call_json(auth, sid, "GET", f"processes/{pid}"))

    async def wait_process(self, request: Request) -> Response:
        auth, sid, pid = _auth(request), _sid(request), _pid(request)
        req = await _json_body(request, optional=True)
        if set(req) - {"timeout_s"}:
            raise errors.InvalidRequest('the wait request is {"timeout_s": SECONDS} (or empty)')
        result = await relay.unless_disconnected(
            request.receive,
            self.call_json(auth, sid, "POST", f"processes/{pid}/wait", json=req, timeout=None),
            errors.InvalidRequest("the client disconnected"),
        )
        return JSONResponse(result)

    # ---- files ------------------------------------------------------------------------------------
    async def _file(self, request: Request) -> tuple[str, str, Grant, dict[str, str]]:
        """(auth, sid, grant, the worker's path parameters) of a files call: `path` or `path_b64`
        checked and resolved from the sandbox's workdir exactly as the API does (core.filepaths)."""
        auth, sid = _auth(request), _sid(request)
        q = request.query_params
        g = await self.grants.get(auth, sid)
        target = filepaths.check_path(q.get("path"), q.get("path_b64"), g.defaults.get("workdir"))
        if isinstance(target, bytes):
            return auth, sid, g, {"path_b64": base64.b64encode(target).decode("ascii")}
        return auth, sid, g, {"path": target}

    async def read_file(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        opening = self.call(auth, sid, "GET", "files", params=params)
        r = await opening.__aenter__()
        length = r.headers.get("content-length")

        async def body() -> typing.AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            except Exception as e:  # noqa: BLE001 - the headers are sent: the download is cut short
                log.warning(
                    "edge file download broke: %s", getattr(e, "message", e), extra={"sandbox_id": sid}
                )
            finally:
                await opening.__aexit__(None, None, None)

        headers = {"Content-Length": length} if length and length.isdigit() else {}
        return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)

    async def write_file(self, request: Request) -> Response:
        auth, sid, g, params = await self._file(request)
        limit = int(g.defaults.get("max_file_bytes") or 0) or None
        declared = request.headers.get("content-length")
        if limit and declared and declared.isdigit() and int(declared) > limit:
            raise errors.PayloadTooLarge(
                f"file body is {declared} bytes; the limit is {limit} (ATOLL_MAX_FILE_MB)"
            )

        async def chunks() -> typing.AsyncIterator[bytes]:
            n = 0
            async for chunk in request.stream():
                n += len(chunk)
                if limit and n > limit:
                    raise errors.PayloadTooLarge(f"file body exceeds {limit} bytes (ATOLL_MAX_FILE_MB)")
                if chunk:
                    yield chunk

        headers = {"Content-Type": "application/octet-stream"}
        if declared and declared.isdigit():
            headers["Content-Length"] = declared
        await self.call_json(
            auth,
            sid,
            "PUT",
            "files",
            params=params,
            content=chunks(),
            headers=headers,
            timeout=None,
            replayable=False,
        )
        return Response(status_code=204)

    async def delete_file(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        await self.call_json(auth, sid, "DELETE", "files", params=params)
        return Response(status_code=204)

    async def stat_file(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        return JSONResponse(await self.call_json(auth, sid, "GET", "files/stat", params=params))

    async def list_files(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        return JSONResponse({"items": await self.call_json(auth, sid, "GET", "files/list", params=params)})

    # ---- terminals --------------------------------------------------------------------------------
    async def open_pty(self, request: Request) -> Response:
        auth, sid = _auth(request), _sid(request)
        req = await _json_body(request, optional=True)
        unknown = sorted(set(req) - PTY_FIELDS)
        if unknown:
            raise errors.InvalidRequest(f"unknown field(s) in the terminal request: {', '.join(unknown)}")
        g = await self.grants.get(auth, sid)
        spec = {"cols": 80, "rows": 24, **{k: v for k, v in req.items() if v is not None}}
        spec.setdefault("user", g.defaults.get("user"))
        for name, limit in (("cols", ptyframes.MAX_COLS), ("rows", ptyframes.MAX_ROWS)):
            v = spec[name]
            if not isinstance(v, int) or isinstance(v, bool) or not ptyframes.MIN_SIZE <= v <= limit:
                raise errors.InvalidRequest(
                    f"{name} must be an integer {ptyframes.MIN_SIZE}..{limit}, got {v!r}"
                )
        try:
            body = wire.dump(
                wire.load(api.PtySpec, {k: v for k, v in spec.items() if v is not None}, "pty request")
            )
        except errors.RuntimeFailure as e:
            raise errors.InvalidRequest(
                f"malformed terminal request: {e.detail or e.message}"[:1000]
            ) from None
        return JSONResponse(await self.call_json(auth, sid, "POST", "pty", json=body), status_code=201)

    async def kill_pty(self, request: Request) -> Response:
        auth, sid = _auth(request), _sid(request)
        pty_id = request.path_params["pty_id"]
        if not ptyframes.is_pty_id(pty_id):
            raise errors.PtyNotFound(
                f"no terminal {pty_id[:40]!r} in sandbox {sid} (ids look like pty_0123456789ab)"
            )
        await self.call_json(auth, sid, "DELETE", f"pty/{pty_id}")
        return Response(status_code=204)

    async def _tunnel(self, g: Grant, pty_id: str) -> portstream.SocketPort:
        """A terminal's frame stream through the worker's port tunnel, with the grant."""
        if not g.tunnel_port:
            raise errors.Unavailable(f"worker {g.worker_name!r} has no port tunnel (it runs an older atoll)")
        host = urllib.parse.urlsplit(g.url).hostname or ""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, g.tunnel_port)), 5)
            hello = f"ATOLL-PTY {api.PROTOCOL_VERSION} grant:{g.grant} {g.sandbox_id} {pty_id}\n".encode()
            await asyncio.wait_for(loop.sock_sendall(sock, hello), 5)
            raw = await asyncio.wait_for(portstream.read_line(sock), 5)
        except (OSError, TimeoutError, ValueError) as e:
            sock.close()
            raise errors.Unavailable(
                f"worker {g.worker_name!r}'s port tunnel did not answer the edge: {e!r}"
            ) from None
        line = (raw or b"").decode("utf-8", "replace").strip()
        if line == "OK":
            return portstream.SocketPort(sock)
        sock.close()
        _, code, message = (line.split(" ", 2) + ["", ""])[:3]
        raise errors.from_code(code or "runtime_error", message or f"the tunnel answered {line!r}")

    async def pty_stream(self, auth: str, sid: str, pty_id: str) -> portstream.SocketPort:
        """A terminal's frame stream through the worker's port tunnel, with a grant; a stale grant
        (or a sandbox that moved) is asked for again once, as `call` does."""
        for attempt in (0, 1):
            g = await self.grants.get(auth, sid)
            try:
                return await self._tunnel(g, pty_id)
            except errors.AtollError as e:
                self.grants.drop(auth, sid)
                if attempt == 1 or e.code not in ("unauthorized", "sandbox_not_found", "invalid_state"):
                    raise
        raise AssertionError("unreachable")

    async def attach_pty(self, websocket: WebSocket) -> None:
        sid, pty_id = websocket.path_params["sid"], websocket.path_params["pty_id"]
        stream: portstream.SocketPort | None = None
        try:
            auth = _checked_auth(websocket.headers.get("authorization", ""))
            if not ids.SANDBOX_ID_RE.match(sid):
                raise errors.InvalidRequest(f"{sid[:60]!r} is not a sandbox id")
            if not ptyframes.is_pty_id(pty_id):
                raise errors.PtyNotFound(
                    f"no terminal {pty_id[:40]!r} in sandbox {sid} (ids look like pty_0123456789ab)"
                )
            stream = await self.pty_stream(auth, sid, pty_id)
        except Passed as p:
            await websocket.accept()
            await websocket.send_text(p.body.decode("utf-8", "replace"))
            await websocket.close(code=4000 + p.status)
            return
        except errors.AtollError as e:
            await websocket.accept()
            await websocket.send_text(ptyrelay.error_text(e.code, e.message))
            await websocket.close(code=4000 + e.status)
            return
        assert stream is not None
        try:
            await websocket.accept()
            await ptyrelay.relay(websocket, stream, sid, pty_id)
        except errors.AtollError as e:
            with contextlib.suppress(Exception):
                await websocket.send_text(ptyrelay.error_text(e.code, e.message))
                await websocket.close(code=4000 + e.status)
        finally:
            stream.close()

    # ---- the rest ---------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "server": self.server_url})

    def app(self) -> Starlette:
        sb = "/v1/sandboxes/{sid}"
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route(sb + "/exec", self.exec_, methods=["POST"]),
            Route(sb + "/processes/{pid}", self.get_process, methods=["GET"]),
            Route(sb + "/processes/{pid}", self.kill_process, methods=["DELETE"]),
            Route(sb + "/processes/{pid}/output", self.process_output, methods=["GET"]),
            Route(sb + "/processes/{pid}/stdin", self.send_stdin, methods=["POST"]),
            Route(sb + "/processes/{pid}/signal", self.signal_process, methods=["POST"]),
            Route(sb + "/processes/{pid}/wait", self.wait_process, methods=["POST"]),
            Route(sb + "/files", self.read_file, methods=["GET"]),
            Route(sb + "/files", self.write_file, methods=["PUT"]),
            Route(sb + "/files", self.delete_file, methods=["DELETE"]),
            Route(sb + "/files/stat", self.stat_file, methods=["GET"]),
            Route(sb + "/files/list", self.list_files, methods=["GET"]),
            Route(sb + "/pty", self.open_pty, methods=["POST"]),
            Route(sb + "/pty/{pty_id}", self.kill_pty, methods=["DELETE"]),
            WebSocketRoute(sb + "/pty/{pty_id}/ws", self.attach_pty),
        ]

        async def not_here(request: Request, exc: Exception) -> Response:
            e = errors.NotFound(
                f"the edge serves a sandbox's exec, process, file and terminal calls only; send {request.method} "
                f"{request.url.path} to the API server at {self.server_url}",
                code="not_found",
            )
            return _error_answer(e, request.state.rid)

        async def atoll_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, errors.AtollError)
            if exc.status >= 500:
                log.warning(
                    "edge call failed: %s",
                    exc.message,
                    extra={"path": request.url.path, "detail": exc.detail},
                )
            return _error_answer(exc, request.state.rid)

        async def passed(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, Passed)
            return Response(exc.body, status_code=exc.status, media_type=exc.content_type)

        app = Starlette(
            routes=routes,
            exception_handlers={errors.AtollError: atoll_error, Passed: passed, 404: not_here, 405: not_here},
        )

        class Rid:
            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                if scope["type"] == "http":
                    scope.setdefault("state", {})["rid"] = "edge_" + secrets.token_hex(8)
                    try:
                        await self.inner(scope, receive, send)
                    except Exception:  # noqa: BLE001 - never a traceback to the client
                        log.exception("edge request failed", extra={"path": scope.get("path")})
                        rid = scope["state"]["rid"]
                        e = errors.AtollError(f"internal error in the edge; its log has it as {rid}")
                        await _error_answer(e, rid)(scope, receive, send)
                    return
                await self.inner(scope, receive, send)

        app.add_middleware(Rid)
        return app

    async def aclose(self) -> None:
        await self.grants.aclose()
        await self.workers.aclose()


def _exec_line(obj: dict) -> dict:
    ev = wire.load_exec_event(obj)
    if isinstance(ev, api.ExecOutput):
        return {ev.stream: ev.text}
    return {"exit_code": ev.exit_code, "timed_out": ev.timed_out, "duration_ms": ev.duration_ms}


def _process_line(obj: dict) -> dict:
    ev = wire.load_process_event(obj)
    if isinstance(ev, api.ProcessOutput):
        return {ev.stream: ev.text, "offset": ev.offset}
    if isinstance(ev, api.ProcessDropped):
        return {"dropped": ev.dropped, "offset": ev.offset}
    line = {"exit_code": ev.exit_code, "timed_out": ev.timed_out}
    return {**line, "duration_ms": ev.duration_ms, "offset": ev.offset}


def listen(host: str, port: int, what: str = "--port or ATOLL_EDGE_PORT") -> socket.socket:
    """The edge's listening socket; a port in use is a start-up error naming the setting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without
    # it an answer written in two pieces waits for the client's delayed ACK (~40 ms, measured)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise SystemExit(
            f"atoll edge: port {port} on {host} {why}; pick another with {what} "
            "(and the address with --host or ATOLL_EDGE_HOST)"
        ) from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def e2b_settings(server: str, ca_file: str | None, env: typing.Mapping[str, str] | None = None):
    """The E2B app's settings (e2b.app.Settings) for an edge whose API is `server`: k_e2b
    ATOLL_E2B_TOKEN_KEY (hex, from the server that started this edge), ATOLL_E2B_INTERNET (allow|deny) and ATOLL_E2B_PAUSE_TIER."""
    from atoll.e2b import app as e2b_app

    env = os.environ if env is None else env
    verify: ssl.SSLContext | bool = True
    if ca_file:
        verify = ssl.create_default_context(cafile=ca_file)
        if urllib.parse.urlsplit(server).hostname in ("127.0.0.1", "::1", "localhost"):
            # the API's own certificate names the installation's names, not always loopback
            verify.check_hostname = False
    key = env.get("ATOLL_E2B_TOKEN_KEY") or None
    try:
        token_key = bytes.fromhex(key) if key else None
    except ValueError:
        raise SystemExit(
            "atoll edge: ATOLL_E2B_TOKEN_KEY is not hex (it is set by atoll server / atoll up)"
        ) from None
    return e2b_app.Settings(
        api_url=server,
        verify=verify,
        token_key=token_key,
        internet=(env.get("ATOLL_E2B_INTERNET") or "allow").lower() != "deny",
        pause_tier=env.get("ATOLL_E2B_PAUSE_TIER") or "memory",
    )


def seam_for(edge: Edge) -> typing.Any:
    """The envd services' seam: `seam_for(request, sandbox_id)` → an edge.seam.GrantedWorker, the
    sandbox's data verbs on its worker under a grant asked with the request's X-Access-Token
    (`Authorization: E2B-Access`) or API key."""
    from atoll.edge import seam  # it imports this module

    return seam.request_seams(edge)


def e2b_asgi(edge: Edge, settings: typing.Any, state_of: typing.Any = None) -> typing.Any:
    """The E2B port's app (e2b.app) with this edge's native routes behind `/v1/…`."""
    from atoll.e2b import app as e2b_app

    return e2b_app.create_app(settings, seam_for=seam_for(edge), state_of=state_of, fallback=edge.app())


def by_port(apps: dict[int, typing.Any], default: typing.Any) -> typing.Any:
    """One ASGI app serving several listening sockets: each request goes to the app of the port
    it arrived on (the native routes on --port, E2B's on --e2b-port)."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await default(scope, receive, send)
            return
        server = scope.get("server") or ("", 0)
        target: typing.Any = apps.get(server[1], default)
        await target(scope, receive, send)

    return app


async def serve(
    edge: Edge,
    sock: socket.socket,
    tls: tuple[str, str] | None = None,
    e2b: tuple[socket.socket, typing.Any] | None = None,
) -> None:
    """Serve the native routes on `sock` and, with `e2b` = (socket, e2b.app.Settings), E2B's on
    that socket too, in one uvicorn server until SIGINT/SIGTERM."""
    app = edge.app()
    sockets = [sock]
    e2b_app = None
    if e2b is not None:
        e2b_app = e2b_asgi(edge, e2b[1])
        app = by_port({e2b[0].getsockname()[1]: e2b_app}, app)
        sockets.append(e2b[0])
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    try:
        await uvicorn.Server(config).serve(sockets=sockets)
    finally:
        if e2b_app is not None:
            await e2b_app.control.aclose()
        await edge.aclose()


def main(
    server: str,
    ca_file: str | None = None,
    host: str | None = None,
    port: int | None = None,
    tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
    e2b_port: int | None = None,
) -> None:
    """Run the edge in the foreground until SIGINT/SIGTERM. With `--e2b-port` (ATOLL_E2B_PORT;
    0/off: none) it also serves E2B's API there (e2b.app, docs/e2b-compat.md), same address. With a certificate and key
    (`--tls-cert-file`/`--tls-key-file`, ATOLL_EDGE_TLS_CERT_FILE/ATOLL_EDGE_TLS_KEY_FILE) it
    serves https; otherwise plain http (keep it on loopback or behind TLS: keys pass through it)."""
    cert = tls_cert_file or os.environ.get("ATOLL_EDGE_TLS_CERT_FILE") or None
    key = tls_key_file or os.environ.get("ATOLL_EDGE_TLS_KEY_FILE") or None
    if bool(cert) != bool(key):
        print(
            "atoll edge: invalid setting: give both --tls-cert-file and --tls-key-file "
            "(ATOLL_EDGE_TLS_CERT_FILE, ATOLL_EDGE_TLS_KEY_FILE), or neither",
            file=sys.stderr,
        )
        raise SystemExit(2)
    for what, path in (("--tls-cert-file", cert), ("--tls-key-file", key)):
        if path and not os.path.isfile(path):
            print(f"atoll edge: invalid setting: {what} {path!r} is not a file", file=sys.stderr)
            raise SystemExit(2)
    host = host or os.environ.get("ATOLL_EDGE_HOST") or "127.0.0.1"
    raw_port = port if port is not None else os.environ.get("ATOLL_EDGE_PORT") or DEFAULT_PORT
    try:
        port_n = int(raw_port)
        if not 0 <= port_n <= 65535:
            raise ValueError
    except ValueError:
        print(
            f"atoll edge: invalid setting: ATOLL_EDGE_PORT / --port {raw_port!r} is not a port (0-65535)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    raw_e2b = e2b_port if e2b_port is not None else os.environ.get("ATOLL_E2B_PORT") or "off"
    try:
        e2b_n = 0 if str(raw_e2b).lower() == "off" else int(raw_e2b)
        if not 0 <= e2b_n <= 65535:
            raise ValueError
    except ValueError:
        print(
            f"atoll edge: invalid setting: ATOLL_E2B_PORT / --e2b-port {raw_e2b!r} is not a port "
            "(1-65535; 0 or off: no E2B API)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    if not server.startswith(("http://", "https://")):
        print(
            f"atoll edge: invalid setting: --server {server!r} must be the API's http(s):// URL",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if ca_file and not os.path.isfile(ca_file):
        print(f"atoll edge: invalid setting: --ca-file {ca_file!r} is not a file", file=sys.stderr)
        raise SystemExit(2)
    logconfig.configure(os.environ.get("ATOLL_LOG_FORMAT", "text"), os.environ.get("ATOLL_LOG_LEVEL", "INFO"))
    try:
        sock = listen(host, port_n)
        e2b_sock = listen(host, e2b_n, "--e2b-port or ATOLL_E2B_PORT") if e2b_n else None
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        raise SystemExit(2) from None
    log.info("starting atoll edge", extra={"server": server, "listen": f"{host}:{sock.getsockname()[1]}"})
    e2b = None
    if e2b_sock is not None:
        e2b = (e2b_sock, e2b_settings(server, ca_file))
        log.info("E2B API on %s:%d", host, e2b_sock.getsockname()[1])
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(Edge(server, ca_file), sock, (cert, key) if cert and key else None, e2b))

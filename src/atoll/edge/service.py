"""`atoll edge`: the API's sandbox data routes, relayed straight to the worker holding the sandbox.

For each call it needs a grant (core.grants) from edge.upstream.Grants: asked of the server
(`POST /v1/sandboxes/{id}/grant`, with the caller's own `Authorization` header, so the server
checks the key, its tenant and the sandbox exactly as for any call, and resumes a sandbox in
standby), kept per (hash of the header, sandbox) and re-checked with the server at most every
REVALIDATE_S (a revoked key is refused within that). The call goes to the worker's URL with
`Authorization: Grant <grant>`. A worker that answers 401 (the grant is stale: it registered
again), 404 sandbox_not_found or 409 invalid_state (the sandbox moved or sleeps) before anything
was relayed has the grant dropped and a new one asked for, once. The server's refusals (401 for a
wrong key, 404 for another tenant's sandbox, …) reach the client as the server gave them. While a
call is open, edge.watchdog ends it when the key is revoked, the sandbox moved, or the worker
stops answering its liveness probe (frozen): 503, retryable, instead of waiting for ever.

Served here, in the API's request and answer shapes: POST …/exec (plain, `Accept:
application/x-ndjson` streamed, `background`), GET …/processes (the list), GET …/processes/{pid}
and …/output (NDJSON), POST …/stdin, …/signal, …/wait and DELETE …/processes/{pid}; GET/PUT/DELETE
…/files, GET …/files/stat, …/files/list, …/files/watch (NDJSON), GET/PUT …/files/tar, POST
…/files/mkdir, …/files/move, …/files/chmod (paths checked as the API does: core.filepaths); POST
and GET …/pty, DELETE …/pty/{id} and the terminal WebSocket …/pty/{id}/ws (the key checked before
the handshake is accepted; then through the worker's port tunnel, its `ATOLL-PTY` hello carrying
the grant; shared.ptyrelay relays it as the API does). Lists are paged by edge.pages. Anything
else answers 404 with an error naming the API server's URL (the edge is not a proxy for control
calls). Over an https:// worker URL the worker's certificate is checked against `--ca-file` and
must name that worker. Uses shared.http11 (worker calls), shared.ndjson, shared.relay; httpx for
the server. Called by cli.main (`atoll edge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import socket
import ssl
import sys
import typing
import urllib.parse

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from atoll.core import errors, inputs, signals, wire
from atoll.core import worker_api as api
from atoll.edge import calls, files, pages, seam, terminals, upstream
from atoll.shared import logconfig, relay

log = logging.getLogger(__name__)

DEFAULT_PORT = 7083
"""Not 7082: that is `atoll up`'s E2B port (the API port + 2), which may run on the same machine."""
EXEC_FIELDS = frozenset(
    {"cmd", "cwd", "env", "timeout_s", "background", "user", "max_output_bytes", "stdin", "shell"}
)


def _error_answer(e: errors.AtollError, rid: str) -> JSONResponse:
    body = {"error": {"code": e.code, "message": e.message, "request_id": rid, "retryable": e.retryable}}
    return JSONResponse(body, status_code=e.status, headers={"X-Request-Id": rid})


class Edge(files.FileRoutes, terminals.TerminalRoutes):
    """The edge's routes over its grant cache and worker channels (calls.Base)."""

    # ---- the one way to a worker ------------------------------------------------------------------

    # ---- exec -------------------------------------------------------------------------------------
    async def exec_(self, request: Request) -> Response:
        auth, sid = calls.auth(request), calls.sid(request)
        req = await calls.json_body(request)
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
        background = req.get("background", False)
        if not isinstance(background, bool):  # as the API's model: true or false, nothing else
            raise errors.InvalidRequest(f"background must be true or false, not {background!r:.40}")
        if background:
            return JSONResponse(await self.call_json(auth, sid, "POST", "processes", json=spec))
        if calls.NDJSON in request.headers.get("accept", ""):
            return await self.lines(
                auth, sid, "POST", "exec", _exec_line, json=spec, headers={"Accept": calls.NDJSON}
            )
        result = await relay.unless_disconnected(
            request.receive,
            self.call_json(auth, sid, "POST", "exec", json=spec, timeout=None),
            errors.InvalidRequest("the client disconnected; the command was stopped"),
        )
        return JSONResponse(result)

    # ---- processes --------------------------------------------------------------------------------
    async def process_output(self, request: Request) -> Response:
        auth, sid, pid = calls.auth(request), calls.sid(request), calls.pid(request)
        offset = request.query_params.get("offset", "0")
        if not (offset.isascii() and offset.isdigit()):
            raise errors.InvalidRequest(
                f"offset {offset!r} is not a byte offset (an integer >= 0); use 0 or an offset from an earlier line"
            )
        follow = inputs.flag(request.query_params.get("follow"), "follow")
        params = {"offset": str(int(offset)), "follow": "1" if follow else "0"}
        return await self.lines(auth, sid, "GET", f"processes/{pid}/output", _process_line, params=params)

    async def list_processes(self, request: Request) -> Response:
        auth, sid = calls.auth(request), calls.sid(request)
        page = pages.Page.of(request.query_params, "/v1/sandboxes/{id}/processes")
        items = [
            wire.load(api.ProcessInfo, i, "process")
            for i in await self.call_json(auth, sid, "GET", "processes")
        ]
        return JSONResponse(page.answer(items, lambda i: (i.started_at, i.pid)))

    async def get_process(self, request: Request) -> Response:
        auth, sid, pid = calls.auth(request), calls.sid(request), calls.pid(request)
        return JSONResponse(await self.call_json(auth, sid, "GET", f"processes/{pid}"))

    async def kill_process(self, request: Request) -> Response:
        auth, sid, pid = calls.auth(request), calls.sid(request), calls.pid(request)
        await self.call_json(auth, sid, "DELETE", f"processes/{pid}")
        return Response(status_code=204)

    async def send_stdin(self, request: Request) -> Response:
        auth, sid, pid = calls.auth(request), calls.sid(request), calls.pid(request)
        eof = inputs.flag(request.query_params.get("eof"), "eof")
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
        auth, sid, pid = calls.auth(request), calls.sid(request), calls.pid(request)
        req = await calls.json_body(request)
        if set(req) != {"signal"} or not isinstance(req["signal"], str | int):
            raise errors.InvalidRequest('the signal request is {"signal": NAME}, e.g. {"signal": "INT"}')
        name = signals.normalize(req["signal"])
        await self.call_json(auth, sid, "POST", f"processes/{pid}/signal", json={"signal": name})
        return JSONResponse(await self.call_json(auth, sid, "GET", f"processes/{pid}"))

    async def wait_process(self, request: Request) -> Response:
        auth, sid, pid = calls.auth(request), calls.sid(request), calls.pid(request)
        req = await calls.json_body(request, optional=True)
        if set(req) - {"timeout_s"}:
            raise errors.InvalidRequest('the wait request is {"timeout_s": SECONDS} (or empty)')
        result = await relay.unless_disconnected(
            request.receive,
            self.call_json(auth, sid, "POST", f"processes/{pid}/wait", json=req, timeout=None),
            errors.InvalidRequest("the client disconnected"),
        )
        return JSONResponse(result)

    # ---- files ------------------------------------------------------------------------------------

    # ---- terminals --------------------------------------------------------------------------------

    # ---- the rest ---------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "server": self.server_url})

    def app(self) -> Starlette:
        sb = "/v1/sandboxes/{sid}"
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route(sb + "/exec", self.exec_, methods=["POST"]),
            Route(sb + "/processes", self.list_processes, methods=["GET"]),
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
            Route(sb + "/files/watch", self.watch_files, methods=["GET"]),
            Route(sb + "/files/tar", self.read_tar, methods=["GET"]),
            Route(sb + "/files/tar", self.write_tar, methods=["PUT"]),
            Route(sb + "/files/mkdir", self.make_dir, methods=["POST"]),
            Route(sb + "/files/move", self.move_file, methods=["POST"]),
            Route(sb + "/files/chmod", self.chmod_file, methods=["POST"]),
            Route(sb + "/pty", self.open_pty, methods=["POST"]),
            Route(sb + "/pty", self.list_ptys, methods=["GET"]),
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
            assert isinstance(exc, upstream.Passed)
            return Response(exc.body, status_code=exc.status, media_type=exc.content_type)

        app = Starlette(
            routes=routes,
            exception_handlers={
                errors.AtollError: atoll_error,
                upstream.Passed: passed,
                404: not_here,
                405: not_here,
            },
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
    return api.process_line(wire.load_process_event(obj))


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
    ATOLL_E2B_TOKEN_KEY (hex, from the server that started this edge), ATOLL_E2B_INTERNET (allow|deny), ATOLL_E2B_PAUSE_TIER and ATOLL_E2B_VOLUME_MB (the size of a
    volume Volume.create makes, 1024), ATOLL_E2B_DOMAIN (the answers' `domain`: DOMAIN[:PORT] of
    the ingress router serving E2B's sandbox hosts; unset or `off`: none)."""
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
        volume_mb=_volume_mb(env.get("ATOLL_E2B_VOLUME_MB") or "1024"),
        domain=_domain(env.get("ATOLL_E2B_DOMAIN") or ""),
    )


def _domain(raw: str) -> str | None:
    raw = raw.strip()
    if not raw or raw.lower() == "off":
        return None
    if any(c in raw for c in "/ ?#@") or not raw.isascii():
        raise SystemExit(f"atoll edge: ATOLL_E2B_DOMAIN={raw!r} is not DOMAIN or DOMAIN:PORT (or off)")
    return raw


def _volume_mb(raw: str) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= 16 * 1024 * 1024:
        raise SystemExit(
            f"atoll edge: ATOLL_E2B_VOLUME_MB must be a whole number of MiB from 1 to 16777216, not {raw[:40]!r}"
        )
    return int(raw)


def seam_for(edge: Edge) -> typing.Any:
    """The envd services' seam: `seam_for(request, sandbox_id)` → an edge.seam.GrantedWorker, the
    sandbox's data verbs on its worker under a grant asked with the request's X-Access-Token
    (`Authorization: E2B-Access`) or API key."""
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


def server_url_problem(server: str) -> str | None:
    """What is wrong with `--server` as written (None: nothing): it is the API's base URL, which
    the edge puts /v1/… after, so a URL ending in /v1 would make every grant a 404."""
    path = urllib.parse.urlsplit(server).path.rstrip("/")
    if path.endswith("/v1"):
        base = server.rstrip("/")[: -len("/v1")]
        return (
            f"--server {server!r} ends in /v1: give the API server's base URL, without /v1 "
            f"(e.g. --server {base}); the edge adds /v1/… itself"
        )
    return None


def server_warning(server: str, ca_file: str | None, timeout: float = 3.0) -> str | None:
    """A warning when the API server cannot be reached at start, or does not answer as an atoll
    server (its GET /healthz): the edge starts anyway (the server may come up later), and its
    calls answer 503 naming the server until it can be reached."""
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
    try:
        r = httpx.get(server.rstrip("/") + "/healthz", timeout=timeout, verify=verify)
    except httpx.HTTPError as e:
        return (
            f"the API server at {server} cannot be reached now ({type(e).__name__}: {str(e)[:200]}); "
            "the edge starts, and its calls answer 503 until the server answers — check --server "
            "(and --ca-file for https)"
        )
    try:
        body = r.json()
    except ValueError:
        body = None
    if not (isinstance(body, dict) and "status" in body and "workers" in body):
        return (
            f"{server} answered GET /healthz with {r.status_code} but not as an atoll API server: "
            "is --server the API's URL (not a worker's, an edge's or a proxy's)?"
        )
    return None


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
    problem = server_url_problem(server)
    if problem:
        print(f"atoll edge: invalid setting: {problem}", file=sys.stderr)
        raise SystemExit(2)
    warning = server_warning(server, ca_file)
    if warning:
        print(f"atoll edge: warning: {warning}", file=sys.stderr)
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

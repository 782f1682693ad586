"""The edge's terminal routes, in the API's shapes: POST …/pty (open), GET …/pty (the list, paged
by edge.pages), DELETE …/pty/{id}, and the WebSocket …/pty/{id}/ws. The WebSocket's key is checked
(the grant asked for) before the handshake is accepted, as the API refuses one; it is then relayed
through the worker's port tunnel, whose `ATOLL-PTY` hello carries the grant, by shared.ptyrelay
(the API's relay), under an edge.watchdog.Watch. Part of edge.service.Edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.parse

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket

from atoll.core import errors, ids, wire
from atoll.core import worker_api as api
from atoll.edge import calls, pages, upstream, watchdog
from atoll.guest.agent import ptyframes
from atoll.shared import portstream, ptyrelay

PTY_FIELDS = frozenset({"cols", "rows", "term", "cmd", "cwd", "env", "user"})


async def _deny(websocket: WebSocket, status: int, body: bytes, content_type: str) -> None:
    """Refuse a WebSocket handshake with an HTTP answer (the ASGI websocket.http.response
    extension), as the API refuses one without a valid key; a server without it closes (403)."""
    try:
        await websocket.send_denial_response(Response(body, status_code=status, media_type=content_type))
    except RuntimeError:
        await websocket.close(code=1008)


class TerminalRoutes(calls.Base):
    """The terminal routes of the edge."""

    async def open_pty(self, request: Request) -> Response:
        auth, sid = calls.auth(request), calls.sid(request)
        req = await calls.json_body(request, optional=True)
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

    async def list_ptys(self, request: Request) -> Response:
        auth, sid = calls.auth(request), calls.sid(request)
        page = pages.Page.of(request.query_params, "/v1/sandboxes/{id}/pty")
        items = [wire.load(api.PtyInfo, i, "terminal") for i in await self.call_json(auth, sid, "GET", "pty")]
        return JSONResponse(page.answer(items, lambda i: (i.created_at, i.pty_id)))

    async def kill_pty(self, request: Request) -> Response:
        auth, sid = calls.auth(request), calls.sid(request)
        pty_id = request.path_params["pty_id"]
        if not ptyframes.is_pty_id(pty_id):
            raise errors.PtyNotFound(
                f"no terminal {pty_id[:40]!r} in sandbox {sid} (ids look like pty_0123456789ab)"
            )
        await self.call_json(auth, sid, "DELETE", f"pty/{pty_id}")
        return Response(status_code=204)

    async def _tunnel(self, g: upstream.Grant, pty_id: str, port: int | None = None) -> portstream.SocketPort:
        """A terminal's frame stream (or, with `port`, a connection into one of the ports a grant
        opens, core.grants.GRANT_PORTS) through the worker's port tunnel, with the grant. A port
        nothing listens on is ConnectionRefusedError."""
        if not g.tunnel_port:
            raise errors.Unavailable(f"worker {g.worker_name!r} has no port tunnel (it runs an older atoll)")
        host = urllib.parse.urlsplit(g.url).hostname or ""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, g.tunnel_port)), 5)
            if port is None:
                hello = f"ATOLL-PTY {api.PROTOCOL_VERSION} grant:{g.grant} {g.sandbox_id} {pty_id}\n"
            else:
                hello = f"ATOLL-TUNNEL {api.PROTOCOL_VERSION} grant:{g.grant} {g.sandbox_id} {port}\n"
            await asyncio.wait_for(loop.sock_sendall(sock, hello.encode()), 5)
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
        if code == "refused":
            raise ConnectionRefusedError(message)
        raise errors.from_code(code or "runtime_error", message or f"the tunnel answered {line!r}")

    async def pty_stream(
        self, auth: str, sid: str, pty_id: str, resume: bool = True
    ) -> portstream.SocketPort:
        """A terminal's frame stream through the worker's port tunnel, with a grant; a stale grant
        (or a sandbox that moved) is asked for again once, as `call` does."""
        for attempt in (0, 1):
            g = await self.grants.get(auth, sid, resume)
            try:
                return await self._tunnel(g, pty_id)
            except errors.AtollError as e:
                self.grants.drop(auth, sid)
                if attempt == 1 or e.code not in ("unauthorized", "sandbox_not_found", "invalid_state"):
                    raise
        raise AssertionError("unreachable")

    async def port_stream(self, auth: str, sid: str, port: int) -> portstream.SocketPort:
        """A connection into the sandbox's `port` (one of core.grants.GRANT_PORTS: the code
        interpreter's) through the worker's port tunnel, as `pty_stream`."""
        for attempt in (0, 1):
            g = await self.grants.get(auth, sid)
            try:
                return await self._tunnel(g, "", port)
            except errors.AtollError as e:
                self.grants.drop(auth, sid)
                if attempt == 1 or e.code not in ("unauthorized", "sandbox_not_found", "invalid_state"):
                    raise
        raise AssertionError("unreachable")

    async def attach_pty(self, websocket: WebSocket) -> None:
        """The terminal WebSocket. The key is checked (the grant asked for) before the handshake
        is accepted: a missing, wrong or revoked key, or a key whose scope does not reach the
        sandbox, is an HTTP 401/403 refusal as the API's; other errors (no such sandbox or
        terminal) are an error frame and close code 4000 + status after the accept, as the API's.
        While open, the watchdog ends it when the key is revoked or the worker stops answering."""
        sid, pty_id = websocket.path_params["sid"], websocket.path_params["pty_id"]
        stream: portstream.SocketPort | None = None
        g: upstream.Grant | None = None
        try:
            auth = calls.checked_auth(websocket.headers.get("authorization", ""))
            if not ids.SANDBOX_ID_RE.match(sid):
                raise errors.InvalidRequest(f"{sid[:60]!r} is not a sandbox id")
            g = await self.grants.get(auth, sid)  # the key first, as the API checks it first
            if not ptyframes.is_pty_id(pty_id):
                raise errors.PtyNotFound(
                    f"no terminal {pty_id[:40]!r} in sandbox {sid} (ids look like pty_0123456789ab)"
                )
            stream = await self.pty_stream(auth, sid, pty_id)
            g = await self.grants.get(auth, sid)  # the one the stream was opened with (kept)
        except upstream.Passed as p:
            if stream is not None:
                stream.close()
            if p.status in (401, 403):
                return await _deny(websocket, p.status, p.body, p.content_type)
            await websocket.accept()
            await websocket.send_text(p.body.decode("utf-8", "replace"))
            await websocket.close(code=4000 + p.status)
            return
        except errors.AtollError as e:
            if stream is not None:
                stream.close()
            if (
                isinstance(e, errors.Unauthorized) and g is None
            ):  # no usable key: refused before the handshake
                body = calls.dumps({"error": {"code": e.code, "message": e.message, "retryable": False}})
                return await _deny(websocket, 401, body, "application/json")
            await websocket.accept()
            await websocket.send_text(ptyrelay.error_text(e.code, e.message))
            await websocket.close(code=4000 + e.status)
            return
        assert stream is not None and g is not None
        watch = watchdog.Watch(self.grants, self.workers, auth, sid, g)
        relaying: asyncio.Future | None = None
        try:
            await websocket.accept()
            relaying = task = asyncio.ensure_future(ptyrelay.relay(websocket, stream, sid, pty_id))

            def stop() -> None:
                task.cancel()

            watch.on_cut = stop
            await asyncio.wait({relaying})
            if not relaying.cancelled():
                relaying.result()
            elif watch.cut is None:
                raise asyncio.CancelledError
            else:
                raise watch.cut
        except errors.AtollError as e:  # the handshake is done: report it in-band
            with contextlib.suppress(Exception):
                await websocket.send_text(ptyrelay.error_text(e.code, e.message))
                await websocket.close(code=4000 + e.status)
        finally:
            watch.close()
            if relaying is not None and not relaying.done():
                relaying.cancel()
                with contextlib.suppress(BaseException):
                    await relaying
            stream.close()

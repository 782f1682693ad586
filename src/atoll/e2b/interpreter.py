"""E2B's code interpreter routes on the E2B port: `POST /execute` and `/contexts…` sent by
`e2b_code_interpreter` 2.11.5 with `E2b-Sandbox-Id` and `E2b-Sandbox-Port: 49999`
(docs/e2b-compat.md §5), relayed to the code interpreter service inside the sandbox
(atoll.guest.interpreter, on core.grants.GRANT_PORTS' port — 49999 is atoll's guest agent's).

The connection goes through the worker's port tunnel with a grant (the seam object's `open_port`,
edge.seam.GrantedWorker); when nothing listens there yet, the service is started as a background
process (`python3 /opt/atoll/interpreter.py`, the template `code-interpreter-v1` has the kernel)
and the connection tried again until it answers. The request is sent as HTTP/1.1 (h11) and the
answer streamed back: `/execute`'s NDJSON as it comes, the service's `{"error"}` answers as E2B's
`{"code", "message"}`. The edge closes each connection first (no TIME_WAIT inside the sandbox),
and at once when the caller disconnects (the service then interrupts the execution).

Auth: `/execute` needs the sandbox's `X-Access-Token` (checked here when this process holds
k_e2b, else by the grant route). `/contexts` calls carry none from 2.11.5 (§1 finding 7): they are
accepted by sandbox id when this process holds k_e2b (it makes the token itself), as E2B's own
server does; docs/security-model.md says what that opens. The ingress router's `49999-{id}` hosts
(E2B_DOMAIN mode, reachable from outside) refuse token-less calls before they get here. A paused
sandbox is resumed only with E2B's auto-resume (envd_routes.Envd.resumes). Mounted by e2b.app.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import typing

import h11
from starlette.requests import Request

from atoll.core import errors, grants
from atoll.core import worker_api as api
from atoll.e2b import control, envd_routes

log = logging.getLogger(__name__)

SDK_PORT = "49999"
"""The port e2b_code_interpreter names in `E2b-Sandbox-Port`."""
PORT = grants.GRANT_PORTS[0]
"""Where the service listens inside the sandbox (atoll.guest.interpreter.PORT)."""
SERVICE_CMD = ["python3", "/opt/atoll/interpreter.py", str(PORT)]
"""How the service is started (atoll.guest.interpreter.INSTALLED_PATH)."""
START_TIMEOUT_S = 60.0
"""How long a just-started service may take to listen."""
MAX_BODY = 16 * 1024 * 1024
_READ = 64 * 1024


def wants(scope: dict) -> bool:
    """Whether an HTTP request is one of the code interpreter's (its path, and the SDK's port)."""
    path = scope.get("path", "")
    if path != "/execute" and path != "/contexts" and not path.startswith("/contexts/"):
        return False
    for k, v in scope.get("headers") or ():
        if k == b"e2b-sandbox-port":
            return v.decode("latin-1").strip() == SDK_PORT
    return False


class _Headers(typing.NamedTuple):
    headers: typing.Mapping[str, str]


def _atoll_error(e: errors.AtollError, sid: str) -> control.E2BError:
    if getattr(e, "paused", False):  # edge.seam.SandboxPaused: envd's answer for a paused sandbox
        return control.E2BError(502, e.message)
    if e.code == "sandbox_not_found":
        return control.E2BError(502, f"The sandbox {sid} was not found: {e.message}")
    if e.status in (401, 403):
        return control.E2BError(401, e.message)
    if e.code == "invalid_state":
        return control.E2BError(502, f"The sandbox {sid} is not running: {e.message}")
    return control.E2BError(e.status if e.status >= 400 else 500, e.message)


class Interpreter:
    """The routes, over `envd`'s token check and seam objects."""

    def __init__(self, envd: envd_routes.Envd):
        self.envd = envd
        self._starting: dict[str, asyncio.Lock] = {}

    # ---- reaching the service ---------------------------------------------------------------------
    async def _seam(self, request: Request, sid: str, path: str) -> typing.Any:
        if self.envd.seam_for is None:
            raise control.E2BError(
                502, f"The sandbox {sid} cannot be reached: this edge has no data path to workers yet"
            )
        if path == "/execute" or request.headers.get("x-access-token"):
            self.envd.check_token(request, sid)
            source: typing.Any = request
        elif self.envd.token_key is not None:
            # /contexts: 2.11.5 sends no token; accepted by sandbox id (module docstring)
            token = grants.e2b_access_token(self.envd.token_key, sid)
            source = _Headers({"x-access-token": token})
        else:
            source = request  # a standalone edge: an API key or the token must come with it
        # E2B's pause rule, as for envd's calls: a paused sandbox created without auto-resume is
        # 502 "was not found: it is paused", and stays paused
        resume = await self.envd.resumes(sid)
        seam = self.envd.seam_for(source, sid) if resume else self.envd.seam_for(source, sid, resume=False)
        if asyncio.iscoroutine(seam):
            seam = await seam
        return seam

    async def _open(self, seam: typing.Any, sid: str) -> api.PortStream:
        """A connection to the service, started first when nothing listens."""
        try:
            return await seam.open_port(sid, PORT)
        except ConnectionRefusedError:
            pass
        lock = self._starting.setdefault(sid, asyncio.Lock())
        try:
            return await self._start(seam, sid, lock)
        finally:
            if not lock.locked() and self._starting.get(sid) is lock:
                del self._starting[sid]

    async def _start(self, seam: typing.Any, sid: str, lock: asyncio.Lock) -> api.PortStream:
        async with lock:
            try:
                return await seam.open_port(sid, PORT)
            except ConnectionRefusedError:
                pass
            started = await seam.start_process(
                sid, api.ExecSpec(cmd=list(SERVICE_CMD), max_output_bytes=64 * 1024)
            )
            log.info("code interpreter started", extra={"sandbox_id": sid, "pid": started.pid})
            deadline = time.monotonic() + START_TIMEOUT_S
            delay = 0.05
            while True:
                try:
                    return await seam.open_port(sid, PORT)
                except ConnectionRefusedError as e:
                    if time.monotonic() > deadline:
                        raise control.E2BError(
                            502,
                            f"the code interpreter of sandbox {sid} did not start listening within "
                            f"{START_TIMEOUT_S:.0f} s ({e}); is it a code-interpreter-v1 sandbox "
                            "(python3 with ipykernel and jupyter_client)?",
                        ) from None
                    info = await seam.get_process(sid, started.pid)
                    if not info.running:
                        raise control.E2BError(
                            502,
                            f"the code interpreter of sandbox {sid} exited (exit code {info.exit_code}): "
                            "its template has no Jupyter kernel (python3 with ipykernel and "
                            "jupyter_client); create the sandbox from code-interpreter-v1",
                        ) from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)

    # ---- one call ---------------------------------------------------------------------------------
    async def handle(self, scope: dict, receive: typing.Any, send: typing.Any) -> None:
        request = Request(scope, receive)
        sid = self.envd.sandbox_id(request)
        path = scope["path"]
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                raise control.E2BError(413, f"the request body is over {MAX_BODY} bytes")
        try:
            seam = await self._seam(request, sid, path)
            stream = await self._open(seam, sid)
        except errors.AtollError as e:
            raise _atoll_error(e, sid) from None
        # the caller leaving (its read deadline: run_code's `timeout`) closes the connection into
        # the sandbox, and the service interrupts the kernel (atoll.guest.interpreter)
        watch = asyncio.ensure_future(_until_disconnect(receive, stream))
        try:
            await self._relay(stream, request.method, path, bytes(body), send)
        finally:
            watch.cancel()
            stream.close()

    async def _relay(self, stream: api.PortStream, method: str, path: str, body: bytes, send) -> None:
        conn = h11.Connection(h11.CLIENT)
        req = h11.Request(
            method=method,
            target=path,
            headers=[
                ("Host", f"127.0.0.1:{PORT}"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
            ],
        )
        await stream.write(conn.send(req) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        started = False
        status = 0
        error_body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.read(_READ)
                if not data and not started:
                    raise control.E2BError(
                        502, "the code interpreter closed the connection before it answered"
                    )
                conn.receive_data(data)
                if not data:
                    break  # cut mid-answer: the SDK sees the stream end
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                if status == 200:
                    ctype = dict(event.headers).get(b"content-type", b"application/json")
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]}
                    )
                    started = True
            elif isinstance(event, h11.Data):
                if started:
                    await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
                elif len(error_body) < MAX_BODY:
                    error_body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        message = error_body.decode("utf-8", "replace")
        with contextlib.suppress(ValueError, AttributeError):
            message = str(json.loads(error_body).get("error") or message)
        # the service's own failure (a 5xx: e.g. a template without a kernel) is a bad gateway here
        raise control.E2BError(status if 400 <= status < 500 else 502, message[:2000])


async def _until_disconnect(receive: typing.Any, stream: api.PortStream) -> None:
    """Closes `stream` when the HTTP caller disconnects (its body was read before)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            stream.close()
            return

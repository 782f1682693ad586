"""envd's routes on the E2B port (the requests carrying `E2b-Sandbox-Id`, as the `e2b` SDKs send
them to E2B_SANDBOX_URL): `GET /health` from the sandbox's state without resuming it (204 running;
502 "was not found", paused or unknown — the SDKs read only a 502 as "not running"), and the Connect
RPC services `filesystem.Filesystem` (e2b.envd_files), `process.Process` (e2b.envd_process) and
the plain-HTTP `/files` (e2b.envd_http), each over the seam object `seam_for(request, sandbox_id)`
returns, kept per (sandbox, access token) so a polled watcher lives across calls. The access
token (`X-Access-Token`) is checked here when the process holds its key (ATOLL_E2B_TOKEN_KEY).
Mounted by e2b.app.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import typing

from starlette.requests import Request
from starlette.responses import Response

from atoll.core import ids
from atoll.e2b import control

MAX_ENVD_APPS = 1024
ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
ENVD_FILES = "/files"
"""envd's plain-HTTP file route (`GET`/`POST /files?path=`), served by e2b.envd_http when present."""

SeamFor = typing.Callable[[Request, str], typing.Any]
"""`seam_for(request, sandbox_id)` → a WorkerAPI-like object for that one sandbox (or an awaitable
of one), authorized by the request's `X-Access-Token`; raising `E2BError` refuses the call."""
StateOf = typing.Callable[[str], typing.Awaitable[str | dict | None]]
"""`state_of(sandbox_id)` → atoll's state of the sandbox (`running`, `standby`, …) or None when
there is none, without resuming it (the /health probe); or `{"state": …, "compat": {…}|None}`
with its `compat` too (E2B's auto-resume: without it envd calls to a paused sandbox answer 502)."""


class Envd:
    """envd's routes for the sandbox named by `E2b-Sandbox-Id`."""

    def __init__(self, token_key: bytes | None, seam_for: SeamFor | None, state_of: StateOf | None):
        self.token_key = token_key
        self.seam_for = seam_for
        self.state_of = state_of
        self._apps: collections.OrderedDict[tuple[str, str, str, bool], typing.Any] = (
            collections.OrderedDict()
        )
        self._factories: dict[str, typing.Any] | None = None
        self._resumes: collections.OrderedDict[str, bool] = collections.OrderedDict()
        """Whether a sandbox's envd calls resume it, for those a look found (`resumes`): E2B's
        auto-resume is fixed at its create, so their later calls need no look-up."""

    @staticmethod
    def sandbox_id(request: Request) -> str:
        sid = request.headers.get("e2b-sandbox-id", "")
        if not sid:
            raise control.E2BError(
                404,
                f"{request.url.path} is an envd route: send the E2b-Sandbox-Id header "
                "(the SDK does when E2B_SANDBOX_URL points here)",
            )
        if not ids.SANDBOX_ID_RE.match(sid):
            raise control.E2BError(502, f"The sandbox {sid[:80]!r} was not found")
        return sid

    def check_token(self, request: Request, sid: str) -> None:
        """`X-Access-Token` checked here when this process holds k_e2b (the server's edge child);
        else the grant route checks it when the seam object asks for a grant."""
        key = self.token_key
        if key is None:
            return
        if not control.check_access_token(key, sid, request.headers.get("x-access-token")):
            raise control.E2BError(
                401,
                f"wrong or missing X-Access-Token for sandbox {sid} (envdAccessToken of its create or connect answer)",
            )

    async def look(self, sid: str) -> tuple[str | None, dict | None]:
        """(atoll state, compat) of sandbox `sid` from `state_of`, never resuming it."""
        assert self.state_of is not None
        got = await self.state_of(sid)
        if isinstance(got, dict):
            compat = got.get("compat")
            return got.get("state"), compat if isinstance(compat, dict) else None
        return got, None

    async def health(self, request: Request) -> Response:
        sid = self.sandbox_id(request)
        self.check_token(request, sid)
        if self.state_of is None:
            raise control.E2BError(
                502, f"The sandbox {sid} was not found: this edge cannot see sandbox states"
            )
        state, _ = await self.look(sid)
        if state in ("running", "creating"):
            return Response(status_code=204)
        if state == "standby":
            raise control.E2BError(502, control.paused_message(sid))
        raise control.E2BError(502, f"The sandbox {sid} was not found")

    async def resumes(self, sid: str) -> bool:
        """Whether this envd call may resume sandbox `sid` from standby: E2B's auto-resume when it
        was created through E2B (its `compat`), atoll's own rule (always) otherwise, or when this
        edge cannot see states. The first call to a sandbox looks it up (a paused one that does
        not resume is then 502 here, before any grant is asked); later calls do not (issue 22:
        the server-side time of `Start`): a seam that does not resume asks its grant with
        `resume: false`, so a sandbox paused since is refused by its worker and then by the
        grant route (edge.seam.SandboxPaused), and `rpc` answers that 502 too."""
        if self.state_of is None:
            return True
        known = self._resumes.get(sid)
        if known is not None:
            self._resumes.move_to_end(sid)
            return known
        state, compat = await self.look(sid)
        resume = True if compat is None else bool(compat.get("auto_resume"))
        if state is not None:  # found, and its auto-resume is settled (a failed look keeps nothing)
            self._resumes[sid] = resume
            while len(self._resumes) > MAX_ENVD_APPS:
                self._resumes.popitem(last=False)
        if state == "standby" and not resume:
            raise control.E2BError(502, control.paused_message(sid))
        return resume

    def _services(self) -> dict[str, typing.Any]:
        """The envd services atoll has: path prefix → factory(seam, sid) of an ASGI app, made
        once. Modules written beside this one (issue 22) are mounted when present: absent, 501."""
        if self._factories is not None:
            return self._factories
        out: dict[str, typing.Any] = {}
        from atoll.e2b import envd_files
        from atoll.e2b.proto.filesystem import filesystem_connect

        out["/filesystem.Filesystem/"] = lambda seam, sid: filesystem_connect.FilesystemASGIApplication(
            envd_files.FilesystemService(seam, sid)
        )
        try:
            from atoll.e2b import envd_process  # type: ignore[attr-defined,unused-ignore]
            from atoll.e2b.proto.process import process_connect
        except ImportError:
            pass
        else:
            out["/process.Process/"] = lambda seam, sid: process_connect.ProcessASGIApplication(
                envd_process.ProcessService(seam, sid)
            )
        try:  # envd_http.FilesHTTP(seam, sandbox_id).handle(request): GET/POST /files
            from atoll.e2b import envd_http  # type: ignore[attr-defined,unused-ignore]
        except ImportError:
            pass
        else:
            if hasattr(envd_http, "FilesHTTP"):
                out[ENVD_FILES] = lambda seam, sid: _asgi(envd_http.FilesHTTP(seam, sid).handle)
        self._factories = out
        return out

    async def rpc(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        sid = self.sandbox_id(request)
        self.check_token(request, sid)
        path = scope["path"]
        prefix = ENVD_FILES if path == ENVD_FILES else next(p for p in ENVD_PREFIXES if path.startswith(p))
        factory = self._services().get(prefix)
        if factory is None:
            raise control.E2BError(501, f"envd's {prefix.strip('/')} is not served by this atoll yet")
        if self.seam_for is None:
            raise control.E2BError(
                502, f"The sandbox {sid} cannot be reached: this edge has no data path to workers yet"
            )
        resume = await self.resumes(sid)
        token = hashlib.sha256(request.headers.get("x-access-token", "").encode()).hexdigest()
        k = (prefix, sid, token, resume)
        app = self._apps.get(k)
        if app is None:
            seam = self.seam_for(request, sid) if resume else self.seam_for(request, sid, resume=False)
            if asyncio.iscoroutine(seam):
                seam = await seam
            app = factory(seam, sid)
            self._apps[k] = app
            while len(self._apps) > MAX_ENVD_APPS:
                self._apps.popitem(last=False)
        else:
            self._apps.move_to_end(k)
        if resume:
            await app(scope, receive, send)
        else:
            await _paused_as_502(app, scope, receive, send, sid)


async def _paused_as_502(app, scope, receive, send, sid: str) -> None:
    """`app` for a sandbox whose calls do not resume it, its answer held until its first body
    message: if by then the call met the sandbox paused (control.mark_paused), the answer is envd's
    502 for a paused sandbox (E2BError), not Connect's `unavailable` (a unary 503, or a 200 stream
    ending in an error); after that first message everything passes as it comes."""
    seen = control.watch_paused()
    held: list[dict] = []
    passing = False

    async def hold(message: dict) -> None:
        nonlocal passing
        if passing:
            await send(message)
        elif message["type"] == "http.response.start" or seen:
            held.append(message)
        else:
            passing = True
            for m in held:
                await send(m)
            held.clear()
            await send(message)

    await app(scope, receive, hold)
    if not passing:
        if seen:
            raise control.E2BError(502, control.paused_message(sid))
        for m in held:
            await send(m)


def _asgi(handle: typing.Callable[[Request], typing.Awaitable[Response]]) -> typing.Any:
    """An ASGI app of one request handler."""

    async def app(scope, receive, send) -> None:
        response = await handle(Request(scope, receive))
        await response(scope, receive, send)

    return app

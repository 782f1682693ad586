"""`GrantedWorker`: one sandbox's data verbs of the seam (core.worker_api.WorkerAPI) over the grant
path, inside an edge process.

The E2B edge (atoll.e2b: envd's Filesystem and Process services) is written against WorkerAPI;
this object lets it run in an edge that holds no worker token and no records. Each call gets a
grant from the server through the edge's `Grants` cache (`POST /v1/sandboxes/{id}/grant` with the
caller's Authorization: `Bearer <key>`, or `E2B-Access <envd access token>`) and is sent to the
worker's seam route with `Authorization: Grant <grant>` by the edge's `call` (calls.Base), which
asks for a new grant once when the worker refuses a stale one (or the sandbox moved). The plain verbs are the generated
ones (shared.seam_verbs, from core.seam's table: the control plane's RemoteWorker has the same);
the streams (exec, process output, file bodies, watches, tars) are written here over shared.http11
as edge.service does, and a terminal's frame stream comes through the worker's port tunnel
(`pty_stream`), as does a connection into the code interpreter's port (`port_stream`; both
terminals.TerminalRoutes, which edge.service.Edge is).
Only what a grant opens is served (core.grants.DATA_PATH: exec, processes, files, terminals and
the GRANT_PORTS of this one sandbox); any other verb, or another sandbox's id, is refused before
anything is sent. The server's refusals (401 wrong key or token, 404 another tenant's sandbox,
409 `atoll up` without a worker listener) arrive as the same domain errors (core.errors).

Made by `seam_for` / `seam_for_access_token`, or per request by `request_seams(edge)` (the E2B app's
`seam_for(request, sid)` callable).
"""

from __future__ import annotations

import base64
import contextlib
import json
import typing
from collections.abc import AsyncIterator

from atoll.core import errors, grants, wire
from atoll.core import worker_api as api
from atoll.edge import terminals, upstream
from atoll.shared import http11, ndjson, seam_verbs

_NDJSON = {"Accept": "application/x-ndjson"}


def _path_params(path: api.FilePath) -> dict[str, str]:
    if isinstance(path, bytes):
        return {"path_b64": base64.b64encode(path).decode("ascii")}
    return {"path": path}


def _json_line(line: bytes, what: str) -> dict:
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise errors.RuntimeFailure(f"a malformed line arrived in the {what}", detail=repr(line[:200]))
    if "error" in obj:
        raise wire.error_from_body(500, obj, f"the {what} broke")
    return obj


async def _ending(r: http11.Response, lines: AsyncIterator[dict]) -> AsyncIterator[api.ProcessEvent]:
    """A process stream's events; at its last (the exit, or the end a pause brings) the answer is
    marked finished, so that the connection to the worker is kept for the next call even when
    the reader stops there (http11.Response.finished)."""
    try:
        async for obj in lines:
            ev = wire.load_process_event(obj)
            if isinstance(ev, (api.ProcessExit, api.ProcessEnded)):
                r.finished()
            yield ev
    finally:
        await _close(lines)


async def _close(gen: typing.Any) -> None:
    """Close an asynchronous generator a call is done with, rather than leave it to the garbage
    collector (asyncio's finaliser hook: a loop wake-up and a task each, five per envd `Start`);
    one still being read elsewhere (`already running`) is left to end with its reader."""
    with contextlib.suppress(RuntimeError):
        await gen.aclose()


def _refused(p: upstream.Passed) -> errors.AtollError:
    """The server's refusal of a grant (its status and error body) as the domain error."""
    try:
        body = json.loads(p.body)
    except ValueError:
        body = None
    return wire.error_from_body(p.status, body, f"the API server refused the grant ({p.status})")


class SandboxPaused(errors.Conflict):
    """A call to a sandbox in standby that was asked not to resume it (the grant route's 409
    invalid_state to `{"resume": false}`). `paused` tells the E2B services to answer it as envd
    answers a paused sandbox (502 / Connect `unavailable`, "was not found: it is paused")."""

    paused = True


class GrantedWorker(seam_verbs.RemoteVerbs):
    """WorkerAPI's data verbs for sandbox `sandbox_id`, called with `auth` (the Authorization
    header the grant is asked for with) through `edge`. Shares the edge's grant cache and worker
    channels: making one costs nothing; `aclose` closes nothing (the edge owns them)."""

    def __init__(self, edge: terminals.TerminalRoutes, auth: str, sandbox_id: str, resume: bool = True):
        self.edge = edge
        self.auth = auth
        self.sandbox_id = sandbox_id
        self.resumes = resume
        """Whether a call resumes the sandbox from standby (False: E2B's sandboxes without
        auto-resume, whose calls are then refused 409 invalid_state; docs/e2b-compat.md §6.4)."""
        self.name = f"the worker of sandbox {sandbox_id} (through the edge)"
        self._sub = f"/sandboxes/{sandbox_id}/"

    # ---- plumbing -------------------------------------------------------------------------------
    def _refused(self, p: upstream.Passed) -> errors.AtollError:
        e = _refused(p)
        if not self.resumes and e.status == 409 and e.code == "invalid_state":
            return SandboxPaused(
                f"The sandbox {self.sandbox_id} was not found: it is paused; Sandbox.connect() resumes it",
                detail=e.message,
            )
        return e

    def _where(self, path: str) -> str:
        """The part of seam path `path` after /sandboxes/{id}/, or an error for a path a grant
        does not open (another sandbox, a lifecycle or worker verb)."""
        m = grants.DATA_PATH.match(path)
        if m is None:
            raise self._not_granted(repr(path[:100]))
        if m.group("sid") != self.sandbox_id:
            raise errors.InvalidRequest(
                f"this seam is for sandbox {self.sandbox_id}, not {m.group('sid')[:40]!r}; "
                "get one for that sandbox (seam_for)"
            )
        return path[len(self._sub) :]

    @contextlib.asynccontextmanager
    async def _open(
        self, method: str, path: str, *, timeout: float | None, **kw: typing.Any
    ) -> AsyncIterator[http11.Response]:
        sub = self._where(path)
        try:
            async with self.edge.call(
                self.auth, self.sandbox_id, method, sub, timeout=timeout, resume=self.resumes, **kw
            ) as r:
                yield r
        except upstream.Passed as p:
            raise self._refused(p) from None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None,
        effect: str | None = None,
        **kw: typing.Any,
    ) -> typing.Any:
        async with self._open(method, path, timeout=timeout, **kw) as r:
            try:
                body = await r.aread()
            except http11.ChannelError as e:
                raise self._broke(e, effect) from None
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            raise errors.RuntimeFailure(
                f"{self.name} answered {path} with something that is not JSON"
            ) from None

    def _broke(self, e: Exception, effect: str | None) -> errors.Unavailable:
        what = "it only read, so nothing changed" if effect is None else f"its outcome is unknown: {effect}"
        return errors.Unavailable(
            f"{self.name} stopped answering during the call ({type(e).__name__}); {what}", detail=repr(e)
        )

    async def _lines(self, r: http11.Response, what: str) -> AsyncIterator[dict]:
        lines = ndjson.alines(r.aiter_raw())
        try:
            async for line in lines:
                yield _json_line(line, what)
        except http11.ChannelError as e:
            raise self._broke(e, None) from None
        finally:
            await _close(lines)

    def _sb(self, sandbox_id: str, *rest: str) -> str:
        return "/".join([f"/sandboxes/{sandbox_id}", *rest])

    async def e2b_access_token(self) -> str:
        """The sandbox's envd access token from the grant answer (core.grants.e2b_access_token):
        what the E2B edge answers as `envdAccessToken`; "" when asked with an access token."""
        try:
            g = await self.edge.grants.get(self.auth, self.sandbox_id, self.resumes)
        except upstream.Passed as p:
            raise self._refused(p) from None
        return g.e2b_access_token

    # ---- exec -----------------------------------------------------------------------------------
    async def exec(self, sandbox_id: str, spec: api.ExecSpec) -> api.ExecResult:
        data = await self._call(
            "POST",
            self._sb(sandbox_id, "exec"),
            json=wire.dump(spec),
            timeout=None,
            effect="the command may have run, in whole or in part",
        )
        return wire.load(api.ExecResult, data, "exec result")

    @contextlib.asynccontextmanager
    async def exec_stream(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[AsyncIterator[api.ExecEvent]]:
        path = self._sb(sandbox_id, "exec")
        async with self._open("POST", path, json=wire.dump(spec), headers=_NDJSON, timeout=None) as r:

            async def events() -> AsyncIterator[api.ExecEvent]:
                async for obj in self._lines(r, "exec stream"):
                    yield wire.load_exec_event(obj)

            yield events()

    # ---- processes ------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def process_output(
        self, sandbox_id: str, pid: int, offset: int, follow: bool
    ) -> AsyncIterator[AsyncIterator[api.ProcessEvent]]:
        params = {"offset": str(int(offset)), "follow": "1" if follow else "0"}
        path = self._sb(sandbox_id, "processes", str(int(pid)), "output")
        async with self._open("GET", path, params=params, timeout=None) as r:
            events = _ending(r, self._lines(r, "process output stream"))
            try:
                yield events
            finally:
                await _close(events)

    @contextlib.asynccontextmanager
    async def run_process(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[tuple[api.ProcessStarted, AsyncIterator[api.ProcessEvent]]]:
        path = self._sb(sandbox_id, "processes", "run")
        async with self._open("POST", path, json=wire.dump(spec), headers=_NDJSON, timeout=None) as r:
            lines = self._lines(r, "process stream")
            first = await anext(lines, None)
            if first is None:
                raise errors.RuntimeFailure(f"{self.name} did not say which process it started")
            started = wire.load(api.ProcessStarted, first, "process started")
            events = _ending(r, lines)
            try:
                yield started, events
            finally:
                await _close(events)

    # ---- files ----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _download(
        self, where: str, params: dict, sized: bool = True
    ) -> AsyncIterator[api.FileDownload]:
        async with self._open("GET", where, params=params, timeout=seam_verbs.CALL_TIMEOUT_S) as r:
            length = r.headers.get("content-length") if sized else None

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in r.aiter_raw():
                        yield chunk
                except http11.ChannelError as e:
                    raise self._broke(e, None) from None

            yield api.FileDownload(int(length) if length and length.isdigit() else None, chunks())

    async def _upload(
        self,
        where: str,
        params: dict,
        chunks: AsyncIterator[bytes],
        size: int | None,
        content_type: str = "application/octet-stream",
    ) -> typing.Any:
        """A PUT of a streamed body: sent once (a refused grant is then a retryable 503)."""
        headers = {"Content-Type": content_type}
        if size is not None:
            headers["Content-Length"] = str(size)
        return await self._call(
            "PUT",
            where,
            params=params,
            content=chunks,
            headers=headers,
            timeout=None,
            replayable=False,
            effect="the file change may have been made, in whole or in part",
        )

    def read_file(self, sandbox_id: str, path: api.FilePath) -> typing.AsyncContextManager[api.FileDownload]:
        return self._download(self._sb(sandbox_id, "files"), _path_params(path))

    async def write_file(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> None:
        await self._upload(self._sb(sandbox_id, "files"), _path_params(path), chunks, size)

    @contextlib.asynccontextmanager
    async def watch_files(
        self, sandbox_id: str, path: api.FilePath, recursive: bool
    ) -> AsyncIterator[AsyncIterator[api.FileEvent]]:
        params = {**_path_params(path), "recursive": "1" if recursive else "0"}
        async with self._open(
            "GET", self._sb(sandbox_id, "files", "watch"), params=params, timeout=None
        ) as r:

            async def events() -> AsyncIterator[api.FileEvent]:
                async for obj in self._lines(r, "watch stream"):
                    yield wire.load(api.FileEvent, obj, "file event")

            yield events()

    async def write_tar(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        where = self._sb(sandbox_id, "files", "tar")
        data = await self._upload(where, _path_params(path), chunks, size, "application/x-tar")
        return wire.load(api.TarWritten, data, "tar answer")

    def read_tar(self, sandbox_id: str, path: api.FilePath) -> typing.AsyncContextManager[api.FileDownload]:
        return self._download(self._sb(sandbox_id, "files", "tar"), _path_params(path), sized=False)

    # ---- terminals ------------------------------------------------------------------------------
    async def attach_pty(self, sandbox_id: str, pty_id: str) -> api.PortStream:
        self._where(self._sb(sandbox_id, "pty", pty_id))
        try:
            return await self.edge.pty_stream(self.auth, self.sandbox_id, pty_id, self.resumes)
        except upstream.Passed as p:
            raise self._refused(p) from None

    # ---- what a grant does not open (the server's: call the API) --------------------------------
    def _not_granted(self, verb: str) -> errors.InvalidRequest:
        return errors.InvalidRequest(
            f"the edge reaches a sandbox only through a grant, which opens its exec, processes, files "
            f"and terminals, not {verb}; make that call through the API server"
        )

    async def open_port(self, sandbox_id: str, port: int) -> api.PortStream:
        """A connection into one of the ports a grant opens (core.grants.GRANT_PORTS: the code
        interpreter service's) through the worker's port tunnel; ConnectionRefusedError when
        nothing listens there."""
        if port not in grants.GRANT_PORTS:
            raise self._not_granted(
                f"its port {port} (a grant opens only port(s) {', '.join(map(str, grants.GRANT_PORTS))}, "
                "the code interpreter's; previews go through the ingress router)"
            )
        self._where(self._sb(sandbox_id, "ports", str(port)))
        try:
            return await self.edge.port_stream(self.auth, self.sandbox_id, port)
        except upstream.Passed as p:
            raise _refused(p) from None

    def build_log(self, build_id: str) -> typing.AsyncContextManager[AsyncIterator[bytes]]:
        raise self._not_granted("template builds")

    def read_store_file(
        self, kind: str, name: str, path: api.FilePath
    ) -> typing.AsyncContextManager[api.FileDownload]:
        raise self._not_granted("volumes and drives")

    async def write_store_file(
        self, kind: str, name: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.FileStat:
        raise self._not_granted("volumes and drives")

    def read_store_tar(self, kind: str, name: str) -> typing.AsyncContextManager[api.FileDownload]:
        raise self._not_granted("volumes and drives")

    async def write_store_tar(
        self, kind: str, name: str, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        raise self._not_granted("volumes and drives")

    def events(self) -> AsyncIterator[api.WorkerEvent]:
        raise self._not_granted("the worker's events")

    async def aclose(self) -> None:
        """Nothing of its own to close: the grant cache and the channels are the edge's."""


def _header(value: str, what: str) -> str:
    if not value.strip() or not (value.isascii() and value.isprintable()):
        raise errors.Unauthorized(f"missing or invalid {what}: it must be non-empty printable ASCII")
    return value


def seam_for(edge: terminals.TerminalRoutes, auth_header: str, sandbox_id: str) -> GrantedWorker:
    """Sandbox `sandbox_id`'s data verbs through `edge`, with the caller's Authorization header
    (`Bearer <API key>`, or `E2B-Access <token>`) as the grant route checks it."""
    return GrantedWorker(edge, _header(auth_header, "Authorization header"), sandbox_id)


def seam_for_access_token(
    edge: terminals.TerminalRoutes, token: str, sandbox_id: str, resume: bool = True
) -> GrantedWorker:
    """The same with the sandbox's envd access token (E2B's `X-Access-Token`) instead of a key: the
    server checks it (core.grants.check_e2b_access_token) and it opens this one sandbox only.
    `resume=False`: its calls do not resume the sandbox from standby (409 invalid_state)."""
    token = _header(token or "", "access token (X-Access-Token)")
    return GrantedWorker(edge, f"{grants.E2B_ACCESS_SCHEME} {token}", sandbox_id, resume)


class _HasHeaders(typing.Protocol):
    @property
    def headers(self) -> typing.Mapping[str, str]: ...


def request_seams(edge: terminals.TerminalRoutes) -> typing.Callable[..., GrantedWorker]:
    """The E2B app's `seam_for(request, sid)`: a GrantedWorker with what the request carries —
    E2B's `X-Access-Token` (envd calls), else `X-API-Key` (control calls), else an
    `Authorization: Bearer <key>` (atoll's own). envd's `Authorization: Basic` (the user name) is
    not a credential and is never sent on. Nothing at all is 401 before anything is sent.
    `resume=False` (a sandbox without E2B's auto-resume): its calls never resume it."""

    def seam_for_request(request: _HasHeaders, sandbox_id: str, resume: bool = True) -> GrantedWorker:
        h = request.headers
        token = h.get("x-access-token")
        if token:
            return seam_for_access_token(edge, token, sandbox_id, resume)
        key = h.get("x-api-key")
        if key:
            return GrantedWorker(edge, _header(f"Bearer {key.strip()}", "API key"), sandbox_id, resume)
        auth = h.get("authorization") or ""
        if auth[:7].lower() == "bearer ":
            return GrantedWorker(edge, _header(auth, "Authorization header"), sandbox_id, resume)
        raise errors.Unauthorized(
            f"sandbox {sandbox_id}: send its envd access token (X-Access-Token) or an API key (X-API-Key)"
        )

    return seam_for_request

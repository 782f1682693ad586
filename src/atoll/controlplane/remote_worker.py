"""`RemoteWorker`: the seam (core.worker_api.WorkerAPI) over HTTP, to one `atoll worker` process.

It rides on the small HTTP/1.1 client atoll.shared.http11 (kept-alive connections; ~1 ms less per call
than httpx, which on the exec path is the difference between the split and `atoll up`). Over https:// the
TLS handshake checks the worker's certificate against the installation CA and its host name, and
then that the certificate names this worker (core.pki.check_worker_certificate: another worker's
certificate and key are refused) before a byte of a request goes out. Every
request carries the token the server issued at registration and `Atoll-Protocol`; an answer
that lacks it or speaks another version is refused. Worker errors come back as the same domain
errors (core.wire.error_from_body); a worker that cannot be reached is `Unavailable` (503; the
record is left alone), whose message says what is known: a call that never reached the worker,
or one that only reads, changed nothing; a call that changes something (an exec, a file write, a
signal, a lifecycle step) cut off after it was sent has an unknown outcome (`_unreachable`). Exec output and
file bodies are streamed both ways, never held whole. Long calls have no read timeout (the worker
watches its sandboxes itself); connecting has one.
Made by controlplane.workers at registration; used by controlplane.lifecycle and the routers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import socket
import ssl
import typing
import urllib.parse
from collections.abc import AsyncIterator

from atoll.core import config, errors, pki, seam, wire
from atoll.core import worker_api as api
from atoll.shared import http11, ndjson, portstream
from atoll.shared import seam_verbs as remote_verbs

NDJSON = "application/x-ndjson"
CONNECT_TIMEOUT_S = 5.0  # (http11 connects within 5 s)
STEP_TIMEOUT_S = remote_verbs.STEP_TIMEOUT_S
CALL_TIMEOUT_S = remote_verbs.CALL_TIMEOUT_S
PREFIX = seam.PREFIX
_BY_PATH = object()
"""No effect given: guess it from the path (hand-written calls)."""


# What a hand-written call that changes something may have done when its worker was lost after it
# was sent (the plain verbs say so in core.seam's table).
_EFFECTS: tuple[tuple[re.Pattern[str], str | None], ...] = tuple(
    (re.compile(pattern), effect)
    for pattern, effect in (
        (r"/exec$", "the command may have run, in whole or in part"),
        (r"/files(/tar)?$", "the file change may have been made, in whole or in part"),
    )
)


def _effect(method: str, path: str) -> str | None:
    """What the call may have done, or None when it changes nothing (a read)."""
    if method in ("GET", "HEAD"):
        return None
    for pattern, effect in _EFFECTS:
        if pattern.search(path):
            return effect
    return "the change may have been made"


def _path_params(path: api.FilePath) -> dict[str, str]:
    if isinstance(path, bytes):
        return {"path_b64": base64.b64encode(path).decode("ascii")}
    return {"path": path}


_DEFAULT = object()
"""`_download(timeout=_DEFAULT)`: the stream's default timeout."""


class RemoteWorker(remote_verbs.RemoteVerbs):
    def __init__(
        self,
        url: str,
        token: str,
        name: str,
        on_unreachable: typing.Callable[[str], None] | None = None,
        tunnel_port: int = 0,
        tls: ssl.SSLContext | None = None,
        on_refused: typing.Callable[[str], None] | None = None,
    ):
        self.url = url.rstrip("/")
        self.name = name
        self.token = token
        self.tunnel_port = tunnel_port
        self._on_unreachable = on_unreachable
        self._on_refused = on_refused
        """Called when the worker refuses the token (401): it registered again since."""
        host, port = self.address(self.url)
        if self.url.startswith("https://"):
            if tls is None:
                raise errors.InvalidRequest(
                    f"worker URL {url!r} is https:// but this server has no CA to check it"
                )
            self._channel = http11.Channel(
                host, port, tls=tls, check_peer=lambda der: pki.check_worker_certificate(der, name)
            )
        else:
            self._channel = http11.Channel(host, port)
        self._headers = {"Authorization": f"Bearer {token}", wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION)}

    @staticmethod
    def address(url: str) -> tuple[str, int]:
        """(host, port) of a worker URL: https://HOST:PORT, or http://HOST:PORT on a loopback
        address only (the link carries the worker's token and every sandbox's traffic)."""
        parsed = urllib.parse.urlsplit(url)
        try:
            port = parsed.port
        except ValueError:
            port = None
        if parsed.scheme not in ("http", "https") or not parsed.hostname or not port:
            raise errors.InvalidRequest(
                f"worker URL {url!r} must be https://HOST:PORT (or http:// on loopback)"
            )
        if parsed.scheme == "http" and not config.is_loopback_url(url):
            raise errors.InvalidRequest(
                f"worker URL {url!r} is plain http:// to an address that is not loopback; a worker on "
                "another machine serves https (start it with --server https://… and --ca-file)"
            )
        return parsed.hostname, port

    # ---- plumbing -------------------------------------------------------------------------------
    def _unreachable(
        self, e: Exception, method: str, path: str, effect: str | None | object = _BY_PATH
    ) -> errors.Unavailable:
        """503 for a call (`method` `path`) that got no answer, saying what is known of its outcome:
        `effect` (what it may have done; None: it only reads), from the table (core.seam) for plain
        verbs, else guessed from the path."""
        if isinstance(e, http11.ConnectFailed):
            if self._on_unreachable is not None:
                self._on_unreachable(f"cannot be reached at {self.url} (connecting failed: {e})"[:500])
            return errors.Unavailable(
                f"worker {self.name!r} cannot be reached at {self.url} ({type(e).__name__}); the call "
                "did not reach it, so nothing about the sandbox changed — retry once it is back "
                "(GET /v1/workers)",
                detail=repr(e),
            )
        if effect is _BY_PATH:
            effect = _effect(method, path)
        if effect is None:
            return errors.Unavailable(
                f"worker {self.name!r} stopped answering at {self.url} ({type(e).__name__}) during a "
                "call that only reads; nothing about the sandbox changed — retry once it is back "
                "(GET /v1/workers)",
                detail=repr(e),
            )
        # Sent, then no answer: the worker may have done it. Repeating a PUT or DELETE is harmless
        # (it sets the same end state); repeating a POST may do it twice.
        return errors.Unavailable(
            f"worker {self.name!r} stopped answering at {self.url} ({type(e).__name__}) after the call "
            f"was sent: its outcome is unknown — {effect}. Once the worker is back (GET "
            "/v1/workers), check the sandbox before repeating the call",
            detail=repr(e),
            retryable=method in ("PUT", "DELETE"),
        )

    def _check(self, r: http11.Response) -> None:
        if r.status_code == 401:
            # the worker answers a token it no longer accepts before anything else (not even its
            # protocol): it registered again since, with this server or another sharing the records
            why = f"worker {self.name!r} no longer accepts this server's token (it registered again since)"
            if self._on_refused is not None:
                self._on_refused(why)
            raise errors.Unavailable(
                f"{why}; the call was not carried out, so nothing about the sandbox changed — retry in "
                "a few seconds (GET /v1/workers)"
            )
        wire.check_protocol(r.headers.get(wire.PROTOCOL_HEADER.lower()), f"worker {self.name!r}")

    def _raise(self, r: http11.Response) -> typing.NoReturn:
        try:
            body = r.json()
        except ValueError:
            body = None
        raise wire.error_from_body(r.status_code, body, f"worker {self.name!r} answered {r.status_code}")

    def _hdrs(self, extra: dict[str, str] | None) -> dict[str, str]:
        return {**self._headers, **extra} if extra else self._headers

    async def _call(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None = CALL_TIMEOUT_S,
        headers: dict[str, str] | None = None,
        effect: typing.Any = _BY_PATH,
        **kw: typing.Any,
    ) -> typing.Any:
        try:
            r = await self._channel.request(
                method, PREFIX + path, timeout=timeout, headers=self._hdrs(headers), **kw
            )
        except http11.ChannelError as e:
            raise self._unreachable(e, method, path, effect) from None
        self._check(r)
        if r.status_code >= 400:
            self._raise(r)
        if r.status_code == 204 or not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            raise errors.RuntimeFailure(
                f"worker {self.name!r} answered {path} with something that is not JSON"
            ) from None

    @contextlib.asynccontextmanager
    async def _stream(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = CONNECT_TIMEOUT_S + CALL_TIMEOUT_S,
        **kw: typing.Any,
    ) -> AsyncIterator[http11.Response]:
        try:
            async with self._channel.stream(
                method,
                PREFIX + path,
                timeout=timeout,
                headers=self._hdrs(headers),
                **kw,
            ) as r:
                self._check(r)
                if r.status_code >= 400:
                    await r.aread()
                    self._raise(r)
                yield r
        except http11.ChannelError as e:
            raise self._unreachable(e, method, path) from None

    def _sb(self, sid: str, *rest: str) -> str:
        return "/".join([f"/sandboxes/{sid}", *rest])

    # ---- lifecycle ------------------------------------------------------------------------------
    async def open_port(self, sandbox_id: str, port: int) -> api.PortStream:
        """Through the worker's tunnel listener (worker.tunnel): one line to ask, then bytes."""
        return await self._tunnel("ATOLL-TUNNEL", sandbox_id, str(port))

    async def _tunnel(self, hello: str, sandbox_id: str, target: str) -> api.PortStream:
        """One tunnel connection: the hello, the worker's one-line answer (read without taking a
        byte past it: what follows is the sandbox's), then a SocketPort the ingress router's
        process can take over whole."""
        if not self.tunnel_port:
            raise errors.Unavailable(f"worker {self.name} has no port tunnel (it runs an older atoll)")
        host = self.address(self.url)[0]
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, self.tunnel_port)), 5)
        except (OSError, TimeoutError) as e:
            sock.close()
            raise errors.Unavailable(f"worker {self.name}'s port tunnel cannot be reached: {e!r}") from None
        try:
            # the tunnel is plain TCP: it carries a token derived for it alone, never the API's
            tunnel_token = wire.tunnel_token(self.token)
            hello_line = f"{hello} {api.PROTOCOL_VERSION} {tunnel_token} {sandbox_id} {target}\n".encode()
            await asyncio.wait_for(loop.sock_sendall(sock, hello_line), TUNNEL_ANSWER_S)
            raw = await asyncio.wait_for(portstream.read_line(sock), TUNNEL_ANSWER_S)
        except (OSError, TimeoutError, ValueError) as e:
            sock.close()
            raise errors.Unavailable(f"worker {self.name}'s port tunnel did not answer: {e!r}") from None
        line = (raw or b"").decode("utf-8", "replace").strip()
        if line == "OK":
            return portstream.SocketPort(sock)
        sock.close()
        _, code, message = (line.split(" ", 2) + ["", ""])[:3]
        if code == "refused":
            raise ConnectionRefusedError(message)
        if code == "unauthorized":  # as the API's 401: it registered again since (`_check`)
            why = f"worker {self.name!r} no longer accepts this server's token (it registered again since)"
            if self._on_refused is not None:
                self._on_refused(why)
            raise errors.Unavailable(f"{why}; nothing was opened in the sandbox — retry in a few seconds")
        raise errors.from_code(code or "runtime_error", message or f"the tunnel answered {line!r}")

    # ---- templates, pools, fork -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def build_log(self, build_id: str) -> AsyncIterator[AsyncIterator[bytes]]:
        path = f"/builds/{build_id}/log"
        async with self._stream("GET", path, timeout=None) as r:

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in r.aiter_raw():
                        yield chunk
                except http11.ChannelError as e:
                    raise self._unreachable(e, "GET", path) from None

            yield chunks()

    # ---- exec and processes ---------------------------------------------------------------------
    async def exec(self, sandbox_id: str, spec: api.ExecSpec) -> api.ExecResult:
        data = await self._call("POST", self._sb(sandbox_id, "exec"), json=wire.dump(spec), timeout=None)
        return wire.load(api.ExecResult, data, "exec result")

    @contextlib.asynccontextmanager
    async def exec_stream(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[AsyncIterator[api.ExecEvent]]:
        path = self._sb(sandbox_id, "exec")
        async with self._stream("POST", path, json=wire.dump(spec), headers={"Accept": NDJSON}) as r:
            yield self._exec_events(r, path)

    async def _exec_events(self, r: http11.Response, path: str) -> AsyncIterator[api.ExecEvent]:
        async for line in _lines(r, self, "POST", path):
            obj = _json_line(line)
            if "error" in obj:
                raise wire.error_from_body(500, obj, f"the exec stream from worker {self.name!r} broke")
            yield wire.load_exec_event(obj)

    # ---- terminals --------------------------------------------------------------------------------
    async def attach_pty(self, sandbox_id: str, pty_id: str) -> api.PortStream:
        """Through the worker's tunnel (worker.tunnel, `ATOLL-PTY` hello): the frame stream."""
        return await self._tunnel("ATOLL-PTY", sandbox_id, pty_id)

    # process handles (issue 9)
    @contextlib.asynccontextmanager
    async def process_output(
        self, sandbox_id: str, pid: int, offset: int, follow: bool
    ) -> AsyncIterator[AsyncIterator[api.ProcessEvent]]:
        params = {"offset": str(int(offset)), "follow": "1" if follow else "0"}
        path = self._sb(sandbox_id, "processes", str(int(pid)), "output")
        async with self._stream("GET", path, params=params, timeout=None) as r:
            yield self._process_events(r, path)

    async def _process_events(
        self, r: http11.Response, path: str, lines: AsyncIterator[bytes] | None = None
    ) -> AsyncIterator[api.ProcessEvent]:
        async for line in lines if lines is not None else _lines(r, self, "GET", path):
            obj = _json_line(line)
            if "error" in obj:
                raise wire.error_from_body(500, obj, f"the output stream from worker {self.name!r} broke")
            yield wire.load_process_event(obj)

    @contextlib.asynccontextmanager
    async def run_process(
        self, sandbox_id: str, spec: api.ExecSpec
    ) -> AsyncIterator[tuple[api.ProcessStarted, AsyncIterator[api.ProcessEvent]]]:
        path = self._sb(sandbox_id, "processes", "run")
        async with self._stream("POST", path, json=wire.dump(spec), headers={"Accept": NDJSON}) as r:
            lines = _lines(r, self, "POST", path)
            first = await anext(lines, None)
            obj = _json_line(first) if first is not None else {}
            if "error" in obj or first is None:
                raise wire.error_from_body(
                    500, obj, f"worker {self.name!r} did not say which process it started"
                )
            yield wire.load(api.ProcessStarted, obj, "process started"), self._process_events(r, path, lines)

    # ---- files ----------------------------------------------------------------------------------
    def read_file(self, sandbox_id: str, path: api.FilePath) -> typing.AsyncContextManager[api.FileDownload]:
        return self._download(self._sb(sandbox_id, "files"), _path_params(path), timeout=_DEFAULT)

    async def write_file(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> None:
        await self._upload(self._sb(sandbox_id, "files"), _path_params(path), chunks, size)

    # ---- files, issue 9 ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def watch_files(
        self, sandbox_id: str, path: api.FilePath, recursive: bool
    ) -> AsyncIterator[AsyncIterator[api.FileEvent]]:
        params = {**_path_params(path), "recursive": "1" if recursive else "0"}
        path_ = self._sb(sandbox_id, "files", "watch")
        async with self._stream("GET", path_, params=params, timeout=None) as r:
            yield self._file_events(r, path_)

    async def _file_events(self, r: http11.Response, path: str) -> AsyncIterator[api.FileEvent]:
        async for line in _lines(r, self, "GET", path):
            obj = _json_line(line)
            if "error" in obj:
                raise wire.error_from_body(500, obj, f"the watch stream from worker {self.name!r} broke")
            yield wire.load(api.FileEvent, obj, "file event")

    async def write_tar(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        where = self._sb(sandbox_id, "files", "tar")
        data = await self._upload(where, _path_params(path), chunks, size, "application/x-tar")
        return wire.load(api.TarWritten, data, "tar answer")

    def read_tar(self, sandbox_id: str, path: api.FilePath) -> typing.AsyncContextManager[api.FileDownload]:
        return self._download(self._sb(sandbox_id, "files", "tar"), _path_params(path), sized=False)

    # ---- byte streams: sandbox files and tars, volumes' and drives' ------------------------------
    @contextlib.asynccontextmanager
    async def _download(
        self, where: str, params: dict, *, timeout: typing.Any = None, sized: bool = True
    ) -> AsyncIterator[api.FileDownload]:
        """A GET whose answer is bytes, relayed chunk by chunk (`timeout` _DEFAULT: the stream's
        own; `sized`: the size from Content-Length, else None)."""
        kw = {} if timeout is _DEFAULT else {"timeout": timeout}
        async with self._stream("GET", where, params=params, **kw) as r:
            length = r.headers.get("content-length") if sized else None

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in r.aiter_raw():
                        yield chunk
                except http11.ChannelError as e:
                    raise self._unreachable(e, "GET", where) from None

            yield api.FileDownload(int(length) if length and length.isdigit() else None, chunks())

    async def _upload(
        self,
        where: str,
        params: dict,
        chunks: AsyncIterator[bytes],
        size: int | None,
        content_type: str = "application/octet-stream",
    ) -> typing.Any:
        """A PUT of a streamed body (no timeout: as long as the bytes take)."""
        headers = {"Content-Type": content_type}
        if size is not None:
            headers["Content-Length"] = str(size)
        return await self._call("PUT", where, params=params, content=chunks, headers=headers, timeout=None)

    def read_store_file(
        self, kind: str, name: str, path: api.FilePath
    ) -> typing.AsyncContextManager[api.FileDownload]:
        return self._download(f"/stores/{kind}/{name}/files", _path_params(path))

    async def write_store_file(
        self, kind: str, name: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.FileStat:
        data = await self._upload(f"/stores/{kind}/{name}/files", _path_params(path), chunks, size)
        return wire.load(api.FileStat, data, "file stat")

    def read_store_tar(self, kind: str, name: str) -> typing.AsyncContextManager[api.FileDownload]:
        return self._download(f"/stores/{kind}/{name}/tar", {})

    async def write_store_tar(
        self, kind: str, name: str, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        data = await self._upload(f"/stores/{kind}/{name}/tar", {}, chunks, size)
        return wire.load(api.TarWritten, data, "tar answer")

    # ---- events ---------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[api.WorkerEvent]:
        async with self._stream("GET", "/events") as r:
            async for line in _lines(r, self, "GET", "/events"):
                obj = _json_line(line)
                if obj.get("kind") == "ping":
                    continue
                yield wire.load_event(obj)

    def abort_calls(self) -> None:
        """End every call in flight (they raise Unavailable): the worker is taken for lost, and a
        call must not wait on a worker that may be stopped (SIGSTOP) or gone."""
        self._channel.abort_now()

    async def aclose(self) -> None:
        await self._channel.aclose()


async def _lines(r: http11.Response, worker: RemoteWorker, method: str, path: str) -> AsyncIterator[bytes]:
    """ndjson lines of the answer to `method` `path` (cut by `shared.ndjson`)."""
    try:
        async for line in ndjson.alines(r.aiter_raw()):
            yield line
    except http11.ChannelError as e:
        raise worker._unreachable(e, method, path) from None


def _json_line(line: bytes) -> dict:
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise errors.RuntimeFailure("a malformed line arrived from a worker", detail=repr(line[:200]))
    return obj


TUNNEL_ANSWER_S = 5.0
"""A worker answers a tunnel request at once (it connects into the sandbox first): one that does
not within this is stalled (a stopped process whose kernel still accepts connections)."""

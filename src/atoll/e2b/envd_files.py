"""envd's `filesystem.Filesystem` service (the `e2b` SDKs' `sandbox.files`) over atoll's seam:
each RPC is one or a few `WorkerAPI` file verbs on one sandbox (stat_file, list_files, make_dir,
move_file, delete_file, watch_files), answered as envd answers (docs/e2b-compat.md §4.3):

- a relative path is resolved against the sandbox user's home, as envd does;
- `Remove` of a missing path succeeds (envd's RemoveAll); `MakeDir` of an existing directory is
  `already_exists`; a missing path elsewhere is `not_found`;
- `ListDir` walks `depth` levels (bounded by MAX_DEPTH and MAX_ENTRIES);
- `WatchDir` streams `start`, then events named relative to the watched directory, with a
  keepalive after each `Keepalive-Ping-Interval` seconds of silence; a rename is a `RENAME` of the
  old name and a `CREATE` of the new one (envd sends both);
- `CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher` keep a watch open in this process with a
  bounded buffer (an edge behind a load balancer must pin a sandbox's calls to one edge for these).

Built by the E2B edge with the worker and sandbox a call was routed to; the edge mounts it through
the generated `FilesystemASGIApplication`. atoll errors become Connect errors (`connect_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import stat as statmod
import typing

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.e2b import control
from atoll.e2b.proto.filesystem import filesystem_connect
from atoll.e2b.proto.filesystem import filesystem_pb as fs

MAX_DEPTH = 16
MAX_ENTRIES = 10_000
"""A ListDir stops with `resource_exhausted` past this many entries."""
WATCHER_BUFFER = 10_000
"""Events a polled watcher keeps; past it the next GetWatcherEvents is an error."""
MAX_WATCHERS = 64
"""Polled watchers one service (one sandbox) may hold at once."""
DEFAULT_KEEPALIVE_S = 50.0
PAUSED_STREAM = (
    "the sandbox was paused; Sandbox.connect() resumes it, and commands.connect(pid) reattaches to a process"
)
"""Why a stream ended with Connect `canceled` at a pause (the SDKs raise TimeoutException)."""

_STATUS_CODES = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.FAILED_PRECONDITION,
    413: Code.RESOURCE_EXHAUSTED,
    429: Code.RESOURCE_EXHAUSTED,
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
    507: Code.RESOURCE_EXHAUSTED,
}


def connect_error(e: errors.AtollError) -> ConnectError:
    """The Connect error an SDK reads for an atoll error (its code and message kept). A sandbox
    paused and not resumed (edge.seam.SandboxPaused, marked `paused`) is `unavailable` with
    envd's "was not found" text, which both SDKs read as "not running"."""
    if getattr(e, "paused", False):
        control.mark_paused()  # before anything was sent: envd_routes answers 502 instead
        return ConnectError(Code.UNAVAILABLE, e.message)
    return ConnectError(_STATUS_CODES.get(e.status, Code.INTERNAL), f"{e.code}: {e.message}")


_TYPES = {"file": fs.FileType.FILE, "dir": fs.FileType.DIRECTORY, "symlink": fs.FileType.SYMLINK}
_EVENTS = {
    "create": fs.EventType.CREATE,
    "modify": fs.EventType.WRITE,
    "delete": fs.EventType.REMOVE,
    "chmod": fs.EventType.CHMOD,
}


def _go_mode(kind: str, mode: int) -> int:
    """Go's os.FileMode bits, as envd reports them (directory and symlink flags on top)."""
    perm = mode & 0o7777
    if kind == "dir":
        return perm | (1 << 31)
    if kind == "symlink":
        return perm | (1 << 27)
    return perm


def _permissions(kind: str, mode: int) -> str:
    """`ls -l`'s mode string, as Go's FileMode.String() prints it for these kinds."""
    return {"dir": "d", "symlink": "L"}.get(kind, "-") + statmod.filemode(mode)[1:]


def entry(st: api.FileStat | api.FileEntry) -> fs.EntryInfo:
    """envd's EntryInfo for an atoll stat or listing entry (owner and group names are not known
    to atoll's stat: left empty)."""
    ts = Timestamp()
    ts.seconds = int(st.mtime)
    ts.nanos = int((st.mtime - int(st.mtime)) * 1e9)
    info = fs.EntryInfo(
        name=st.name,
        type=_TYPES.get(st.type, fs.FileType.UNSPECIFIED),
        path=st.path,
        size=st.size,
        mode=_go_mode(st.type, st.mode),
        permissions=_permissions(st.type, st.mode),
        modified_time=ts,
    )
    target = getattr(st, "target", None)
    if target is not None:
        info.symlink_target = target
    return info


class _Watcher:
    def __init__(self, stack: contextlib.AsyncExitStack):
        self.stack = stack
        self.task: asyncio.Future | None = None
        self.events: list[fs.FilesystemEvent] = []
        self.failed: str | None = None
        self.code = Code.RESOURCE_EXHAUSTED
        """What GetWatcherEvents answers once it `failed`."""


class FilesystemService(filesystem_connect.Filesystem):
    def __init__(self, worker: api.WorkerAPI, sandbox_id: str, *, home: str = "/root"):
        self.worker, self.sid, self.home = worker, sandbox_id, home
        self._watchers: dict[str, _Watcher] = {}

    def _path(self, raw: str) -> str:
        if not raw:
            raise ConnectError(Code.INVALID_ARGUMENT, "path is empty; give a file or directory path")
        return posixpath.normpath(raw if raw.startswith("/") else posixpath.join(self.home, raw))

    async def _call(self, aw: typing.Awaitable) -> typing.Any:
        try:
            return await aw
        except errors.AtollError as e:
            raise connect_error(e) from None

    async def stat(self, request: fs.StatRequest, ctx) -> fs.StatResponse:
        return fs.StatResponse(
            entry=entry(await self._call(self.worker.stat_file(self.sid, self._path(request.path))))
        )

    async def make_dir(self, request: fs.MakeDirRequest, ctx) -> fs.MakeDirResponse:
        path = self._path(request.path)
        if not await self._call(self.worker.make_dir(self.sid, path)):
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {path!r} already exists")
        return fs.MakeDirResponse(entry=entry(await self._call(self.worker.stat_file(self.sid, path))))

    async def move(self, request: fs.MoveRequest, ctx) -> fs.MoveResponse:
        src, dst = self._path(request.source), self._path(request.destination)
        return fs.MoveResponse(entry=entry(await self._call(self.worker.move_file(self.sid, src, dst))))

    async def remove(self, request: fs.RemoveRequest, ctx) -> fs.RemoveResponse:
        try:
            await self.worker.delete_file(self.sid, self._path(request.path))
        except errors.FileNotFound:
            pass  # envd's RemoveAll: gone already is done
        except errors.AtollError as e:
            raise connect_error(e) from None
        return fs.RemoveResponse()

    async def list_dir(self, request: fs.ListDirRequest, ctx) -> fs.ListDirResponse:
        depth = request.depth or 1
        if depth > MAX_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth {depth} is more than {MAX_DEPTH}")
        root = self._path(request.path)
        top = await self._call(self.worker.stat_file(self.sid, root))
        if top.type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"path {root!r} is not a directory")
        out: list[fs.EntryInfo] = []
        level = [root]
        for _ in range(depth):
            below = []
            for d in level:
                for e in await self._call(self.worker.list_files(self.sid, d)):
                    if e.type not in _TYPES:
                        continue  # envd drops entries of an unknown type
                    out.append(entry(e))
                    if len(out) > MAX_ENTRIES:
                        raise ConnectError(
                            Code.RESOURCE_EXHAUSTED,
                            f"{root!r} holds more than {MAX_ENTRIES} entries to depth {depth}; list less deep",
                        )
                    if e.type == "dir":
                        below.append(e.path)
            level = below
        return fs.ListDirResponse(entries=out)

    # ---- watches -----------------------------------------------------------------------------
    @staticmethod
    def _events(root: str, ev: api.FileEvent) -> list[fs.FilesystemEvent]:
        def rel(p: str) -> str:
            return posixpath.relpath(p, root)

        if ev.type == "rename":
            out = []
            if ev.from_path is not None:
                out.append(fs.FilesystemEvent(name=rel(ev.from_path), type=fs.EventType.RENAME))
            out.append(fs.FilesystemEvent(name=rel(ev.path), type=fs.EventType.CREATE))
            return out
        kind = _EVENTS.get(ev.type)
        return [] if kind is None else [fs.FilesystemEvent(name=rel(ev.path), type=kind)]

    async def watch_dir(self, request: fs.WatchDirRequest, ctx) -> typing.AsyncIterator[fs.WatchDirResponse]:
        root = self._path(request.path)
        keepalive = _keepalive_s(ctx)
        try:
            async with self.worker.watch_files(self.sid, root, request.recursive) as events:
                it = aiter(events)
                while True:
                    # the next event, waited for across keepalives: cancelling a pending read on
                    # timeout would close the stream's generator (and end the watch)
                    nxt = asyncio.ensure_future(anext(it))
                    try:
                        while not (await asyncio.wait({nxt}, timeout=keepalive))[0]:
                            yield fs.WatchDirResponse(
                                event=Oneof("keepalive", fs.WatchDirResponse.KeepAlive())
                            )
                        ev = nxt.result()
                    except StopAsyncIteration:
                        return
                    finally:
                        if not nxt.done():
                            nxt.cancel()
                            # let the read end before the stream's generator is closed (closing it while
                            # the read runs is `aclose(): asynchronous generator is already running`)
                            await asyncio.wait({nxt})
                    if ev.type == "ready":
                        yield fs.WatchDirResponse(event=Oneof("start", fs.WatchDirResponse.StartEvent()))
                    elif ev.type == "ended":
                        raise ConnectError(Code.CANCELED, PAUSED_STREAM)
                    elif ev.type == "overflow":
                        raise ConnectError(
                            Code.RESOURCE_EXHAUSTED, f"too many changes under {root!r}: events were lost"
                        )
                    for out in self._events(root, ev):
                        yield fs.WatchDirResponse(event=Oneof("filesystem", out))
        except errors.AtollError as e:
            raise connect_error(e) from None

    async def create_watcher(self, request: fs.CreateWatcherRequest, ctx) -> fs.CreateWatcherResponse:
        if len(self._watchers) >= MAX_WATCHERS:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED, f"{MAX_WATCHERS} watchers are open on this sandbox; remove one first"
            )
        root = self._path(request.path)
        stack = contextlib.AsyncExitStack()
        try:
            events = await stack.enter_async_context(
                self.worker.watch_files(self.sid, root, request.recursive)
            )
            it = aiter(events)
            first = await anext(it)  # `ready`: the watch is in place when this call answers
        except errors.AtollError as e:
            await stack.aclose()
            raise connect_error(e) from None
        assert first.type == "ready", first
        wid = secrets.token_hex(8)

        async def pump(w: _Watcher) -> None:
            try:
                async for ev in it:
                    if ev.type == "ended":
                        w.failed = (
                            f"the sandbox was paused, which ended watcher on {root!r}; create a new one"
                        )
                        w.code = Code.NOT_FOUND
                        return
                    if ev.type == "overflow" or len(w.events) >= WATCHER_BUFFER:
                        w.failed = f"more than {WATCHER_BUFFER} events under {root!r} waited to be read: events were lost"
                        return
                    w.events.extend(self._events(root, ev))
            except errors.AtollError as e:
                w.failed = f"{e.code}: {e.message}"

        w = _Watcher(stack)
        w.task = asyncio.ensure_future(pump(w))
        self._watchers[wid] = w
        return fs.CreateWatcherResponse(watcher_id=wid)

    def _watcher(self, wid: str) -> _Watcher:
        w = self._watchers.get(wid)
        if w is None:
            raise ConnectError(
                Code.NOT_FOUND, f"watcher {wid!r} does not exist (removed, or made on another edge)"
            )
        return w

    async def get_watcher_events(
        self, request: fs.GetWatcherEventsRequest, ctx
    ) -> fs.GetWatcherEventsResponse:
        w = self._watcher(request.watcher_id)
        if w.failed:
            await self._drop(request.watcher_id)
            raise ConnectError(w.code, w.failed)
        got, w.events = w.events, []
        return fs.GetWatcherEventsResponse(events=got)

    async def remove_watcher(self, request: fs.RemoveWatcherRequest, ctx) -> fs.RemoveWatcherResponse:
        self._watcher(request.watcher_id)
        await self._drop(request.watcher_id)
        return fs.RemoveWatcherResponse()

    async def _drop(self, wid: str) -> None:
        w = self._watchers.pop(wid, None)
        if w is None:
            return
        if w.task is not None:
            w.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await w.task
        await w.stack.aclose()

    async def close(self) -> None:
        """End every polled watcher (the sandbox went away, or the edge stops)."""
        for wid in list(self._watchers):
            await self._drop(wid)


def _keepalive_s(ctx: typing.Any) -> float:
    raw = None
    with contextlib.suppress(Exception):
        raw = ctx.request_headers.get("keepalive-ping-interval")  # a property of connectrpc's context
    try:
        v = float(raw) if raw else DEFAULT_KEEPALIVE_S
    except ValueError:
        v = DEFAULT_KEEPALIVE_S
    return min(max(v, 1.0), 300.0)

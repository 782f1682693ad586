"""The fuller files API of `FakeWorker` (issue 9: stat, mkdir, move, chmod, watch, tar), in memory.

A mixin of testing.fake_worker.FakeWorker over its `FakeRuntime.files` ({path bytes: content});
directories are the parents of files plus those made with `make_dir`. A watch sees the changes the
fake itself makes (write_file, delete_file, make_dir, move_file, chmod_file, write_tar). Tars are
checked by the guest agent's own validation (guest.agent.tarball.plan, against the tar alone), so a
tar the agent refuses is refused here too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import tarfile
import typing
from collections.abc import AsyncIterator

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.guest.agent import tarball


def _key(path: api.FilePath) -> bytes:
    return path if isinstance(path, bytes) else path.encode("utf-8", "surrogateescape")


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


class FakeFileOps:
    """Mixed into FakeWorker, which provides `_running(sid)` and `_step(verb, sid)`."""

    _running: typing.Callable[..., typing.Any]
    _step: typing.Callable[..., typing.Awaitable[None]]

    def _dirs(self, sid: str) -> set[bytes]:
        dirs = self.__dict__.setdefault("_fake_dirs", {})
        return dirs.setdefault(sid, {b"/"})

    def _modes(self, sid: str) -> dict[bytes, int]:
        return self.__dict__.setdefault("_fake_modes", {}).setdefault(sid, {})

    def _is_dir(self, sid: str, key: bytes) -> bool:
        key = key.rstrip(b"/") or b"/"
        if key in self._dirs(sid):
            return True
        prefix = key.rstrip(b"/") + b"/"
        return any(p.startswith(prefix) for p in self._running(sid).files)

    def _files_changed(self, sid: str, path: api.FilePath, kind: str, is_dir: bool = False, old=None) -> None:
        key = _key(path)
        for root, recursive, q in self.__dict__.get("_fake_watches", {}).get(sid, ()):
            prefix = root.rstrip(b"/") + b"/"
            if not key.startswith(prefix):
                continue
            if not recursive and b"/" in key[len(prefix) :]:
                continue
            q.put_nowait(
                api.FileEvent(kind, _text(key), is_dir, _text(_key(old)) if old is not None else None)
            )

    def _stat(self, sid: str, key: bytes) -> api.FileStat:
        rt = self._running(sid)
        key = key.rstrip(b"/") or b"/"
        name = key.rsplit(b"/", 1)[-1] or b"/"
        if key in rt.files:
            kind, size, mode = "file", len(rt.files[key]), self._modes(sid).get(key, 0o644)
        elif self._is_dir(sid, key):
            kind, size, mode = "dir", 4096, self._modes(sid).get(key, 0o755)
        else:
            raise errors.FileNotFound(f"path {_text(key)!r} does not exist")
        b64 = base64.b64encode
        return api.FileStat(
            _text(name), _text(key), b64(name).decode(), b64(key).decode(), kind, size, mode, 0.0
        )

    async def stat_file(self, sandbox_id: str, path: api.FilePath) -> api.FileStat:
        return self._stat(sandbox_id, _key(path))

    async def make_dir(self, sandbox_id: str, path: api.FilePath) -> bool:
        key = _key(path).rstrip(b"/") or b"/"
        rt = self._running(sandbox_id)
        parts = key.split(b"/")
        for i in range(2, len(parts) + 1):
            if b"/".join(parts[:i]) in rt.files:
                raise errors.InvalidPath(f"cannot create directory {_text(key)!r}: a file is in the way")
        if self._is_dir(sandbox_id, key):
            return False
        self._dirs(sandbox_id).add(key)
        self._files_changed(sandbox_id, key, "create", True)
        return True

    async def move_file(self, sandbox_id: str, src: api.FilePath, dst: api.FilePath) -> api.FileStat:
        rt = self._running(sandbox_id)
        s, d = _key(src).rstrip(b"/"), _key(dst).rstrip(b"/")
        if s in rt.files:
            if self._is_dir(sandbox_id, d):
                raise errors.InvalidPath(f"cannot move {_text(s)!r} to {_text(d)!r}: a directory is there")
            rt.files[d] = rt.files.pop(s)
        elif self._is_dir(sandbox_id, s):
            if d == s or d.startswith(s + b"/"):
                raise errors.InvalidPath(f"cannot move the directory {_text(s)!r} into itself")
            for p in [p for p in rt.files if p.startswith(s + b"/")]:
                rt.files[d + p[len(s) :]] = rt.files.pop(p)
            dirs = self._dirs(sandbox_id)
            for p in [p for p in dirs if p == s or p.startswith(s + b"/")]:
                dirs.discard(p)
                dirs.add(d + p[len(s) :])
        else:
            raise errors.FileNotFound(f"cannot move {_text(s)!r}: it does not exist")
        self._files_changed(sandbox_id, d, "rename", self._is_dir(sandbox_id, d), old=s)
        return self._stat(sandbox_id, d)

    async def chmod_file(self, sandbox_id: str, path: api.FilePath, mode: int) -> api.FileStat:
        key = _key(path).rstrip(b"/") or b"/"
        before = self._stat(sandbox_id, key)
        self._modes(sandbox_id)[key] = mode
        self._files_changed(sandbox_id, key, "chmod", before.type == "dir")
        return self._stat(sandbox_id, key)

    @contextlib.asynccontextmanager
    async def watch_files(
        self, sandbox_id: str, path: api.FilePath, recursive: bool
    ) -> AsyncIterator[AsyncIterator[api.FileEvent]]:
        key = _key(path).rstrip(b"/") or b"/"
        if self._stat(sandbox_id, key).type != "dir":
            raise errors.InvalidPath(f"path {_text(key)!r} is not a directory")
        q: asyncio.Queue = asyncio.Queue()
        watches = self.__dict__.setdefault("_fake_watches", {}).setdefault(sandbox_id, [])
        entry = (key, recursive, q)
        watches.append(entry)

        async def events() -> AsyncIterator[api.FileEvent]:
            yield api.FileEvent("ready", _text(key), True)
            while True:
                yield await q.get()

        try:
            ends = getattr(self, "stream_ends", None)
            yield events() if ends is None else ends.watch(sandbox_id, path, events())
        finally:
            watches.remove(entry)

    async def write_tar(
        self, sandbox_id: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        rt = self._running(sandbox_id)
        await self._step("write_tar", sandbox_id)
        root = _key(path).rstrip(b"/") or b"/"
        if root in rt.files:
            raise errors.InvalidPath(f"cannot unpack into {_text(root)!r}: it is a file")
        blob = b"".join([c async for c in chunks])
        try:
            tf = tarfile.open(
                fileobj=io.BytesIO(blob), mode="r:*", encoding="utf-8", errors="surrogateescape"
            )
        except (tarfile.TarError, EOFError) as e:
            raise errors.InvalidRequest(
                f"the body is not a tar archive (plain, gzip, bzip2 or xz): {e}"  # as the guest agent says
            ) from None
        with tf:
            try:
                members = tarball.plan(tf, None)
            except tarball.Refused as e:
                raise errors.InvalidRequest(f"tar refused, nothing was written: {e}") from None
            counts = {"files": 0, "dirs": 0, "links": 0, "bytes": 0}
            self._dirs(sandbox_id).add(root)
            for rel, m in members:
                key = root + b"/" + rel.encode("utf-8", "surrogateescape")
                if m.isdir():
                    self._dirs(sandbox_id).add(key)
                    counts["dirs"] += 1
                elif m.isreg():
                    f = tf.extractfile(m)
                    rt.files[key] = f.read() if f is not None else b""
                    counts["files"] += 1
                    counts["bytes"] += len(rt.files[key])
                    self._files_changed(sandbox_id, key, "create")
                else:
                    counts["links"] += 1  # the fake keeps no links
        return api.TarWritten(_text(root), **counts)

    @contextlib.asynccontextmanager
    async def read_tar(self, sandbox_id: str, path: api.FilePath) -> AsyncIterator[api.FileDownload]:
        rt = self._running(sandbox_id)
        root = _key(path).rstrip(b"/") or b"/"
        if self._stat(sandbox_id, root).type != "dir":
            raise errors.InvalidPath(f"path {_text(root)!r} is not a directory")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", encoding="utf-8", errors="surrogateescape") as tf:
            for p, data in sorted(rt.files.items()):
                if p.startswith(root + b"/"):
                    info = tarfile.TarInfo(p[len(root) + 1 :].decode("utf-8", "surrogateescape"))
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))

        async def chunks() -> AsyncIterator[bytes]:
            yield buf.getvalue()

        yield api.FileDownload(None, chunks())

"""GET /files/watch?path=&recursive=1: a directory's changes as an NDJSON stream, from inotify.

inotify_init1 and inotify_add_watch are called through ctypes (stdlib); events are read with
os.read and sent as they arrive, one line each, never held back: {"type": "create" | "modify" |
"delete" | "rename" | "chmod", "path": ..., "is_dir": bool} (a rename also has "from"; a move whose
two halves arrive in one read is one rename, a move out of the watched tree is a delete and one
into it a create). A recursive watch adds every new subdirectory as it appears and reports what was
already in it (a `mkdir -p a/b/c` or an unpacked tar). The first line is {"type": "ready"} once the
watches are in place. The stream ends when the client goes away (poll sees the socket close), when
the watched directory is deleted ({"type": "delete"} of it, then the end), or on an inotify queue
overflow or a tree grown past MAX_WATCHES directories ({"type": "overflow"}, then the end: events
were lost or would be). The inotify fd is closed whatever
ends it. Called by `handlers_fileops`; `Watcher` runs on the host in unit tests.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import threading

from .common import dumps, printable
from .connection import Conn
from .errors import ApiError, PeerGone, invalid_path

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
_HEADER = struct.Struct("iIII")
READ_SIZE = 65536
MAX_WATCHES = 8192

_libc = None


def _lib():
    global _libc
    if _libc is None:
        try:
            import ctypes  # imported on first use: not every template's python3 has it
        except ImportError:
            raise ApiError(
                501,
                "not_implemented",
                "watching files needs Python's ctypes module in the sandbox, and this template's python3 "
                "lacks it; install the full python3 package in the template",
            ) from None
        lib = ctypes.CDLL(None, use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = (lib, ctypes)
    return _libc


class TooManyDirectories(Exception):
    """The tree has more directories than one watch follows (MAX_WATCHES)."""


class Watcher:
    """One inotify instance watching `root` (and, when recursive, every directory below it)."""

    def __init__(self, root: str, recursive: bool):
        lib, ctypes = _lib()
        self.lib, self.ctypes = lib, ctypes
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self.paths: dict[int, str] = {}
        self.fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            e = ctypes.get_errno()
            raise ApiError(500, "runtime_error", f"inotify_init1 failed: {os.strerror(e)} (errno {e})")
        try:
            self._add(self.root, top=True)
            if recursive:
                self._add_tree(self.root, report=None)
        except TooManyDirectories:
            self.close()
            raise ApiError(
                400,
                "invalid_request",
                f"{printable(self.root)!r} holds more than {MAX_WATCHES} directories, the most one recursive "
                "watch follows; watch a smaller tree, or pass recursive=false",
            ) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _add(self, path: str, top: bool = False) -> bool:
        if len(self.paths) >= MAX_WATCHES:
            raise TooManyDirectories()
        wd = self.lib.inotify_add_watch(self.fd, os.fsencode(path), MASK | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd < 0:
            e = self.ctypes.get_errno()
            if not top:
                return False  # gone again, or not a directory any more: nothing to watch
            shown = printable(path)
            if e in (errno.ENOENT,):
                raise ApiError(404, "file_not_found", f"directory {shown!r} does not exist")
            if e == errno.ENOTDIR:
                raise invalid_path(f"path {shown!r} is not a directory; watch the directory that holds it")
            if e in (errno.EACCES, errno.EPERM):
                raise ApiError(403, "permission_denied", f"watching {shown!r} is not permitted")
            if e == errno.ENOSPC:
                raise ApiError(
                    507, "disk_full", "the sandbox's inotify watch limit is reached; close other watches"
                )
            raise ApiError(500, "runtime_error", f"inotify_add_watch {shown!r} failed: {os.strerror(e)}")
        self.paths[wd] = path
        return True

    def _add_tree(self, top: str, report: list | None, fresh: bool = True) -> None:
        """Watch every directory below `top`; with `report`, add a create event for each entry of a
        directory whose watch is new here (`fresh`: `top`'s is): they appeared before it was in place."""
        stack = [(top, fresh)]
        watched = set(self.paths.values())
        while stack:
            d, new = stack.pop()
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if report is not None and new:
                    report.append({"type": "create", "path": printable(entry.path), "is_dir": is_dir})
                if not is_dir:
                    continue
                if entry.path in watched:
                    stack.append((entry.path, False))
                elif self._add(entry.path):
                    stack.append((entry.path, True))

    def _forget_tree(self, path: str) -> None:
        for wd, p in list(self.paths.items()):
            if p == path or p.startswith(path + "/"):
                self.lib.inotify_rm_watch(self.fd, wd)
                self.paths.pop(wd, None)

    def _moved_tree(self, old: str, new: str) -> None:
        for wd, p in list(self.paths.items()):
            if p == old or p.startswith(old + "/"):
                self.paths[wd] = new + p[len(old) :]

    def read(self) -> tuple[list[dict], bool]:
        """The events ready now (as API events) and whether the stream must end (also when the tree
        grew past MAX_WATCHES directories: then an overflow event, since changes would be missed)."""
        out: list[dict] = []
        try:
            return self._read(out)
        except TooManyDirectories:
            out.append({"type": "overflow", "path": printable(self.root), "is_dir": True})
            return out, True

    def _read(self, out: list[dict]) -> tuple[list[dict], bool]:
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return [], False
        raw = []
        off = 0
        while off + _HEADER.size <= len(data):
            wd, mask, cookie, length = _HEADER.unpack_from(data, off)
            off += _HEADER.size
            name = data[off : off + length].rstrip(b"\0")
            off += length
            raw.append((wd, mask, cookie, os.fsdecode(name)))
        end = False
        i = 0
        while i < len(raw):
            wd, mask, cookie, name = raw[i]
            i += 1
            if mask & IN_Q_OVERFLOW:
                out.append({"type": "overflow", "path": printable(self.root), "is_dir": True})
                return out, True
            base = self.paths.get(wd)
            if base is None:
                continue
            if mask & IN_IGNORED:
                self.paths.pop(wd, None)
                end = end or base == self.root
                continue
            path = f"{base.rstrip('/')}/{name}" if name else base
            is_dir = bool(mask & IN_ISDIR)
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                if base == self.root:
                    out.append({"type": "delete", "path": printable(path), "is_dir": True})
                    return out, True
                continue  # a subdirectory: its parent's watch reports it
            if mask & IN_MOVED_FROM:
                nxt = raw[i] if i < len(raw) else None
                if nxt is not None and nxt[1] & IN_MOVED_TO and nxt[2] == cookie and nxt[0] in self.paths:
                    i += 1
                    new = f"{self.paths[nxt[0]].rstrip('/')}/{nxt[3]}"
                    out.append(
                        {"type": "rename", "path": printable(new), "from": printable(path), "is_dir": is_dir}
                    )
                    if is_dir:
                        self._moved_tree(path, new)
                        if self.recursive:  # it may have moved before all its watches were added
                            if new in self.paths.values():
                                self._add_tree(new, report=out, fresh=False)
                            elif self._add(new):
                                self._add_tree(new, report=out)
                    continue
                out.append({"type": "delete", "path": printable(path), "is_dir": is_dir})
                if is_dir:
                    self._forget_tree(path)
                continue
            if mask & (IN_CREATE | IN_MOVED_TO):
                out.append({"type": "create", "path": printable(path), "is_dir": is_dir})
                if is_dir and self.recursive and self._add(path):
                    self._add_tree(path, report=out)
                continue
            if mask & IN_DELETE:
                out.append({"type": "delete", "path": printable(path), "is_dir": is_dir})
            elif mask & IN_MODIFY:
                out.append({"type": "modify", "path": printable(path), "is_dir": is_dir})
            elif mask & IN_ATTRIB:
                out.append({"type": "chmod", "path": printable(path), "is_dir": is_dir})
        return out, end


def _peer_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


MAX_OPEN = 32
"""Watches open at once in one sandbox; past it 409 (each holds a thread and an inotify fd)."""
_open = threading.BoundedSemaphore(MAX_OPEN)
_scanning = threading.Semaphore(2)
"""Recursive watches walking their tree at once: the walk holds the GIL, and many at a time
starved the agent's health answers until the worker gave the sandbox up (150 watches of /)."""


def serve(conn: Conn, path: str, recursive: bool) -> None:
    if not _open.acquire(blocking=False):
        raise ApiError(
            409,
            "invalid_state",
            f"this sandbox has {MAX_OPEN} file watches open, the most it serves at once; close one "
            "(or watch a common parent directory recursively) and try again",
        )
    try:
        with _scanning if recursive else contextlib.nullcontext():
            watcher = Watcher(path, recursive)  # 404/400 before the stream starts
    except BaseException:
        _open.release()
        raise
    try:
        conn.start_chunked("application/x-ndjson")
        conn.write_chunk(dumps({"type": "ready", "path": printable(watcher.root), "is_dir": True}) + b"\n")
        poller = select.poll()
        poller.register(watcher.fd, select.POLLIN)
        poller.register(conn.sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            for fd, _ev in poller.poll():
                if fd == watcher.fd:
                    events, end = watcher.read()
                    if events:
                        conn.write_chunk(b"".join(dumps(e) + b"\n" for e in events))
                    if end:
                        conn.end_chunked()
                        return
                else:  # the caller sends nothing during a watch: data or a close both end it
                    closed = _peer_closed(conn.sock)
                    conn.keep_alive = False
                    raise PeerGone(
                        "the client closed the watch" if closed else "the client wrote during a watch"
                    )
    finally:
        watcher.close()
        _open.release()

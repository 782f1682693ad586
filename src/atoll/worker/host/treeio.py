"""File calls on a volume's or drive's tree from the host, safe against what sandboxes put there.

The tree is written by sandboxes (hostile content): every path is walked one component at a time
from a directory descriptor of the tree's root with O_NOFOLLOW, so a symlink anywhere on the way —
even one swapped in while the call runs — fails the call instead of leading the worker outside the
tree. `..` is refused outright. Paths are absolute from the tree's root (`/` is the root).
Writes go to a temporary file in the target directory and are renamed into place (a reader, in a
sandbox or here, sees the old file or the whole new one). Blocking; the worker runs these in a
thread. Called by worker.service.node (drive and volume file verbs).
"""

from __future__ import annotations

import binascii
import contextlib
import errno
import itertools
import os
import shutil
import stat
import typing

from atoll.core import errors
from atoll.core.worker_api import MAX_LIST_DEPTH, MAX_LIST_ENTRIES, FileEntry, FileStat, StoreEntry

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_tmp_counter = itertools.count()


def _b64(raw: bytes) -> str:
    return binascii.b2a_base64(raw, newline=False).decode("ascii")


def parts(path: str | bytes) -> list[bytes]:
    """The components of an absolute tree path (`/` -> []); refuses relative paths, NUL and `..`."""
    raw = os.fsencode(path)
    if not raw.startswith(b"/") or b"\x00" in raw or len(raw) > 4096:
        raise errors.InvalidPath(
            f"path {path!r} must be absolute from the tree's root (such as /data/a.txt), without NUL"
        )
    out = [p for p in raw.split(b"/") if p not in (b"", b".")]
    if b".." in out:
        raise errors.InvalidPath(f"path {path!r} must not contain '..'")
    if any(len(p) > 255 for p in out):
        raise errors.InvalidPath(f"path {str(path)[:100]!r}…: a name in it is over 255 bytes")
    return out


def _os_error(e: OSError, what: str, path: object) -> errors.AtollError:
    if e.errno == errno.ENOENT:
        return errors.FileNotFound(f"{what}: {path!r} does not exist")
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return errors.InvalidPath(
            f"{what}: a component of {path!r} is a symbolic link or not a directory (links are never "
            "followed from outside a sandbox)"
        )
    if e.errno == errno.EISDIR:
        return errors.InvalidPath(f"{what}: {path!r} is a directory")
    if e.errno == errno.ENAMETOOLONG:
        return errors.InvalidPath(f"{what}: a name in {str(path)[:100]!r} is over 255 bytes")
    if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
        return errors.InsufficientStorage(f"{what}: no space left for {path!r}", code="store_full")
    if e.errno == errno.ENOTEMPTY:
        return errors.Conflict(f"{what}: directory {path!r} is not empty", code="invalid_state")
    if e.errno == errno.EEXIST:
        return errors.Conflict(f"{what}: {path!r} exists and is not a directory", code="invalid_state")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return errors.PermissionDenied(f"{what}: {path!r}: {e.strerror}")
    return errors.RuntimeFailure(f"{what}: {path!r}: {e.strerror}")


@contextlib.contextmanager
def _walk(root: str, comps: list[bytes], *, create: bool = False) -> typing.Iterator[int]:
    """A descriptor of the directory `comps` names under `root` (made when `create`)."""
    fd = os.open(root, _O_DIR)
    try:
        for c in comps:
            try:
                nxt = os.open(c, _O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(c, 0o755, dir_fd=fd)
                nxt = os.open(c, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _show(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def list_dir(root: str, path: str | bytes) -> list[FileEntry]:
    comps = parts(path)
    prefix = b"/" + b"/".join(comps) if comps else b""
    try:
        with _walk(root, comps) as fd:
            items = []
            for name in os.listdir(fd):
                raw = os.fsencode(name)
                try:
                    st = os.stat(raw, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                items.append(
                    FileEntry(
                        name=_show(raw),
                        path=_show(prefix + b"/" + raw),
                        name_b64=_b64(raw),
                        path_b64=_b64(prefix + b"/" + raw),
                        type=_kind(st.st_mode),
                        size=st.st_size,
                        mode=stat.S_IMODE(st.st_mode),
                        mtime=st.st_mtime,
                    )
                )
    except OSError as e:
        raise _os_error(e, "listing", path) from None
    items.sort(key=lambda i: (i.name, i.name_b64))
    return items


def stat_path(root: str, path: str | bytes) -> FileStat:
    comps = parts(path)
    if not comps:
        st = os.stat(root)
        return FileStat("", "/", "", _b64(b"/"), "dir", st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime)
    try:
        with _walk(root, comps[:-1]) as fd:
            st = os.stat(comps[-1], dir_fd=fd, follow_symlinks=False)
            target = (
                os.readlink(comps[-1], dir_fd=fd).decode("utf-8", "replace")
                if stat.S_ISLNK(st.st_mode)
                else None
            )
    except OSError as e:
        raise _os_error(e, "stat", path) from None
    full = b"/" + b"/".join(comps)
    return FileStat(
        _show(comps[-1]),
        _show(full),
        _b64(comps[-1]),
        _b64(full),
        _kind(st.st_mode),
        st.st_size,
        stat.S_IMODE(st.st_mode),
        st.st_mtime,
        target,
    )


def _entry(raw_name: bytes, full: bytes, st: os.stat_result, target: str | None) -> StoreEntry:
    return StoreEntry(
        name=_show(raw_name),
        path=_show(full),
        name_b64=_b64(raw_name),
        path_b64=_b64(full),
        type=_kind(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        atime=st.st_atime,
        mtime=st.st_mtime,
        ctime=st.st_ctime,
        target=target,
    )


def _lstat_entry(dfd: int, comps: list[bytes]) -> StoreEntry:
    st = os.stat(comps[-1], dir_fd=dfd, follow_symlinks=False)
    target = (
        os.readlink(comps[-1], dir_fd=dfd).decode("utf-8", "replace") if stat.S_ISLNK(st.st_mode) else None
    )
    return _entry(comps[-1], b"/" + b"/".join(comps), st, target)


def stat_entry(root: str, path: str | bytes) -> StoreEntry:
    """`path`'s lstat with owner and times (the root itself for `/`)."""
    comps = parts(path)
    try:
        if not comps:
            return _entry(b"", b"/", os.stat(root), None)
        with _walk(root, comps[:-1]) as fd:
            return _lstat_entry(fd, comps)
    except OSError as e:
        raise _os_error(e, "stat", path) from None


def list_tree(root: str, path: str | bytes, depth: int) -> list[StoreEntry]:
    """The entries under directory `path`, `depth` levels down (1: its own entries), each
    directory's entries sorted by name and listed right after it; never following a link."""
    if not 1 <= depth <= MAX_LIST_DEPTH:
        raise errors.InvalidRequest(f"depth must be from 1 to {MAX_LIST_DEPTH}, not {depth}")
    comps = parts(path)
    out: list[StoreEntry] = []

    def walk(fd: int, prefix: bytes, left: int) -> None:
        for name in sorted(os.fsencode(n) for n in os.listdir(fd)):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                target = (
                    os.readlink(name, dir_fd=fd).decode("utf-8", "replace")
                    if stat.S_ISLNK(st.st_mode)
                    else None
                )
            except OSError:
                continue  # gone meanwhile
            if len(out) >= MAX_LIST_ENTRIES:
                raise errors.InvalidRequest(
                    f"listing {_show(prefix) or '/'!r}: over {MAX_LIST_ENTRIES} entries; list a smaller "
                    "directory or a lower depth"
                )
            out.append(_entry(name, prefix + b"/" + name, st, target))
            if left > 1 and stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, _O_DIR, dir_fd=fd)
                except OSError:
                    continue  # replaced by a link or gone meanwhile: not followed
                try:
                    walk(sub, prefix + b"/" + name, left - 1)
                finally:
                    os.close(sub)

    try:
        with _walk(root, comps) as fd:
            walk(fd, b"/" + b"/".join(comps) if comps else b"", depth)
    except OSError as e:
        raise _os_error(e, "listing", path) from None
    return out


def _set_attrs(dfd: int, name: bytes, mode: int | None, uid: int | None, gid: int | None) -> None:
    if uid is not None or gid is not None:
        os.chown(
            name, -1 if uid is None else uid, -1 if gid is None else gid, dir_fd=dfd, follow_symlinks=False
        )
    if mode is not None:
        # chmod through an O_PATH descriptor of the entry itself: a link swapped in after a check
        # would otherwise be followed (Linux has no lchmod)
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise errors.InvalidPath(f"{_show(name)!r} is a symbolic link: a link has no mode of its own")
            os.chmod(f"/proc/self/fd/{fd}", mode)
        finally:
            os.close(fd)


def _check_attrs(mode: int | None, uid: int | None, gid: int | None) -> None:
    if mode is not None and not 0 <= mode <= 0o7777:
        raise errors.InvalidRequest(f"mode must be permission bits from 0 to 0o7777 (4095), not {mode}")
    for what, v in (("uid", uid), ("gid", gid)):
        if v is not None and not 0 <= v <= 0xFFFFFFFE:
            raise errors.InvalidRequest(f"{what} must be from 0 to 4294967294, not {v}")


def set_attrs(root: str, path: str | bytes, mode: int | None, uid: int | None, gid: int | None) -> StoreEntry:
    """Set the mode and owner of `path` (the entry itself; a link's owner, never its target's)."""
    _check_attrs(mode, uid, gid)
    comps = parts(path)
    if not comps:
        raise errors.InvalidPath("'/' is the tree's root; its mode and owner are the store's own")
    try:
        with _walk(root, comps[:-1]) as dfd:
            _set_attrs(dfd, comps[-1], mode, uid, gid)
            return _lstat_entry(dfd, comps)
    except OSError as e:
        raise _os_error(e, "setting mode/owner of", path) from None


def make_dir(
    root: str, path: str | bytes, parents: bool, mode: int | None, uid: int | None, gid: int | None
) -> StoreEntry:
    """Make directory `path` (with its parents when `parents`; an existing directory is kept, a
    file in its place is a conflict), then set `mode` and the owner on it."""
    _check_attrs(mode, uid, gid)
    comps = parts(path)
    if not comps:
        raise errors.InvalidPath("'/' is the tree's root and exists; give a directory path such as /data")
    try:
        with _walk(root, comps[:-1], create=parents) as dfd:
            try:
                os.mkdir(comps[-1], 0o755 if mode is None else mode, dir_fd=dfd)
            except FileExistsError:
                st = os.stat(comps[-1], dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise
            _set_attrs(dfd, comps[-1], mode, uid, gid)  # mkdir's mode passes through the umask
            return _lstat_entry(dfd, comps)
    except OSError as e:
        raise _os_error(e, "making directory", path) from None


def open_read(root: str, path: str | bytes) -> tuple[int, int]:
    """An open descriptor of a regular file and its size (the caller closes it)."""
    comps = parts(path)
    if not comps:
        raise errors.InvalidPath("reading: '/' is a directory; list it with files/list")
    try:
        with _walk(root, comps[:-1]) as dfd:
            fd = os.open(comps[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError as e:
        raise _os_error(e, "reading", path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise errors.InvalidPath(f"reading: {path!r} is not a regular file (it is a {_kind(st.st_mode)})")
    os.set_blocking(fd, True)
    return fd, st.st_size


class Writer:
    """A file being written: chunks go to a temporary file beside the target, `commit` renames it
    into place, `abort` removes it."""

    def __init__(self, root: str, path: str | bytes):
        self.path = path
        comps = parts(path)
        if not comps:
            raise errors.InvalidPath(
                "writing: '/' is the tree's root, not a file; give a file path such as /a.txt"
            )
        self.name = comps[-1]
        self.tmp = b".atoll-upload-%d-%d" % (os.getpid(), next(_tmp_counter))
        try:
            with _walk(root, comps[:-1], create=True) as dfd:
                self.dfd = os.dup(dfd)
            self.fd = os.open(
                self.tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=self.dfd,
            )
        except OSError as e:
            raise _os_error(e, "writing", path) from None

    def write(self, chunk: bytes) -> None:
        try:
            view = memoryview(chunk)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as e:
            self.abort()
            raise _os_error(e, "writing", self.path) from None

    def commit(self) -> None:
        try:
            os.close(self.fd)
            self.fd = -1
            try:
                st = os.stat(self.name, dir_fd=self.dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory")
            except FileNotFoundError:
                pass
            os.rename(self.tmp, self.name, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
        except OSError as e:
            self.abort()
            raise _os_error(e, "writing", self.path) from None
        finally:
            if self.dfd >= 0:
                os.close(self.dfd)
                self.dfd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dfd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dfd)
            os.close(self.dfd)
            self.dfd = -1


def remove(root: str, path: str | bytes) -> None:
    """Remove a file, a symlink or a directory with what is in it (never following links)."""
    comps = parts(path)
    if not comps:
        raise errors.InvalidPath("deleting: '/' is the tree's root; delete what is in it instead")
    try:
        with _walk(root, comps[:-1]) as dfd:
            st = os.stat(comps[-1], dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(os.fsdecode(comps[-1]), dir_fd=dfd)
            else:
                os.unlink(comps[-1], dir_fd=dfd)
    except OSError as e:
        raise _os_error(e, "deleting", path) from None

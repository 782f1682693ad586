"""The file handlers: read a file (sendfile, Content-Length), write one (streamed to a temp file in
the same directory, then renamed over the path), list a directory and delete a path. Paths are
resolved here, inside the sandbox, with ordinary system calls; a path's query value is percent-decoded
to its exact bytes (names that are not UTF-8 arrive as surrogate escapes), and listings give each
entry's exact bytes as `name_b64`/`path_b64`. Failed system calls become answers by errno
(`_os_error`: 403 permission_denied / read_only_path, 400 io_error, 507 disk_full, ...).

`FileHandlers` is mixed into `routing.Agent`, which routes /files and /files/list here.
"""

from __future__ import annotations

import binascii
import errno
import os
import stat

from .common import printable
from .connection import Conn, Request
from .errors import ApiError, BadRequest, PeerGone, invalid, invalid_path

IO_CHUNK = 1 << 20  # file transfer piece
MAX_ZERO_SIZE_READ = 16 << 20  # /proc-style files that report size 0
MAX_UPLOAD_DRAIN = 1 << 40  # a refused upload is read to its end (the server caps uploads far lower)

_NOT_A_GOOD_PATH = {
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENAMETOOLONG,
    errno.ELOOP,
    errno.EINVAL,
    errno.EXDEV,
    errno.ENOTEMPTY,
    errno.EEXIST,
    errno.EBUSY,
    errno.ETXTBSY,
    errno.ENXIO,
    errno.ENODEV,
}


def _in_memory(path: str) -> bool:
    """Whether `path` is on the sandbox's memory-backed /tmp (a tmpfs bounded by its memory)."""
    try:
        real = os.path.realpath(path)
    except (OSError, ValueError):
        return False
    return real == "/tmp" or real.startswith("/tmp/")


def _os_error(e: OSError, doing: str, path: str) -> ApiError:
    """A failed system call on `path` as the answer that tells the caller what to do instead."""
    n = e.errno
    what = f"{doing} {path!r} failed: {e.strerror}"
    if n in (errno.ENOSPC, errno.EDQUOT) and _in_memory(path):
        return ApiError(
            507,
            "disk_full",
            f"{what}; /tmp is kept in the sandbox's memory and holds at most half its memory_mb: "
            "write large files elsewhere (on its disk, e.g. under /root), delete files in /tmp, or "
            "create the sandbox with a larger memory_mb",
        )
    if n in (errno.ENOSPC, errno.EDQUOT):
        return ApiError(
            507,
            "disk_full",
            f"{what}; the sandbox's disk is full (its disk_mb quota): delete files, or create the "
            "sandbox with a larger disk_mb",
        )
    if n == errno.EROFS:
        return ApiError(
            403,
            "read_only_path",
            f"{what}; it is on a read-only file system: choose a writable path such as /tmp",
        )
    if n in (errno.EACCES, errno.EPERM):
        return ApiError(
            403,
            "permission_denied",
            f"{what}; the guest agent may not do this there: choose another path, or change the "
            "permissions with exec (chmod, chown)",
        )
    if n == errno.EIO:
        return ApiError(
            400,
            "io_error",
            f"{what}; it is probably a special file (such as /proc/<pid>/mem) that cannot be read or "
            "written whole: use exec with a program that knows how to read it",
        )
    if n == errno.EFBIG:
        return ApiError(413, "payload_too_large", f"{what}; the file would exceed the largest size allowed")
    if n in _NOT_A_GOOD_PATH:
        return invalid_path(what)
    return ApiError(500, "runtime_error", f"{what} (errno {n})")


def _b64(raw: bytes) -> str:
    return binascii.b2a_base64(raw, newline=False).decode("ascii")


class FileHandlers:
    """GET/PUT/DELETE /files?path= and GET /files/list?path=.

    A mixin of `routing.Agent`, whose __init__ sets `_tmp_names` (the counter naming temp files).
    """

    @staticmethod
    def _path(req: Request) -> str:
        path = req.query.get("path")
        if path is None or path == "":
            raise invalid_path(
                "missing ?path= query parameter; pass an absolute path such as /home/user/a.txt"
            )
        if "\x00" in path:
            raise invalid_path(f"path {path!r} contains a NUL byte; remove it")
        if not path.startswith("/"):
            raise invalid_path(f"path {path!r} is not absolute; paths must start with '/'")
        return path

    def write_file(self, conn: Conn, req: Request) -> None:
        try:
            self._write_file(conn, req)
        except ApiError:
            # Read the rest of the upload before answering: the caller sends all of it before it reads
            # the answer, and a connection closed under it would turn this error into a broken upload.
            try:
                req.body.drain(MAX_UPLOAD_DRAIN)
            except BadRequest:
                pass
            raise

    def _write_file(self, conn: Conn, req: Request) -> None:
        path = self._path(req)
        mode = None
        mode_text = req.query.get("mode")
        if mode_text:
            try:
                mode = int(mode_text, 8)
            except ValueError:
                mode = -1
            if not 0 <= mode <= 0o7777:
                raise invalid(f"mode {mode_text!r} is not an octal permission mode like 0644")
        try:
            old = os.stat(path)
        except FileNotFoundError:
            old = None
        except NotADirectoryError:
            raise invalid_path(f"cannot write {path!r}: a parent of it is a file, not a directory") from None
        except OSError as e:
            raise _os_error(e, "writing", path) from None
        if old is not None and stat.S_ISDIR(old.st_mode):
            raise invalid_path(f"path {path!r} is a directory; pass a file path")
        parent, base = os.path.split(path)
        parent = parent or "/"
        if not base:
            raise invalid_path(f"path {path!r} ends with '/'; pass a file path")
        try:
            os.makedirs(parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise invalid_path(f"cannot create {parent!r} for {path!r}: a component is a file") from None
        except OSError as e:
            raise _os_error(e, "creating the directory", parent) from None
        while True:
            tmp = f"{parent.rstrip('/')}/.{base[:64]}.atoll-{os.getpid()}-{next(self._tmp_names)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise _os_error(e, "writing", path) from None
        try:
            buf = memoryview(bytearray(IO_CHUNK))
            while True:
                n = req.body.readinto(buf)
                if not n:
                    break
                view = buf[:n]
                while view:
                    try:
                        written = os.write(fd, view)
                    except OSError as e:
                        raise _os_error(e, "writing", path) from None
                    view = view[written:]
            try:
                if old is not None and stat.S_ISREG(old.st_mode):
                    try:
                        os.fchown(fd, old.st_uid, old.st_gid)
                    except OSError:
                        pass
                    os.fchmod(fd, mode if mode is not None else stat.S_IMODE(old.st_mode))
                else:
                    os.fchmod(fd, mode if mode is not None else 0o644)
                os.close(fd)
                fd = -1
                os.replace(tmp, path)
            except OSError as e:
                raise _os_error(e, "finishing", path) from None
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        conn.send_no_content()

    def read_file(self, conn: Conn, req: Request) -> None:
        path = self._path(req)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, "file_not_found", f"file {path!r} does not exist") from None
        except OSError as e:
            raise _os_error(e, "reading", path) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise invalid_path(f"path {path!r} is a directory; list it with GET /files/list?path=")
            if not stat.S_ISREG(st.st_mode):
                raise invalid_path(f"path {path!r} is not a regular file (device, fifo or socket)")
            size = st.st_size
            if size == 0:  # empty, or a /proc-style file that does not know its size
                data = bytearray()
                while len(data) < MAX_ZERO_SIZE_READ:
                    try:
                        piece = os.read(fd, 65536)
                    except OSError as e:
                        raise _os_error(e, "reading", path) from None
                    if not piece:
                        break
                    data += piece
                return conn.send(200, bytes(data), "application/octet-stream")
            conn.send_raw(
                conn._head(200, [("Content-Type", "application/octet-stream"), ("Content-Length", str(size))])
            )
            if not conn.head_only:
                self._send_file_body(conn, fd, size, path)
        finally:
            os.close(fd)

    @staticmethod
    def _send_file_body(conn: Conn, fd: int, size: int, path: str) -> None:
        out = conn.sock.fileno()
        offset = 0
        use_sendfile = True
        while offset < size:
            if use_sendfile:
                try:
                    sent = os.sendfile(out, fd, offset, min(IO_CHUNK, size - offset))
                except OSError as e:
                    if offset == 0 and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        use_sendfile = False
                        continue
                    if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN):
                        raise PeerGone(str(e)) from None
                    raise
            else:
                try:
                    data = os.pread(fd, min(IO_CHUNK, size - offset), offset)
                except OSError as e:
                    raise _os_error(e, "reading", path) from None
                conn.send_raw(data)
                sent = len(data)
            if sent == 0:  # the file shrank after we promised Content-Length bytes
                raise ApiError(500, "runtime_error", f"{path!r} shrank while it was being read")
            offset += sent

    def list_dir(self, conn: Conn, req: Request) -> None:
        path = self._path(req)
        try:
            it = os.scandir(path)
        except FileNotFoundError:
            raise ApiError(404, "file_not_found", f"directory {path!r} does not exist") from None
        except NotADirectoryError:
            if os.path.exists(path):
                raise invalid_path(
                    f"path {path!r} is not a directory; read it with GET /files?path="
                ) from None
            raise ApiError(404, "file_not_found", f"directory {path!r} does not exist") from None
        except OSError as e:
            raise _os_error(e, "listing", path) from None
        items = []
        prefix = path.rstrip("/")
        raw_prefix = os.fsencode(prefix)
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                mode = st.st_mode
                if stat.S_ISLNK(mode):
                    kind = "symlink"
                elif stat.S_ISDIR(mode):
                    kind = "dir"
                elif stat.S_ISREG(mode):
                    kind = "file"
                else:
                    kind = "other"
                raw_name = os.fsencode(entry.name)
                items.append(
                    {
                        "name": printable(entry.name),
                        "path": printable(f"{prefix}/{entry.name}"),
                        "name_b64": _b64(raw_name),
                        "path_b64": _b64(raw_prefix + b"/" + raw_name),
                        "type": kind,
                        "size": st.st_size,
                        "mode": stat.S_IMODE(mode),
                        "mtime": st.st_mtime,
                    }
                )
        items.sort(key=lambda i: (i["name"], i["name_b64"]))
        conn.send_json(200, {"items": items})

    def delete_file(self, conn: Conn, req: Request) -> None:
        path = self._path(req)
        if not os.path.normpath(path).strip("/"):
            raise invalid_path("refusing to delete '/'; pass a path below it")
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, "file_not_found", f"path {path!r} does not exist") from None
        except OSError as e:
            raise _os_error(e, "deleting", path) from None
        try:
            if stat.S_ISDIR(st.st_mode):
                import shutil  # only needed here

                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _os_error(e, "deleting", path) from None
        conn.send_no_content()

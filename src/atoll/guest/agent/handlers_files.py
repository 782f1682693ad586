"""The file handlers: read a file (sendfile, Content-Length), write one (streamed to a temp file in
the same directory, then renamed over the path), list a directory and delete a path. Paths are
resolved here, inside the sandbox, with ordinary system calls.

`FileHandlers` is mixed into `routing.Agent`, which routes /files and /files/list here.
"""

from __future__ import annotations

import errno
import os
import stat

from .common import printable
from .connection import Conn, Request
from .errors import ApiError, PeerGone, invalid, invalid_path

IO_CHUNK = 1 << 20  # file transfer piece
MAX_ZERO_SIZE_READ = 16 << 20  # /proc-style files that report size 0


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
            raise invalid_path(f"cannot write {path!r}: {e.strerror}") from None
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
            raise ApiError(
                500, "runtime_error", f"cannot create directory {parent!r}: {e.strerror}"
            ) from None
        while True:
            tmp = f"{parent.rstrip('/')}/.{base[:64]}.atoll-{os.getpid()}-{next(self._tmp_names)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise ApiError(
                    500, "runtime_error", f"cannot create a temp file in {parent!r}: {e}"
                ) from None
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
                        raise ApiError(
                            500, "runtime_error", f"writing {path!r} failed: {e.strerror}"
                        ) from None
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
                raise ApiError(500, "runtime_error", f"finishing {path!r} failed: {e}") from None
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
            raise invalid_path(f"cannot open {path!r}: {e.strerror}") from None
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
                    piece = os.read(fd, 65536)
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
                    raise ApiError(500, "runtime_error", f"reading {path!r} failed: {e}") from None
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
            raise invalid_path(f"cannot list {path!r}: {e.strerror}") from None
        items = []
        prefix = path.rstrip("/")
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
                items.append(
                    {
                        "name": printable(entry.name),
                        "path": printable(f"{prefix}/{entry.name}"),
                        "type": kind,
                        "size": st.st_size,
                        "mode": stat.S_IMODE(mode),
                        "mtime": st.st_mtime,
                    }
                )
        items.sort(key=lambda i: i["name"])
        conn.send_json(200, {"items": items})

    def delete_file(self, conn: Conn, req: Request) -> None:
        path = self._path(req)
        if not os.path.normpath(path).strip("/"):
            raise invalid_path("refusing to delete '/'; pass a path below it")
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, "file_not_found", f"path {path!r} does not exist") from None
        try:
            if stat.S_ISDIR(st.st_mode):
                import shutil  # only needed here

                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ApiError(500, "runtime_error", f"deleting {path!r} failed: {e}") from None
        conn.send_no_content()

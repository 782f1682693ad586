"""The agent's fuller files API (issue 9): stat (lstat semantics), mkdir -p, move, chmod, and the
routes of `watch` (inotify, guest/agent/watch.py) and `tarball` (tar upload and download).

Paths arrive as `?path=` (and `?from=&to=` for a move), absolute and percent-decoded to their exact
bytes, like the other file routes (`handlers_files`). `FileOpsHandlers` is mixed into
`routing.Agent`, which routes /files/stat, /files/mkdir, /files/move, /files/chmod, /files/watch and
/files/tar here.
"""

from __future__ import annotations

import errno
import os
import stat

from . import tarball, watch
from .common import printable
from .connection import Conn, Request
from .errors import ApiError, invalid, invalid_path
from .handlers_files import _b64, _os_error


def kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def stat_entry(path: str) -> dict:
    """The lstat of `path` as the API's FileStat (raises OSError)."""
    st = os.lstat(path)
    target = None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = printable(os.readlink(path))
        except OSError:
            target = None
    norm = path.rstrip("/") or "/"
    name = os.path.basename(norm) or "/"
    return {
        "name": printable(name),
        "path": printable(norm),
        "name_b64": _b64(os.fsencode(name)),
        "path_b64": _b64(os.fsencode(norm)),
        "type": kind_of(st.st_mode),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
        "target": target,
    }


def parse_mode(text: str | None) -> int:
    """A permission mode given as octal text ("755", "0o755", "0755")."""
    if text is None or text == "":
        raise invalid("missing ?mode= query parameter; pass an octal permission mode such as 755")
    t = text.strip().lower()
    if t.startswith("0o"):
        t = t[2:]
    try:
        mode = int(t, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise invalid(f"mode {text!r} is not an octal permission mode from 0 to 7777, such as 755 or 0644")
    return mode


class FileOpsHandlers:
    """GET /files/stat, POST /files/mkdir, /files/move, /files/chmod, GET /files/watch, PUT|GET
    /files/tar. A mixin of `routing.Agent`; `_path` comes from `handlers_files.FileHandlers`."""

    @staticmethod
    def _named_path(req: Request, name: str) -> str:
        path = req.query.get(name)
        if not path:
            raise invalid_path(f"missing ?{name}= query parameter; pass an absolute path")
        if "\x00" in path or not path.startswith("/"):
            raise invalid_path(f"{name} {printable(path)!r} must be an absolute path without NUL bytes")
        return path

    def stat_file(self, conn: Conn, req: Request) -> None:
        path = self._path(req)  # type: ignore[attr-defined]
        try:
            conn.send_json(200, stat_entry(path))
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, "file_not_found", f"path {printable(path)!r} does not exist") from None
        except OSError as e:
            raise _os_error(e, "stat of", printable(path)) from None

    def make_dir(self, conn: Conn, req: Request) -> None:
        path = self._path(req)  # type: ignore[attr-defined]
        shown = printable(path)
        try:
            if os.path.isdir(path):
                return conn.send_json(200, {"path": shown, "created": False})
            if os.path.lexists(path):
                raise invalid_path(
                    f"cannot create directory {shown!r}: a file is in the way; delete or move it first"
                )
            os.makedirs(path, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise invalid_path(
                f"cannot create directory {shown!r}: a component of it is a file, not a directory"
            ) from None
        except OSError as e:
            raise _os_error(e, "creating the directory", shown) from None
        conn.send_json(200, {"path": shown, "created": True})

    def move_file(self, conn: Conn, req: Request) -> None:
        src, dst = self._named_path(req, "from"), self._named_path(req, "to")
        s, d = os.path.normpath(src), os.path.normpath(dst)
        shown_s, shown_d = printable(src), printable(dst)
        if not os.path.lexists(src):
            raise ApiError(404, "file_not_found", f"cannot move {shown_s!r}: it does not exist")
        if s == "/":
            raise invalid_path("refusing to move '/'; pass a path below it")
        if d == s:
            raise invalid_path(f"cannot move {shown_s!r} onto itself; give another destination")
        if d.startswith(s.rstrip("/") + "/") and os.path.isdir(src) and not os.path.islink(src):
            raise invalid_path(f"cannot move the directory {shown_s!r} into itself ({shown_d!r})")
        if os.path.lexists(dst):
            src_dir = os.path.isdir(src) and not os.path.islink(src)
            dst_dir = os.path.isdir(dst) and not os.path.islink(dst)
            if src_dir or dst_dir:
                raise invalid_path(
                    f"cannot move {shown_s!r} to {shown_d!r}: the destination exists and one of them is a "
                    "directory; delete the destination first, or move into a path below it"
                )
        parent = os.path.dirname(d)
        try:
            os.makedirs(parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise invalid_path(
                f"cannot move to {shown_d!r}: a parent of it is a file, not a directory"
            ) from None
        except OSError as e:
            raise _os_error(e, "creating the directory", printable(parent)) from None
        try:
            try:
                os.rename(src, dst)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                import shutil  # noqa: PLC0415 - rare, and shutil pulls in bz2 and lzma

                shutil.move(src, dst)  # another file system: copy, then remove the source
            conn.send_json(200, stat_entry(dst))
        except FileNotFoundError:
            raise ApiError(404, "file_not_found", f"cannot move {shown_s!r}: it does not exist") from None
        except OSError as e:
            raise _os_error(e, f"moving {shown_s!r} to", shown_d) from None

    def chmod_file(self, conn: Conn, req: Request) -> None:
        path = self._path(req)  # type: ignore[attr-defined]
        mode = parse_mode(req.query.get("mode"))
        shown = printable(path)
        try:
            if os.path.islink(path):
                raise invalid_path(
                    f"{shown!r} is a symlink; chmod its target instead (Linux has no symlink modes)"
                )
            os.chmod(path, mode)
            conn.send_json(200, stat_entry(path))
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, "file_not_found", f"path {shown!r} does not exist") from None
        except OSError as e:
            raise _os_error(e, "chmod of", shown) from None

    def watch_files(self, conn: Conn, req: Request) -> None:
        path = self._path(req)  # type: ignore[attr-defined]
        recursive = req.query.get("recursive", "0").lower() in ("1", "true", "yes")
        watch.serve(conn, path, recursive)

    def write_tar(self, conn: Conn, req: Request) -> None:
        tarball.receive(conn, req, self._path(req))  # type: ignore[attr-defined]

    def read_tar(self, conn: Conn, req: Request) -> None:
        tarball.send(conn, self._path(req))  # type: ignore[attr-defined]

"""Many files at once as a tar stream: `receive` (PUT /files/tar?path=DIR) and `send` (GET
/files/tar?path=DIR). Called by `handlers_fileops`; `plan` is pure apart from lstat/readlink under the
target, so unit tests run it on the host.

An upload is read whole first (into memory up to IN_MEMORY, else an unlinked temp file) (the body may be gzip, bzip2 or xz: tarfile
detects it), then every member is checked before anything is written: no absolute or `..` names, no
device, fifo or other special members, no symlink whose target — resolved through the tar's own
symlinks and the ones already on disk under DIR — leaves DIR, no hard link except to an earlier
regular file of the same tar, no member whose parent resolves outside DIR. One refused member refuses
the whole tar (400, nothing written). Writing then uses O_NOFOLLOW and checks each parent's real path
again. Names keep their exact bytes (PAX headers, surrogate escapes) both ways.
"""

from __future__ import annotations

import io
import os

from .common import printable
from .connection import Conn, Request
from .errors import ApiError, BadRequest, invalid, invalid_path

SPOOL_DIR = "/tmp"
IN_MEMORY = 32 << 20  # a tar body up to this is unpacked from memory, a larger one from a temp file
MAX_MEMBERS = 200_000
MAX_LINK_HOPS = 40
MAX_UPLOAD_DRAIN = 1 << 40
COPY_CHUNK = 1 << 20
SEND_CHUNK = 256 << 10
ENCODING = "utf-8"
ERRORS = "surrogateescape"

TYPE_CHECKING = False  # typing itself is not imported (its ~0.2 MB, in every idle agent)
if TYPE_CHECKING:
    import tarfile


class Refused(Exception):
    """A member that makes the whole tar unacceptable."""


def _clean(name: str) -> str:
    """A member name as a path relative to DIR ('' for DIR itself); Refused if it points outside."""
    if name.startswith("/"):
        raise Refused(f"member {printable(name)!r} has an absolute path; tar relative paths (tar -C DIR .)")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"member {printable(name)!r} contains '..'; it would be written outside the target")
    return "/".join(parts)


class _Tree:
    """Resolves member paths through the tar's symlinks and those already on disk under `root`.

    What is on disk is read one directory at a time (scandir: one getdents for many names, since
    every system call costs ~50 us in gVisor) and remembered; `disk(rel)` is "dir", "file", "link",
    "other" or None (nothing there)."""

    def __init__(self, root: str | None, links: dict[str, str]):
        self.root = root
        self.links = links
        self._dirs: dict[str, dict[str, str]] = {}
        self._inside: dict[str, bool] = {}

    def disk(self, rel: str) -> str | None:
        if self.root is None or not rel:
            return None
        parent, _, name = rel.rpartition("/")
        entries = self._dirs.get(parent)
        if entries is None:
            entries = {}
            try:
                with os.scandir(os.path.join(self.root, parent) if parent else self.root) as it:
                    for e in it:
                        try:
                            kind = (
                                "link"
                                if e.is_symlink()
                                else "dir"
                                if e.is_dir(follow_symlinks=False)
                                else "file"
                                if e.is_file(follow_symlinks=False)
                                else "other"
                            )
                        except OSError:
                            kind = "other"
                        entries[e.name] = kind
            except OSError:
                pass
            self._dirs[parent] = entries
        return entries.get(name)

    def _target(self, key: str) -> str | None:
        target = self.links.get(key)
        if target is None and self.disk(key) == "link":
            try:
                target = os.readlink(os.path.join(self.root, key))  # type: ignore[arg-type]
            except OSError:
                target = None
        return target

    def inside(self, rel: str) -> bool:
        """Does `rel` (relative to root, may hold '..' and symlinks) resolve to a path inside root?"""
        known = self._inside.get(rel)
        if known is not None:
            return known
        todo = [p for p in rel.split("/") if p not in ("", ".")]
        todo.reverse()
        current: list[str] = []
        hops = 0
        ok = True
        while todo:
            comp = todo.pop()
            if comp == "..":
                if not current:
                    ok = False
                    break
                current.pop()
                continue
            key = "/".join([*current, comp])
            target = self._target(key)
            if target is None:
                current.append(comp)
                continue
            hops += 1
            if hops > MAX_LINK_HOPS or target.startswith("/"):
                ok = False
                break
            todo.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
        self._inside[rel] = ok
        return ok


def plan(tf: tarfile.TarFile, root: str | None) -> list[tuple[str, tarfile.TarInfo]]:
    """Every member of `tf` checked against `root`: [(relative path, member)] to write, in order.
    Raises Refused (with the member and the reason) for the first unacceptable member. With `root`
    None only the tar's own members are considered (testing.fake_worker uses that)."""
    return _plan(tf, root)[0]


def _plan(tf: tarfile.TarFile, root: str | None) -> tuple[list[tuple[str, tarfile.TarInfo]], _Tree]:
    members: list[tuple[str, tarfile.TarInfo]] = []
    links: dict[str, str] = {}
    regular: set[str] = set()
    for n, m in enumerate(tf):
        if n >= MAX_MEMBERS:
            raise Refused(f"the tar has more than {MAX_MEMBERS} members; upload it in parts")
        rel = _clean(m.name)
        shown = printable(m.name)
        if m.isreg() or m.isdir():
            pass
        elif m.issym():
            if m.linkname.startswith("/"):
                raise Refused(
                    f"symlink {shown!r} points to the absolute path {printable(m.linkname)!r}; "
                    "only relative links that stay inside the target are accepted"
                )
            if not rel:
                raise Refused("the tar replaces the target directory itself with a symlink")
            links[rel] = m.linkname
        elif m.islnk():
            target = _clean(m.linkname)
            if target not in regular:
                raise Refused(
                    f"hard link {shown!r} points to {printable(m.linkname)!r}, which is not an earlier "
                    "regular file of this tar"
                )
        else:
            kind = "device" if m.ischr() or m.isblk() else "fifo" if m.isfifo() else "special"
            raise Refused(
                f"member {shown!r} is a {kind} file; only files, directories and links are accepted"
            )
        if rel:
            members.append((rel, m))
        if m.isreg():
            regular.add(rel)
        else:
            regular.discard(rel)
    tree = _Tree(root, links)
    not_dirs = {rel for rel, m in members if not m.isdir() and not m.issym()}
    kinds: dict[str, bool] = {}
    for rel, m in members:  # one name as a directory and as something else: refused, not half-written
        if kinds.setdefault(rel, m.isdir()) != m.isdir():
            raise Refused(
                f"member {printable(m.name)!r} appears both as a directory and as a file or link; "
                "keep one of them"
            )
    checked: set[str] = set()
    for rel, m in members:
        parent = os.path.dirname(rel)
        shown = printable(m.name)
        up = parent
        while up and up not in checked:
            if up in not_dirs or tree.disk(up) in ("file", "other"):
                raise Refused(
                    f"member {shown!r} is below {printable(up)!r}, which is a file, not a directory"
                )
            checked.add(up)
            up = os.path.dirname(up)
        if not tree.inside(rel if m.isdir() else parent):
            raise Refused(
                f"member {shown!r} would be written through a symlink that leads outside the target"
            )
        if m.issym() and not tree.inside(f"{parent}/{m.linkname}" if parent else m.linkname):
            raise Refused(f"symlink {shown!r} -> {printable(m.linkname)!r} leads outside the target")
        if not m.isdir() and tree.disk(rel) == "dir":
            raise Refused(f"member {shown!r} is not a directory, but a directory of that name exists")
        if m.isdir() and tree.disk(rel) in ("file", "other"):
            raise Refused(f"member {shown!r} is a directory, but a file of that name exists")
    return members, tree


def _spool(req: Request):
    """The request body as a readable file: in memory up to IN_MEMORY bytes, else in an unlinked
    temp file under SPOOL_DIR (then also closed by the caller)."""
    data = bytearray()
    buf = memoryview(bytearray(COPY_CHUNK))
    fd = -1
    try:
        while True:
            got = req.body.readinto(buf)
            if not got:
                break
            if fd < 0:
                data += buf[:got]
                if len(data) <= IN_MEMORY:
                    continue
                fd = _temp_file()
                view = memoryview(data)
                data = bytearray()
            else:
                view = buf[:got]
            while view:
                view = view[os.write(fd, view) :]
        if fd < 0:
            return io.BytesIO(bytes(data))
        os.lseek(fd, 0, os.SEEK_SET)
        return open(fd, "rb", buffering=COPY_CHUNK)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def _temp_file() -> int:
    for _ in range(10):
        path = f"{SPOOL_DIR}/.atoll-tar-{os.getpid()}-{os.urandom(6).hex()}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        os.unlink(path)
        return fd
    raise FileExistsError(f"no free temp file name in {SPOOL_DIR}")


_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def _write(
    tf: tarfile.TarFile,
    root: str,
    members: list[tuple[str, tarfile.TarInfo]],
    tree: _Tree,
    raw: memoryview | None = None,
) -> dict:
    """Write the planned members, with as few system calls per member as it takes (each costs
    ~50 us in gVisor): a file is open (O_NOFOLLOW), write, futimens, close; a name that was on disk
    is unlinked first (never written through: it may be a hard link to a file elsewhere)."""
    real_root = os.path.realpath(root)
    umask = os.umask(0)
    os.umask(umask)
    counts = {"files": 0, "dirs": 0, "links": 0, "bytes": 0}
    dir_modes: list[tuple[str, int]] = []
    ready: set[str] = {""}
    made: set[str] = set()  # names this tar wrote (a later member of the same name replaces it)

    def parent_ready(rel: str) -> None:
        parent = os.path.dirname(rel)
        if parent in ready:
            return
        full = os.path.join(root, parent)
        os.makedirs(full, exist_ok=True)
        real = os.path.realpath(full)
        if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
            raise Refused(f"{printable(full)!r} resolves outside the target while writing; stopped")
        ready.add(parent)

    def clear(rel: str, full: str) -> None:
        if rel in made or tree.disk(rel) not in (None, "dir"):
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass

    for rel, m in members:
        full = os.path.join(root, rel)
        parent_ready(rel)
        if m.isdir():
            if rel not in ready:
                try:
                    os.mkdir(full, 0o700)
                except FileExistsError:
                    if not os.path.isdir(full) or os.path.islink(full):
                        raise Refused(f"{printable(rel)!r} exists and is not a directory") from None
                ready.add(rel)
                counts["dirs"] += 1
                dir_modes.append((full, m.mode & 0o777))
            continue
        clear(rel, full)
        made.add(rel)
        if m.issym():
            os.symlink(m.linkname, full)
            counts["links"] += 1
            continue
        if m.islnk():
            os.link(os.path.join(root, _clean(m.linkname)), full, follow_symlinks=False)
            counts["links"] += 1
            continue
        mode = m.mode & 0o777
        fd = os.open(full, _FILE_FLAGS, mode)
        try:
            if raw is not None and not m.issparse():  # a plain tar in memory: its bytes as they lie
                view = raw[m.offset_data : m.offset_data + m.size]
                if len(view) != m.size:
                    raise _tarfile().ReadError(f"unexpected end of data in {printable(m.name)!r}")
                counts["bytes"] += m.size
                while view:
                    view = view[os.write(fd, view[:COPY_CHUNK]) :]
            else:
                src = tf.extractfile(m)
                left = m.size
                while src is not None and left > 0:
                    piece = src.read(min(COPY_CHUNK, left))
                    if not piece:
                        break
                    left -= len(piece)
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(fd, view) :]
                    counts["bytes"] += len(piece)
            if mode & umask:
                os.fchmod(fd, mode)
            try:
                os.utime(fd, (m.mtime, m.mtime))
            except (OSError, OverflowError, ValueError):
                pass
        finally:
            os.close(fd)
        counts["files"] += 1
    for full, mode in reversed(dir_modes):  # last: a read-only directory may still take its files
        try:
            os.chmod(full, mode)
        except OSError:
            pass
    return counts


def _tarfile():
    """tarfile, imported on the first tar call rather than at the agent's start: with what it pulls
    in (shutil, bz2, lzma, their C libraries) ~1 MB that every idle sandbox's agent would hold.
    It comes from the template's Python, which the sandbox's own code can change or remove: a
    failed import is a clean error, raised before any answer has begun."""
    try:
        import tarfile  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - ImportError, or a module broken by the sandbox's code
        raise ApiError(
            409,
            "invalid_state",
            f"the sandbox's Python module tarfile cannot be imported ({type(e).__name__}: {e}); "
            "tar calls need the template's tarfile.py intact — restore it, or read files one by one",
        ) from None
    return tarfile


def receive(conn: Conn, req: Request, root: str) -> None:
    """PUT /files/tar?path=DIR: answers {files, dirs, links, bytes} written."""
    from .handlers_files import _os_error

    tarfile = _tarfile()

    shown = printable(root)
    spool = None
    try:
        if os.path.lexists(root) and not os.path.isdir(root):
            raise invalid_path(f"cannot unpack into {shown!r}: it exists and is not a directory")
        try:
            spool = _spool(req)
        except OSError as e:
            raise _os_error(e, "spooling the tar for", shown) from None
        try:
            tf = tarfile.open(fileobj=spool, mode="r:*", encoding=ENCODING, errors=ERRORS)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise invalid(f"the body is not a tar archive (plain, gzip, bzip2 or xz): {e}") from None
        with tf:
            try:
                members, tree = _plan(tf, root)
            except Refused as e:
                raise ApiError(400, "invalid_request", f"tar refused, nothing was written: {e}") from None
            except (tarfile.TarError, EOFError, OSError) as e:
                raise invalid(f"the tar is damaged, nothing was written: {e}") from None
            try:
                os.makedirs(root, exist_ok=True)
                if isinstance(spool, io.BytesIO) and tf.fileobj is spool:  # plain tar in memory
                    with spool.getbuffer() as raw:
                        counts = _write(tf, root, members, tree, raw)
                else:
                    counts = _write(tf, root, members, tree)
            except Refused as e:
                raise ApiError(400, "invalid_request", f"tar unpacking stopped: {e}") from None
            except (tarfile.TarError, EOFError) as e:
                raise invalid(f"the tar is damaged (unpacking stopped part-way): {e}") from None
            except OSError as e:
                raise _os_error(e, "unpacking the tar into", shown) from None
    except ApiError:
        try:
            req.body.drain(MAX_UPLOAD_DRAIN)
        except BadRequest:
            pass
        raise
    finally:
        if spool is not None:
            spool.close()
    conn.send_json(200, {"path": shown, **counts})


class _ChunkWriter:
    """A write-only file object that sends what tarfile writes as HTTP chunks."""

    def __init__(self, conn: Conn):
        self.conn = conn

    def write(self, data) -> int:
        self.conn.write_chunk(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


def send(conn: Conn, root: str) -> None:
    """GET /files/tar?path=DIR: the directory's contents (names relative to it) as a tar stream."""
    from .handlers_files import _os_error

    shown = printable(root)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        raise ApiError(404, "file_not_found", f"directory {shown!r} does not exist") from None
    except NotADirectoryError:
        if os.path.lexists(root):
            raise invalid_path(f"path {shown!r} is not a directory; read it with GET /files?path=") from None
        raise ApiError(404, "file_not_found", f"directory {shown!r} does not exist") from None
    except OSError as e:
        raise _os_error(e, "listing", shown) from None
    tarfile = _tarfile()  # before the answer begins: a failure is an error answer, not a cut stream
    conn.start_chunked("application/x-tar")
    if conn.head_only:
        return
    out = _ChunkWriter(conn)
    with tarfile.open(
        fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, encoding=ENCODING, errors=ERRORS,
        bufsize=SEND_CHUNK,
    ) as tf:  # fmt: skip
        _add_tree(tf, root, "", names, os.lstat(root).st_dev)
    conn.end_chunked()


def _add_tree(tf: tarfile.TarFile, path: str, arc: str, names: list[str], dev: int) -> None:
    """Add `names` under `path` (recursively) like `tar --one-file-system`: other mounts (the
    sandbox's /proc, /dev and atoll's own under them) are left out, and so are entries that vanish
    or cannot be read while the stream is built (sockets too), instead of cutting the stream."""
    for name in names:
        full, arcname = os.path.join(path, name), f"{arc}/{name}" if arc else name
        try:
            if os.lstat(full).st_dev != dev:
                continue
            info = tf.gettarinfo(full, arcname)
        except OSError:
            continue
        if info is None:  # a socket
            continue
        if info.isreg():
            try:
                f = open(full, "rb")  # noqa: SIM115 - closed below
            except OSError:
                continue
            with f:
                tf.addfile(info, f)
        else:
            tf.addfile(info)
        if info.isdir():
            try:
                below = sorted(os.listdir(full))
            except OSError:
                continue
            _add_tree(tf, full, arcname, below, dev)

"""Tar helpers of `sandbox.files.upload_dir` / `download_dir`, shared by both clients. No network.

`tar_chunks` streams a local tree as a PAX tar, header and file pieces as they are read (a big file
is never held whole); names keep their exact bytes (surrogate escapes). `extract` unpacks a spooled
download with tarfile's "data" filter (no absolute or `..` names, no links leading out, no device
files, no setuid bits), so a hostile sandbox cannot write outside `local_dir`.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from typing import IO

from atoll import errors

CHUNK = 256 * 1024
ENCODING = "utf-8"
ERRORS = "surrogateescape"


class _NoSink:
    """gettarinfo needs a TarFile; nothing is written through this one."""

    def write(self, data: bytes) -> int:
        return len(data)

    def tell(self) -> int:
        return 0


def tar_chunks(local_dir: str | os.PathLike[str]) -> Iterator[bytes]:
    """The tree under `local_dir` (names relative to it) as tar bytes, piece by piece. Files,
    directories (empty ones too), symlinks (as themselves) and hard links; sockets, fifos and
    devices are skipped."""
    root = os.fspath(local_dir)
    if not os.path.isdir(root):
        raise NotADirectoryError(f"upload_dir: {root!r} is not a local directory")
    tf = tarfile.open(
        fileobj=_NoSink(), mode="w", format=tarfile.PAX_FORMAT, encoding=ENCODING, errors=ERRORS
    )  # type: ignore[call-overload]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*sorted(dirnames), *sorted(filenames)]:
            full = os.path.join(dirpath, name)
            arcname = os.path.relpath(full, root)
            info = tf.gettarinfo(full, arcname)
            if info is None or not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
                continue
            if info.isdir():
                info.size = 0
            yield info.tobuf(tarfile.PAX_FORMAT, ENCODING, ERRORS)
            if info.isreg() and info.size:
                left = info.size
                with open(full, "rb") as f:
                    while left > 0:
                        piece = f.read(min(CHUNK, left))
                        if not piece:  # the file shrank while it was read: pad to the promised size
                            piece = b"\0" * left
                        left -= len(piece)
                        yield piece
                if info.size % tarfile.BLOCKSIZE:
                    yield b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def extract(spool: IO[bytes], local_dir: str | os.PathLike[str]) -> int:
    """Unpack the tar in `spool` (at offset 0) into `local_dir` (created); returns the number of
    members. Uses the "data" filter (Python 3.11.4+), which refuses anything pointing outside."""
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is None:
        raise RuntimeError("download_dir needs tarfile's 'data' filter (Python 3.11.4 or newer)")
    root = os.fspath(local_dir)
    os.makedirs(root, exist_ok=True)

    def keep_symlinks(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        # A symlink is made as it is, even to an absolute path (a venv's bin/python3 -> /usr/bin/…):
        # making it writes nothing through it, and every later member still passes the "data"
        # filter, which resolves the links already on disk, so none is written through one that
        # leads out.
        if member.issym():
            return tarfile.tar_filter(member, dest)
        return data_filter(member, dest)

    with tarfile.open(fileobj=spool, mode="r:*", encoding=ENCODING, errors=ERRORS) as tf:
        try:
            tf.extractall(root, filter=keep_symlinks)
        except tarfile.FilterError as e:
            raise errors.InvalidRequest(
                f"the downloaded tree has a member that would land outside {root!r} ({e}); it and "
                "the members after it were not written (the ones before it were)",
                code="unsafe_member",
            ) from None
        return len(tf.getmembers())

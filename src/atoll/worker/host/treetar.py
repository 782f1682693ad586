"""Tar export and import of a volume's or drive's tree, in a process chrooted into the tree.

Run by the worker as `python -I -S treetar.py export|import ROOT` (worker.service.node via
`run_export`/`run_import` below): the child chroots into ROOT first, so nothing in the tree — a
symlink a sandbox planted, or swapped in while the tar is written — can make it read or write
outside. Export writes a tar of the tree (members relative to its root) to stdout; import reads a
tar from stdin and unpacks it with tarfile's `data` filter (no absolute names, no `..`, no device
nodes, no setuid bits, hard links only inside; a symbolic link to an absolute path is kept — in the
chroot it names a path of the tree, as it does in the sandbox), then prints one JSON line of counts. Standalone on
purpose: imports nothing of atoll (the file is run by path with an isolated interpreter).

Nothing may load code from the tree after the chroot (the child is root, and root leaves a chroot
at will): tarfile's user and group name lookups are switched off (glibc's NSS would read the
tree's /etc/nsswitch.conf and dlopen a library it names: a sandbox could plant both), every module
the work needs (the compressors included) is imported before the chroot, and the import path is
emptied after it, so a lazy import fails instead of reading a module from the tree.
"""

from __future__ import annotations

import bz2  # noqa: F401 - tarfile opens compressed streams with these: imported before the chroot
import contextlib
import errno
import gzip  # noqa: F401
import json
import lzma
import os
import sys
import tarfile
import zlib

# Numeric owners only: no getpwuid/getgrgid, so no NSS module is ever loaded (see the docstring).
tarfile.pwd = None  # type: ignore[attr-defined]
tarfile.grp = None  # type: ignore[attr-defined]


def _export() -> int:
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(".")):
            tar.add(name, recursive=True)
    return 0


def _import() -> int:
    counts = {"files": 0, "dirs": 0, "links": 0, "bytes": 0}
    try:
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|*") as tar:
            for member in tar:
                parts = member.name.split("/")
                if member.name.startswith("/") or ".." in parts:
                    msg = f"tar member {member.name!r} refused: names must be relative to the root, without '..'"
                    print(json.dumps({"error": "invalid_request", "message": msg}))
                    return 2
                if member.issym() and member.linkname.startswith("/"):
                    # An absolute link (a venv's bin/python3, what an export of the tree holds):
                    # in this chroot, as in the sandbox that mounts the tree, it names a path of
                    # the tree's own world, never the host's — made as it is (data_filter refuses it).
                    path = "/" + member.name.rstrip("/")
                    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
                    if os.path.lexists(path) and not os.path.isdir(path):
                        os.unlink(path)
                    os.symlink(member.linkname, path)
                    counts["links"] += 1
                    continue
                try:
                    checked = tarfile.data_filter(member, "/")
                except tarfile.FilterError as e:
                    print(json.dumps({"error": "invalid_request", "message": f"tar member refused: {e}"}))
                    return 2
                if checked is None:
                    continue
                try:
                    tar.extract(checked, "/", set_attrs=True, filter="fully_trusted")
                except KeyError as e:  # a hard link to a member the stream did not hold
                    msg = f"tar member {member.name!r} refused: {e.args[0] if e.args else e}"
                    print(json.dumps({"error": "invalid_request", "message": msg}))
                    return 2
                except BaseException:
                    if checked.isfile():  # a file cut short (full, or a truncated stream): removed
                        with contextlib.suppress(OSError):
                            os.unlink("/" + checked.name)
                    raise
                if checked.isdir():
                    counts["dirs"] += 1
                elif checked.issym() or checked.islnk():
                    counts["links"] += 1
                else:
                    counts["files"] += 1
                    counts["bytes"] += checked.size
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as e:
        # (tarfile's stream mode wraps the compressors' errors in ReadError; the others: belt and braces)
        print(json.dumps({"error": "invalid_request", "message": _not_a_tar(e, counts)}))
        return 2
    except OSError as e:
        # the tree is full, or the tar does not fit it (a file where it has a directory, ...)
        code = "store_full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "invalid_request"
        print(json.dumps({"error": code, "message": f"unpacking failed: {e.strerror}: {e.filename or ''}"}))
        return 3
    print(json.dumps(counts))
    return 0


def _not_a_tar(e: BaseException, counts: dict) -> str:
    if not (counts["files"] or counts["dirs"] or counts["links"]):
        return f"the body is not a tar archive: {e}; send a tar (optionally gzip) stream; nothing was written"
    return (
        f"the tar stream is damaged after {counts['files']} file(s), {counts['dirs']} dir(s) and "
        f"{counts['links']} link(s), which were written: {e}; send a whole tar (optionally gzip) stream"
    )


def main() -> int:
    verb, root = sys.argv[1], sys.argv[2]
    os.chroot(root)
    os.chdir("/")
    sys.path[:] = []  # a module not imported yet is not looked for in the tree
    sys.path_importer_cache.clear()
    return _export() if verb == "export" else _import()


if __name__ == "__main__":
    sys.exit(main())

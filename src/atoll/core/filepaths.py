"""The target of a files call: `path` (text, absolute or relative to the sandbox's working
directory) or `path_b64` (its exact bytes), checked the one way the API and the edge both take it.
Pure; used by controlplane.http (the API's file routes) and edge.service.
"""

from __future__ import annotations

import base64
import binascii

from atoll.core import errors

MAX_PATH = 4096
"""Longest file path a files call takes: characters of `path` once joined to the working directory,
bytes of `path_b64` (docs/specification.md states this; tests/unit/test_file_path_limits.py checks)."""


def check_path(path: str | None, path_b64: str | None = None, workdir: str | None = None) -> str | bytes:
    """The target of a files call: `path` (text), or `path_b64` (the exact bytes, standard or URL-safe
    base64, as GET …/files/list gives them) for names that are not UTF-8. A relative `path` is
    taken from the sandbox's working directory: its template's `workdir`, else / (where commands
    without a cwd run too)."""
    if path_b64 is not None:
        if path:
            raise errors.InvalidPath("give either 'path' or 'path_b64', not both")
        try:
            raw = base64.b64decode(
                path_b64.replace(" ", "+").replace("-", "+").replace("_", "/"), validate=True
            )
        except (ValueError, binascii.Error):
            raise errors.InvalidPath(
                f"path_b64 {path_b64[:100]!r} is not base64; pass the path_b64 of a GET …/files/list entry "
                "or base64 of the path's bytes"
            ) from None
        if b"\x00" in raw:
            raise errors.InvalidPath("path_b64 decodes to a path that contains a NUL byte")
        if not raw.startswith(b"/"):
            raise errors.InvalidPath(f"path_b64 decodes to {raw[:100]!r}, which is not an absolute path")
        if b".." in raw.split(b"/"):
            raise errors.InvalidPath(f"path_b64 decodes to {raw[:100]!r}, which contains '..'")
        if len(raw) > MAX_PATH:
            raise errors.InvalidPath(f"path_b64 decodes to {len(raw)} bytes; the limit is {MAX_PATH}")
        return raw
    if path is None or path == "":
        raise errors.InvalidPath(
            "query parameter 'path' is required: an absolute path inside the sandbox, e.g. /home/user/a.txt "
            "(or 'path_b64', its bytes in base64, for names that are not UTF-8)"
        )
    if "\x00" in path:
        raise errors.InvalidPath("path contains a NUL byte")
    if not path.startswith("/"):  # from the working directory: the template's workdir, else /
        path = (workdir or "/").rstrip("/") + "/" + path
    if any(part == ".." for part in path.split("/")):
        raise errors.InvalidPath(
            f"path {path!r} contains '..'; give the absolute path without parent references"
        )
    if len(path) > MAX_PATH:  # counted on the resolved path: a relative one includes its workdir
        raise errors.InvalidPath(f"path is {len(path)} characters; the limit is {MAX_PATH}")
    return path

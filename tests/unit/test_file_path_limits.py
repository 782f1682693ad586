"""What docs/specification.md's file-path row and docs/security-model.md say is what
`controlplane.http.check_path` enforces: a relative path is joined to the working directory
first and the 4096 limit counts the resolved path; `path_b64` is absolute only and counted in
bytes. Each clause of the row is checked against the code, and the row against the constant."""

from __future__ import annotations

import base64
import pathlib

import pytest

from atoll.controlplane import http
from atoll.core import errors

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _row() -> str:
    rows = [r for r in (DOCS / "specification.md").read_text().splitlines() if r.startswith("| file path")]
    assert len(rows) == 1, rows
    return rows[0]


def test_the_specification_row_says_what_check_path_enforces():
    row = _row()
    assert f"≤ {http.MAX_PATH} characters" in row and f"≤ {http.MAX_PATH} bytes" in row, row
    assert "relative" in row and "joined to the sandbox's working directory first" in row, row
    assert "a relative path's workdir counts" in row, row
    assert "`path_b64`: standard or URL-safe base64 of an absolute path" in row, row
    security = (DOCS / "security-model.md").read_text()
    assert "requires an absolute path" not in security  # written before relative paths
    assert f"resolved path over {http.MAX_PATH}" in security.replace("\n  ", " ")


def test_a_relative_path_is_joined_to_the_workdir_and_the_limit_counts_the_result():
    assert http.check_path("a.txt", None, "/srv/app") == "/srv/app/a.txt"
    assert http.check_path("a.txt", None, None) == "/a.txt"
    fits = "x" * (http.MAX_PATH - len("/srv/app/"))
    assert http.check_path(fits, None, "/srv/app") == "/srv/app/" + fits
    with pytest.raises(errors.InvalidPath, match=f"{http.MAX_PATH + 1} characters"):
        http.check_path(fits + "y", None, "/srv/app")  # fits alone, not with its workdir
    assert http.check_path("/" + "é" * (http.MAX_PATH - 1), None, None)  # characters, not bytes
    for bad in ("../etc/passwd", "/a/../b", "a\x00b", ""):
        with pytest.raises(errors.InvalidPath):
            http.check_path(bad, None, "/srv/app")


def test_path_b64_is_absolute_counted_in_bytes_and_alone():
    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    assert http.check_path(None, b64(b"/\xff"), "/srv/app") == b"/\xff"
    assert http.check_path(None, base64.urlsafe_b64encode(b"/\xfb\xff").decode()) == b"/\xfb\xff"
    assert http.check_path(None, b64(b"/" + b"x" * (http.MAX_PATH - 1)))
    for raw in (b"rel", b"/a/../b", b"/" + b"x" * http.MAX_PATH, b"/a\x00"):
        with pytest.raises(errors.InvalidPath):
            http.check_path(None, b64(raw), "/srv/app")
    with pytest.raises(errors.InvalidPath, match="not both"):
        http.check_path("/a", b64(b"/a"))

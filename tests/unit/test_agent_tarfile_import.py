"""The guest agent imports tarfile on its first tar call, from the template's Python, which the
sandbox's own code may have broken or removed: that is a clear 409, raised before any answer has
begun (a download used to answer 200 and then cut its stream)."""

from __future__ import annotations

import sys

import pytest

from atoll.guest.agent import tarball
from atoll.guest.agent.errors import ApiError


class _Conn:
    head_only = False

    def __init__(self):
        self.started = False

    def start_chunked(self, *_):
        self.started = True


def test_a_tarfile_that_cannot_be_imported_is_a_409_before_the_answer_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tarfile", None)  # as if the sandbox removed tarfile.py
    (tmp_path / "f").write_text("x")
    conn = _Conn()
    with pytest.raises(ApiError) as e:
        tarball.send(conn, str(tmp_path))
    assert (e.value.status, e.value.code) == (409, "invalid_state")
    assert "tarfile" in e.value.message and "restore it" in e.value.message
    assert conn.started is False

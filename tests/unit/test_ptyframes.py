"""The terminal frame format (one definition, atoll.guest.agent.ptyframes): frames round-trip through the incremental decoder in any split, and
bad frames and sizes are refused."""

from __future__ import annotations

import random

import pytest

from atoll.guest.agent import ptyframes as core


def test_round_trip_in_any_split():
    stream = (
        core.data(b"hello")
        + core.resize(132, 43)
        + core.exit_frame(130)
        + core.error("invalid_request", "x")
        + core.data(bytes(range(256)) * 10)
    )
    rng = random.Random(7)
    for _ in range(50):
        decoder = core.Decoder()
        frames, i = [], 0
        while i < len(stream):
            n = rng.randint(1, 40)
            frames += decoder.feed(stream[i : i + n])
            i += n
        assert [k for k, _ in frames] == [core.DATA, core.RESIZE, core.EXIT, core.ERROR, core.DATA]
        assert frames[0][1] == b"hello"
        assert core.parse_resize(frames[1][1]) == (132, 43)
        assert core.parse_exit(frames[2][1]) == 130
        assert core.parse_error(frames[3][1]) == {"code": "invalid_request", "message": "x"}
        assert frames[4][1] == bytes(range(256)) * 10


def test_big_data_is_split_and_bad_frames_are_refused():
    big = b"x" * (core.MAX_PAYLOAD + 5)
    frames = core.Decoder().feed(core.data(big))
    assert [len(p) for _, p in frames] == [core.MAX_PAYLOAD, 5]
    assert core.data(b"") == b""
    with pytest.raises(ValueError, match="unknown frame type 9"):
        core.Decoder().feed(b"\x09\x00\x00\x00\x00")
    with pytest.raises(ValueError, match="exceeds"):
        core.Decoder().feed(b"\x01\xff\xff\xff\xff")
    with pytest.raises(ValueError):
        core.parse_resize(b"\x00")


@pytest.mark.parametrize(
    ("cols", "rows", "bad"),
    [
        (1, 1, None),
        (1000, 1000, None),
        (0, 24, "cols"),
        (100000, 24, "cols"),
        (80, 0, "rows"),
        (True, 5, "cols"),
        ("80", 24, "cols"),
    ],
)
def test_size_bounds(cols, rows, bad):
    problem = core.size_problem(cols, rows)
    assert (problem is None) == (bad is None)
    if bad:
        assert problem.startswith(bad) and repr(cols if bad == "cols" else rows) in problem
    assert core.is_pty_id("pty_0123456789ab") and not core.is_pty_id("pty_../../x")

"""The guest agent's output capture (`capture.Capture`): a bounded head and tail of each stream with a
marker naming the bytes dropped between them, whatever the command writes."""

from __future__ import annotations

import os

from atoll.guest.agent import capture


def test_small_output_is_kept_whole():
    cap = capture.Capture(10)
    cap.add("stdout", b"0123")
    cap.add("stdout", b"456789")
    cap.add("stderr", b"ok")
    assert cap.result("stdout") == ("0123456789", 0)
    assert cap.result("stderr") == ("ok", 0)


def test_head_and_tail_are_kept_with_a_marker():
    cap = capture.Capture(10)
    for piece in (b"0123456", b"789abcdef", b"ghij", b"KLMNO"):
        cap.add("stdout", piece)
    text, dropped = cap.result("stdout")
    total = len(b"0123456789abcdefghijKLMNO")
    assert dropped == total - 10
    assert text.startswith("01234\n") and text.endswith("\nKLMNO")
    assert f"{dropped} bytes of stdout truncated" in text
    assert cap.result("stderr") == ("", 0)


def test_memory_stays_bounded_whatever_is_written():
    cap = capture.Capture(1000)
    chunk = os.urandom(capture.PIPE_READ)
    for _ in range(200):  # ~13 MB through a 1000-byte capture
        cap.add("stdout", chunk)
        assert len(cap.head["stdout"]) <= 500 and len(cap.tail["stdout"]) <= 500
    _, dropped = cap.result("stdout")
    assert 200 * len(chunk) - 1000 <= dropped <= 200 * len(chunk) - 1000 + 6


def test_one_big_piece_fills_head_and_tail():
    cap = capture.Capture(6)
    cap.add("stdout", b"abcdefghijklmnop")
    text, dropped = cap.result("stdout")
    assert text.startswith("abc\n") and text.endswith("\nnop") and dropped == 10


def test_cuts_fall_on_character_boundaries():
    cap = capture.Capture(8)
    cap.add("stderr", "ééééééééé".encode())  # 18 bytes, 2 per character; head ends inside a character?
    cap.add("stderr", b"x")
    text, dropped = cap.result("stderr")
    assert "\ufffd" not in text
    assert text.startswith("éé\n") and text.endswith("\néx")
    assert dropped == 19 - len("éé".encode()) - len("éx".encode())


def test_odd_sizes_and_a_limit_of_one():
    cap = capture.Capture(1)
    cap.add("stdout", b"abc")
    text, dropped = cap.result("stdout")
    assert text.startswith("a\n") and dropped == 2
    cap = capture.Capture(7)
    cap.add("stdout", b"0123456789")
    text, dropped = cap.result("stdout")
    assert text.startswith("0123\n") and text.endswith("\n789") and dropped == 3

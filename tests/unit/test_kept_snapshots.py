"""worker.runtimes.forks' kept state on disk (named snapshots and a fork's temporary one): what
`kept.json` holds survives a reload, an unfinished directory reads as none, and a snapshot's size
counts a hard-linked image once."""

from __future__ import annotations

import os

from atoll.worker.runtimes import forks


def test_kept_state_round_trips_and_unfinished_reads_as_none(tmp_path):
    d = tmp_path / "snp-0123456789abcdef"
    os.makedirs(d / "upper")
    assert forks.Kept.load(str(d)) is None  # no kept.json yet: a snapshot cut short
    settings = {"template": "base", "memory_mb": 256, "env": {"A": "1"}, "lower": "/l1:/l2"}
    forks.Kept(str(d), settings, True).save()
    kept = forks.Kept.load(str(d))
    assert kept is not None and kept.settings == settings and kept.memory is True
    assert kept.image == str(d / "image") and kept.upper == str(d / "upper")
    assert forks.Kept(str(d), settings, False).image is None
    (d / forks.KEPT_META).write_text("{not json")
    assert forks.Kept.load(str(d)) is None


def test_size_counts_hard_links_once(tmp_path):
    os.makedirs(tmp_path / "image")
    (tmp_path / "image" / "checkpoint.img").write_bytes(b"x" * 1000)
    os.link(tmp_path / "image" / "checkpoint.img", tmp_path / "link.img")
    (tmp_path / "upper.txt").write_bytes(b"y" * 10)
    assert forks.size_of(str(tmp_path)) == 1010

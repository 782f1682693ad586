"""tests/file_order.py, the order `make test` hands test files to its processes: its estimates
name files that exist, and the longest file comes first, an unlisted integration file before the
short unit files, files of equal estimates whole."""

from __future__ import annotations

import os

from tests import file_order

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_estimated_file_exists():
    gone = [p for p in file_order.ESTIMATE_S if not os.path.isfile(os.path.join(ROOT, p))]
    assert not gone, f"renamed or removed: take them out of tests/file_order.py (or re-measure): {gone}"


def test_longest_first_and_unlisted_by_folder():
    longest = max(file_order.ESTIMATE_S, key=file_order.ESTIMATE_S.__getitem__)
    paths = [
        "tests/unit/test_not_listed.py",
        "tests/integration/test_not_listed.py",
        "tests/unit/test_sniff.py",
        longest,
    ]
    assert sorted(paths, key=file_order.rank) == [
        longest,
        "tests/integration/test_not_listed.py",
        "tests/unit/test_sniff.py",
        "tests/unit/test_not_listed.py",
    ]


class _Item:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid


def test_items_keep_their_order_within_a_file_and_files_stay_whole():
    a, b = "tests/unit/test_a_not_listed.py", "tests/unit/test_b_not_listed.py"
    items = [_Item(f"{a}::t[1]"), _Item(f"{b}::t[1]"), _Item(f"{a}::t[2]"), _Item(f"{b}::t[2]")]
    items.append(_Item("tests/integration/test_split.py::t"))
    file_order.LongestFirst().pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/integration/test_split.py::t",
        f"{a}::t[1]",
        f"{a}::t[2]",
        f"{b}::t[1]",
        f"{b}::t[2]",
    ]

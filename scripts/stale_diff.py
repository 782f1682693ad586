"""What the generator scripts (gen_seam.py, unasync_sdk.py) print under `--check` when a checked-in
generated file is stale: the unified diff from it to what the script would write, then (on
stderr) the command that brings it up to date. Imported by both from this directory."""

from __future__ import annotations

import difflib
import sys


def print_diff(rel: str, current: str, expected: str, max_lines: int) -> None:
    """The first `max_lines` lines of the diff of `rel` from its checked-in text to the generated one."""
    diff = difflib.unified_diff(
        current.splitlines(keepends=True),
        expected.splitlines(keepends=True),
        f"{rel} (checked in)",
        f"{rel} (generated)",
    )
    sys.stdout.writelines(list(diff)[:max_lines])


def print_stale(what: str, script: str) -> None:
    print(f"\n{what} is stale: run `python scripts/{script}`", file=sys.stderr)

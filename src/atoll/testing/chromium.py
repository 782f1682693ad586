"""Debian's chromium as the dashboard's tests and benchmark launch it (headless, nothing fetched).

`PATH` is where `make test-ui` installs it; `ARGS` are the flags every launch passes to Playwright's
`chromium.launch(executable_path=PATH, args=ARGS)`: no setuid sandbox (we run as root), headless,
and none of chromium's own background traffic (updates, sync, first-run pages), so that the
browser talks only to the loopback server under test. Used by tests/ui/conftest.py and
bench/bench_ui.py.
"""

from __future__ import annotations

PATH = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

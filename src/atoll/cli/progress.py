"""What `atoll sandbox create` shows while its template is still being built (a first-time
build: the built-in template at a fresh start, or a user template just submitted): a rich status
line with the build's progress (its log's last line for a user template), polled every
POLL_S until the template is ready, then the create goes on. A create answers at once with an
error while there is no ready build (404/409), so the CLI waits first rather than fail.
Called by atoll.cli.main (`sandbox create`).
"""

from __future__ import annotations

import time
import typing

from rich.console import Console

from atoll import errors

POLL_S = 0.5


def _text(t: typing.Any) -> str:
    progress = (t.get("progress") or "").strip().splitlines()
    return f"building template {t.name!r}" + (f": {progress[-1][:100]}" if progress else "")


def wait_for_template(client: typing.Any, name: str, timeout_s: float = 3600.0) -> bool:
    """Block while template `name` is building, showing its progress on stderr. True if it had
    to wait. A template that does not exist (yet) or failed is left for the create to report."""
    try:
        t = client.templates.get(name)
    except errors.AtollError:
        return False
    if t.status != "building":
        return False
    console = Console(stderr=True)
    deadline = time.monotonic() + timeout_s
    with console.status(_text(t)) as status:
        while t.status == "building" and time.monotonic() < deadline:
            time.sleep(POLL_S)
            t = client.templates.get(name)
            status.update(_text(t))
    if t.status == "ready":
        console.print(f"template {name!r} ready")
    return True

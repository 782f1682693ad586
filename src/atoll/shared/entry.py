"""What each of atoll's long-running entry points does around serving: its settings loaded (a bad
one is a message on stderr and exit status 2), logging set up, root required, the start logged,
the event loop run, and the process ended with the status and the stop signal it got.

Used by `controlplane.main` (`atoll server`), `worker.service.main` (`atoll worker`) and `up`
(`atoll up`). It imports no process package.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import typing

from atoll.core import config
from atoll.shared import logconfig

T = typing.TypeVar("T")
ROOT_FOR = "runsc, mounts, network namespaces, cgroups"
"""Why a process with a worker in it needs root."""


def settings_or_exit(prog: str, load: typing.Callable[[], T]) -> T:
    """`load()`'s settings; a SettingsError is printed as `PROG: invalid setting: …` and the
    process exits with status 2 (nothing was started)."""
    try:
        return load()
    except config.SettingsError as e:
        print(f"{prog}: invalid setting: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def start(
    prog: str,
    settings: typing.Any,
    log: logging.Logger,
    *,
    needs_root: str | None = None,
    **extra: typing.Any,
) -> None:
    """Logging set up from `settings` (its log_format and log_level), root required when
    `needs_root` says what it is for, then `starting PROG` logged with the redacted settings."""
    logconfig.configure(settings.log_format, settings.log_level)
    if needs_root and os.geteuid() != 0:
        print(f"{prog}: {needs_root}; run as root", file=sys.stderr)
        raise SystemExit(2)
    log.info("starting %s", prog, extra={"settings": settings.redacted(), **extra})


def run(main: typing.Coroutine[typing.Any, typing.Any, int | None], caught: list[int] | None = None) -> None:
    """Run `main` in a new event loop and end the process with its status. The stop signals in
    `caught` (filled while it ran) are raised again once the loop is closed, so the process ends
    as the signal says (uvicorn's convention) but only after its clean-up."""
    status = asyncio.run(main)
    for sig in reversed(caught or []):
        signal.raise_signal(sig)
    raise SystemExit(status or 0)

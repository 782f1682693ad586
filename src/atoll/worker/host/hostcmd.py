"""Run host commands (ip, mount, mkfs, runsc) asynchronously with captured output.

Called by the worker's adapters (netns, storage, runsc). Raises RuntimeFailure with the command and
its stderr tail when a command fails, so the caller's error says what broke on the host.
"""

from __future__ import annotations

import asyncio
import logging
import os

from atoll.core import errors

log = logging.getLogger(__name__)


async def run(
    *argv: str,
    check: bool = True,
    input: bytes | None = None,
    timeout: float | None = 120,
    new_session: bool = False,
) -> tuple[int, str, str]:
    """Run argv, return (returncode, stdout, stderr). Raise RuntimeFailure on non-zero when check.

    `new_session=True` starts the command in its own session, out of reach of a signal sent to
    atoll's process group (Ctrl-C, `kill -- -pgid`): for steps that must finish even when atoll
    is being stopped, like `runsc delete`."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=new_session,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(input), timeout)
    except TimeoutError:
        try:
            os.kill(proc.pid, 9)
        except ProcessLookupError:
            pass
        await proc.wait()
        raise errors.RuntimeFailure(
            f"host command {os.path.basename(argv[0])} timed out after {timeout}s", detail=" ".join(argv)
        ) from None
    rc = proc.returncode or 0
    so, se = out.decode(errors="replace"), err.decode(errors="replace")
    if check and rc != 0:
        raise errors.RuntimeFailure(
            f"host command {os.path.basename(argv[0])} failed (exit {rc})",
            detail=f"{' '.join(argv)}: {se.strip()[-800:] or so.strip()[-800:]}",
        )
    return rc, so, se

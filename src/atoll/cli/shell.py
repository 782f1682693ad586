"""`atoll sandbox shell ID`: an interactive terminal in a sandbox, through the SDK's Terminal.

The local terminal is put in raw mode (restored on exit, also on errors and signals), so every
keystroke (^C, arrows, tab) goes to the sandbox's program and its output comes back as is; a
SIGWINCH resizes the remote terminal; the remote program's exit code is the command's. When stdin
is not a terminal (a pipe, a file) it still works, without raw mode: the input is typed as it is
read. Registered on `atoll sandbox` by `atoll.cli.main` (`register`).
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start
# and evaluating them from strings is slow (see atoll.cli.main).
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from atoll import errors

if TYPE_CHECKING:
    from atoll._client import Sandbox

_session: Callable[[typer.Context], AbstractContextManager[Any]]


def register(
    sandbox_app: typer.Typer, session: Callable[[typer.Context], AbstractContextManager[Any]]
) -> None:
    global _session
    _session = session
    sandbox_app.command("shell")(shell)


def shell(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    cmd: Annotated[
        str | None,
        typer.Option("--cmd", help="Run this (with the login shell's -c) instead of a login shell."),
    ] = None,
    term: Annotated[
        str | None,
        typer.Option("--term", help="TERM inside the sandbox (default: yours, else xterm-256color)."),
    ] = None,
) -> None:
    """Open an interactive terminal in a sandbox (resuming it); exit with the program's exit code."""
    from atoll._client import Sandbox  # here, not at the top: the CLI's start-up cost

    term = term or os.environ.get("TERM") or None
    with _session(ctx) as client:
        sandbox = Sandbox(client, {"id": sandbox_id})
        code = run(sandbox, cmd=cmd, term=term)
    raise typer.Exit(code)


def _size(fd: int) -> tuple[int, int]:
    """The local terminal's size; 80x24 for a dimension it reports as 0 (a pty nobody sized, as
    under `script` or some CI runners) or cannot tell."""
    try:
        size = os.get_terminal_size(fd)
        cols, rows = size.columns, size.lines
    except OSError:
        cols, rows = shutil.get_terminal_size((80, 24))
    return min(cols, 1000) if cols > 0 else 80, min(rows, 1000) if rows > 0 else 24


def run(sandbox: "Sandbox", *, cmd: str | None, term: str | None) -> int:
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    interactive = os.isatty(stdin)
    cols, rows = _size(stdout if os.isatty(stdout) else stdin)
    terminal = sandbox.pty(cols, rows, term=term, cmd=cmd)
    wake_r, wake_w = os.pipe()
    outcome: dict[str, Any] = {}

    def pump_output() -> None:
        try:
            for chunk in terminal:
                os.write(stdout, chunk)
            outcome["code"] = terminal.exit_code
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = e
        finally:
            os.write(wake_w, b"x")

    saved = termios.tcgetattr(stdin) if interactive else None
    old_winch = signal.signal(signal.SIGWINCH, lambda *_: os.write(wake_w, b"w"))
    reader = threading.Thread(target=pump_output, name="terminal-output", daemon=True)
    try:
        if saved is not None:
            tty.setraw(stdin, termios.TCSANOW)  # keep what was typed ahead
        reader.start()
        watching = [stdin, wake_r]
        while "code" not in outcome and "error" not in outcome:
            ready, _, _ = select.select(watching, [], [])
            if wake_r in ready:
                for note in os.read(wake_r, 64):
                    if note == ord("w"):
                        terminal.resize(*_size(stdout if os.isatty(stdout) else stdin))
                continue
            data = os.read(stdin, 65536)
            if data:
                terminal.send(data)
            else:
                watching = [wake_r]  # input ended (a pipe): wait for the program to end
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, old_winch)
        terminal.close()
        reader.join(5)
        os.close(wake_r)
        os.close(wake_w)
    if "error" in outcome:
        e = outcome["error"]
        if isinstance(e, errors.AtollError):
            raise e
        raise errors.APIConnectionError(f"the terminal broke: {type(e).__name__}: {e}")
    return int(outcome["code"])

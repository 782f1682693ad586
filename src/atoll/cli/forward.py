"""`atoll sandbox exec`'s standard input: forwarded to the command when it is not a terminal.

Up to INLINE_STDIN_BYTES of UTF-8 text go in the exec call itself (`stdin`, fed then closed, the
output streamed as for any exec). Anything larger, or bytes that are not UTF-8, is streamed: the
command starts as a background process, stdin goes to it in STDIN_CHUNK_BYTES pieces through
POST …/processes/{pid}/stdin (then EOF), and its output is followed until it exits; Ctrl-C kills
it. Called by `atoll.cli.main.exec_`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO, Any

from atoll._client import Sandbox
from atoll._client._models import ExecResult

INLINE_STDIN_BYTES = 512 * 1024  # well within the server's 1 MiB JSON body, escaping included
STDIN_CHUNK_BYTES = 1024 * 1024


def read_inline(stream: IO[bytes]) -> tuple[str | None, bytes]:
    """(text, b"") when all of `stream` is UTF-8 within INLINE_STDIN_BYTES; else (None, what was read)."""
    head = stream.read(INLINE_STDIN_BYTES + 1)
    if len(head) <= INLINE_STDIN_BYTES:
        try:
            return head.decode("utf-8"), b""
        except UnicodeDecodeError:
            pass
    return None, head


def run_streamed(
    sandbox: Sandbox,
    command: Any,
    head: bytes,
    stream: IO[bytes],
    write: Callable[[str, str], None],
    **exec_args: Any,
) -> ExecResult:
    """Run `command` as a background process fed with `head` then the rest of `stream`."""
    process = sandbox.exec(command, background=True, **exec_args)
    try:
        chunk = head
        while chunk:
            process.send_stdin(chunk)
            chunk = stream.read(STDIN_CHUNK_BYTES)
        process.close_stdin()
        exit_event = None
        for event in process.output(follow=True, offset=0):
            if event.kind in ("stdout", "stderr"):
                write(event.kind, event.text)
            elif event.kind == "exit":
                exit_event = event
    except BaseException:
        try:
            process.kill()
        finally:
            pass
        raise
    if exit_event is None:
        exit_code = process.wait()
        return ExecResult(exit_code=exit_code)
    return ExecResult(
        exit_code=exit_event.exit_code, timed_out=exit_event.timed_out, duration_ms=exit_event.duration_ms
    )


def stdin_forwarded(no_stdin: bool) -> bool:
    return not no_stdin and not sys.stdin.isatty()

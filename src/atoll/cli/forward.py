"""`atoll sandbox exec`'s standard input: forwarded to the command when it is not a terminal.

Up to INLINE_STDIN_BYTES of UTF-8 text go in the exec call itself (`stdin`, fed then closed, the
output streamed as for any exec). Anything larger, or bytes that are not UTF-8, is streamed: the
command starts as a background process, stdin goes to it in STDIN_CHUNK_BYTES pieces through
POST …/processes/{pid}/stdin (then EOF) while a second thread follows its output until it exits;
Ctrl-C kills it. Called by `atoll.cli.main.exec_`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from atoll import errors
from atoll._client import Sandbox
from atoll._client._models import ExecResult, OutputEvent

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
    """Run `command` as a background process fed with `head` then the rest of `stream`, its output
    followed on a second thread meanwhile (it goes through the process's 4 MiB output buffer: a
    gap, if the command outran the reader, is reported on stderr)."""
    process = sandbox.exec(command, background=True, **exec_args)
    ended: list[OutputEvent] = []
    failed: list[BaseException] = []

    def follow() -> None:
        try:
            for event in sandbox.processes.get(process.pid).output(follow=True, offset=0):
                if event.kind in ("stdout", "stderr"):
                    write(event.kind, event.text)
                elif event.kind == "dropped":
                    write("stderr", f"\n[atoll: {event.dropped} bytes of output were dropped here]\n")
                else:
                    ended.append(event)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failed.append(e)

    follower = threading.Thread(target=follow, name="atoll-output", daemon=True)
    follower.start()
    try:
        chunk = head
        while chunk:
            try:
                process.send_stdin(chunk)
            except (errors.ProcessExited, errors.StdinClosed):
                break  # it stopped reading (exited, or closed its stdin): the rest is dropped, as with a pipe
            chunk = stream.read(STDIN_CHUNK_BYTES)
        with contextlib.suppress(errors.ProcessExited, errors.StdinClosed):
            process.close_stdin()
        while follower.is_alive():
            follower.join(0.2)
    except BaseException:
        with contextlib.suppress(errors.AtollError):
            process.kill()
        raise
    if failed:
        raise failed[0]
    if not ended:
        return ExecResult(exit_code=process.wait())
    last = ended[-1]
    return ExecResult(exit_code=last.exit_code, timed_out=last.timed_out, duration_ms=last.duration_ms)


def stdin_forwarded(no_stdin: bool) -> bool:
    return not no_stdin and not sys.stdin.isatty()

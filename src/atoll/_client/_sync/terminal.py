"""GENERATED FILE - do not edit. `Terminal`: an interactive terminal over the sandbox's pty WebSocket.

Generated from `_async/terminal.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from atoll import errors

from .. import _base
from ._parents import SandboxLike

if TYPE_CHECKING:
    from websockets import exceptions as ws_exceptions
    from websockets.sync.client import ClientConnection


class Terminal:
    """An attached terminal (`sandbox.pty()` / `sandbox.pty_attach(id)`): `send` keystrokes,
    `read` or iterate over output bytes, `resize`, `wait` for the exit code. `close` (or leaving
    the context) detaches; the session lives on in the sandbox."""

    def __init__(self, sandbox: SandboxLike, pty_id: str, ws: ClientConnection) -> None:
        self.sandbox = sandbox
        self.pty_id = pty_id
        self._ws = ws
        self._pending: list[bytes] = []
        self.exit_code: int | None = None
        """The program's exit code, once it ended (set by `read`/`wait`)."""

    def _check_first(self) -> None:
        """An attach the server refused ends with one error message: raise it now."""
        try:
            msg = _base.recv(self._ws, 0.05)
        except TimeoutError:
            return
        except _closed() as exc:
            raise _base.terminal_closed(exc.rcvd.code if exc.rcvd else None, "", self.pty_id) from None
        kind, value = _base.terminal_message(msg)
        if kind == "error":
            self._ws.close()
            raise value
        if kind == "exit":
            self.exit_code = value
        else:
            self._pending.append(value)

    def send(self, data: bytes | str) -> None:
        """Type `data` (str is sent as UTF-8), in messages of at most 1 MiB (the server's limit)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        for i in range(0, len(raw), _base.TERMINAL_MESSAGE_MAX):
            self._send(raw[i : i + _base.TERMINAL_MESSAGE_MAX])

    def resize(self, cols: int, rows: int) -> None:
        problem = _base.terminal_size_problem(cols, rows)
        if problem:
            raise errors.InvalidRequest(problem, code="invalid_request")
        self._send(json.dumps({"resize": [cols, rows]}))

    def _send(self, message: bytes | str) -> None:
        if self.exit_code is not None:
            raise errors.Conflict(
                f"the program of terminal {self.pty_id} has ended (exit code {self.exit_code}); open "
                "a new one with sandbox.pty()",
                code="invalid_state",
            )
        try:
            self._ws.send(message)
        except _closed() as exc:
            raise _base.terminal_closed(
                exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else "", self.pty_id
            ) from exc

    def read(self, timeout: float | None = None) -> bytes:
        """The next piece of output; b"" once the program ended (`exit_code` is then set).
        TimeoutError if nothing arrives within `timeout` seconds."""
        if self._pending:
            return self._pending.pop(0)
        if self.exit_code is not None:
            return b""
        while True:
            try:
                msg = _base.recv(self._ws, timeout)
            except _closed() as exc:
                raise _base.terminal_closed(
                    exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else "", self.pty_id
                ) from None
            kind, value = _base.terminal_message(msg)
            if kind == "data":
                return value
            if kind == "exit":
                self.exit_code = value
                return b""
            raise value

    def wait(self, timeout: float | None = None) -> int:
        """Read (and drop) output until the program ends; its exit code."""
        while self.read(timeout):
            pass
        assert self.exit_code is not None
        return self.exit_code

    def close(self) -> None:
        """Detach (the session lives on)."""
        self._ws.close()

    def __iter__(self) -> Terminal:
        return self

    def __next__(self) -> bytes:
        data = self.read()
        if not data:
            raise StopIteration
        return data

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pty_id={self.pty_id!r}, sandbox={self.sandbox.id!r})"


def _closed() -> type[ws_exceptions.ConnectionClosed]:
    """websockets' ConnectionClosed, imported when first needed (websockets is imported only by
    terminals: see `pty_attach`)."""
    from websockets import exceptions

    return exceptions.ConnectionClosed

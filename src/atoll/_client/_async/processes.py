"""`sandbox.processes` and `AsyncProcess`: a command's handle (output by offset, stdin, signals, wait).

Part of the hand-written async SDK; `scripts/unasync_sdk.py` generates its sync twin in `_sync/`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from atoll import errors
from atoll.shared import ndjson

from .. import _base
from .._models import (
    OutputEvent,
    ProcessInfo,
)
from ._parents import SandboxLike


class AsyncProcesses:
    """`sandbox.processes`: call it for the list (`await sandbox.processes()`), or `get(pid)` for a
    handle on one background process (also after the caller that started it went away)."""

    def __init__(self, sandbox: SandboxLike) -> None:
        self.sandbox = sandbox

    async def __call__(self) -> list[ProcessInfo]:
        return await self.list()

    async def list(self) -> list[ProcessInfo]:
        """The background processes started in this sandbox, running or finished."""
        return [
            ProcessInfo(item) for item in await self.sandbox._client._items(self.sandbox._path("processes"))
        ]

    async def get(self, pid: int) -> AsyncProcess:
        """A handle on process `pid` (`ProcessNotFound` if the sandbox has no such process)."""
        process = AsyncProcess(self.sandbox, int(pid))
        await process.info()
        return process


class AsyncProcess:
    """Handle on a background process, returned by `sandbox.exec(..., background=True)` and
    `sandbox.processes.get(pid)`: its record (`info()`), `wait()`, `output()` from any offset,
    `send_stdin()` / `close_stdin()`, `signal()` and `kill()`. `data` is its last known record."""

    def __init__(self, sandbox: SandboxLike, pid: int, data: Mapping[str, Any] | None = None) -> None:
        self.sandbox = sandbox
        self.pid = pid
        self.data = dict(data or {"pid": pid})
        self.offset = 0
        """The offset after the last output event `output()` yielded: where a reattach resumes."""

    def _path(self, *rest: str) -> str:
        return self.sandbox._path("processes", str(self.pid), *rest)

    @property
    def running(self) -> bool | None:
        """As of the last `info()`, `wait()` or `signal()` (None before any)."""
        return self.data.get("running")

    @property
    def exit_code(self) -> int | None:
        return self.data.get("exit_code")

    async def kill(self) -> None:
        """SIGKILL its process group and forget it (its record and output are gone after)."""
        await self.sandbox.kill_process(self.pid)

    async def info(self) -> ProcessInfo:
        """Its record (`running`, `exit_code`, `stdin_open`, `output_bytes`, ...)."""
        response = await self.sandbox._client._request("GET", self._path())
        self.data = _base.json_body(response)
        return ProcessInfo(self.data)

    async def wait(self, timeout: float | None = None) -> int | None:  # noqa: ASYNC109 - the wait's own limit
        """Wait until it exits and return its exit code; `ProcessRunning` if it still runs after
        `timeout` seconds (None: no limit). The wait counts as activity: the sandbox stays up."""
        client = self.sandbox._client
        step = 60.0  # each call waits at most this long, so no HTTP timeout cuts a long wait
        left = timeout
        while True:
            this = step if left is None else min(step, left)
            try:
                response = await client._request(
                    "POST", self._path("wait"), json={"timeout_s": this}, timeout=this + client.timeout
                )
            except errors.ProcessRunning:
                if left is not None:
                    left -= this
                    if left <= 0:
                        raise
                continue
            self.data = _base.json_body(response)
            return self.data.get("exit_code")

    async def output(self, follow: bool = True, offset: int | None = None) -> AsyncIterator[OutputEvent]:
        """Its output from byte `offset` (default: where the last `output()` of this handle
        stopped, else 0) as `OutputEvent`s: stdout/stderr pieces, then an `exit` event once it has
        exited. With `follow` it waits for more until the exit; without, it ends at the output so
        far. Leaving the loop early leaves the process running; `output(offset=e.offset)` with
        the last event's offset resumes with nothing lost or repeated."""
        start = self.offset if offset is None else int(offset)
        params = {"offset": str(start), "follow": "1" if follow else "0"}
        client = self.sandbox._client
        timeout = httpx.Timeout(client.timeout, read=None) if follow else client.timeout
        async with client._stream("GET", self._path("output"), params=params, timeout=timeout) as response:
            async for line in ndjson.alines(response.aiter_bytes()):
                event = self._event(line)
                self.offset = event.offset
                yield event

    def _event(self, line: bytes) -> OutputEvent:
        obj = _base.json_line(line)
        if "error" in obj:
            raise _base.stream_error(obj)
        return OutputEvent.from_json(obj)

    async def send_stdin(self, data: str | bytes, eof: bool = False) -> int:
        """Write `data` (text is sent as UTF-8) to its stdin; close it after with `eof`. Returns
        the bytes written. `StdinClosed` after an eof, `ProcessExited` once it exited."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        response = await self.sandbox._client._request(
            "POST",
            self._path("stdin"),
            params={"eof": "1"} if eof else None,
            content=raw,
            headers={"Content-Type": "application/octet-stream"},
        )
        return int(_base.json_body(response).get("written", 0))

    async def close_stdin(self) -> None:
        """Close its stdin (the program reads EOF)."""
        await self.send_stdin(b"", eof=True)

    async def signal(self, name: str | int = "TERM") -> ProcessInfo:
        """Send a signal (TERM, SIGTERM, 15, INT, ...) to its process group; its record after."""
        response = await self.sandbox._client._request("POST", self._path("signal"), json={"signal": name})
        self.data = _base.json_body(response)
        return ProcessInfo(self.data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pid={self.pid}, sandbox={self.sandbox.id!r})"

"""Interactive processes of an atoll session for the Agents SDK's PTY calls (`pty_exec_start`,
`pty_write_stdin`, `pty_terminate_all`): `tty=True` runs on an atoll terminal (`sandbox.pty`, a
WebSocket), `tty=False` on a background process (`sandbox.exec(background=True)`) whose output is
followed. A pump task per process moves output into the buffer the SDK's `collect_pty_output`
drains. Used by `_session.AtollSandboxSession` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)

from atoll import errors


@dataclass
class PtyEntry:
    """One interactive process: an atoll terminal (`terminal`) or background process (`process`)."""

    tty: bool
    terminal: Any = None
    process: Any = None
    chunks: deque[bytes] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    last_used: float = field(default_factory=time.monotonic)
    pump: asyncio.Task[None] | None = None

    async def append(self, chunk: bytes) -> None:
        async with self.lock:
            self.chunks.append(chunk)
        self.notify.set()

    async def run_pump(self) -> None:
        """Follow the output until the program ends; its exit code then (-1 when the stream broke
        without one, so that the SDK does not wait for output that will never come)."""
        try:
            if self.tty:
                async for data in self.terminal:
                    await self.append(data)
                self.exit_code = self.terminal.exit_code
            else:
                async for event in self.process.output(follow=True):
                    if event.kind in ("stdout", "stderr") and event.text:
                        await self.append(event.text.encode("utf-8"))
                    elif event.kind == "exit":
                        self.exit_code = event.exit_code if event.exit_code is not None else -1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke: say so in the output, end the process
            await self.append(f"\n[atoll: output stream ended: {exc}]\n".encode())
        if self.exit_code is None:
            self.exit_code = -1
        async with self.lock:
            pass
        self.closed.set()
        self.notify.set()

    async def terminate(self) -> None:
        if self.exit_code is None:
            with contextlib.suppress(errors.AtollError, OSError):
                if self.tty:
                    await self.terminal.sandbox.kill_pty(self.terminal.pty_id)
                else:
                    await self.process.kill()
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()
            await asyncio.gather(self.pump, return_exceptions=True)
        if self.tty:
            with contextlib.suppress(Exception):
                await self.terminal.close()


class PtyProcesses:
    """The interactive processes of one session, by the ids the Agents SDK hands to the model."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._entries: dict[int, PtyEntry] = {}
        self._ids: set[int] = set()

    async def register(self, entry: PtyEntry) -> int:
        entry.pump = asyncio.create_task(entry.run_pump())
        async with self._lock:
            process_id = allocate_pty_process_id(self._ids)
            self._ids.add(process_id)
            pruned = self._prune()
            self._entries[process_id] = entry
        if pruned is not None:
            await pruned.terminate()
        return process_id

    def _prune(self) -> PtyEntry | None:
        if len(self._entries) < PTY_PROCESSES_MAX:
            return None
        meta = [(pid, e.last_used, e.closed.is_set()) for pid, e in self._entries.items()]
        victim = process_id_to_prune_from_meta(meta)
        if victim is None:
            return None
        self._ids.discard(victim)
        return self._entries.pop(victim, None)

    async def get(self, process_id: int) -> PtyEntry | None:
        async with self._lock:
            return self._entries.get(process_id)

    async def update(
        self,
        process_id: int,
        entry: PtyEntry,
        *,
        yield_ms: int,
        max_output_tokens: int | None,
        first: bool,
        input_empty: bool = False,
    ) -> PtyExecUpdate:
        wait_ms = (
            clamp_pty_yield_time_ms(yield_ms)
            if first
            else resolve_pty_write_yield_time_ms(yield_time_ms=yield_ms, input_empty=input_empty)
        )
        output, original_tokens, closed = await collect_pty_output(
            output_chunks=entry.chunks,
            output_lock=entry.lock,
            output_notify=entry.notify,
            is_done=entry.closed.is_set,
            yield_time_ms=wait_ms,
            max_output_tokens=max_output_tokens,
        )
        entry.last_used = time.monotonic()
        live_id: int | None = process_id
        exit_code = entry.exit_code if closed else None
        if exit_code is not None:
            async with self._lock:
                self._entries.pop(process_id, None)
                self._ids.discard(process_id)
            await entry.terminate()
            live_id = None
        return PtyExecUpdate(
            process_id=live_id, output=output, exit_code=exit_code, original_token_count=original_tokens
        )

    async def terminate_all(self) -> None:
        async with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._ids.clear()
        for entry in entries:
            await entry.terminate()

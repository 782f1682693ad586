"""envd's `process.Process` service (the `e2b` SDKs' `sandbox.commands` and `sandbox.pty`) over
atoll's seam for one sandbox, answered as envd answers (docs/e2b-compat.md §4.2, §6.2):

- every `Start` is an atoll **background** process started and followed in one seam call
  (`run_process`: one request to the worker, one to the guest agent); an E2B process outlives its
  stream, so a client that leaves leaves it running, and `Connect(pid)` re-attaches at the current
  end of its output (`process_output(follow=True)`, by offset);
- `/bin/bash -l -c CMD` runs as atoll's `cmd=CMD, shell="bash"` (the same login shell); any other
  argv runs as a list; `stdin: false` feeds an empty stdin (EOF at once), else a pipe stays open
  for `SendInput`/`StreamInput`/`CloseStdin`;
- the stream is `start{pid}`, then `data` (stdout/stderr bytes), a `keepalive` after each
  `Keepalive-Ping-Interval` seconds of silence, then `end{exitCode, exited, status, error}`;
- `Connect-Timeout-Ms` is the command's deadline: atoll's own `timeout_s` kills it (capped at
  86 400 s; past that the service sends KILL itself when connectrpc cancels the stream at the
  deadline) and the stream ends `deadline_exceeded`, as envd's;
- `SendSignal` is atoll's `signal_process` (never `kill_process`, which forgets the record and
  with it the `end` a stream waits for); a process a signal ended, whoever sent it (the seam's
  `ProcessExit.signal`), ends with envd's `exitCode -1` and `signal: killed` (Go's text);
- a pause with the stream open ends it with Connect `canceled` (the worker ends the follow:
  `ProcessEnded`); the process runs on, and `Connect(pid)` after `Sandbox.connect` reattaches;
- a PTY `Start` opens an atoll terminal (`open_pty`) and relays its attach (`attach_pty`) as `pty`
  data; `SendInput{pty}` and `Update` (resize) go through that attach when this service holds it,
  else through a short attach of their own.

Output is byte-exact: the seam's `ProcessOutput.b64` carries the bytes of a piece that is not
UTF-8. Known gap: `List` knows `envs`/`cwd` only for processes started through this service.

Built by the E2B edge with the worker and sandbox a call was routed to, like
`envd_files.FilesystemService`; the edge mounts it through the generated `ProcessASGIApplication`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import typing

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.e2b import envd_files
from atoll.e2b.proto.process import process_connect
from atoll.e2b.proto.process import process_pb as pr
from atoll.guest.agent import ptyframes

log = logging.getLogger(__name__)

MAX_TIMEOUT_S = 86_400
"""atoll's cap on a process's timeout_s; a longer deadline is kept by this service instead."""
OUTPUT_BYTES = 1 << 20
"""ExecSpec.max_output_bytes for the processes started here (unused by background reads)."""
MAX_STDIN_BYTES = api.MAX_STDIN_BYTES
_SIGNALS = {pr.Signal.SIGKILL: "KILL", pr.Signal.SIGTERM: "TERM"}
_SIGNAL_TEXT = {"KILL": "signal: killed", "TERM": "signal: terminated"}
_NUMBERS = {"KILL": 9, "TERM": 15}

Event = pr.ProcessEvent


def _event(kind: str, value: typing.Any) -> Event:
    return Event(event=Oneof(kind, value))  # type: ignore[arg-type]  # kind is one of the oneof's names


def _start(pid: int) -> Event:
    return _event("start", Event.StartEvent(pid=pid))


def _data(stream: str, data: bytes) -> Event:
    return _event("data", Event.DataEvent(output=Oneof(stream, data)))  # type: ignore[arg-type]


def _keepalive() -> Event:
    return _event("keepalive", Event.KeepAlive())


def _end(code: int, *, exited: bool, status: str, error: str | None = None) -> Event:
    end = Event.EndEvent(exit_code=code, exited=exited, status=status)
    if error is not None:
        end.error = error
    return _event("end", end)


def _config(cmd: str | list[str] | None) -> pr.ProcessConfig:
    """envd's config for an atoll command: a shell string is what `bash -l -c` ran."""
    if isinstance(cmd, list):
        return pr.ProcessConfig(cmd=cmd[0] if cmd else "", args=list(cmd[1:]))
    return pr.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", cmd or ""])


class ProcessService(process_connect.Process):
    def __init__(self, worker: api.WorkerAPI, sandbox_id: str, *, home: str = "/root"):
        self.worker, self.sid, self.home = worker, sandbox_id, home
        self._configs: dict[int, pr.ProcessConfig] = {}
        """What Start was asked for, by pid (envs and cwd are not in atoll's process record)."""
        self._tags: dict[str, int] = {}
        self._signalled: dict[int, str] = {}
        """pid -> the signal this service sent it (its end reads as envd's `signal: …`)."""
        self._ptys: dict[int, str] = {}
        """pid -> atoll terminal id, for the terminals opened here."""
        self._attaches: dict[int, api.PortStream] = {}
        """pid -> the attach a PTY Start stream relays (input and resizes go through it)."""
        self._tasks: set[asyncio.Future] = set()

    # ---- helpers -------------------------------------------------------------------------------
    async def _call(self, aw: typing.Awaitable) -> typing.Any:
        try:
            return await aw
        except errors.ProcessNotFound:
            raise ConnectError(Code.NOT_FOUND, "process not found in this sandbox") from None
        except errors.AtollError as e:
            raise envd_files.connect_error(e) from None

    def _pid(self, selector: pr.ProcessSelector | None) -> int:
        sel = selector.selector if selector is not None else None
        if sel is None:
            raise ConnectError(Code.INVALID_ARGUMENT, 'no process selected: give "process": {"pid": N}')
        if sel.field == "tag":
            pid = self._tags.get(sel.value)
            if pid is None:
                raise ConnectError(Code.NOT_FOUND, f"process with tag {sel.value!r} not found")
            return pid
        if not sel.value:
            raise ConnectError(Code.INVALID_ARGUMENT, "pid 0 selects no process; give the pid from Start")
        return int(sel.value)

    async def _process(self, pid: int) -> api.ProcessInfo:
        try:
            return await self.worker.get_process(self.sid, pid)
        except errors.ProcessNotFound:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found") from None
        except errors.AtollError as e:
            raise envd_files.connect_error(e) from None

    async def _pty_id(self, pid: int) -> str | None:
        if pid in self._ptys:
            return self._ptys[pid]
        for p in await self._call(self.worker.list_ptys(self.sid)):
            if p.pid == pid:
                self._ptys[pid] = p.pty_id
                return p.pty_id
        return None

    def _spawn(self, aw: typing.Awaitable) -> None:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _kill_at_deadline(self, pid: int) -> None:
        self._signalled.setdefault(pid, "KILL")
        with contextlib.suppress(errors.AtollError):
            await self.worker.signal_process(self.sid, pid, "KILL")

    def _end_of(self, pid: int, exit: api.ProcessExit) -> Event:
        sent = self._signalled.get(pid)
        if exit.exit_code is None:
            return _end(-1, exited=False, status="unknown", error="the process ended without an exit status")
        if exit.signal is not None:  # whoever sent it (`kill -9 <pid>` from another command too)
            text = signal_status(exit.signal)
            return _end(-1, exited=False, status=text, error=text)
        if sent is not None and exit.exit_code == 128 + _NUMBERS[sent]:
            # a worker that does not say which signal ended it: the one this service sent
            text = _SIGNAL_TEXT[sent]
            return _end(-1, exited=False, status=text, error=text)
        return _end(exit.exit_code, exited=True, status=f"exit status {exit.exit_code}")

    async def _follow(self, pid: int, offset: int, ctx: typing.Any) -> typing.AsyncIterator[Event]:
        """Output from `offset` and the end, keepalives in silences; at the deadline the process
        is killed (connectrpc ends the stream with deadline_exceeded)."""
        with self._guarded(pid, ctx):
            async with self.worker.process_output(self.sid, pid, offset, True) as events:
                async for ev in self._relay(pid, events, ctx):
                    yield ev

    @contextlib.contextmanager
    def _guarded(self, pid: int | None, ctx: typing.Any) -> typing.Iterator[list[int]]:
        """Around a follow of process `pid` (or of the one being started: its pid is appended to
        the list this gives once known): the seam's errors as Connect's, and the process killed
        when the stream is cancelled at its deadline."""
        known = [] if pid is None else [pid]
        try:
            yield known
        except errors.ProcessNotFound:
            what = f"process with pid {known[0]}" if known else "the process"
            raise ConnectError(Code.NOT_FOUND, f"{what} not found") from None
        except errors.AtollError as e:
            raise envd_files.connect_error(e) from None
        except asyncio.CancelledError:
            left = getattr(ctx, "timeout_ms", None)
            if known and left is not None and left <= 0:  # the deadline, not a client that left
                self._spawn(self._kill_at_deadline(known[0]))
            raise

    async def _relay(
        self, pid: int, events: typing.AsyncIterator[api.ProcessEvent], ctx: typing.Any
    ) -> typing.AsyncIterator[Event]:
        """The seam's events of a followed process as envd's, keepalives in silences."""
        keepalive = envd_files._keepalive_s(ctx)
        it = aiter(events)
        while True:
            # the next piece, waited for across keepalives: cancelling a pending read
            # would close the output stream's generator
            nxt = asyncio.ensure_future(anext(it))
            try:
                while not (await asyncio.wait({nxt}, timeout=keepalive))[0]:
                    yield _keepalive()
                ev = nxt.result()
            except StopAsyncIteration:
                raise ConnectError(
                    Code.UNAVAILABLE, f"the output of process {pid} ended without its exit; reconnect"
                ) from None
            finally:
                if not nxt.done():
                    nxt.cancel()
                    # let the read end before the stream's generator is closed (closing it while
                    # the read runs is `aclose(): asynchronous generator is already running`)
                    await asyncio.wait({nxt})
            if isinstance(ev, api.ProcessOutput):
                raw = base64.b64decode(ev.b64) if ev.b64 is not None else ev.text.encode()
                if raw:
                    yield _data(ev.stream, raw)
            elif isinstance(ev, api.ProcessEnded):
                # the sandbox is being paused: the process runs on after Sandbox.connect
                raise ConnectError(Code.CANCELED, envd_files.PAUSED_STREAM)
            elif isinstance(ev, api.ProcessExit):
                if ev.timed_out:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {pid} was killed at its timeout")
                yield self._end_of(pid, ev)
                return

    # ---- RPCs ----------------------------------------------------------------------------------
    async def start(self, request: pr.StartRequest, ctx) -> typing.AsyncIterator[pr.StartResponse]:
        proc = request.process
        if proc is None or not proc.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, 'no command: give "process": {"cmd": …, "args": […]}')
        if request.pty is not None:
            async for ev in self._start_pty(request, ctx):
                yield pr.StartResponse(event=ev)
            return
        args = list(proc.args)
        cmd: str | list[str]
        shell: typing.Literal["bash"] | None = None
        if proc.cmd in ("/bin/bash", "bash") and len(args) == 3 and args[:2] == ["-l", "-c"]:
            cmd, shell = args[2], "bash"
        else:
            cmd = [proc.cmd, *args]
        timeout_s = None
        left = ctx.timeout_ms
        if left is not None:
            if left <= 0:
                raise ConnectError(Code.DEADLINE_EXCEEDED, "the deadline passed before the command started")
            if left / 1000 <= MAX_TIMEOUT_S:
                timeout_s = max(left / 1000, 0.001)
        fed_and_closed = request.has_field("stdin") and not request.stdin
        spec = api.ExecSpec(
            cmd=cmd,
            max_output_bytes=OUTPUT_BYTES,
            cwd=proc.cwd or self.home,
            env=dict(proc.envs) or None,
            timeout_s=timeout_s,
            user=_basic_user(ctx),
            stdin="" if fed_and_closed else None,
            shell=shell,
        )
        # one call: the process started and its output followed (the seam's run_process)
        with self._guarded(None, ctx) as known:
            async with self.worker.run_process(self.sid, spec) as (started, events):
                pid = started.pid
                known.append(pid)
                self._configs[pid] = pr.ProcessConfig(
                    cmd=proc.cmd, args=args, envs=dict(proc.envs), cwd=proc.cwd or self.home
                )
                if request.tag:
                    self._tags[request.tag] = pid
                yield pr.StartResponse(event=_start(pid))
                async for ev in self._relay(pid, events, ctx):
                    yield pr.StartResponse(event=ev)

    async def connect(self, request: pr.ConnectRequest, ctx) -> typing.AsyncIterator[pr.ConnectResponse]:
        pid = self._pid(request.process)
        pty_id = await self._pty_id(pid)
        if pty_id is not None:
            yield pr.ConnectResponse(event=_start(pid))
            async for ev in self._relay_pty(pid, pty_id, ctx, replay=False):
                yield pr.ConnectResponse(event=ev)
            return
        info = await self._process(pid)
        yield pr.ConnectResponse(event=_start(pid))
        async for ev in self._follow(pid, info.output_bytes, ctx):
            yield pr.ConnectResponse(event=ev)

    async def list(self, request: pr.ListRequest, ctx) -> pr.ListResponse:
        out = []
        for p in await self._call(self.worker.list_processes(self.sid)):
            if p.running:
                out.append(pr.ProcessInfo(config=self._configs.get(p.pid) or _config(p.cmd), pid=p.pid))
        for t in await self._call(self.worker.list_ptys(self.sid)):
            if t.running:
                out.append(pr.ProcessInfo(config=self._configs.get(t.pid) or _config(t.cmd), pid=t.pid))
        tags = {pid: tag for tag, pid in self._tags.items()}
        for info in out:
            if info.pid in tags:
                info.tag = tags[info.pid]
        return pr.ListResponse(processes=out)

    async def _stdin(self, pid: int, data: bytes, eof: bool) -> None:
        if len(data) > MAX_STDIN_BYTES:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED,
                f"{len(data)} bytes of input in one message; send at most {MAX_STDIN_BYTES}",
            )
        try:
            await self.worker.send_stdin(self.sid, pid, data, eof)
        except errors.ProcessNotFound:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found") from None
        except errors.AtollError as e:
            raise envd_files.connect_error(e) from None

    async def _input(self, pid: int, given: pr.ProcessInput | None) -> None:
        inp = given.input if given is not None else None
        if inp is None:
            raise ConnectError(
                Code.INVALID_ARGUMENT, 'no input: give "input": {"stdin": <base64>} or {"pty": …}'
            )
        if inp.field == "pty":
            await self._pty_send(pid, ptyframes.data(inp.value))
        else:
            await self._stdin(pid, inp.value, False)

    async def send_input(self, request: pr.SendInputRequest, ctx) -> pr.SendInputResponse:
        await self._input(self._pid(request.process), request.input)
        return pr.SendInputResponse()

    async def stream_input(
        self, request: typing.AsyncIterator[pr.StreamInputRequest], ctx
    ) -> pr.StreamInputResponse:
        pid: int | None = None
        async for msg in request:
            ev = msg.event
            if ev is None or ev.field == "keepalive":
                continue
            if ev.field == "start":
                pid = self._pid(ev.value.process)
                await self._process(pid)  # an unknown pid fails before any input
                continue
            if pid is None:
                raise ConnectError(
                    Code.INVALID_ARGUMENT, "the first message of StreamInput must be start{process}"
                )
            await self._input(pid, ev.value.input)
        return pr.StreamInputResponse()

    async def close_stdin(self, request: pr.CloseStdinRequest, ctx) -> pr.CloseStdinResponse:
        pid = self._pid(request.process)
        if await self._pty_id(pid) is not None:
            raise ConnectError(
                Code.FAILED_PRECONDITION, f"process {pid} is a terminal: send Ctrl-D (\\x04) instead"
            )
        await self._stdin(pid, b"", True)
        return pr.CloseStdinResponse()

    async def send_signal(self, request: pr.SendSignalRequest, ctx) -> pr.SendSignalResponse:
        pid = self._pid(request.process)
        name = _SIGNALS.get(request.signal)
        if name is None:
            raise ConnectError(
                Code.UNIMPLEMENTED, f"signal {request.signal.name} is not supported; send SIGTERM or SIGKILL"
            )
        pty_id = await self._pty_id(pid)
        if pty_id is not None and name == "KILL":
            self._signalled[pid] = name
            await self._call(self.worker.kill_pty(self.sid, pty_id))
            return pr.SendSignalResponse()
        info = await self._process(pid)
        if info.running:
            self._signalled[pid] = name
        try:
            await self.worker.signal_process(self.sid, pid, name)
        except errors.ProcessNotFound:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found") from None
        except errors.AtollError as e:
            raise envd_files.connect_error(e) from None
        return pr.SendSignalResponse()

    async def update(self, request: pr.UpdateRequest, ctx) -> pr.UpdateResponse:
        pid = self._pid(request.process)
        if request.pty is None or request.pty.size is None:
            return pr.UpdateResponse()  # envd: nothing to change
        size = request.pty.size
        problem = ptyframes.size_problem(size.cols, size.rows)
        if problem:
            raise ConnectError(Code.INVALID_ARGUMENT, f"terminal size: {problem}")
        await self._pty_send(pid, ptyframes.resize(size.cols, size.rows))
        return pr.UpdateResponse()

    # ---- terminals -----------------------------------------------------------------------------
    async def _start_pty(self, request: pr.StartRequest, ctx) -> typing.AsyncIterator[Event]:
        proc, pty = request.process, request.pty
        assert proc is not None and pty is not None  # start() checked both
        size = pty.size
        cols, rows = (size.cols, size.rows) if size is not None else (80, 24)
        problem = ptyframes.size_problem(cols, rows)
        if problem:
            raise ConnectError(Code.INVALID_ARGUMENT, f"terminal size: {problem}")
        envs = dict(proc.envs)
        spec = api.PtySpec(
            cols=cols,
            rows=rows,
            term=envs.get("TERM"),
            cmd=[proc.cmd, *proc.args],
            cwd=proc.cwd or self.home,
            env=envs or None,
            user=_basic_user(ctx),
        )
        started = await self._call(self.worker.open_pty(self.sid, spec))
        pid = started.pid
        self._ptys[pid] = started.pty_id
        self._configs[pid] = pr.ProcessConfig(cmd=proc.cmd, args=list(proc.args), envs=envs, cwd=spec.cwd)
        if request.tag:
            self._tags[request.tag] = pid
        yield _start(pid)
        async for ev in self._relay_pty(pid, started.pty_id, ctx, replay=True):
            yield ev

    async def _relay_pty(self, pid: int, pty_id: str, ctx, *, replay: bool) -> typing.AsyncIterator[Event]:
        keepalive = envd_files._keepalive_s(ctx)
        stream = await self._call(self.worker.attach_pty(self.sid, pty_id))
        self._attaches.setdefault(pid, stream)
        decoder = ptyframes.Decoder()
        first = True
        try:
            while True:
                nxt = asyncio.ensure_future(stream.read(65536))
                try:
                    while not (await asyncio.wait({nxt}, timeout=keepalive))[0]:
                        yield _keepalive()
                    chunk = nxt.result()
                finally:
                    if not nxt.done():
                        nxt.cancel()
                        # let the read end before the stream's generator is closed (closing it while
                        # the read runs is `aclose(): asynchronous generator is already running`)
                        await asyncio.wait({nxt})
                if not chunk:
                    if pid in self._signalled:
                        text = _SIGNAL_TEXT[self._signalled[pid]]
                        yield _end(-1, exited=False, status=text, error=text)
                        return
                    raise ConnectError(
                        Code.UNAVAILABLE, f"the terminal of process {pid} went away; reconnect"
                    )
                for kind, payload in decoder.feed(chunk):
                    if kind == ptyframes.DATA:
                        # an attach replays the scrollback first: a Connect starts at the live end
                        if replay or not first:
                            yield _data("pty", payload)
                    elif kind == ptyframes.EXIT:
                        code = ptyframes.parse_exit(payload)
                        sent = self._signalled.get(pid)
                        if sent is not None and code == 128 + _NUMBERS[sent]:
                            yield _end(-1, exited=False, status=_SIGNAL_TEXT[sent], error=_SIGNAL_TEXT[sent])
                        else:
                            yield _end(code, exited=True, status=f"exit status {code}")
                        return
                    first = False
                first = False
        except asyncio.CancelledError:
            left = getattr(ctx, "timeout_ms", None)
            if left is not None and left <= 0:
                self._signalled.setdefault(pid, "KILL")
                self._spawn(self._call(self.worker.kill_pty(self.sid, pty_id)))
            raise
        finally:
            if self._attaches.get(pid) is stream:
                del self._attaches[pid]
            stream.close()

    async def _pty_send(self, pid: int, frames: bytes) -> None:
        pty_id = await self._pty_id(pid)
        if pty_id is None:
            await self._process(pid)  # not_found for an unknown pid
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {pid} has no terminal; send stdin instead")
        held = self._attaches.get(pid)
        try:
            if held is not None and not held.closed:
                await held.write(frames)
                return
            stream = await self._call(self.worker.attach_pty(self.sid, pty_id))
            try:
                await stream.write(frames)
            finally:
                stream.close()
        except (ConnectionError, OSError) as e:
            raise ConnectError(Code.UNAVAILABLE, f"the terminal of process {pid} is gone: {e}") from None

    async def close(self) -> None:
        """Drop what this service holds (the sandbox went away, or the edge stops)."""
        for stream in list(self._attaches.values()):
            stream.close()
        self._attaches.clear()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


_GO_SIGNALS = {
    1: "hangup",
    2: "interrupt",
    3: "quit",
    4: "illegal instruction",
    5: "trace/breakpoint trap",
    6: "aborted",
    7: "bus error",
    8: "floating point exception",
    9: "killed",
    10: "user defined signal 1",
    11: "segmentation fault",
    12: "user defined signal 2",
    13: "broken pipe",
    14: "alarm clock",
    15: "terminated",
}


def signal_status(signal: int) -> str:
    """envd's status for a process a signal ended: Go's `ProcessState.String()`."""
    return "signal: " + _GO_SIGNALS.get(signal, f"signal {signal}")


def _basic_user(ctx: typing.Any) -> str | None:
    """The user of `Authorization: Basic base64("user:")`, as the SDKs send it (None: not given)."""
    raw = None
    with contextlib.suppress(Exception):
        raw = ctx.request_headers.get("authorization")
    if not raw or not raw.lower().startswith("basic "):
        return None
    try:
        user = base64.b64decode(raw[6:].strip(), validate=True).decode().split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError(
            Code.INVALID_ARGUMENT, "the Authorization header is not Basic base64(user:)"
        ) from None
    return user or None

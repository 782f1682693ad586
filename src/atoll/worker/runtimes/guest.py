"""Calls to each sandbox's guest agent, watched, and translated into the seam's types.

The guest agent speaks its own small HTTP/JSON protocol (guest/agent); this module is the only
place that knows it. Every call runs under `_watch`: it ends at once when the sandbox's runtime
dies (liveness), and a call that waits long has the agent's `/health` asked on another connection
every PROBE_EVERY_S: one failure gets the agent a SIGCONT (`runsc kill`, the one way something
inside can have stopped it), PROBE_FAILURES in a row end the call and mark the sandbox failed.
Answers are untrusted data (the agent runs beside the code it serves): they are bounded, and
decoded into core.worker_api types before anything else sees them.
Called by worker.node (exec, files, processes), worker.tiers (health, gate, identity) and
worker.pressure (relief).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import socket
import time
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass

from atoll.core import errors, wire
from atoll.core import worker_api as api
from atoll.shared import ndjson, portstream
from atoll.worker.host import bundle, netns, runsc
from atoll.worker.runtimes import agent_channel
from atoll.worker.runtimes.liveness import Liveness
from atoll.worker.runtimes.runtime import RuntimeStore

log = logging.getLogger(__name__)

PROBE_AFTER_S = 5.0
PROBE_EVERY_S = 3.0
PROBE_TIMEOUT_S = 4.0
PROBE_FAILURES = 3
SPAWN_TIMEOUT_S = 30.0  # a background exec answers once its process is spawned
EXEC_MARGIN_S = 30.0  # an exec with timeout_s gets this long beyond it for its answer
FINAL_GATE_TIMEOUT_S = 5.0  # POST /gate/final waits up to 2 s in the agent, then for our shutdown
NDJSON = "application/x-ndjson"


@dataclass
class Gate:
    """What the checkpoint gate found: whether this runsc could save the sandbox now."""

    ok: bool
    blockers: list[str]
    external_connections: int = 0


def _agent_error(r: agent_channel.Response) -> errors.AtollError:
    try:
        err = r.json()["error"]
        code, message = str(err.get("code", "runtime_error")), str(err.get("message", r.text))
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message = "runtime_error", f"guest agent answered {r.status_code}: {r.text[:300]}"
    return errors.from_code(code, message, status=r.status_code)


def _path_param(path: api.FilePath) -> dict[str, str | bytes]:
    return {"path": path}


class Guest:
    def __init__(self, runtimes: RuntimeStore, runsc_root: str, liveness: Liveness):
        self.runtimes = runtimes
        self.runsc_root = runsc_root
        self.liveness = liveness
        self._channels: dict[str, agent_channel.AgentChannel] = {}
        self._bg: set[asyncio.Task] = set()
        self._attached: dict[str, set[_AttachedPty]] = {}  # terminal attach sockets, reset with the rest
        self._sealed: dict[str, errors.AtollError] = {}  # final_gate .. unseal: no new connection

    # ---- channels -------------------------------------------------------------------------------
    def channel(self, sid: str) -> agent_channel.AgentChannel:
        sealed = self._sealed.get(sid)
        if sealed is not None:  # a checkpoint is being taken: a connection now would fail it
            raise sealed
        ch = self._channels.get(sid)
        if ch is None:
            rt = self.runtimes.get(sid)
            ch = agent_channel.AgentChannel(rt.name, netns.SANDBOX_IP, bundle.AGENT_PORT)
            self._channels[sid] = ch
        return ch

    async def close(self, sid: str, ended: errors.AtollError | None = None) -> None:
        """Reset every connection to the sandbox's agent (RSTs, no TIME_WAIT inside it). `ended`:
        what the calls this cuts answer (the sandbox is being deleted or checkpointed), rather
        than "the agent did not answer"."""
        ch = self._channels.pop(sid, None)
        if ch is not None:
            ch.ended = ended
            await ch.aclose()
        for stream in list(self._attached.pop(sid, ())):
            stream.close()

    async def final_gate(self, sid: str, ended: errors.AtollError) -> Gate:
        """The last call before a checkpoint, after `close(sid)`: POST /gate/final on a connection of
        its own. The agent waits until the endpoints of the connections just reset have left the
        connected state, answers the gate (a TCP connection or epoll server that came up since the
        first gate refuses it now), and once we shut our side down resets this connection itself,
        so when we see that reset nothing of ours is open inside (DESIGN.md: an endpoint still
        connected when runsc saves kills the sandbox). From here until `unseal(sid)` no connection
        to the agent is opened: a call meanwhile gets `ended`."""
        rt = self.runtimes.get(sid)
        sock = await agent_channel.AgentChannel(rt.name, netns.SANDBOX_IP, bundle.AGENT_PORT).make_socket()
        self._sealed[sid] = ended
        try:
            return await asyncio.wait_for(self._ask_final_gate(sock), FINAL_GATE_TIMEOUT_S)
        except (
            OSError,
            TimeoutError,
            asyncio.IncompleteReadError,
            ValueError,
            IndexError,
            TypeError,
            AttributeError,
        ) as e:
            return Gate(False, [f"the checkpoint gate could not be evaluated: {e!r}"])
        finally:
            sock.close()  # after the agent's reset: nothing is sent; else an RST, and no checkpoint

    @staticmethod
    async def _ask_final_gate(sock: typing.Any) -> Gate:
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (netns.SANDBOX_IP, bundle.AGENT_PORT))
        await loop.sock_sendall(
            sock, b"POST /gate/final HTTP/1.1\r\nHost: agent\r\nContent-Length: 0\r\n\r\n"
        )
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk or len(buf) > 65536:
                raise ValueError(f"no complete answer head from the agent: {buf[:200]!r}")
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if length > 1 << 20:
            raise ValueError(f"gate answer of {length} bytes")
        while len(body) < length:
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                raise ValueError("the agent closed the connection mid-answer")
            body += chunk
        if status == 404:
            # An agent from before /gate/final (a sandbox restored from an older image): reset
            # this connection and give the stack a moment, as before.
            sock.close()
            await asyncio.sleep(0.05)
            return Gate(True, [])
        data = json.loads(body[:length])
        if status != 200:
            raise ValueError(f"the agent answered {status}: {data!r}")
        sock.shutdown(socket.SHUT_WR)  # we have read the answer: the agent may reset now
        while True:
            try:
                chunk = await loop.sock_recv(sock, 4096)
            except ConnectionResetError:
                break  # the agent's reset: its endpoint was closed within its close call
            if not chunk:  # an orderly close (not this agent's way): let its last ACK land
                await asyncio.sleep(0.05)
                break
        blockers = [str(b) for b in data.get("blockers", [])]
        return Gate(not blockers, blockers, int(data.get("external_connections", 0)))

    def unseal(self, sid: str) -> None:
        self._sealed.pop(sid, None)

    async def aclose(self) -> None:
        for sid in list(self._channels):
            await self.close(sid)
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=5)

    # ---- watched calls --------------------------------------------------------------------------
    async def _watch(self, sid: str, aw: typing.Awaitable) -> typing.Any:
        """Await `aw` (an agent call), but give up as soon as the sandbox's runtime dies, or when its
        agent stops answering health checks (see the module docstring)."""
        task = asyncio.ensure_future(aw)
        died = asyncio.ensure_future(self.liveness.exited(sid).wait())
        probe: asyncio.Future | None = None
        failures = 0
        next_probe = time.monotonic() + PROBE_AFTER_S
        try:
            while True:
                waiting = {task, died} if probe is None else {task, died, probe}
                timeout = max(0.0, next_probe - time.monotonic()) if probe is None else None
                await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                if died.done() or not self.liveness.alive(sid):
                    raise self.liveness.died(sid)
                if probe is not None and probe.done():
                    failures = 0 if probe.result() else failures + 1
                    probe = None
                    next_probe = time.monotonic() + PROBE_EVERY_S
                    if failures >= PROBE_FAILURES:
                        raise self._unresponsive(sid, failures)
                    if failures:
                        self._continue_agent(sid)
                elif probe is None and time.monotonic() >= next_probe:
                    probe = asyncio.ensure_future(self.answers(sid))
        finally:
            for t in (task, probe, died):
                if t is not None and not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t

    async def answers(self, sid: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
        try:
            r = await self.channel(sid).request("GET", "/health", timeout=timeout)
            return r.status_code == 200
        except (agent_channel.ChannelError, OSError):
            return False

    def _continue_agent(self, sid: str) -> None:
        """SIGCONT to the agent, in the background (`runsc kill` would hang on a hung sentry)."""
        rt = self.runtimes.get(sid)
        log.warning("sandbox.agent.unresponsive: sending SIGCONT", extra={"sandbox_id": sid})
        t = asyncio.ensure_future(runsc.signal(self.runsc_root, rt.cid, "CONT"))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _unresponsive(self, sid: str, failures: int) -> errors.SandboxDied:
        rt = self.runtimes.get(sid)
        cause = (
            f"the guest agent of sandbox {sid} stopped answering: {failures} health checks in a row "
            f"failed within {PROBE_TIMEOUT_S:.0f}s each (a SIGCONT did not help) while a call was waiting; "
            "the sandbox is marked failed — its files are kept until you delete it"
        )
        log.warning("sandbox.agent.unresponsive", extra={"sandbox_id": sid, "generation": rt.generation})
        self.liveness.failed(sid, cause)
        return errors.SandboxDied(cause)

    def _unreachable(
        self, sid: str, e: agent_channel.ChannelError, ch: agent_channel.AgentChannel
    ) -> errors.AtollError:
        """What a failed agent call means: the worker closed the channel on purpose (deleted,
        checkpointed), the sandbox died, its answer was too large to hold, or the agent did not
        answer."""
        if ch.ended is not None:
            return ch.ended
        if not self.liveness.alive(sid):
            return self.liveness.died(sid)
        if isinstance(e, agent_channel.AnswerTooLarge):
            return errors.PayloadTooLarge(
                f"the answer from sandbox {sid} is larger than {agent_channel.MAX_ANSWER_BYTES >> 20} MiB, "
                "the most atoll holds for a listing; list a smaller directory (or read a file instead)",
                code="answer_too_large",
            )
        return errors.RuntimeFailure(f"the guest agent of sandbox {sid} did not answer", detail=repr(e))

    async def request(self, sid: str, method: str, url: str, **kw: typing.Any) -> agent_channel.Response:
        ch = self.channel(sid)
        try:
            r = await self._watch(sid, ch.request(method, url, **kw))
        except agent_channel.ChannelError as e:
            raise self._unreachable(sid, e, ch) from None
        if r.status_code >= 400:
            raise _agent_error(r)
        return r

    @contextlib.asynccontextmanager
    async def stream(self, sid: str, method: str, url: str, **kw: typing.Any):
        """An agent answer whose body is read chunk by chunk, each wait watched: a sentry that dies
        mid-stream ends it with SandboxDied at once instead of leaving it open."""
        ch = self.channel(sid)
        try:
            cm = ch.stream(method, url, **kw)
            r = await self._watch(sid, cm.__aenter__())
            try:
                if r.status_code >= 400:
                    await r.aread()
                    raise _agent_error(r)
                r.wrap_body(lambda body: self._watched_body(sid, body))
                yield r
            finally:
                await cm.__aexit__(None, None, None)
        except agent_channel.ChannelError as e:
            raise self._unreachable(sid, e, ch) from None

    async def _watched_body(self, sid: str, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        end = object()

        async def step() -> typing.Any:
            try:
                return await anext(body)
            except StopAsyncIteration:
                return end

        try:
            while (chunk := await self._watch(sid, step())) is not end:
                yield chunk
        except agent_channel.ChannelError:
            if not self.liveness.alive(sid):
                raise self.liveness.died(sid) from None
            raise
        finally:
            with contextlib.suppress(Exception):
                await body.aclose()  # type: ignore[attr-defined]

    # ---- lifecycle helpers (tiers, create) -------------------------------------------------------
    async def wait_ready(self, sid: str, timeout: float, log_path: str) -> dict:
        """Wait until the agent answers /health after a boot or a restore."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                r = await self.channel(sid).request("GET", "/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except (agent_channel.ChannelError, OSError, ValueError) as e:
                last = e
            if self.liveness.exited(sid).is_set():  # it died: say so, with the cause
                raise self.liveness.died(sid)
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.005)
        raise errors.RuntimeFailure(
            f"the guest agent of sandbox {sid} did not answer within {timeout}s",
            detail=f"last error: {last!r}; runsc log: {runsc.tail(log_path)}",
        )

    async def identify_when_ready(
        self,
        sid: str,
        generation: int,
        cpus: float,
        timeout: float,
        log_path: str,
        *,
        alive: typing.Callable[[], bool],
    ) -> None:
        """After a restore: POST /identity (new generation, the CPU count) until the agent answers
        it — one round trip instead of a /health poll and then the identity. `alive` says whether
        the restored sentry still runs (liveness watches it only once the restore succeeded: a
        restore that fails is undone, not a death)."""
        body = {"sandbox_id": sid, "generation": generation, "hostname": None, "env": None, "cpus": cpus}
        deadline = time.monotonic() + timeout
        delay = 0.002
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                r = await self.channel(sid).request("POST", "/identity", json=body, timeout=2)
            except (agent_channel.ChannelError, OSError) as e:
                last = e
            else:
                if r.status_code == 200:
                    return
                raise _agent_error(r)
            if not alive():
                raise errors.RuntimeFailure(
                    f"the restored sentry of sandbox {sid} exited before its agent answered",
                    detail=f"runsc log: {runsc.tail(log_path)}",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.005)
        raise errors.RuntimeFailure(
            f"the guest agent of sandbox {sid} did not answer within {timeout}s after its restore",
            detail=f"last error: {last!r}; runsc log: {runsc.tail(log_path)}",
        )

    async def identify(
        self,
        sid: str,
        generation: int,
        *,
        hostname: str | None,
        env: dict | None,
        cpus: float,
        workdir: str | None = None,
    ) -> str | None:
        """Tell the agent who it is now (after a restore): id, generation, hostname, env, the CPU
        count its commands see. Returns the hostname it answers."""
        r = await self.request(
            sid,
            "POST",
            "/identity",
            json={
                "sandbox_id": sid,
                "generation": generation,
                "hostname": hostname,
                "env": env,
                "cpus": cpus,
                "workdir": workdir,
                "seed": secrets.token_hex(32),
            },
        )
        try:
            return r.json().get("hostname")
        except (ValueError, AttributeError):
            return None

    async def gate(self, sid: str) -> Gate:
        """Ask the agent what this runsc could not save (the sandbox must be thawed)."""
        try:
            r = await self.channel(sid).request("GET", "/gate", timeout=10)
            data = r.json()
            blockers = [str(b) for b in data.get("blockers", [])]
            return Gate(not blockers, blockers, int(data.get("external_connections", 0)))
        except (agent_channel.ChannelError, ValueError, TypeError, AttributeError) as e:
            return Gate(False, [f"the checkpoint gate could not be evaluated: {e!r}"])

    async def kill_all(self, sid: str) -> None:
        await self.request(sid, "POST", "/processes/kill-all", timeout=10)

    # ---- exec -----------------------------------------------------------------------------------
    @staticmethod
    def _exec_timeout(spec: api.ExecSpec) -> float | None:
        # A foreground exec without timeout_s has no deadline; the health checks watch it instead.
        return None if spec.timeout_s is None else spec.timeout_s + EXEC_MARGIN_S

    async def exec(self, sid: str, spec: api.ExecSpec) -> api.ExecResult:
        r = await self.request(sid, "POST", "/exec", json=spec.to_json(), timeout=self._exec_timeout(spec))
        return wire.load(api.ExecResult, r.json(), "exec answer from the guest agent")

    @contextlib.asynccontextmanager
    async def exec_stream(self, sid: str, spec: api.ExecSpec) -> AsyncIterator[AsyncIterator[api.ExecEvent]]:
        async with self.stream(
            sid,
            "POST",
            "/exec",
            json=spec.to_json(),
            headers={"Accept": NDJSON},
            timeout=self._exec_timeout(spec),
        ) as r:
            yield _exec_events(r.aiter_raw())

    async def start_process(self, sid: str, spec: api.ExecSpec) -> api.ProcessStarted:
        r = await self.request(
            sid, "POST", "/exec", json=spec.to_json(background=True), timeout=SPAWN_TIMEOUT_S
        )
        return wire.load(api.ProcessStarted, r.json(), "process from the guest agent")

    @contextlib.asynccontextmanager
    async def run_process(
        self, sid: str, spec: api.ExecSpec
    ) -> AsyncIterator[tuple[api.ProcessStarted, AsyncIterator[api.ProcessEvent]]]:
        """A background process started and followed in one agent call (POST /exec, background,
        `Accept: application/x-ndjson`: `{pid, log_path}` first, then its output lines); an agent
        from before that answers `{pid, log_path}` alone, and its output is then followed apart."""
        async with self.stream(
            sid,
            "POST",
            "/exec",
            json=spec.to_json(background=True),
            headers={"Accept": NDJSON},
            timeout=SPAWN_TIMEOUT_S,
        ) as r:
            if NDJSON in r.headers.get("content-type", ""):
                lines = ndjson.alines(r.aiter_raw())
                first = await anext(lines, None)
                if first is None:
                    raise errors.RuntimeFailure("the guest agent's process stream ended before its pid")
                started = _started(first)
                yield started, _process_events_of(lines)
                return
            started = _started(await r.aread())
        async with self.process_output(sid, started.pid, 0, True) as events:
            yield started, events

    async def list_processes(self, sid: str) -> list[api.ProcessInfo]:
        r = await self.request(sid, "GET", "/processes")
        return wire.load(list[api.ProcessInfo], _items(r), "process list from the guest agent")

    async def kill_process(self, sid: str, pid: int) -> None:
        await self.request(sid, "DELETE", f"/processes/{int(pid)}")

    async def process_count(self, sid: str) -> int:
        """The user processes inside the sandbox (the agent's GET /stats), for metrics."""
        r = await self.request(sid, "GET", "/stats", timeout=PROBE_TIMEOUT_S)
        try:
            n = r.json()["processes"]
        except (ValueError, KeyError, TypeError):
            n = None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise errors.RuntimeFailure(
                "the guest agent answered /stats without a process count", detail=r.text[:300]
            )
        return n

    # process handles: GET /processes/<pid>[/output], POST …/stdin|signal|wait
    async def get_process(self, sid: str, pid: int) -> api.ProcessInfo:
        r = await self.request(sid, "GET", f"/processes/{int(pid)}")
        return wire.load(api.ProcessInfo, r.json(), "process from the guest agent")

    @contextlib.asynccontextmanager
    async def process_output(
        self, sid: str, pid: int, offset: int, follow: bool
    ) -> AsyncIterator[AsyncIterator[api.ProcessEvent]]:
        params = {"offset": str(int(offset)), "follow": "1" if follow else "0"}
        async with self.stream(sid, "GET", f"/processes/{int(pid)}/output", params=params, timeout=None) as r:
            yield _process_events(r.aiter_raw())

    async def send_stdin(self, sid: str, pid: int, data: bytes, eof: bool) -> int:
        params = {"eof": "1"} if eof else {}
        r = await self.request(
            sid, "POST", f"/processes/{int(pid)}/stdin", params=params, content=data, timeout=None
        )
        try:
            return int(r.json()["written"])
        except (ValueError, KeyError, TypeError):
            raise errors.RuntimeFailure(
                "the guest agent's stdin answer is malformed", detail=r.text[:300]
            ) from None

    async def signal_process(self, sid: str, pid: int, signal: str) -> None:
        await self.request(sid, "POST", f"/processes/{int(pid)}/signal", json={"signal": signal})

    async def wait_process(self, sid: str, pid: int, timeout_s: float | None) -> api.ProcessInfo:
        r = await self.request(
            sid, "POST", f"/processes/{int(pid)}/wait", json={"timeout_s": timeout_s}, timeout=None
        )
        return wire.load(api.ProcessInfo, r.json(), "process from the guest agent")

    # ---- files ----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def read_file(self, sid: str, path: api.FilePath) -> AsyncIterator[api.FileDownload]:
        async with self.stream(sid, "GET", "/files", params=_path_param(path), timeout=None) as r:
            length = r.headers.get("content-length")
            yield api.FileDownload(int(length) if length and length.isdigit() else None, r.aiter_raw())

    async def write_file(
        self, sid: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> None:
        headers = {"Content-Length": str(size)} if size is not None else {}
        await self.request(
            sid, "PUT", "/files", params=_path_param(path), content=chunks, headers=headers, timeout=None
        )

    async def list_files(self, sid: str, path: api.FilePath) -> list[api.FileEntry]:
        r = await self.request(sid, "GET", "/files/list", params=_path_param(path))
        return wire.load(list[api.FileEntry], _items(r), "file listing from the guest agent")

    async def delete_file(self, sid: str, path: api.FilePath) -> None:
        await self.request(sid, "DELETE", "/files", params=_path_param(path))

    # ---- files, issue 9 (agent: guest/agent/handlers_fileops.py, watch.py, tarball.py) -----------
    async def stat_file(self, sid: str, path: api.FilePath) -> api.FileStat:
        r = await self.request(sid, "GET", "/files/stat", params=_path_param(path))
        return wire.load(api.FileStat, _obj(r), "stat from the guest agent")

    async def make_dir(self, sid: str, path: api.FilePath) -> bool:
        r = await self.request(sid, "POST", "/files/mkdir", params=_path_param(path))
        return bool(_obj(r).get("created"))

    async def move_file(self, sid: str, src: api.FilePath, dst: api.FilePath) -> api.FileStat:
        r = await self.request(sid, "POST", "/files/move", params={"from": src, "to": dst})
        return wire.load(api.FileStat, _obj(r), "stat from the guest agent")

    async def chmod_file(self, sid: str, path: api.FilePath, mode: int) -> api.FileStat:
        r = await self.request(sid, "POST", "/files/chmod", params={"path": path, "mode": f"{int(mode):o}"})
        return wire.load(api.FileStat, _obj(r), "stat from the guest agent")

    @contextlib.asynccontextmanager
    async def watch_files(
        self, sid: str, path: api.FilePath, recursive: bool
    ) -> AsyncIterator[AsyncIterator[api.FileEvent]]:
        params = {"path": path, "recursive": "1" if recursive else "0"}
        async with self.stream(sid, "GET", "/files/watch", params=params, timeout=None) as r:
            yield _file_events(r.aiter_raw())

    async def write_tar(
        self, sid: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        headers = {"Content-Length": str(size)} if size is not None else {}
        r = await self.request(
            sid, "PUT", "/files/tar", params=_path_param(path), content=chunks, headers=headers, timeout=None
        )
        return wire.load(api.TarWritten, _obj(r), "tar answer from the guest agent")

    @contextlib.asynccontextmanager
    async def read_tar(self, sid: str, path: api.FilePath) -> AsyncIterator[api.FileDownload]:
        async with self.stream(sid, "GET", "/files/tar", params=_path_param(path), timeout=None) as r:
            yield api.FileDownload(None, r.aiter_raw())

    # ---- terminals ------------------------------------------------------------------------------
    async def open_pty(self, sid: str, spec: api.PtySpec) -> api.PtyStarted:
        r = await self.request(sid, "POST", "/pty", json=wire.dump(spec), timeout=SPAWN_TIMEOUT_S)
        return wire.load(api.PtyStarted, r.json(), "terminal from the guest agent")

    async def list_ptys(self, sid: str) -> list[api.PtyInfo]:
        r = await self.request(sid, "GET", "/pty")
        return wire.load(list[api.PtyInfo], _items(r), "terminal list from the guest agent")

    async def kill_pty(self, sid: str, pty_id: str) -> None:
        await self.request(sid, "DELETE", f"/pty/{pty_id}")

    async def attach_pty(self, sid: str, pty_id: str) -> api.PortStream:
        """GET /pty/<id>/attach upgraded to the agent's frame stream, on a socket of its own (with
        SO_LINGER 0: closing it is an RST; `close(sid)` resets it before a checkpoint)."""
        ch = self.channel(sid)
        sock = await ch.make_socket()
        w: asyncio.StreamWriter | None = None
        try:
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(sock, (netns.SANDBOX_IP, bundle.AGENT_PORT)), 5)
            r, w = await asyncio.open_connection(sock=sock, limit=1 << 20)
            w.write(
                f"GET /pty/{pty_id}/attach HTTP/1.1\r\nHost: agent\r\nUpgrade: atoll-pty\r\n"
                "Connection: Upgrade\r\n\r\n".encode()
            )
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            if status != 101:
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length" and value.strip().isdigit():
                        length = min(int(value), 65536)
                body = await asyncio.wait_for(r.readexactly(length), 10) if length else b""
                raise wire.error_from_body(status, _json_or_none(body), "the guest agent refused the attach")
        except BaseException as e:
            if w is not None:
                w.transport.abort()
            else:
                sock.close()
            if isinstance(e, (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError)):
                if not self.liveness.alive(sid):
                    raise self.liveness.died(sid) from None
                raise errors.RuntimeFailure(
                    f"the guest agent of sandbox {sid} did not accept the terminal attach", detail=repr(e)
                ) from None
            raise
        return _AttachedPty(r, w, self._attached.setdefault(sid, set()))


class _AttachedPty(portstream.StreamPort):
    """An attach socket (api.PortStream) that Guest.close resets with the sandbox's other sockets."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, owner: set):
        super().__init__(r, w)
        self._owner = owner
        owner.add(self)

    def close(self) -> None:
        self._owner.discard(self)
        super().close()


def _json_or_none(body: bytes) -> typing.Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _items(r: agent_channel.Response) -> typing.Any:
    try:
        return r.json()["items"]
    except (ValueError, KeyError, TypeError):
        raise errors.RuntimeFailure(
            "the guest agent answered a list without items", detail=r.text[:300]
        ) from None


def _obj(r: agent_channel.Response) -> dict:
    try:
        obj = r.json()
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise errors.RuntimeFailure(
            "the guest agent answered something that is not a JSON object", detail=r.text[:300]
        )
    return obj


_FILE_EVENT_TYPES = {"ready", "create", "modify", "delete", "rename", "chmod", "overflow"}


async def _file_events(raw: AsyncIterator[bytes]) -> AsyncIterator[api.FileEvent]:
    """The agent's ndjson watch stream as seam events (untrusted: each line checked)."""
    async for line in ndjson.alines(raw):
        yield _file_event(line)


def _file_event(line: bytes) -> api.FileEvent:
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if (
        not isinstance(obj, dict)
        or obj.get("type") not in _FILE_EVENT_TYPES
        or not isinstance(obj.get("path"), str)
        or not isinstance(obj.get("from", ""), (str, type(None)))
    ):
        raise errors.RuntimeFailure("the guest agent sent a malformed watch event", detail=repr(line[:200]))
    return api.FileEvent(obj["type"], obj["path"], bool(obj.get("is_dir")), obj.get("from"))


async def _exec_events(raw: AsyncIterator[bytes]) -> AsyncIterator[api.ExecEvent]:
    """The agent's ndjson exec stream as seam events (lines cut by `shared.ndjson`); a line the
    agent could not have meant is a RuntimeFailure."""
    exited = False
    async for line in ndjson.alines(raw):
        ev = _exec_event(line)
        exited = exited or isinstance(ev, api.ExecExit)
        yield ev
    if not exited:
        raise errors.RuntimeFailure(
            "the exec stream from the guest agent ended before the command's exit status"
        )


async def _process_events(raw: AsyncIterator[bytes]) -> AsyncIterator[api.ProcessEvent]:
    """The agent's ndjson process output as seam events (lines as in `_exec_events`)."""
    async for line in ndjson.alines(raw):
        yield _process_event(line)


async def _process_events_of(lines: AsyncIterator[bytes]) -> AsyncIterator[api.ProcessEvent]:
    async for line in lines:
        yield _process_event(line)


def _started(raw: bytes) -> api.ProcessStarted:
    """The agent's `{pid, log_path}` of a background process it started."""
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        raise wire.error_from_body(500, obj, "the guest agent could not start the process")
    return wire.load(api.ProcessStarted, obj, "process from the guest agent")


def _process_event(line: bytes) -> api.ProcessEvent:
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise errors.RuntimeFailure("the guest agent sent a malformed output line", detail=repr(line[:200]))
    if "error" in obj:
        raise wire.error_from_body(500, obj, "the guest agent's output stream broke")
    exact = obj.get("b64")
    if exact is not None:
        try:  # the agent is on the sandbox's side: check what it claims before passing it on
            base64.b64decode(exact, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise errors.RuntimeFailure(
                "the guest agent sent output whose b64 is not base64", detail=repr(line[:200])
            ) from None
    for name in ("stdout", "stderr"):
        if isinstance(obj.get(name), str):
            return wire.load(
                api.ProcessOutput,
                {"stream": name, "text": obj[name], "offset": obj.get("offset"), "b64": obj.get("b64")},
                "output line",
            )
    if "dropped" in obj:
        return wire.load(api.ProcessDropped, obj, "output line from the guest agent")
    if "exit_code" in obj:
        return wire.load(api.ProcessExit, obj, "output line from the guest agent")
    raise errors.RuntimeFailure("the guest agent sent an unknown output line", detail=repr(line[:200]))


def _exec_event(line: bytes) -> api.ExecEvent:
    try:
        obj = json.loads(line)
    except ValueError:
        raise errors.RuntimeFailure(
            "the guest agent sent a malformed exec stream line", detail=repr(line[:200])
        ) from None
    if not isinstance(obj, dict):
        raise errors.RuntimeFailure(
            "the guest agent sent a malformed exec stream line", detail=repr(line[:200])
        )
    if "error" in obj:
        raise wire.error_from_body(500, obj, "the guest agent's exec stream broke")
    for name in ("stdout", "stderr"):
        text = obj.get(name)
        if isinstance(text, str):
            return api.ExecOutput(name, text)  # type: ignore[arg-type]
    if "exit_code" in obj or "timed_out" in obj:
        return wire.load(api.ExecExit, obj, "exec exit from the guest agent")
    raise errors.RuntimeFailure("the guest agent sent an unknown exec stream line", detail=repr(line[:200]))

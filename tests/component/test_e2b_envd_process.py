"""envd's Process service over the seam (atoll.e2b.envd_process), served by the generated
connectrpc application and called in the framing the `e2b` SDKs use (Connect, JSON), against an
in-memory worker (FakeWorker: a background process prints what the test makes it print and
echoes its stdin): a Start stream (start, stdout/stderr data, end with the exit code), what the
command became in atoll, stdin closed or open, SendInput/StreamInput/CloseStdin, SendSignal and
envd's `-1 signal: killed`, Connect to a running and an exited process, List, the deadline
(`Connect-Timeout-Ms`), keepalives, a terminal, and the errors the SDKs map (not_found,
invalid_argument, unimplemented)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct

import httpx
import pytest

from atoll.core import worker_api as api
from atoll.e2b import envd_process
from atoll.e2b.proto.process import process_connect
from atoll.testing.fake_worker import FakeWorker

SID = "sb-pppppppppppppppp"
STREAM = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _envelope(msg: dict, flags: int = 0) -> bytes:
    raw = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(raw)) + raw


def _frames(body: bytes) -> list[tuple[int, dict]]:
    out = []
    while body:
        flags, n = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + n])))
        body = body[5 + n :]
    return out


def _events(frames: list[tuple[int, dict]]) -> list[dict]:
    return [f["event"] for flags, f in frames if flags == 0]


def _error(answer: tuple[int, list[tuple[int, dict]]]) -> dict:
    status, frames = answer
    assert status == 200 and len(frames) == 1 and frames[0][0] == 2, answer
    return frames[0][1]["error"]


@pytest.fixture
async def envd():
    worker = FakeWorker()
    await worker.create(api.SandboxSpec(SID, "base", 512, 1, 64))
    service = envd_process.ProcessService(worker, SID, home="/home/user")
    app = process_connect.ProcessASGIApplication(service)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as c:

        async def call(rpc: str, body: dict) -> httpx.Response:
            return await c.post(f"/process.Process/{rpc}", json=body)

        async def stream(rpc: str, body: dict, **headers: str) -> tuple[int, list[tuple[int, dict]]]:
            r = await c.post(
                f"/process.Process/{rpc}", content=_envelope(body), headers={**STREAM, **headers}
            )
            return r.status_code, _frames(r.content) if r.status_code == 200 else r.json()

        yield worker, service, call, stream, c
    await service.close()
    await worker.aclose()


def _pid(worker: FakeWorker) -> int:
    return max(worker.runtimes[SID].processes)


async def _when_started(worker: FakeWorker, n: int = 1) -> int:
    for _ in range(500):
        if len(worker.runtimes[SID].processes) >= n:
            return _pid(worker)
        await asyncio.sleep(0.01)
    raise AssertionError("no process was started")


async def _connect_as_it_writes_after_and_exits(worker: FakeWorker, stream, pid: int):
    """Connect to process `pid`; 0.1 s later it writes "after\n" and exits 0. The stream's answer."""

    async def later():
        await asyncio.sleep(0.1)
        worker.write_process(SID, pid, b"after\n")
        worker.end_process(SID, pid, 0)

    task = asyncio.ensure_future(later())
    answer = await stream("Connect", {"process": {"pid": pid}})
    await task
    return answer


async def test_a_command_streams_start_output_and_its_exit_code(envd):
    worker, _, _, stream, _ = envd
    seen: list[api.ExecSpec] = []

    def handler(spec):
        seen.append(spec)
        return api.ExecResult(exit_code=0, stdout="hello\n", stderr="", duration_ms=1, timed_out=False)

    worker.exec_handler = handler

    async def the_process():
        pid = await _when_started(worker)
        await asyncio.sleep(0.05)
        worker.write_process(SID, pid, b"oops\n", "stderr")
        worker.end_process(SID, pid, 3)

    body = {
        "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hello; exit 3"], "envs": {"X": "1"}},
        "stdin": False,
    }
    task = asyncio.ensure_future(the_process())
    status, frames = await stream("Start", body, **{"Connect-Timeout-Ms": "60000"})
    await task
    assert status == 200, frames
    pid = _pid(worker)
    assert _events(frames) == [
        {"start": {"pid": pid}},
        {"data": {"stdout": _b64(b"hello\n")}},
        {"data": {"stderr": _b64(b"oops\n")}},
        {"end": {"exitCode": 3, "exited": True, "status": "exit status 3"}},
    ]
    assert frames[-1] == (2, {})  # end of stream, no error
    (spec,) = seen
    # `bash -l -c CMD` is atoll's shell command; stdin false: fed empty and closed; the deadline
    # is the process's timeout; cwd defaults to the home, as envd's
    assert (spec.cmd, spec.shell, spec.stdin, spec.env, spec.cwd) == (
        "echo hello; exit 3",
        "bash",
        "",
        {"X": "1"},
        "/home/user",
    )
    assert spec.timeout_s is not None and 59 < spec.timeout_s <= 60
    assert worker.runtimes[SID].processes[pid].background


async def test_binary_output_is_byte_exact(envd):
    worker, _, _, stream, _ = envd
    blob = bytes(range(256)) * 2

    async def the_process():
        pid = await _when_started(worker)
        worker.write_process(SID, pid, blob)
        worker.write_process(SID, pid, "é\n".encode(), "stderr")
        worker.end_process(SID, pid, 0)

    task = asyncio.ensure_future(the_process())
    status, frames = await stream("Start", {"process": {"cmd": "x"}, "stdin": False})
    await task
    data = [e["data"] for e in _events(frames) if "data" in e]
    assert b"".join(base64.b64decode(d["stdout"]) for d in data if "stdout" in d) == blob
    assert [base64.b64decode(d["stderr"]) for d in data if "stderr" in d] == ["é\n".encode()]


async def test_another_argv_runs_as_a_list_and_exit_0_has_no_code(envd):
    worker, _, _, stream, _ = envd
    seen: list[api.ExecSpec] = []
    worker.exec_handler = lambda spec: (
        seen.append(spec) or api.ExecResult(exit_code=0, stdout="", stderr="", duration_ms=1, timed_out=False)
    )

    async def the_process():
        worker.end_process(SID, await _when_started(worker), 0)

    task = asyncio.ensure_future(the_process())
    status, frames = await stream(
        "Start", {"process": {"cmd": "/usr/bin/env", "args": ["true"], "cwd": "/tmp"}, "stdin": True}
    )
    await task
    assert status == 200, frames
    assert _events(frames)[-1] == {"end": {"exited": True, "status": "exit status 0"}}
    assert (seen[0].cmd, seen[0].shell, seen[0].stdin, seen[0].cwd, seen[0].timeout_s) == (
        ["/usr/bin/env", "true"],
        None,
        None,  # stdin true: a pipe stays open
        "/tmp",
        None,  # no Connect-Timeout-Ms: no deadline
    )


async def test_stdin_input_close_and_a_streamed_input(envd):
    worker, _, call, stream, c = envd
    result: dict = {}

    async def start():
        result["start"] = await stream("Start", {"process": {"cmd": "/bin/cat"}, "stdin": True})

    task = asyncio.ensure_future(start())
    pid = await _when_started(worker)
    r = await call("SendInput", {"process": {"pid": pid}, "input": {"stdin": _b64(b"one\n")}})
    assert r.status_code == 200 and r.json() == {}, r.text
    # StreamInput: a client stream, start{process} first, then data and keepalives
    body = (
        _envelope({"start": {"process": {"pid": pid}}})
        + _envelope({"data": {"input": {"stdin": _b64(b"two\n")}}})
        + _envelope({"keepalive": {}})
        + _envelope({"data": {"input": {"stdin": _b64(b"three\n")}}})
    )  # a Connect request stream ends with the body (no end-of-stream frame: that is a response's)
    r = await c.post("/process.Process/StreamInput", content=body, headers=STREAM)
    assert r.status_code == 200 and _frames(r.content) == [(0, {}), (2, {})], r.content
    r = await call("CloseStdin", {"process": {"pid": pid}})
    assert r.status_code == 200, r.text
    assert worker.runtimes[SID].stdin[pid] == b"one\ntwo\nthree\n"
    r = await call("SendInput", {"process": {"pid": pid}, "input": {"stdin": _b64(b"late")}})
    assert r.status_code == 400 and r.json()["code"] == "failed_precondition", r.text
    assert "stdin_closed" in r.json()["message"]
    worker.end_process(SID, pid, 0)
    await task
    status, frames = result["start"]
    assert status == 200
    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in _events(frames) if "data" in e)
    assert out == b"one\ntwo\nthree\n"


async def test_a_signalled_process_ends_as_envds_killed_one(envd):
    worker, _, call, stream, _ = envd
    result: dict = {}

    async def start():
        result["start"] = await stream(
            "Start", {"process": {"cmd": "sleep", "args": ["100"]}, "stdin": False}
        )

    task = asyncio.ensure_future(start())
    pid = await _when_started(worker)
    r = await call("List", {})
    assert r.status_code == 200, r.text
    assert r.json()["processes"] == [
        {"config": {"cmd": "sleep", "args": ["100"], "cwd": "/home/user"}, "pid": pid}
    ]
    r = await call("SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 200 and r.json() == {}, r.text
    await task
    status, frames = result["start"]
    assert status == 200, frames
    assert _events(frames)[-1] == {
        "end": {"exitCode": -1, "status": "signal: killed", "error": "signal: killed"}
    }
    # still known (signal_process, not kill_process): a Connect gets start and end; List skips it
    status, frames = await stream("Connect", {"process": {"pid": pid}})
    assert status == 200 and [next(iter(e)) for e in _events(frames)] == ["start", "end"], frames
    assert (await call("List", {})).json() == {}
    # a process that exited on its own: its code, whoever asks
    worker.exec_handler = lambda spec: api.ExecResult(0, "", "", 1, False)
    task = asyncio.ensure_future(stream("Start", {"process": {"cmd": "true"}}))
    pid2 = await _when_started(worker, 2)
    worker.end_process(SID, pid2, 137)
    status, frames = await task
    assert _events(frames)[-1] == {"end": {"exitCode": 137, "exited": True, "status": "exit status 137"}}


async def test_a_process_killed_by_someone_else_reads_as_a_signal_too(envd):
    """`kill -9 <pid>` from another command: the seam says which signal ended it (not only its
    128+N), and envd's `-1 signal: killed` follows; an `exit 137` stays an exit."""
    worker, _, _, stream, _ = envd
    task = asyncio.ensure_future(stream("Start", {"process": {"cmd": "sleep", "args": ["100"]}}))
    pid = await _when_started(worker)
    await worker.signal_process(SID, pid, "KILL")  # not through this service
    status, frames = await task
    assert status == 200, frames
    assert _events(frames)[-1] == {
        "end": {"exitCode": -1, "status": "signal: killed", "error": "signal: killed"}
    }
    task = asyncio.ensure_future(stream("Start", {"process": {"cmd": "sleep", "args": ["100"]}}))
    pid = await _when_started(worker, 2)
    await worker.signal_process(SID, pid, "TERM")
    status, frames = await task
    assert _events(frames)[-1] == {
        "end": {"exitCode": -1, "status": "signal: terminated", "error": "signal: terminated"}
    }


async def test_a_pause_ends_open_streams_with_canceled_and_the_process_runs_on(envd):
    """E2B's pause with process streams open: the worker ends the follow (end_streams), the
    stream ends with Connect `canceled` (the SDKs: TimeoutException), the process is left
    running, and a Connect after the resume reattaches."""
    worker, _, _, stream, _ = envd
    worker.exec_handler = lambda spec: api.ExecResult(0, "before\n", "", 1, False)
    task = asyncio.ensure_future(
        stream("Start", {"process": {"cmd": "x"}}, **{"Connect-Timeout-Ms": "60000"})
    )
    pid = await _when_started(worker)
    await asyncio.sleep(0.1)
    outcome = await worker.pause(SID, api.Tier.MEMORY, end_streams=True)
    assert outcome.tier == api.Tier.MEMORY
    status, frames = await asyncio.wait_for(task, 10)
    assert status == 200, frames
    assert _events(frames) == [{"start": {"pid": pid}}, {"data": {"stdout": _b64(b"before\n")}}]
    assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "canceled", frames
    assert "paused" in frames[-1][1]["error"]["message"]
    assert worker.runtimes[SID].processes[pid].running
    await worker.resume(SID)
    status, frames = await _connect_as_it_writes_after_and_exits(worker, stream, pid)
    assert _events(frames) == [
        {"start": {"pid": pid}},
        {"data": {"stdout": _b64(b"after\n")}},
        {"end": {"exited": True, "status": "exit status 0"}},
    ]


async def test_connect_reattaches_at_the_current_end(envd):
    worker, _, _, stream, c = envd
    worker.exec_handler = lambda spec: api.ExecResult(0, "before\n", "", 1, False)
    # a client that leaves after the start event: the process runs on
    gone = asyncio.ensure_future(
        stream("Start", {"process": {"cmd": "x"}}, **{"Connect-Timeout-Ms": "60000"})
    )
    pid = await _when_started(worker)
    await asyncio.sleep(0.1)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.sleep(0.05)
    assert worker.runtimes[SID].processes[pid].running
    status, frames = await _connect_as_it_writes_after_and_exits(worker, stream, pid)
    assert status == 200, frames
    assert _events(frames) == [
        {"start": {"pid": pid}},
        {"data": {"stdout": _b64(b"after\n")}},  # not the output from before the connect
        {"end": {"exited": True, "status": "exit status 0"}},
    ]


async def test_the_deadline_kills_the_process_and_ends_deadline_exceeded(envd):
    worker, _, _, stream, _ = envd
    status, frames = await stream(
        "Start", {"process": {"cmd": "sleep", "args": ["100"]}}, **{"Connect-Timeout-Ms": "300"}
    )
    assert status == 200
    pid = _pid(worker)
    assert [next(iter(e)) for e in _events(frames)] == ["start"]
    assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "deadline_exceeded", frames
    await asyncio.sleep(0.1)
    info = worker.runtimes[SID].processes[pid]
    assert not info.running and info.exit_code == 137


async def test_keepalives_in_silence(envd):
    worker, _, _, stream, _ = envd

    async def the_process():
        pid = await _when_started(worker)
        await asyncio.sleep(2.5)
        worker.end_process(SID, pid, 0)

    task = asyncio.ensure_future(the_process())
    status, frames = await stream("Start", {"process": {"cmd": "x"}}, **{"Keepalive-Ping-Interval": "1"})
    await task
    kinds = [next(iter(e)) for e in _events(frames)]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("keepalive") >= 1, kinds


async def test_a_terminal(envd):
    worker, _, call, stream, _ = envd
    result: dict = {}

    async def start():
        result["start"] = await stream(
            "Start",
            {
                "process": {"cmd": "/bin/bash", "args": ["-i", "-l"], "envs": {"TERM": "xterm"}},
                "pty": {"size": {"cols": 80, "rows": 24}},
            },
            **{"Connect-Timeout-Ms": "20000"},
        )

    task = asyncio.ensure_future(start())
    for _ in range(500):
        if worker.ptys.sessions.get(SID):
            break
        await asyncio.sleep(0.01)
    (session,) = worker.ptys.sessions[SID].values()
    pid = session.proc.pid
    for _ in range(200):
        if pid in envd[1]._attaches:
            break
        await asyncio.sleep(0.01)
    r = await call("Update", {"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 30}}})
    assert r.status_code == 200, r.text
    r = await call("SendInput", {"process": {"pid": pid}, "input": {"pty": _b64(b"echo hi\n")}})
    assert r.status_code == 200, r.text
    for _ in range(300):
        if b"hi" in session.scrollback:
            break
        await asyncio.sleep(0.01)
    assert (session.cols, session.rows) == (100, 30)
    assert [p["pid"] for p in (await call("List", {})).json()["processes"]] == [pid]
    r = await call("CloseStdin", {"process": {"pid": pid}})
    assert r.status_code == 400 and r.json()["code"] == "failed_precondition", r.text
    r = await call("Update", {"process": {"pid": pid}, "pty": {"size": {"cols": 0, "rows": 30}}})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    r = await call("SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 200, r.text
    await task
    status, frames = result["start"]
    assert status == 200, frames
    events = _events(frames)
    assert events[0] == {"start": {"pid": pid}}
    assert b"hi" in b"".join(base64.b64decode(e["data"]["pty"]) for e in events if "data" in e)
    assert events[-1] == {"end": {"exitCode": -1, "status": "signal: killed", "error": "signal: killed"}}


async def test_bad_input_and_unknown_processes(envd):
    _, _, call, stream, _ = envd
    for rpc, body in [
        ("SendSignal", {"process": {"pid": 4242}, "signal": "SIGNAL_SIGKILL"}),
        ("SendInput", {"process": {"pid": 4242}, "input": {"stdin": "aGk="}}),
        ("CloseStdin", {"process": {"pid": 4242}}),
        ("SendSignal", {"process": {"tag": "nope"}, "signal": "SIGNAL_SIGTERM"}),
    ]:
        r = await call(rpc, body)
        assert r.status_code == 404 and r.json()["code"] == "not_found", (rpc, r.text)
    # a stream's error is its end-of-stream frame (HTTP 200), what both SDKs read
    err = _error(await stream("Connect", {"process": {"pid": 4242}}))
    assert err["code"] == "not_found" and "4242" in err["message"], err
    for rpc, body, words in [
        ("SendSignal", {"process": {}, "signal": "SIGNAL_SIGKILL"}, "no process selected"),
        ("SendInput", {"process": {"pid": 1}}, "no input"),
        ("SendInput", {"process": {"pid": 1}, "input": {"stdin": "not base64!"}}, ""),
        ("SendSignal", {"process": {"pid": "x"}}, ""),
    ]:
        r = await call(rpc, body)
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (rpc, r.text)
        assert words in r.json()["message"]
    r = await call("SendSignal", {"process": {"pid": 1}, "signal": "SIGNAL_UNSPECIFIED"})
    assert r.status_code == 501 and r.json()["code"] == "unimplemented", r.text
    err = _error(await stream("Start", {"process": {"cmd": ""}}))
    assert err["code"] == "invalid_argument" and "no command" in err["message"], err
    err = _error(await stream("Start", {"process": {"cmd": "x"}}, Authorization="Basic %%%"))
    assert err["code"] == "invalid_argument" and "Authorization" in err["message"], err
    # an unknown RPC: a plain 404, which the SDKs read as not_found
    r = await call("Nope", {})
    assert r.status_code == 404


async def test_a_deadline_past_atolls_cap_is_kept_by_the_service(envd, monkeypatch):
    worker, _, _, stream, _ = envd
    monkeypatch.setattr(envd_process, "MAX_TIMEOUT_S", 0.1)  # 300 ms is "past the cap" here
    seen: list[api.ExecSpec] = []
    worker.exec_handler = lambda spec: seen.append(spec) or api.ExecResult(0, "", "", 1, False)
    status, frames = await stream("Start", {"process": {"cmd": "sleep"}}, **{"Connect-Timeout-Ms": "300"})
    assert seen[0].timeout_s is None  # atoll does not time it: the service does
    assert frames[-1][1]["error"]["code"] == "deadline_exceeded", frames
    pid = _pid(worker)
    for _ in range(100):
        if not worker.runtimes[SID].processes[pid].running:
            break
        await asyncio.sleep(0.01)
    info = worker.runtimes[SID].processes[pid]
    assert (info.running, info.exit_code, info.timed_out) == (False, 128 + 9, False)  # KILLed by the service

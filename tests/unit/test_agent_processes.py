"""Process handles in the guest agent (run natively, as in test_guest_agent): stdin for exec and
background processes, output re-read from an offset and followed, reattach, signals, wait; and
the pure parts (the bounded output log, the shell's argv)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import time

import httpx
import pytest

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.core.worker_api import ExecSpec
from atoll.guest.agent import procio, shells
from atoll.shared import http11
from atoll.worker.runtimes import guest
from tests.unit.test_guest_agent import _start_agent


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    running = _start_agent(tmp_path_factory.mktemp("agent"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def client(agent):
    with httpx.Client(base_url=agent.url, timeout=30) as c:
        yield c


def _lines(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.content.split(b"\n") if line.strip()]


def _bg(client, **body) -> int:
    r = client.post("/exec", json={**body, "background": True})
    assert r.status_code == 200, r.text
    return r.json()["pid"]


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]["message"]


def test_exec_stdin_plain_and_streamed(client):
    r = client.post("/exec", json={"cmd": ["cat"], "stdin": "hello\nworld\n"}).json()
    assert (r["exit_code"], r["stdout"]) == (0, "hello\nworld\n")
    code = "import sys; print(sys.stdin.read().upper())"
    r = client.post("/exec", json={"cmd": ["python3", "-c", code], "stdin": "héllo"}).json()
    assert r["stdout"] == "HÉLLO\n"
    big = "x" * (3 << 20)  # more than a pipe holds: fed while the output is read
    r = client.post("/exec", json={"cmd": ["wc", "-c"], "stdin": big}).json()
    assert r["stdout"].strip() == str(len(big))
    lines = _lines(
        client.post(
            "/exec", json={"cmd": ["cat"], "stdin": "abc"}, headers={"Accept": "application/x-ndjson"}
        )
    )
    assert lines[0] == {"stdout": "abc"} and lines[-1]["exit_code"] == 0
    # A command that does not read its stdin still ends (the rest is dropped, as with a pipe)
    r = client.post("/exec", json={"cmd": ["true"], "stdin": big}).json()
    assert r["exit_code"] == 0


def test_background_stdin_fed_line_by_line_and_output_offsets(client):
    prog = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)\nprint('bye', file=sys.stderr)"
    pid = _bg(client, cmd=["python3", "-u", "-c", prog])
    info = client.get(f"/processes/{pid}").json()
    assert info["running"] and info["stdin_open"] and info["exit_code"] is None
    seen = ""
    offset = 0
    for word in ("one", "two", "three"):
        assert client.post(f"/processes/{pid}/stdin", content=f"{word}\n".encode()).json() == {
            "written": len(word) + 1,
            "eof": False,
        }
        deadline = time.monotonic() + 10
        while f"got {word}\n" not in seen and time.monotonic() < deadline:
            for line in _lines(client.get(f"/processes/{pid}/output", params={"offset": offset})):
                assert "exit_code" not in line  # still running: no exit line without follow
                seen += line["stdout"]
                offset = line["offset"]
            time.sleep(0.02)
        assert seen.endswith(f"got {word}\n")
    assert offset == len(seen.encode())
    # Re-read from any offset: the rest of the sequence, nothing else
    part = _lines(client.get(f"/processes/{pid}/output", params={"offset": 4}))
    assert "".join(p["stdout"] for p in part) == seen[4:]
    assert client.post(f"/processes/{pid}/stdin", params={"eof": "1"}).json() == {"written": 0, "eof": True}
    assert client.post(f"/processes/{pid}/wait", json={"timeout_s": 10}).json()["exit_code"] == 0
    lines = _lines(client.get(f"/processes/{pid}/output", params={"offset": offset, "follow": "1"}))
    assert lines[0] == {"stderr": "bye\n", "offset": offset + 4}
    assert lines[-1]["exit_code"] == 0 and lines[-1]["offset"] == offset + 4 and not lines[-1]["timed_out"]
    _error(client.post(f"/processes/{pid}/stdin", content=b"late"), 409, "process_exited")
    with open(
        client.get(f"/processes/{pid}").json()["log_path"], "rb"
    ) as f:  # the log file still gets it all
        assert f.read() == (seen + "bye\n").encode()


def test_stdin_to_a_finished_process_is_409(client):
    pid = _bg(client, cmd=["true"])
    assert client.post(f"/processes/{pid}/wait", json={}).json()["exit_code"] == 0
    msg = _error(client.post(f"/processes/{pid}/stdin", content=b"x" * 100000), 409, "process_exited")
    assert "exit code 0" in msg
    assert client.get("/health").status_code == 200  # the connection survived the unread body


def test_stdin_after_eof_is_409_while_it_runs(client):
    pid = _bg(client, cmd=["sh", "-c", "cat >/dev/null; sleep 30"])
    client.post(f"/processes/{pid}/stdin", params={"eof": "1"}, content=b"last")
    assert client.get(f"/processes/{pid}").json()["stdin_open"] is False
    msg = _error(client.post(f"/processes/{pid}/stdin", content=b"more"), 409, "stdin_closed")
    assert str(pid) in msg
    assert client.delete(f"/processes/{pid}").status_code == 204


def test_background_with_stdin_string_is_fed_then_closed(client):
    pid = _bg(client, cmd=["sh", "-c", "cat; echo done"], stdin="abc\n")
    assert client.post(f"/processes/{pid}/wait", json={"timeout_s": 10}).json()["exit_code"] == 0
    lines = _lines(client.get(f"/processes/{pid}/output"))
    assert "".join(line.get("stdout", "") for line in lines) == "abc\ndone\n"


def test_follow_streams_as_it_comes_and_reattach_loses_nothing(agent, client):
    pid = _bg(
        client,
        cmd=["python3", "-u", "-c", "import time\nfor i in range(40):\n    print(i)\n    time.sleep(0.02)"],
    )
    got = ""
    offset = 0
    # First follower leaves after a few lines (closes its connection mid-stream)
    with httpx.Client(base_url=agent.url, timeout=30) as first:
        with first.stream("GET", f"/processes/{pid}/output", params={"follow": "1"}) as r:
            for raw in r.iter_lines():
                line = json.loads(raw)
                got += line["stdout"]
                offset = line["offset"]
                if got.count("\n") >= 5:
                    break
    assert client.get(f"/processes/{pid}").json()["running"]  # the process did not notice
    lines = _lines(client.get(f"/processes/{pid}/output", params={"offset": offset, "follow": "1"}))
    got += "".join(line.get("stdout", "") for line in lines)
    assert got == "".join(f"{i}\n" for i in range(40))
    assert lines[-1]["exit_code"] == 0


def test_a_background_start_that_follows_in_the_same_answer(agent, client):
    """POST /exec background with Accept: application/x-ndjson (the worker's run_process, E2B's
    Start): `{pid, log_path}` first, then the lines of the output follow, then the exit; a caller
    that leaves mid-way leaves the process running, and it is a handle like any other."""
    ndjson = {"Accept": "application/x-ndjson"}
    body = {"cmd": "echo out; echo err >&2; exit 4", "background": True}
    lines = _lines(client.post("/exec", json=body, headers=ndjson))
    pid = lines[0]["pid"]
    assert lines[0]["log_path"] == f"/tmp/.atoll/proc-{pid}.log"
    out = [(k, v) for line in lines[1:-1] for k, v in line.items() if k in ("stdout", "stderr")]
    assert sorted(out) == [("stderr", "err\n"), ("stdout", "out\n")], lines
    assert lines[-1]["exit_code"] == 4 and lines[-1]["offset"] == 8, lines
    # the same lines as a follow of the handle
    again = _lines(client.get(f"/processes/{pid}/output", params={"follow": "1"}))
    assert again[-1] == lines[-1]

    slow = {"cmd": ["python3", "-u", "-c", "import time\nprint('a')\ntime.sleep(0.5)\nprint('b')"]}
    with httpx.Client(base_url=agent.url, timeout=30) as first:
        with first.stream("POST", "/exec", json={**slow, "background": True}, headers=ndjson) as r:
            it = r.iter_lines()
            pid = json.loads(next(it))["pid"]
            got = ""
            while got != "a\n":  # print() may write "a" and "\n" apart (-u)
                got += json.loads(next(it))["stdout"]
    assert client.get(f"/processes/{pid}").json()["running"]  # the caller left; it runs on
    lines = _lines(client.get(f"/processes/{pid}/output", params={"follow": "1"}))
    assert "".join(line.get("stdout", "") for line in lines) == "a\nb\n" and lines[-1]["exit_code"] == 0
    # a command that cannot start is the same 400 as without the follow
    r = client.post(
        "/exec", json={"cmd": ["true"], "cwd": "/nonexistent", "background": True}, headers=ndjson
    )
    _error(r, 400, "invalid_request")


def test_signal_term_to_a_trapping_script_and_wait(client):
    pid = _bg(
        client,
        cmd=["bash", "-c", "trap 'echo got TERM; exit 3' TERM; echo ready; while true; do sleep 0.05; done"],
    )
    deadline = time.monotonic() + 10
    while "ready" not in client.get(f"/processes/{pid}/output").text and time.monotonic() < deadline:
        time.sleep(0.02)
    msg = _error(client.post(f"/processes/{pid}/wait", json={"timeout_s": 0.2}), 409, "process_running")
    assert "still running" in msg
    r = client.post(f"/processes/{pid}/signal", json={"signal": "SIGTERM"})
    assert r.status_code == 200 and r.json()["signal"] == "TERM"
    assert client.post(f"/processes/{pid}/wait", json={}).json()["exit_code"] == 3
    out = "".join(line.get("stdout", "") for line in _lines(client.get(f"/processes/{pid}/output")))
    assert out == "ready\ngot TERM\n"


def test_a_signal_sent_by_someone_else_is_reported_beside_its_code(client):
    """`kill -9 <pid>` from another command: the record and the output's exit line say which
    signal ended it (E2B's `-1 signal: killed`); an `exit 137` by itself says none."""
    pid = _bg(client, cmd=["sleep", "30"])
    r = client.post("/exec", json={"cmd": ["kill", "-9", str(pid)]}).json()
    assert r["exit_code"] == 0, r
    info = client.post(f"/processes/{pid}/wait", json={"timeout_s": 10}).json()
    assert (info["exit_code"], info["signal"]) == (137, 9), info
    end = _lines(client.get(f"/processes/{pid}/output"))[-1]
    assert (end["exit_code"], end["signal"]) == (137, 9), end
    pid = _bg(client, cmd=["sh", "-c", "exit 137"])
    info = client.post(f"/processes/{pid}/wait", json={"timeout_s": 10}).json()
    assert info["exit_code"] == 137 and "signal" not in info, info
    assert "signal" not in _lines(client.get(f"/processes/{pid}/output"))[-1]


@pytest.mark.parametrize("value", ["TERM", "sigterm", "15", 15])
def test_signal_forms(client, value):
    pid = _bg(client, cmd=["sleep", "30"])
    assert client.post(f"/processes/{pid}/signal", json={"signal": value}).status_code == 200
    assert client.post(f"/processes/{pid}/wait", json={"timeout_s": 10}).json()["exit_code"] == 143


def test_bad_process_requests(client):
    pid = _bg(client, cmd=["sleep", "30"])
    msg = _error(client.post(f"/processes/{pid}/signal", json={"signal": "BOGUS"}), 400, "invalid_request")
    assert "BOGUS" in msg and "TERM" in msg and "HUP" in msg
    _error(client.get(f"/processes/{pid}/output", params={"offset": "-1"}), 400, "invalid_request")
    _error(client.get(f"/processes/{pid}/output", params={"offset": "abc"}), 400, "invalid_request")
    assert "past the end" in _error(
        client.get(f"/processes/{pid}/output", params={"offset": "99"}), 400, "invalid_request"
    )
    _error(client.post(f"/processes/{pid}/wait", json={"timeout_s": "x"}), 400, "invalid_request")
    _error(client.get("/processes/abc"), 400, "invalid_request")
    _error(client.get("/processes/999999"), 404, "process_not_found")
    _error(client.post("/processes/999999/stdin", content=b"x"), 404, "process_not_found")
    _error(client.post("/exec", json={"cmd": "cat", "stdin": 5}), 400, "invalid_request")
    lone = client.post("/exec", content=b'{"cmd": ["cat"], "stdin": "a\\ud800b"}').json()
    assert lone["stdout"] == "a?b"  # a lone surrogate has no UTF-8 form: replaced, not a 500
    _error(client.post("/exec", json={"cmd": "cat", "shell": "zsh"}), 400, "invalid_request")
    assert client.delete(f"/processes/{pid}").status_code == 204


def test_deleting_a_process_ends_its_pump(client, agent):
    def round_of(n: int) -> int:
        for _ in range(n):
            pid = _bg(client, cmd=["sleep", "30"])
            assert client.delete(f"/processes/{pid}").status_code == 204
            _error(client.get(f"/processes/{pid}"), 404, "process_not_found")
        time.sleep(0.5)
        return len(os.listdir(f"/proc/{agent.pid}/task"))

    first = round_of(15)
    # A pump left blocked (its process killed and forgotten) would hold its pooled thread: 15 more
    # rounds would then need 15 more threads.
    assert round_of(15) - first < 5


def test_output_log_keeps_the_newest_bytes():
    log = procio.OutputLog(keep=10)
    log.add("stdout", b"0123456")
    log.add("stderr", b"789ab")
    assert (log.start, log.end) == (2, 12)
    dropped, pieces = log.read(0)
    assert dropped == 2 and pieces == [("stdout", b"23456", 7), ("stderr", b"789ab", 12)]
    log.add("stdout", b"x" * 25)
    dropped, pieces = log.read(12)
    assert (log.start, log.end) == (27, 37) and dropped == 15 and pieces == [("stdout", b"x" * 10, 37)]


def test_output_log_never_splits_a_character():
    log = procio.OutputLog()
    data = "é€😀".encode()
    for i in range(len(data)):
        log.add("stdout", data[i : i + 1])
    log.close()
    _, pieces = log.read(0)
    assert b"".join(p[1] for p in pieces) == data
    assert all(p[1].decode() for p in pieces)  # each piece decodes on its own


def test_shell_argv(monkeypatch):
    monkeypatch.setattr(shells, "_has_bash", True)
    env = {
        "PATH": "/opt/x/bin:/usr/bin",
        "A B": "skipped",
        "PWD": "/x",
        "Q": "it's",
        "ATOLL_SANDBOX_ID": "forged",
    }
    argv = shells.argv(None, "echo hi", env)
    assert argv[:3] == ["/bin/bash", "-l", "-c"] and argv[3].endswith("; echo hi")
    assert env[shells.RESTORE_VAR] == "export PATH=/opt/x/bin:/usr/bin Q='it'\"'\"'s'"
    assert shells.argv("sh", "echo hi", {}) == ["/bin/sh", "-c", "echo hi"]
    monkeypatch.setattr(shells, "_has_bash", False)
    monkeypatch.setattr(shells.os, "access", lambda *a: False)
    assert shells.argv(None, "echo", {}) == ["/bin/sh", "-c", "echo"]
    with pytest.raises(Exception, match="no /bin/bash"):
        shells.argv("bash", "echo", {})


def test_the_restore_line_makes_env_win_over_a_profile(tmp_path):
    """The bash line itself, with a profile that resets PATH and sets FOO (HOME is a temp dir)."""
    (tmp_path / ".profile").write_text("export PATH=/usr/bin:/bin\nexport FOO=profile\nexport BAR=profile\n")
    env = {"HOME": str(tmp_path), "PATH": f"/opt/x/bin:{os.environ['PATH']}", "FOO": "mine"}
    argv = shells.argv("bash", 'echo "$PATH|$FOO|$BAR|${__ATOLL_ENV-unset}"; [[ 1 == 1 ]] && echo ok', env)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    path, foo, bar, restore = out.stdout.splitlines()[0].split("|")
    assert path.startswith("/opt/x/bin:") and foo == "mine" and bar == "profile" and restore == "unset"
    assert out.stdout.splitlines()[1] == "ok"


def test_stdin_pipe_write_times_out_when_nobody_reads():
    r, w = os.pipe()
    pipe = procio.StdinPipe(w)
    with pytest.raises(TimeoutError):
        pipe.write(b"x" * (1 << 20), timeout=0.2)
    pipe.close()
    with pytest.raises(procio.StdinClosed):
        pipe.write(b"x")
    os.close(r)


def test_output_that_is_not_utf8_also_travels_exactly(client):
    blob = bytes(range(256))  # every byte value: not UTF-8
    code = f"import sys; sys.stdout.buffer.write({blob!r}); sys.stdout.flush(); sys.stderr.write('é ok')"
    pid = _bg(client, cmd=["python3", "-c", code])
    assert client.post(f"/processes/{pid}/wait", json={"timeout_s": 10}).json()["exit_code"] == 0
    lines = _lines(client.get(f"/processes/{pid}/output", params={"follow": "1"}))
    out = [line for line in lines if "stdout" in line]
    assert b"".join(base64.b64decode(line["b64"]) for line in out) == blob
    assert "\ufffd" in "".join(line["stdout"] for line in out)  # the text form, as before
    (err,) = [line for line in lines if "stderr" in line]
    assert err["stderr"] == "é ok" and "b64" not in err  # UTF-8 text: exact already, no copy
    # the worker's reading of those lines: the exact bytes kept, a bad b64 refused
    ev = guest._process_event(json.dumps(out[0]).encode())
    assert ev.b64 == out[0]["b64"]
    with pytest.raises(errors.RuntimeFailure, match="not base64"):
        guest._process_event(json.dumps({"stdout": "x", "offset": 1, "b64": "%%%"}).encode())


class _OldAgent(http11.Channel):
    """A channel to the agent that drops `Accept` from POST /exec: how an agent from before the
    followed background start answers (`{pid, log_path}` alone)."""

    def stream(self, method, url, *, headers=None, **kw):
        if url == "/exec":
            headers = {k: v for k, v in (headers or {}).items() if k.lower() != "accept"}
        return super().stream(method, url, headers=headers, **kw)


@pytest.mark.parametrize("old", [False, True], ids=["one call", "an older agent"])
async def test_the_workers_run_process_over_a_real_agent(agent, old):
    """worker.guest.Guest.run_process: one agent call (the pid, then the output follow); an agent
    that answers the pid alone has its output followed with a second call, to the same events."""
    g = guest.Guest(None, "/nonexistent", None)  # type: ignore[arg-type]  # no runtimes: the agent runs natively
    g._channels = {"sb": (_OldAgent if old else http11.Channel)("127.0.0.1", agent.port)}

    async def unwatched(sid, aw):
        return await aw

    g._watch = unwatched  # type: ignore[method-assign]  # no runtime to watch: the agent runs natively
    spec = ExecSpec(cmd="echo out; echo err >&2; exit 5", max_output_bytes=1 << 20)
    try:
        async with g.run_process("sb", spec) as (started, events):
            got = [ev async for ev in events]
        assert started.pid > 0 and started.log_path == f"/tmp/.atoll/proc-{started.pid}.log"
        text = sorted((ev.stream, ev.text) for ev in got if isinstance(ev, api.ProcessOutput))
        assert text == [("stderr", "err\n"), ("stdout", "out\n")], got
        assert isinstance(got[-1], api.ProcessExit) and (got[-1].exit_code, got[-1].offset) == (5, 8), got
        with pytest.raises(errors.InvalidRequest, match="cwd"):
            async with g.run_process("sb", ExecSpec(cmd="true", cwd="/nonexistent", max_output_bytes=1)):
                pass
    finally:
        await g._channels["sb"].aclose()


class _Conn:
    """What `_Tail` writes to: the chunks it ended the answer with, and the thread that wrote them."""

    def __init__(self, sock):
        self.sock = sock
        self.ends: list[tuple[bytes, str]] = []

    def end_chunked(self, last: bytes = b"") -> None:
        import threading

        self.ends.append((last, threading.current_thread().name))


def test_the_pump_writes_a_followers_end_when_it_closes_the_log():
    """The exit line of a followed process goes out from the pump's thread as it closes the log
    (no hand-off to the follower's thread); not while the follower is writing, nor when more than
    PUMP_END_BYTES are left or the connection cannot take it at once (the follower does it then)."""
    import socket
    import threading
    import types

    from atoll.guest.agent import handlers_procs

    def run(fill: bytes = b"", hold: bool = False, full: bool = False):
        a, b = socket.socketpair()
        a.setblocking(False)
        if full:
            with contextlib.suppress(BlockingIOError):
                while True:
                    a.send(b"x" * 65536)
        log = procio.OutputLog()
        proc = types.SimpleNamespace(
            output=log, exit_code=3, timed_out=False, ended_at=2.0, started_at=1.0, signal=None
        )
        conn = _Conn(a)
        tail = handlers_procs._Tail(conn, proc, 0)
        log.closers.append(tail.end_from_pump)
        if fill:
            log.add("stdout", fill)
        if hold:
            tail.lock.acquire()
        t = threading.Thread(target=log.close, name="pump")
        t.start()
        t.join()
        a.close()
        b.close()
        return tail, conn

    tail, conn = run(b"hi\n")
    assert tail.ended and not tail.gone and tail.offset == 3
    [(last, thread)] = conn.ends
    lines = [json.loads(x) for x in last.split(b"\n") if x]
    assert thread == "pump"
    assert lines[0]["stdout"] == "hi\n" and lines[1]["exit_code"] == 3 and lines[1]["offset"] == 3
    for kw in ({"hold": True}, {"fill": b"x" * (handlers_procs.PUMP_END_BYTES + 1)}, {"full": True}):
        tail, conn = run(**kw)
        assert not tail.ended and conn.ends == [], kw  # left to the follower's own thread


def test_a_follower_that_does_not_read_does_not_hold_the_process_back(agent, client):
    """A background start followed in the same answer runs its pump on the follower's thread only
    while the follower keeps up: one that reads nothing while the command writes far more than the
    socket holds does not stop the command (the pump goes on on a pooled thread, the output into
    the log), and still gets the newest output, the bytes dropped and the exit."""
    ndjson = {"Accept": "application/x-ndjson"}
    code = "import sys\nfor _ in range(256): sys.stdout.write('x' * 16384)\n"
    with httpx.Client(base_url=agent.url, timeout=30) as follower:
        with follower.stream(
            "POST", "/exec", json={"cmd": ["python3", "-c", code], "background": True}, headers=ndjson
        ) as r:
            it = r.iter_lines()
            pid = json.loads(next(it))["pid"]
            deadline = time.monotonic() + 20
            while client.get(f"/processes/{pid}").json()["running"]:  # nothing read meanwhile
                assert time.monotonic() < deadline, "the command was held back by its follower"
                time.sleep(0.05)
            lines = [json.loads(line) for line in it if line.strip()]
    assert lines[-1]["exit_code"] == 0 and lines[-1]["offset"] == 256 * 16384, lines[-1]
    assert (
        sum(len(line.get("stdout", "")) for line in lines) + sum(line.get("dropped", 0) for line in lines)
        == 256 * 16384
    )

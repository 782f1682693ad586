"""The guest agent (src/atoll/guest/agent/), packed into its zipapps the way the worker does it and
run natively as a subprocess on 127.0.0.1.

Natively the agent is not PID 1 and runs outside gVisor, so these tests cover its HTTP API, process
handling and file streaming; the /gate parsing is also checked against a fake /proc tree.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from atoll.guest.agent import gate, routing
from atoll.worker.host import agent_pack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return data[data.rindex(")") + 2] not in "ZX"


def _wait_gone(pids, timeout=5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


class RunningAgent:
    def __init__(self, proc: subprocess.Popen, port: int, stderr_path: Path):
        self.proc = proc
        self.pid = proc.pid
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.stderr_path = stderr_path

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def _start_agent(tmp: Path, archive: str = agent_pack.COMPILED) -> RunningAgent:
    """Build the zipapps into `tmp` and run `archive` with the flags a sandbox uses (bundle.py)."""
    agent_pack.build(str(tmp))
    port = _free_port()
    env = {
        "PATH": os.environ.get("PATH", routing.DEFAULT_PATH),
        "ATOLL_SANDBOX_ID": "sbx-unit",
        "ATOLL_GENERATION": "4",
        "ATOLL_AGENT_SHELL": "sh",  # the host's login profile (pyenv, ...) is not under test here
    }
    stderr_path = tmp / f"agent-{port}.stderr"
    python = [sys.executable, "-I", "-S", "-u"]
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [*python, str(tmp / archive), "--host", "127.0.0.1", "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            env=env,
        )
    agent = RunningAgent(proc, port, stderr_path)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with {proc.returncode}: {stderr_path.read_text()}")
        try:
            if httpx.get(f"{agent.url}/health", timeout=1).status_code == 200:
                return agent
        except httpx.HTTPError:
            time.sleep(0.05)
    agent.stop()
    raise RuntimeError(f"agent did not become healthy: {stderr_path.read_text()}")


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


def _exec(client, **body) -> dict:
    r = client.post("/exec", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["message"]
    return err["message"]


def _ndjson(client, body, timeout=30):
    lines, stamps = [], []
    t0 = time.monotonic()
    with client.stream("POST", "/exec", json=body, headers={"Accept": "application/x-ndjson"}) as r:
        assert r.status_code == 200
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["content-type"] == "application/x-ndjson"
        for line in r.iter_lines():
            if line:
                lines.append(json.loads(line))
                stamps.append(time.monotonic() - t0)
    return lines, stamps


# ---- health and identity


def test_health(client, agent):
    h = client.get("/health").json()
    assert h["ok"] is True
    assert h["pid"] == agent.pid
    assert h["sandbox_id"] == "sbx-unit"
    assert h["generation"] == 4
    assert h["hostname"] == socket.gethostname()
    assert abs(h["time"] - time.time()) < 5
    assert h["uptime_s"] >= 0


def test_identity(client):
    r = client.post(
        "/identity", json={"sandbox_id": "sbx-forked", "generation": 9, "hostname": socket.gethostname()}
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"sandbox_id": "sbx-forked", "generation": 9, "hostname": socket.gethostname()}
    h = client.get("/health").json()
    assert (h["sandbox_id"], h["generation"]) == ("sbx-forked", 9)
    _error(client.post("/identity", json={"sandbox_id": "x", "generation": "nine"}), 400, "invalid_request")
    for bad in (0, -1, "2", True):
        body = {"sandbox_id": "x", "generation": 1, "cpus": bad}
        _error(client.post("/identity", json=body), 400, "invalid_request")
    r = client.post("/identity", json={"sandbox_id": "sbx-unit", "generation": 4, "hostname": None})
    assert r.status_code == 200


# ---- exec


def test_exec_string_and_exit_code(client):
    res = _exec(client, cmd="echo out; echo err >&2; exit 3")
    assert res["exit_code"] == 3
    assert res["stdout"] == "out\n"
    assert res["stderr"] == "err\n"
    assert res["timed_out"] is False
    assert isinstance(res["duration_ms"], int)


def test_commands_inherit_no_agent_descriptor(client, agent):
    # another connection is open (and a background process's log) while the command starts
    bg = _exec(client, cmd="sleep 5", background=True)
    with httpx.Client(base_url=agent.url, timeout=30) as other:
        assert other.get("/health").status_code == 200
        listing = "import os; print(' '.join(sorted(os.listdir('/proc/self/fd'), key=int)))"
        res = _exec(client, cmd=[sys.executable, "-c", listing])
    assert res["stdout"] == "0 1 2 3\n", res  # 3 is the listing's own directory handle
    client.delete(f"/processes/{bg['pid']}")


def test_exec_argv_is_not_split_by_a_shell(client):
    res = _exec(client, cmd=["printf", "%s|", "a b", "$HOME", "c"])
    assert res == {**res, "exit_code": 0, "stdout": "a b|$HOME|c|", "stderr": ""}


def test_exec_missing_binary_is_127(client):
    res = _exec(client, cmd=["definitely-not-a-command-xyz", "arg"])
    assert res["exit_code"] == 127
    assert res["stderr"] == "definitely-not-a-command-xyz: command not found\n"
    res = _exec(client, cmd="definitely-not-a-command-xyz")
    assert res["exit_code"] == 127
    assert "not found" in res["stderr"]


def test_exec_not_executable_is_126(client, tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    res = _exec(client, cmd=[str(script)])
    assert res["exit_code"] == 126
    assert "Permission denied" in res["stderr"]


def test_exec_invalid_utf8_is_replaced(client):
    res = _exec(client, cmd="printf 'a\\377b'; printf '\\376' >&2")
    assert res["stdout"] == "a\ufffdb"
    assert res["stderr"] == "\ufffd"


def test_exec_cwd_and_env(client, tmp_path):
    res = _exec(
        client,
        cmd='pwd; echo "$FOO"; echo "$LANG"; echo "${ATOLL_SANDBOX_ID:-unset}"; echo "$PATH"',
        cwd=str(tmp_path),
        env={"FOO": "bar baz"},
    )
    assert res["exit_code"] == 0, res
    pwd_line, foo, lang, leaked, path = res["stdout"].splitlines()
    assert os.path.realpath(pwd_line) == os.path.realpath(tmp_path)
    assert (foo, lang, leaked) == ("bar baz", "C.UTF-8", "sbx-unit")  # its own id, nothing else
    assert path
    res = _exec(client, cmd="echo $LANG", env={"LANG": "en_US.UTF-8"})
    assert res["stdout"] == "en_US.UTF-8\n"


def test_exec_stdin_is_dev_null(client):
    res = _exec(client, cmd="cat; echo done")
    assert res["stdout"] == "done\n"


def test_exec_bad_requests(client, tmp_path):
    msg = _error(
        client.post("/exec", json={"cmd": "true", "cwd": str(tmp_path / "nope")}), 400, "invalid_request"
    )
    assert "nope" in msg
    _error(client.post("/exec", json={"cmd": ""}), 400, "invalid_request")
    _error(client.post("/exec", json={"cmd": 5}), 400, "invalid_request")
    _error(client.post("/exec", json={"cmd": "true", "timeout_s": -1}), 400, "invalid_request")
    _error(client.post("/exec", json={"cmd": "true", "env": {"A": 1}}), 400, "invalid_request")
    _error(client.post("/exec", content=b"{not json"), 400, "invalid_request")
    _error(client.post("/exec", content=b"[1, 2]"), 400, "invalid_request")


def test_exec_user(client):
    msg = _error(client.post("/exec", json={"cmd": "id", "user": "no-such-user-xyz"}), 400, "invalid_request")
    assert "no-such-user-xyz" in msg
    if os.geteuid() != 0:
        pytest.skip("switching users needs root")
    nobody = pwd.getpwnam("nobody")
    res = _exec(client, cmd='id -u; id -g; echo "$HOME $USER"', user="nobody")
    assert res["exit_code"] == 0, res
    uid, gid, home_user = res["stdout"].splitlines()
    assert (int(uid), int(gid)) == (nobody.pw_uid, nobody.pw_gid)
    assert home_user == f"{nobody.pw_dir} nobody"
    res = _exec(client, cmd="id -u", user="root")
    assert res["stdout"] == "0\n"


def test_exec_timeout_kills_the_whole_tree(client, tmp_path):
    d = tmp_path
    cmd = (
        f"sleep 100 & echo $! > {d}/a; "
        f"setsid sleep 101 & echo $! > {d}/b; "  # own session: found by the ppid walk
        f"(sleep 102 & echo $! > {d}/c; wait) & "
        "sleep 103"
    )
    t0 = time.monotonic()
    res = _exec(client, cmd=cmd, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert res["timed_out"] is True
    assert res["exit_code"] == 137
    pids = [int((d / n).read_text()) for n in ("a", "b", "c")]
    assert _wait_gone(pids) == []


def test_exec_returns_when_a_background_child_keeps_the_pipes(client, tmp_path):
    t0 = time.monotonic()
    cmd = f"(while true; do echo tick; sleep 0.05; done) & echo $! > {tmp_path}/pid; echo started"
    res = _exec(client, cmd=cmd)
    assert time.monotonic() - t0 < 3
    assert res["exit_code"] == 0
    # the child may print a tick before or after "started": only the line set is certain
    assert "started" in res["stdout"].splitlines()
    pid = int((tmp_path / "pid").read_text())
    time.sleep(0.5)
    assert _alive(pid)  # its output is still being read (a closed pipe would SIGPIPE it)
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone([pid]) == []


def test_deleting_a_running_foreground_exec(client, agent):
    result = {}

    def run():
        with httpx.Client(base_url=agent.url, timeout=30) as c:
            result.update(_exec(c, cmd=["sleep", "30"]))

    t = threading.Thread(target=run)
    t.start()
    pid = None
    deadline = time.monotonic() + 5
    while pid is None and time.monotonic() < deadline:
        pid = next((p["pid"] for p in _processes(client).values() if p["cmd"] == ["sleep", "30"]), None)
    assert pid is not None
    assert client.delete(f"/processes/{pid}").status_code == 204
    t.join(10)
    assert result["exit_code"] == 137 and result["timed_out"] is False


def test_exec_true_is_fast(client):
    durations = [_exec(client, cmd=["true"])["duration_ms"] for _ in range(20)]
    durations.sort()
    assert durations[10] < 50, durations


def test_concurrent_execs_get_their_own_exit_codes(client, agent):
    results: dict[int, dict] = {}

    def run(i):
        with httpx.Client(base_url=agent.url, timeout=30) as c:
            results[i] = _exec(c, cmd=f"echo {i}; exit {i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(24):
        assert results[i]["exit_code"] == i
        assert results[i]["stdout"] == f"{i}\n"


def test_exec_streaming_order_and_final_line(client):
    lines, stamps = _ndjson(
        client, {"cmd": "printf a; sleep 0.3; printf b >&2; sleep 0.3; printf c; sleep 0.5; exit 4"}
    )
    assert lines[:3] == [{"stdout": "a"}, {"stderr": "b"}, {"stdout": "c"}]
    final = lines[-1]
    assert len(lines) == 4
    assert final["exit_code"] == 4
    assert final["timed_out"] is False
    assert final["duration_ms"] >= 1000
    assert stamps[0] < 0.6  # flushed as it happened, not at the end


def test_exec_streaming_decodes_split_utf8(client):
    lines, _ = _ndjson(client, {"cmd": "printf '\\303'; sleep 0.2; printf '\\251x\\377'"})
    text = "".join(line.get("stdout", "") for line in lines)
    assert text == "éx\ufffd"


def test_exec_streaming_timeout_and_missing_binary(client):
    lines, _ = _ndjson(client, {"cmd": "echo hi; sleep 30", "timeout_s": 0.5})
    assert lines[0] == {"stdout": "hi\n"}
    assert lines[-1]["timed_out"] is True and lines[-1]["exit_code"] == 137
    lines, _ = _ndjson(client, {"cmd": ["no-such-binary-xyz"]})
    assert lines[0] == {"stderr": "no-such-binary-xyz: command not found\n"}
    assert lines[-1]["exit_code"] == 127


def test_exec_answer_keeps_head_and_tail(client):
    res = _exec(client, cmd="seq 1 20000; echo bye >&2", max_output_bytes=100)
    assert res["stdout"].startswith("1\n2\n") and res["stdout"].endswith("19999\n20000\n")
    assert res["stdout_truncated_bytes"] == len("".join(f"{i}\n" for i in range(1, 20001))) - 100
    assert res["stderr"] == "bye\n" and res["stderr_truncated_bytes"] == 0
    for bad in (0, -5, True, "10", 1 << 40):
        _error(client.post("/exec", json={"cmd": "true", "max_output_bytes": bad}), 400, "invalid_request")


def test_deeply_nested_body_is_400(client):
    r = client.post("/exec", content=b"[" * 100000)
    assert "nested" in _error(r, 400, "invalid_request")


# ---- processes


def _processes(client) -> dict[int, dict]:
    r = client.get("/processes")
    assert r.status_code == 200
    return {p["pid"]: p for p in r.json()["items"]}


def test_background_process_is_listed_and_killable(client, tmp_path):
    r = client.post("/exec", json={"cmd": f"sleep 60 & echo $! > {tmp_path}/child; wait", "background": True})
    assert r.status_code == 200, r.text
    pid = r.json()["pid"]
    item = _processes(client)[pid]
    assert item["running"] is True and item["background"] is True and item["exit_code"] is None
    assert item["cmd"].startswith("sleep 60")
    deadline = time.monotonic() + 5
    # The shell creates the file before it writes the pid: wait for the content, not the file.
    while time.monotonic() < deadline:
        if (tmp_path / "child").exists() and (tmp_path / "child").read_text().strip():
            break
        time.sleep(0.02)
    child = int((tmp_path / "child").read_text())
    assert client.delete(f"/processes/{pid}").status_code == 204
    assert pid not in _processes(client)
    assert _wait_gone([pid, child]) == []
    _error(client.delete(f"/processes/{pid}"), 404, "process_not_found")


def test_finished_background_process_stays_listed_with_its_log(client):
    r = client.post("/exec", json={"cmd": "echo hello; echo oops >&2; exit 3", "background": True})
    pid, log_path = r.json()["pid"], r.json()["log_path"]
    deadline = time.monotonic() + 5
    while _processes(client)[pid]["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    item = _processes(client)[pid]
    assert (item["running"], item["exit_code"]) == (False, 3)
    log = client.get("/files", params={"path": log_path})
    assert log.status_code == 200
    assert sorted(log.text.splitlines()) == ["hello", "oops"]
    assert client.delete(f"/processes/{pid}").status_code == 204
    assert pid not in _processes(client)
    assert client.get("/files", params={"path": log_path}).status_code == 404


def test_background_missing_binary_and_unknown_pid(client):
    _error(
        client.post("/exec", json={"cmd": ["no-such-binary-xyz"], "background": True}), 400, "invalid_request"
    )
    _error(client.delete("/processes/999999999"), 404, "process_not_found")
    _error(client.delete("/processes/abc"), 400, "invalid_request")


def test_background_timeout(client):
    pid = client.post("/exec", json={"cmd": ["sleep", "60"], "background": True, "timeout_s": 0.3}).json()[
        "pid"
    ]
    deadline = time.monotonic() + 5
    while _processes(client)[pid]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes(client)[pid]["exit_code"] == 137
    client.delete(f"/processes/{pid}")


def test_running_foreground_exec_is_listed(client, agent):
    done = threading.Event()

    def run():
        with httpx.Client(base_url=agent.url, timeout=30) as c:
            _exec(c, cmd=["sleep", "1"])
        done.set()

    threading.Thread(target=run).start()
    seen = None
    deadline = time.monotonic() + 5
    while seen is None and time.monotonic() < deadline:
        seen = next((p for p in _processes(client).values() if p["cmd"] == ["sleep", "1"]), None)
        time.sleep(0.02)
    assert seen is not None and seen["running"] is True and seen["background"] is False
    assert done.wait(10)
    assert seen["pid"] not in _processes(client)


# ---- files


def test_files_roundtrip_binary(client, tmp_path):
    data = bytes(range(256)) * 100
    path = tmp_path / "deep" / "er" / "blob.bin"
    r = client.put("/files", params={"path": str(path)}, content=data)
    assert r.status_code == 204, r.text
    assert path.read_bytes() == data
    assert (path.stat().st_mode & 0o777) == 0o644
    r = client.get("/files", params={"path": str(path)})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    assert int(r.headers["content-length"]) == len(data)
    assert r.content == data
    # overwrite with a mode; an empty file
    assert client.put("/files", params={"path": str(path), "mode": "0600"}, content=b"x").status_code == 204
    assert path.read_bytes() == b"x" and (path.stat().st_mode & 0o777) == 0o600
    assert client.put("/files", params={"path": str(tmp_path / "empty")}, content=b"").status_code == 204
    assert client.get("/files", params={"path": str(tmp_path / "empty")}).content == b""
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp files left


def test_files_20mb_streamed_both_ways(client, tmp_path):
    chunk = os.urandom(1 << 20)
    blob = b"".join(hashlib.sha256(chunk + bytes([i])).digest() * 32768 for i in range(20))
    assert len(blob) == 20 << 20
    want = hashlib.sha256(blob).hexdigest()

    def gen():  # no length known: httpx sends Transfer-Encoding: chunked
        for i in range(0, len(blob), 300_000):
            yield blob[i : i + 300_000]

    chunked = tmp_path / "chunked.bin"
    assert client.put("/files", params={"path": str(chunked)}, content=gen()).status_code == 204
    sized = tmp_path / "sized.bin"
    assert client.put("/files", params={"path": str(sized)}, content=blob).status_code == 204
    for path in (chunked, sized):
        h = hashlib.sha256()
        with client.stream("GET", "/files", params={"path": str(path)}) as r:
            assert r.status_code == 200
            assert int(r.headers["content-length"]) == len(blob)
            for piece in r.iter_bytes():
                h.update(piece)
        assert h.hexdigest() == want


def test_files_list_and_delete(client, tmp_path):
    (tmp_path / "b.txt").write_bytes(b"12345")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_dir" / "inner").write_text("x")
    (tmp_path / "link").symlink_to("b.txt")
    os.mkfifo(tmp_path / "pipe")
    r = client.get("/files/list", params={"path": str(tmp_path)})
    assert r.status_code == 200
    items = r.json()["items"]
    assert [i["name"] for i in items] == ["a_dir", "b.txt", "link", "pipe"]
    by = {i["name"]: i for i in items}
    assert by["a_dir"]["type"] == "dir"
    assert by["b.txt"] == {
        "name": "b.txt",
        "path": f"{tmp_path}/b.txt",
        "type": "file",
        "size": 5,
        "mode": (tmp_path / "b.txt").stat().st_mode & 0o7777,
        "mtime": (tmp_path / "b.txt").stat().st_mtime,
        "name_b64": base64.b64encode(b"b.txt").decode(),
        "path_b64": base64.b64encode(f"{tmp_path}/b.txt".encode()).decode(),
    }
    assert by["link"]["type"] == "symlink"
    assert by["pipe"]["type"] == "other"
    assert client.delete("/files", params={"path": str(tmp_path / "a_dir")}).status_code == 204
    assert client.delete("/files", params={"path": str(tmp_path / "link")}).status_code == 204
    assert client.delete("/files", params={"path": str(tmp_path / "b.txt")}).status_code == 204
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_files_errors(client, tmp_path):
    (tmp_path / "f").write_text("x")
    assert "absolute" in _error(client.get("/files", params={"path": "rel/x"}), 400, "invalid_path")
    _error(client.get("/files"), 400, "invalid_path")
    _error(client.put("/files", params={"path": "rel"}, content=b"x"), 400, "invalid_path")
    _error(client.get("/files", params={"path": str(tmp_path / "missing")}), 404, "file_not_found")
    assert "/files/list" in _error(client.get("/files", params={"path": str(tmp_path)}), 400, "invalid_path")
    _error(client.get("/files/list", params={"path": str(tmp_path / "f")}), 400, "invalid_path")
    _error(client.get("/files/list", params={"path": str(tmp_path / "missing")}), 404, "file_not_found")
    _error(client.put("/files", params={"path": str(tmp_path)}, content=b"x"), 400, "invalid_path")
    _error(
        client.put("/files", params={"path": str(tmp_path / "f" / "under")}, content=b"x"),
        400,
        "invalid_path",
    )
    _error(
        client.put("/files", params={"path": str(tmp_path / "g"), "mode": "99"}, content=b"x"),
        400,
        "invalid_request",
    )
    _error(client.delete("/files", params={"path": "/"}), 400, "invalid_path")
    _error(client.delete("/files", params={"path": str(tmp_path / "missing")}), 404, "file_not_found")
    _error(client.get("/files", params={"path": "/dev/null"}), 400, "invalid_path")


def test_proc_style_files_are_readable(client):
    r = client.get("/files", params={"path": "/proc/self/status"})
    assert r.status_code == 200
    assert b"Pid:" in r.content


# ---- HTTP behaviour


def test_unknown_routes_are_404(client):
    _error(client.get("/nope"), 404, "not_found")
    _error(client.patch("/files", params={"path": "/x"}), 404, "not_found")
    _error(client.post("/health"), 404, "not_found")


def test_keep_alive_survives_errors_and_unread_bodies(agent):
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        assert first.getheader("Connection") is None
        conn.request("POST", "/nowhere", body=b"z" * 100_000)  # body never read by a handler
        r = conn.getresponse()
        assert r.status == 404
        assert r.getheader("Connection") is None
        r.read()
        conn.request("PUT", "/files?path=relative", body=b"z" * 5000)
        r = conn.getresponse()
        assert r.status == 400
        r.read()
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["ok"] is True
        assert conn.sock is sock  # one connection throughout
    finally:
        conn.close()


def _agent_time_waits(port: int) -> list:
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            rows += gate._read_tcp_table(f"/proc/net/{name}")
        except FileNotFoundError:
            pass
    return [r for r in rows if r[1] == port and r[4] == 0x06]


def test_agent_never_holds_time_wait(agent):
    # normal keep-alive use, then the client closes
    for _ in range(3):
        with httpx.Client(base_url=agent.url) as c:
            c.get("/health")
            c.post("/exec", json={"cmd": "true"})
    # the client asks for Connection: close: the agent still lets the client close first
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    conn.request("GET", "/health", headers={"Connection": "close"})
    r = conn.getresponse()
    assert r.getheader("Connection") == "close"
    r.read()
    conn.close()
    # a malformed request gets a 400 and the connection ends the same way
    with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 400 ")
        assert b"Connection: close" in reply
    time.sleep(0.3)
    assert _agent_time_waits(agent.port) == []


def test_malformed_requests_get_400(agent):
    for raw in (b"GET http://[::1/health HTTP/1.1\r\n\r\n", b"GET /health HTTP/2.0\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as s:
            s.sendall(raw)
            reply = s.recv(65536)
            assert reply.split(b" ", 2)[1] in (b"400", b"505"), reply
            body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "invalid_request"


def test_expect_100_continue_and_chunked_upload(agent, tmp_path):
    target = tmp_path / "expect.bin"
    with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as s:
        s.sendall(
            f"PUT /files?path={target} HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        assert s.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: y\r\n\r\n")
        reply = s.recv(1024)
        assert reply.startswith(b"HTTP/1.1 204 ")
    assert target.read_bytes() == b"hello world"


def test_agent_uses_no_epoll(client, agent, tmp_path):
    _exec(client, cmd="echo x")
    _ndjson(client, {"cmd": "echo y"})
    client.put("/files", params={"path": str(tmp_path / "f")}, content=b"x")
    links = []
    for fd in os.listdir(f"/proc/{agent.pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{agent.pid}/fd/{fd}"))
        except OSError:
            pass
    assert not [link for link in links if "eventpoll" in link], links


# ---- gate


def test_gate_plain_agent(client, agent):
    report = client.get("/gate").json()
    assert set(report) == {"blockers", "external_connections", "epoll_tcp_pids"}
    assert agent.pid not in report["epoll_tcp_pids"]
    assert isinstance(report["external_connections"], int)
    assert not [b for b in report["blockers"] if f":{agent.port} ->" in b]


def test_gate_reports_a_process_watching_tcp_with_epoll(client):
    code = (
        "import selectors, socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "sel = selectors.EpollSelector(); sel.register(s, selectors.EVENT_READ)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    r = client.post("/exec", json={"cmd": [sys.executable, "-c", code], "background": True})
    pid = r.json()["pid"]
    try:
        report = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            report = client.get("/gate").json()
            if pid in report["epoll_tcp_pids"]:
                break
            time.sleep(0.1)
        assert pid in report["epoll_tcp_pids"], report
        assert [b for b in report["blockers"] if b.startswith(f"process {pid} (") and "epoll" in b]
    finally:
        client.delete(f"/processes/{pid}")


def _hex_v4(ip: str, port: int) -> str:
    return f"{socket.inet_aton(ip)[::-1].hex().upper()}:{port:04X}"


def _hex_v6(ip: str, port: int) -> str:
    raw = socket.inet_pton(socket.AF_INET6, ip)
    return "".join(raw[i : i + 4][::-1].hex().upper() for i in range(0, 16, 4)) + f":{port:04X}"


def _tcp_line(n, local, remote, state, inode):
    return f"{n:4d}: {local} {remote} {state:02X} 00000000:00000000 00:00000000 00000000     0        0 {inode} 1"


def _fake_proc(root: Path, tcp: list[str], tcp6: list[str], fds: dict[int, list[str]]) -> None:
    header = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
    )
    (root / "net").mkdir(parents=True)
    (root / "net" / "tcp").write_text("\n".join([header, *tcp]) + "\n")
    (root / "net" / "tcp6").write_text("\n".join([header, *tcp6]) + "\n")
    (root / "net" / "unix").write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 200 /run/x.sock\n"
    )
    for pid, targets in fds.items():
        fd_dir = root / str(pid) / "fd"
        fd_dir.mkdir(parents=True)
        (root / str(pid) / "comm").write_text(f"proc{pid}\n")
        for i, target in enumerate(targets):
            os.symlink(target, fd_dir / str(i))


def test_gate_report_on_a_fake_proc(tmp_path):
    ext = (_hex_v4("10.99.0.2", 5000), _hex_v4("10.99.0.1", 41234))
    tcp = [
        _tcp_line(0, _hex_v4("0.0.0.0", 8080), _hex_v4("0.0.0.0", 0), 0x0A, 100),  # LISTEN
        _tcp_line(1, *ext, 0x01, 101),  # external, ESTABLISHED
        _tcp_line(2, _hex_v4("127.0.0.1", 1), _hex_v4("127.0.0.1", 2), 0x01, 102),  # loopback
        _tcp_line(3, _hex_v4("10.99.0.2", 49999), _hex_v4("10.99.0.1", 5555), 0x01, 103),  # worker channel
        _tcp_line(4, _hex_v4("10.99.0.2", 49999), _hex_v4("10.99.0.1", 5556), 0x06, 0),  # TIME_WAIT there
        _tcp_line(5, _hex_v4("0.0.0.0", 0), _hex_v4("0.0.0.0", 0), 0x07, 104),  # bound, unconnected
        "garbage line",
    ]
    tcp6 = [
        _tcp_line(0, _hex_v6("::ffff:127.0.0.1", 7), _hex_v6("::1", 8), 0x01, 105),  # loopback
        _tcp_line(1, _hex_v6("fd00::2", 443), _hex_v6("fd00::1", 999), 0x08, 106),  # external CLOSE_WAIT
    ]
    fds = {
        10: ["anon_inode:[eventpoll]", "socket:[100]", "/dev/null"],  # epoll + TCP listener
        11: ["anon_inode:[eventpoll]", "socket:[200]"],  # epoll + unix socket only
        12: ["socket:[101]"],  # TCP without epoll
        13: ["anon_inode:[eventpoll]", "socket:[103]"],  # the agent itself
        14: ["socket:[999]", "anon_inode:[eventpoll]"],  # an unknown socket counts as TCP
    }
    _fake_proc(tmp_path, tcp, tcp6, fds)
    report = gate.gate_report(str(tmp_path), own_pid=13, own_port=49999)
    assert report["epoll_tcp_pids"] == [10, 14]
    assert report["external_connections"] == 3
    assert report["blockers"][0] == (
        "TCP connection 10.99.0.2:5000 -> 10.99.0.1:41234 (ESTABLISHED) on the sandbox's external "
        "interface cannot be checkpointed"
    )
    assert "10.99.0.2:49999 -> 10.99.0.1:5556 (TIME_WAIT)" in report["blockers"][1]
    assert "[fd00::2]:443 -> [fd00::1]:999 (CLOSE_WAIT)" in report["blockers"][2]
    assert report["blockers"][3].startswith("process 10 (proc10) watches TCP sockets with epoll")
    assert report["blockers"][4].startswith("process 14 (proc14)")
    assert len(report["blockers"]) == 5


def test_gate_report_clean_and_unreadable(tmp_path):
    clean = tmp_path / "clean"
    _fake_proc(clean, [], [], {20: ["/dev/null", "pipe:[5]"]})
    assert gate.gate_report(str(clean), own_pid=1, own_port=49999) == {
        "blockers": [],
        "external_connections": 0,
        "epoll_tcp_pids": [],
    }
    broken = tmp_path / "broken"
    broken.mkdir()
    report = gate.gate_report(str(broken), own_pid=1, own_port=49999)
    assert len(report["blockers"]) == 1
    assert "could not be evaluated" in report["blockers"][0]


def test_gate_refuses_a_checkpoint_of_many_processes(tmp_path, monkeypatch):
    """A checkpoint of ~512 processes was OOM-killed half-way (and a failed checkpoint kills the
    sandbox): past MAX_PROCESSES the gate keeps the sandbox in the memory tier."""
    monkeypatch.setattr(gate, "MAX_PROCESSES", 3)
    _fake_proc(tmp_path / "three", [], [], {pid: ["/dev/null"] for pid in (20, 21, 22)})
    assert gate.gate_report(str(tmp_path / "three"), own_pid=1, own_port=49999)["blockers"] == []
    _fake_proc(tmp_path / "four", [], [], {pid: ["/dev/null"] for pid in (20, 21, 22, 23)})
    (blocker,) = gate.gate_report(str(tmp_path / "four"), own_pid=1, own_port=49999)["blockers"]
    assert blocker.startswith("4 processes are running")


def test_final_gate_counts_the_workers_other_connections_still_open(tmp_path):
    """POST /gate/final (the worker's last call before runsc saves): the worker's connections to the
    agent port other than the asking one count while gVisor would refuse to save them, so the agent
    waits for the resets the worker sent to be processed; closed or errored ones do not count."""
    own = _hex_v4("10.99.0.2", 49999)
    tcp = [
        _tcp_line(0, own, _hex_v4("10.99.0.1", 5555), 0x01, 103),  # reset sent, not yet processed
        _tcp_line(1, own, _hex_v4("10.99.0.1", 5556), 0x08, 104),  # CLOSE_WAIT
        _tcp_line(2, own, _hex_v4("10.99.0.1", 5557), 0x0F, 105),  # gVisor's error state: reset
        _tcp_line(3, own, _hex_v4("10.99.0.1", 5558), 0x07, 106),  # closed
        _tcp_line(4, own, _hex_v4("10.99.0.1", 6000), 0x01, 107),  # the asking connection
    ]
    _fake_proc(tmp_path, tcp, [], {})
    report = gate.gate_report(str(tmp_path), own_pid=1, own_port=49999, final_peer=6000)
    assert report["own_connections_open"] == 2
    assert report["blockers"] == []  # the plain gate's view of the worker's channel is unchanged
    assert "own_connections_open" not in gate.gate_report(str(tmp_path), own_pid=1, own_port=49999)


def test_final_gate_answers_then_resets_once_the_worker_shut_down(agent):
    """The answer arrives whole, and the agent resets the connection (an RST, closed within its
    close call) only after the worker shut its side down; without that it resets after its wait."""
    host, port = agent.url.removeprefix("http://").split(":")
    for shut_down in (True, False):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /gate/final HTTP/1.1\r\nHost: agent\r\nContent-Length: 0\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" in head, head
            length = int(
                next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
            )
            while len(body) < length:
                body += s.recv(65536)
            report = json.loads(body)
            assert report["own_connections_open"] == 0 and isinstance(report["blockers"], list), report
            t0 = time.monotonic()
            if shut_down:
                s.shutdown(socket.SHUT_WR)
            with pytest.raises(ConnectionResetError):
                while s.recv(4096):  # an orderly close (b"") would end the loop and fail the test
                    pass
            waited = time.monotonic() - t0
            assert waited < 1.0 if shut_down else waited > 1.5, (shut_down, waited)


# ---- lifecycle


def test_sigterm_exits_0_and_kills_background_commands(tmp_path):
    running = _start_agent(tmp_path)
    try:
        with httpx.Client(base_url=running.url, timeout=10) as c:
            started = c.post("/exec", json={"cmd": ["sleep", "60"], "background": True}).json()
        pid = started["pid"]
        assert _alive(pid)
    finally:
        code = running.stop()
    Path(started["log_path"]).unlink(missing_ok=True)
    assert code == 0
    assert _wait_gone([pid]) == []


def test_source_zipapp_runs_the_same_agent(tmp_path):
    """agent-source.pyz is what a template whose python3 is another version runs."""
    running = _start_agent(tmp_path, agent_pack.SOURCE)
    try:
        with httpx.Client(base_url=running.url, timeout=10) as c:
            health = c.get("/health").json()
            res = c.post("/exec", json={"cmd": ["echo", "hi"]}).json()
    finally:
        code = running.stop()
    assert code == 0
    assert health["sandbox_id"] == "sbx-unit" and health["generation"] == 4
    assert res["exit_code"] == 0 and res["stdout"] == "hi\n"

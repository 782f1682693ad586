"""Processes as handles, stdin and the shell convention, against real gVisor sandboxes (through
`atoll up` and, parametrized, `atoll server` + `atoll worker`): what a user types and reads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

import atoll
from tests.integration.conftest import run

pytestmark = pytest.mark.integration

REPL = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    print('=', eval(line), flush=True)\n"
    "print('bye', file=sys.stderr, flush=True)\n"
)


def _lines(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.content.split(b"\n") if x.strip()]


def _streams(chunks: list[dict]) -> list[tuple[str, str]]:
    """(stream, text) with adjacent chunks of one stream joined: a program's writes may reach the
    agent as one read or several (`print` to an unbuffered stderr writes the text and the newline
    separately), so only the order of the streams and their text is fixed, not the chunking."""
    out: list[tuple[str, str]] = []
    for x in chunks:
        for name in ("stdout", "stderr"):
            if name in x:
                if out and out[-1][0] == name:
                    out[-1] = (name, out[-1][1] + x[name])
                else:
                    out.append((name, x[name]))
    return out


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err["message"]


def _start(api, sid, **body) -> int:
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={**body, "background": True})
    assert r.status_code == 200, r.text
    return r.json()["pid"]


def _read_until(api, sid, pid, needle: str, offset: int = 0, timeout: float = 20) -> tuple[str, int]:
    text = ""
    deadline = time.monotonic() + timeout
    while needle not in text:
        assert time.monotonic() < deadline, f"{needle!r} never came; got {text!r}"
        for line in _lines(api.get(f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"offset": offset})):
            text += line.get("stdout", "") + line.get("stderr", "")
            offset = line["offset"]
        time.sleep(0.05)
    return text, offset


@pytest.mark.seam
def test_exec_with_stdin(api, sandbox):
    sid = sandbox["id"]
    assert run(api, sid, "cat", stdin="hello\nsandbox\n")["stdout"] == "hello\nsandbox\n"
    out = run(api, sid, ["python3", "-c", "import sys; print(sys.stdin.read())"], stdin="héllo")
    assert out["stdout"] == "héllo\n" and out["exit_code"] == 0
    r = api.post(
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": "wc -c", "stdin": "x" * 300_000},
        headers={"Accept": "application/x-ndjson"},
    )
    lines = _lines(r)
    assert "".join(x.get("stdout", "") for x in lines).strip() == "300000" and lines[-1]["exit_code"] == 0
    assert run(api, sid, "cat")["stdout"] == ""  # without stdin: /dev/null, as before


@pytest.mark.seam
def test_a_repl_fed_line_by_line_with_output_from_offsets_and_reattach(api, sandbox):
    sid = sandbox["id"]
    pid = _start(api, sid, cmd=["python3", "-u", "-c", REPL])
    text, offset = _read_until(api, sid, pid, "ready\n")
    info = api.get(f"/v1/sandboxes/{sid}/processes/{pid}").json()
    assert info["running"] and info["stdin_open"] and info["exit_code"] is None and info["pid"] == pid
    for expr, want in (("1+1", "= 2\n"), ("6*7", "= 42\n"), ("'ab'*2", "= abab\n")):
        r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", content=f"{expr}\n".encode())
        assert r.json() == {"written": len(expr) + 1, "eof": False}
        more, offset = _read_until(api, sid, pid, want, offset)
        assert more == want  # exactly the new output from the last offset
        text += more
    # Follow, leave mid-stream (the client goes away), then reattach at the last offset
    with api.stream("GET", f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"follow": "1"}) as r:
        first = json.loads(next(r.iter_lines()))
    assert first["stdout"].startswith("ready") and first["offset"] <= offset
    api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", content=b"10**3\n")
    api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", params={"eof": "1"})
    lines = _lines(
        api.get(f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"offset": offset, "follow": "1"})
    )
    assert _streams(lines[:-1]) == [("stdout", "= 1000\n"), ("stderr", "bye\n")]
    assert lines[-1]["exit_code"] == 0 and lines[-1]["offset"] == offset + len("= 1000\nbye\n")
    whole = _lines(api.get(f"/v1/sandboxes/{sid}/processes/{pid}/output"))
    assert "".join(x.get("stdout", "") + x.get("stderr", "") for x in whole) == text + "= 1000\nbye\n"
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/wait", json={"timeout_s": 10})
    assert r.status_code == 200 and r.json()["exit_code"] == 0 and not r.json()["running"]
    _error(api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", content=b"2+2\n"), 409, "process_exited")


@pytest.mark.seam
def test_signal_term_to_a_trapping_bash_script_and_wait(api, sandbox):
    sid = sandbox["id"]
    script = "trap 'echo caught TERM; exit 42' TERM; echo armed; while true; do sleep 0.1; done"
    pid = _start(api, sid, cmd=["bash", "-c", script])
    _read_until(api, sid, pid, "armed")
    msg = _error(
        api.post(f"/v1/sandboxes/{sid}/processes/{pid}/wait", json={"timeout_s": 0.5}), 409, "process_running"
    )
    assert str(pid) in msg
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", json={"signal": "TERM"})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/wait", json={})
    assert r.json()["exit_code"] == 42
    out = _lines(api.get(f"/v1/sandboxes/{sid}/processes/{pid}/output"))
    assert "".join(x.get("stdout", "") for x in out) == "armed\ncaught TERM\n"
    assert out[-1]["exit_code"] == 42


@pytest.mark.seam
def test_bad_process_input(api, sandbox):
    sid = sandbox["id"]
    pid = _start(api, sid, cmd=["sleep", "60"])
    base = f"/v1/sandboxes/{sid}/processes"
    msg = _error(api.post(f"{base}/{pid}/signal", json={"signal": "SIGNOPE"}), 400, "invalid_request")
    assert "SIGNOPE" in msg and "TERM" in msg and "KILL" in msg
    for offset in ("-1", "x", "1.5"):
        assert "offset" in _error(
            api.get(f"{base}/{pid}/output", params={"offset": offset}), 400, "invalid_request"
        )
    _error(api.get(f"{base}/{pid}/output", params={"offset": "999999"}), 400, "invalid_request")
    _error(api.get(f"{base}/abc"), 400, "invalid_request")
    _error(api.get(f"{base}/99999"), 404, "process_not_found")
    _error(api.post(f"{base}/99999/wait", json={}), 404, "process_not_found")
    _error(api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat", "stdin": 7}), 400, "invalid_request")
    _error(api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "x", "shell": "zsh"}), 400, "invalid_request")
    _error(api.post("/v1/sandboxes", json={"shell": "fish"}), 400, "invalid_request")
    r = api.post(f"{base}/{pid}/signal", json={"signal": 9})
    assert r.status_code == 200
    assert api.post(f"{base}/{pid}/wait", json={"timeout_s": 10}).json()["exit_code"] == 137
    assert api.delete(f"{base}/{pid}").status_code == 204  # DELETE keeps working


def test_bash_login_shell_conventions(api, shared_sandbox):
    sid = shared_sandbox["id"]
    out = run(
        api,
        sid,
        "source /etc/os-release && [[ $ID == debian ]] && echo is-$ID; shopt -q login_shell && echo login",
    )
    assert out["stdout"] == "is-debian\nlogin\n", out
    out = run(api, sid, "echo $0; [[ 1 == 1 ]] && echo yes", shell="sh")
    assert out["stdout"].startswith("/bin/sh\n") and out["exit_code"] != 0  # dash has no [[
    out = run(api, sid, 'echo "$PATH"', env={"PATH": "/call/bin:/usr/bin:/bin"})
    assert out["stdout"] == "/call/bin:/usr/bin:/bin\n"  # the call's PATH wins over /etc/profile's


def test_shell_per_sandbox(api):
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "shell": "sh"})
    assert r.status_code == 201, r.text
    sb = r.json()
    try:
        assert sb["shell"] == "sh" and api.get(f"/v1/sandboxes/{sb['id']}").json()["shell"] == "sh"
        assert run(api, sb["id"], "echo $0")["stdout"] == "/bin/sh\n"
        assert run(api, sb["id"], "echo $0", shell="bash")["stdout"] == "/bin/bash\n"  # the call wins
    finally:
        api.delete(f"/v1/sandboxes/{sb['id']}")


def test_a_template_env_path_wins_over_the_login_profile(atoll_server):
    name = f"pathwin-{os.getpid()}"
    path = "/opt/x/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    spec = {
        "env": {"PATH": path},
        "run": [
            "mkdir -p /opt/x/bin && printf '#!/bin/sh\\necho from-opt-x\\n' > /opt/x/bin/tool && chmod +x /opt/x/bin/tool"
        ],
    }
    with atoll.Client(base_url=atoll_server.url, api_key=atoll_server.api_key, request_timeout=600) as c:
        c.templates.build(name, timeout=900, env=spec["env"], run=spec["run"])
        sb = c.sandboxes.create(template=name, idle_timeout_s=0)
        try:
            # the login profile does reset PATH (a bash -l without atoll's re-export loses /opt/x/bin) ...
            raw = sb.exec(["bash", "-l", "-c", 'echo "$PATH"']).stdout.strip()
            assert not raw.startswith("/opt/x/bin"), raw
            # ... and a string command still has the template's PATH, first
            res = sb.exec('echo "$PATH"; tool', check=True)
            assert res.stdout == f"{path}\nfrom-opt-x\n"
            # ... and so does the terminal's default login shell
            with sb.pty(cols=200, rows=24) as term:
                term.send('echo "P=$PATH"; tool; exit\n')
                out = b""
                deadline = time.monotonic() + 30
                while (
                    b"from-opt-x\r\n" not in out.split(b"tool; exit", 1)[-1] and time.monotonic() < deadline
                ):
                    out += term.read(timeout=30)
                text = out.decode(errors="replace")
                assert f"P={path}" in text and "from-opt-x" in text.split("tool; exit", 1)[-1], text
        finally:
            sb.delete()
            c.templates.delete(name)


def test_sdk_process_handles(atoll_server, sandbox):
    with atoll.Client(base_url=atoll_server.url, api_key=atoll_server.api_key, request_timeout=120) as c:
        sb = c.sandboxes.get(sandbox["id"])
        proc = sb.exec(["python3", "-u", "-c", REPL], background=True)
        events = proc.output(follow=True)
        first = ""
        while "\n" not in first:  # print() under -u writes the text and its newline apart
            first += next(events).text
        assert first == "ready\n"
        events.close()  # leave; the process runs on
        proc.send_stdin("3*3\n")
        proc.close_stdin()
        assert proc.wait(timeout=30) == 0
        rest = list(sb.processes.get(proc.pid).output(follow=True, offset=proc.offset))
        kinds = [k for i, k in enumerate(e.kind for e in rest) if i == 0 or rest[i - 1].kind != k]
        assert kinds == ["stdout", "stderr", "exit"]  # pieces of one stream may come apart
        assert "".join(e.text for e in rest if e.kind == "stdout") == "= 9\n"
        with pytest.raises(atoll.errors.CommandFailed) as info:
            sb.exec("echo out; echo err >&2; exit 3", check=True)
        assert (info.value.exit_code, info.value.stdout, info.value.stderr) == (3, "out\n", "err\n")
        assert sb.exec("cat", stdin="piped").stdout == "piped"
        with pytest.raises(atoll.errors.ProcessExited):
            proc.send_stdin("late\n")


@pytest.mark.seam
def test_cli_exec_forwards_stdin(atoll_server, sandbox):
    env = {**os.environ, "ATOLL_URL": atoll_server.url, "ATOLL_API_KEY": atoll_server.api_key}
    cli = [os.path.join(os.path.dirname(sys.executable), "atoll")]
    small = subprocess.run(
        [*cli, "sandbox", "exec", sandbox["id"], "--", "tr a-z A-Z"],
        input=b"hi\n",
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert (small.returncode, small.stdout) == (0, b"HI\n"), small.stderr
    big = os.urandom(1 << 20) + b"\xff"  # over the inline limit and not UTF-8: streamed via the stdin route
    res = subprocess.run(
        [*cli, "sandbox", "exec", sandbox["id"], "--", "sha256sum"],
        input=big,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0].decode() == hashlib.sha256(big).hexdigest()
    code = subprocess.run(
        [*cli, "sandbox", "exec", sandbox["id"], "--", "exit 7"],
        input=b"",
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert code.returncode == 7


@pytest.mark.seam
def test_a_reader_at_a_dropped_offset_is_told(api, sandbox):
    sid = sandbox["id"]
    pid = _start(api, sid, cmd=["python3", "-c", "import sys; sys.stdout.write('x' * 5_000_000 + 'END')"])
    assert (
        api.post(f"/v1/sandboxes/{sid}/processes/{pid}/wait", json={"timeout_s": 60}).json()["exit_code"] == 0
    )
    lines = _lines(api.get(f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"offset": 0}))
    total = 5_000_003
    kept = 4 << 20
    assert lines[0] == {"dropped": total - kept, "offset": total - kept}
    text = "".join(x.get("stdout", "") for x in lines[1:])
    assert len(text) == kept and text.endswith("xEND") and lines[-1]["offset"] == total


@pytest.mark.seam
def test_a_sandbox_is_not_frozen_under_a_follower(api):
    """Idle timeout 1 s, a follow of 4 s: never standby meanwhile (the control plane holds activity
    and the worker counts the stream in flight), standby soon after it ended."""
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 1, "disk_after_s": 0})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        prog = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.5)"
        pid = _start(api, sid, cmd=["python3", "-u", "-c", prog])
        seen, states = "", []
        with api.stream("GET", f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"follow": "1"}) as r:
            for raw in r.iter_lines():
                line = json.loads(raw)
                seen += line.get("stdout", "")
                states.append(api.get(f"/v1/sandboxes/{sid}").json()["state"])
        assert seen == "".join(f"{i}\n" for i in range(8)) and set(states) == {"running"}, states
        deadline = time.monotonic() + 20  # the stream is over: idle again, so standby follows
        while api.get(f"/v1/sandboxes/{sid}").json()["state"] != "standby":
            assert time.monotonic() < deadline, "the sandbox never went idle after the follow ended"
            time.sleep(0.2)
    finally:
        api.delete(f"/v1/sandboxes/{sid}")

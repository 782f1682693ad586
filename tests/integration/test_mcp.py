"""`atoll mcp` against a real `atoll up` (the session's `atoll_server`) and real gVisor sandboxes: the
official MCP client (`ClientSession` over `stdio_client`) starts `python -m atoll mcp` as a
subprocess, lists its tools and drives one sandbox through every tool (create, exec as a string and
as an argv, exec streaming its output as progress notifications, write and read files, list, preview
URL, pause, exec that resumes, fork, delete); bad arguments, wrong ids and a wrong or missing key
answer tool errors with atoll's codes; stdout carries JSON-RPC only; and one session over
streamable HTTP (`atoll mcp --http`)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mcp", reason="the `mcp` extra is not installed: make install (pip install -e '.[mcp]')")

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {
    "create_sandbox",
    "list_sandboxes",
    "exec",
    "read_file",
    "write_file",
    "preview_url",
    "pause_sandbox",
    "fork_sandbox",
    "delete_sandbox",
}


def _env(atoll_server, **changes: str | None) -> dict[str, str]:
    """The server's environment: the MCP client passes only a few variables of its own (HOME, PATH,
    …) plus these, as an assistant's config `env` does. None removes a variable."""
    env = {"ATOLL_URL": atoll_server.url, "ATOLL_API_KEY": atoll_server.api_key}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@contextlib.asynccontextmanager
async def mcp_session(env: dict[str, str], errlog):
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "atoll", "mcp"], env=env, cwd=str(ROOT)
    )
    async with stdio_client(params, errlog=errlog) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


def _text(result) -> str:
    assert len(result.content) == 1, result.content
    return result.content[0].text


async def ok(session: ClientSession, tool: str, args: dict, **kw):
    result = await session.call_tool(tool, args, **kw)
    assert not result.is_error, (tool, args, _text(result))
    return _text(result)


async def ok_json(session: ClientSession, tool: str, args: dict, **kw):
    return json.loads(await ok(session, tool, args, **kw))


async def refused(session: ClientSession, tool: str, args: dict) -> str:
    result = await session.call_tool(tool, args)
    text = _text(result)
    assert result.is_error, (tool, args, text)
    assert "Traceback" not in text and 'File "' not in text, text
    return text


async def test_every_tool_on_one_sandbox(api, atoll_server, tmp_path):
    made: list[str] = []
    with open(tmp_path / "mcp.stderr", "w") as errlog:
        try:
            async with mcp_session(_env(atoll_server), errlog) as s:
                tools = (await s.list_tools()).tools
                assert {t.name for t in tools} == TOOLS
                for t in tools:
                    assert t.description, t.name
                    for name, prop in t.input_schema["properties"].items():
                        assert prop.get("description"), (t.name, name)
                exec_schema = next(t for t in tools if t.name == "exec").input_schema
                assert set(exec_schema["required"]) == {"sandbox_id", "cmd"}

                sb = await ok_json(s, "create_sandbox", {"metadata": {"test": "mcp"}, "timeout_s": 900})
                sid = sb["id"]
                made.append(sid)
                assert sb["state"] == "running" and sb["metadata"] == {"test": "mcp"}, sb
                assert sb["expires_at"], sb  # timeout_s reached the API

                # a string runs through the shell; a non-zero exit is an answer, not a tool error
                r = await ok_json(s, "exec", {"sandbox_id": sid, "cmd": "echo out; echo err >&2; exit 3"})
                assert (r["exit_code"], r["stdout"], r["stderr"]) == (3, "out\n", "err\n"), r
                assert r["timed_out"] is False
                # a list is an argv: no shell splits "a b" or expands $HOME
                r = await ok_json(s, "exec", {"sandbox_id": sid, "cmd": ["printf", "%s|", "a b", "$HOME"]})
                assert (r["exit_code"], r["stdout"]) == (0, "a b|$HOME|"), r
                # a timeout kills the command and says so
                r = await ok_json(s, "exec", {"sandbox_id": sid, "cmd": "sleep 30", "timeout_s": 1})
                assert r["timed_out"] is True, r

                # with a progress token, output streams as progress notifications while it runs
                events: list[tuple[float, float, str]] = []

                async def progress(value, total, message):
                    events.append((time.monotonic(), value, message))

                cmd = "for i in 1 2 3; do echo line$i; sleep 0.3; done; echo oops >&2"
                r = await ok_json(s, "exec", {"sandbox_id": sid, "cmd": cmd}, progress_callback=progress)
                done = time.monotonic()
                assert r["stdout"] == "line1\nline2\nline3\n" and r["stderr"] == "oops\n", r
                messages = [m for _, _, m in events]
                assert "".join(
                    m.removeprefix("[stdout] ") for m in messages if m.startswith("[stdout] ")
                ) == ("line1\nline2\nline3\n"), messages
                assert "[stderr] oops\n" in messages, messages
                values = [v for _, v, _ in events]
                assert values == sorted(values) and len(set(values)) == len(values), values
                assert events[0][0] < done - 0.4, "the first line came only with the result"

                # files: text both ways, parents created; bytes as base64
                text = "héllo\nwörld\n"
                w = await ok_json(
                    s, "write_file", {"sandbox_id": sid, "path": "/tmp/mcp/a/notes.txt", "content": text}
                )
                assert w == {"path": "/tmp/mcp/a/notes.txt", "bytes": len(text.encode())}
                assert await ok(s, "read_file", {"sandbox_id": sid, "path": "/tmp/mcp/a/notes.txt"}) == text
                r = await ok_json(s, "exec", {"sandbox_id": sid, "cmd": ["cat", "/tmp/mcp/a/notes.txt"]})
                assert r["stdout"] == text
                blob = bytes([0, 255, 1, 200, 10])
                await ok(
                    s,
                    "write_file",
                    {
                        "sandbox_id": sid,
                        "path": "/tmp/mcp/bin",
                        "content": base64.b64encode(blob).decode(),
                        "encoding": "base64",
                    },
                )
                got = await ok(
                    s, "read_file", {"sandbox_id": sid, "path": "/tmp/mcp/bin", "encoding": "base64"}
                )
                assert base64.b64decode(got) == blob
                err = await refused(s, "read_file", {"sandbox_id": sid, "path": "/tmp/mcp/bin"})
                assert err.startswith("not_text:") and "base64" in err, err
                err = await refused(s, "read_file", {"sandbox_id": sid, "path": "/tmp/mcp/missing"})
                assert err.startswith("file_not_found:"), err

                listed = await ok_json(s, "list_sandboxes", {})
                assert sid in [x["id"] for x in listed], listed

                pv = await ok_json(s, "preview_url", {"sandbox_id": sid, "port": 8080})
                assert pv["port"] == 8080 and f"8080-{sid}" in pv["url"] and pv["token"], pv
                assert pv["signed_url"].startswith(pv["url"].rstrip("/")), pv

                paused = await ok_json(s, "pause_sandbox", {"sandbox_id": sid})
                assert (paused["state"], paused["standby_tier"]) == ("standby", "memory"), paused
                # any exec resumes it, files intact
                r = await ok_json(s, "exec", {"sandbox_id": sid, "cmd": "cat /tmp/mcp/a/notes.txt"})
                assert r["stdout"] == text
                state = {x["id"]: x["state"] for x in await ok_json(s, "list_sandboxes", {})}
                assert state[sid] == "running"

                copies = await ok_json(s, "fork_sandbox", {"sandbox_id": sid, "count": 1})
                assert len(copies) == 1 and copies[0]["id"] != sid, copies
                copy = copies[0]["id"]
                made.append(copy)
                r = await ok_json(s, "exec", {"sandbox_id": copy, "cmd": "cat /tmp/mcp/a/notes.txt"})
                assert r["stdout"] == text  # the copy has the parent's files

                for victim in (copy, sid):
                    assert await ok_json(s, "delete_sandbox", {"sandbox_id": victim}) == {
                        "id": victim,
                        "deleted": True,
                    }
                err = await refused(s, "exec", {"sandbox_id": sid, "cmd": "true"})
                assert err.startswith("sandbox_not_found:"), err
                err = await refused(s, "delete_sandbox", {"sandbox_id": sid})
                assert err.startswith("sandbox_not_found:"), err
        finally:
            for victim in made:
                api.delete(f"/v1/sandboxes/{victim}")
    log = (tmp_path / "mcp.stderr").read_text()
    assert "atoll mcp: serving stdio" in log, log


async def test_bad_arguments_and_wrong_ids_are_tool_errors(atoll_server, tmp_path):
    unknown = "sb-0000000000000000"
    with open(tmp_path / "mcp.stderr", "w") as errlog:
        async with mcp_session(_env(atoll_server), errlog) as s:
            err = await refused(s, "exec", {"cmd": "true"})
            assert err.startswith("invalid_request: exec: sandbox_id: missing"), err
            for cmd in (5, [], "", ["ls", 3], {"argv": ["ls"]}):
                err = await refused(s, "exec", {"sandbox_id": unknown, "cmd": cmd})
                assert err.startswith("invalid_request: exec: cmd:") and "non-empty string" in err, (cmd, err)
            err = await refused(s, "exec", {"sandbox_id": unknown, "cmd": "true", "timeout": 5})
            assert err.startswith("invalid_request: exec: no argument named 'timeout'"), err
            err = await refused(s, "exec", {"sandbox_id": unknown, "cmd": "true", "timeout_s": -1})
            assert err.startswith("invalid_request: exec: timeout_s:") and "(got -1)" in err, err
            for count in (0, 11, -3):
                err = await refused(s, "fork_sandbox", {"sandbox_id": unknown, "count": count})
                assert err.startswith("invalid_request: fork_sandbox: count:"), (count, err)
            err = await refused(s, "pause_sandbox", {"sandbox_id": unknown, "tier": "freezer"})
            assert err.startswith("invalid_request: pause_sandbox: tier:"), err
            err = await refused(s, "preview_url", {"sandbox_id": unknown, "port": 70000})
            assert err.startswith("invalid_request: preview_url: port:"), err
            err = await refused(
                s, "write_file", {"sandbox_id": unknown, "path": "/x", "content": "%%", "encoding": "base64"}
            )
            assert err.startswith("invalid_request: write_file: content is not valid base64"), err
            # an id no sandbox has, well-formed or not: sandbox_not_found from every tool
            for sid in (unknown, "no-such-sandbox"):
                for tool, args in (
                    ("exec", {"cmd": "true"}),
                    ("read_file", {"path": "/etc/hostname"}),
                    ("write_file", {"path": "/tmp/x", "content": "x"}),
                    ("preview_url", {"port": 8080}),
                    ("pause_sandbox", {}),
                    ("fork_sandbox", {}),
                    ("delete_sandbox", {}),
                ):
                    err = await refused(s, tool, {"sandbox_id": sid, **args})
                    assert err.startswith("sandbox_not_found:") and sid in err, (tool, err)
            # the server is still serving after all that
            assert isinstance(await ok_json(s, "list_sandboxes", {}), list)


@pytest.mark.parametrize("key", ["wrong-key", None], ids=["wrong", "missing"])
async def test_a_wrong_or_missing_key_answers_unauthorized_and_keeps_serving(atoll_server, tmp_path, key):
    with open(tmp_path / "mcp.stderr", "w") as errlog:
        async with mcp_session(_env(atoll_server, ATOLL_API_KEY=key), errlog) as s:
            for _ in range(2):
                err = await refused(s, "list_sandboxes", {})
                assert err.startswith("unauthorized:") and "ATOLL_API_KEY" in err, err
            err = await refused(s, "create_sandbox", {})
            assert err.startswith("unauthorized:"), err
    if key is None:
        assert "no API key" in (tmp_path / "mcp.stderr").read_text()


def _send(proc: subprocess.Popen, message: dict) -> None:
    proc.stdin.write((json.dumps(message) + "\n").encode())
    proc.stdin.flush()


def _until_response(proc: subprocess.Popen, request_id: int, lines: list[bytes]) -> dict:
    while True:
        line = proc.stdout.readline()
        assert line, f"stdout closed before the answer to {request_id}"
        lines.append(line)
        message = json.loads(line)
        if message.get("id") == request_id:
            return message


def test_stdout_carries_only_json_rpc(atoll_server, shared_sandbox, tmp_path):
    """Raw stdio: every line the server writes to stdout is one JSON-RPC 2.0 message, with debug
    logging on, output streamed, errors answered and a command that writes to its own stdout."""
    env = {**os.environ, **_env(atoll_server), "ATOLL_LOG_LEVEL": "DEBUG"}
    errlog = open(tmp_path / "mcp.stderr", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atoll", "mcp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errlog,
        env=env,
        cwd=ROOT,
    )
    lines: list[bytes] = []
    try:
        _send(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "raw", "version": "0"},
                },
            },
        )
        init = _until_response(proc, 1, lines)
        assert init["result"]["serverInfo"]["name"] == "atoll", init
        _send(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        _send(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        assert {t["name"] for t in _until_response(proc, 2, lines)["result"]["tools"]} == TOOLS
        call = {
            "name": "exec",
            "arguments": {"sandbox_id": shared_sandbox["id"], "cmd": "echo to-stdout; echo to-stderr >&2"},
            "_meta": {"progressToken": "p1"},
        }
        _send(proc, {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call})
        answer = _until_response(proc, 3, lines)
        result = json.loads(answer["result"]["content"][0]["text"])
        assert (result["stdout"], result["stderr"]) == ("to-stdout\n", "to-stderr\n"), result
        progress = [json.loads(x) for x in lines if b'"notifications/progress"' in x]
        assert {p["params"]["progressToken"] for p in progress} == {"p1"}, progress
        assert any(p["params"]["message"] == "[stdout] to-stdout\n" for p in progress), progress
        _send(
            proc,
            {"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": "exec", "arguments": {}}},
        )
        assert _until_response(proc, 4, lines)["result"]["isError"] is True
        proc.stdin.close()  # the client hangs up: the server ends
        proc.wait(timeout=30)
        lines += proc.stdout.read().splitlines(keepends=True)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errlog.close()
    for line in lines:
        message = json.loads(line)
        assert message["jsonrpc"] == "2.0" and ("id" in message or "method" in message), line
    log = (tmp_path / "mcp.stderr").read_text()
    assert "atoll mcp: serving stdio" in log, log
    assert " DEBUG " in log, log  # debug logging happened, and on stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mcp_http(atoll_server, tmp_path):
    """`atoll mcp --http` on a free loopback port, stopped (SIGTERM, by its PID) afterwards; yields
    (its URL, the process). Its stdout is a pipe the test reads after the stop."""
    port = _free_port()
    errlog = open(tmp_path / "mcp.stderr", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atoll", "mcp", "--http", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=errlog,
        env={**os.environ, **_env(atoll_server)},
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "mcp.stderr").read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "atoll mcp --http did not listen within 60 s"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out = proc.stdout.read()
        proc.stdout.close()
        errlog.close()
    assert out == b"", out  # logs (uvicorn's access lines too) go to stderr in HTTP mode as well


async def test_streamable_http(mcp_http, shared_sandbox, tmp_path):
    url, proc = mcp_http
    async with streamable_http_client(url) as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            assert {t.name for t in (await s.list_tools()).tools} == TOOLS
            r = await ok_json(s, "exec", {"sandbox_id": shared_sandbox["id"], "cmd": ["echo", "over http"]})
            assert r["stdout"] == "over http\n", r
            err = await refused(s, "exec", {"sandbox_id": "sb-0000000000000000", "cmd": "true"})
            assert err.startswith("sandbox_not_found:"), err
    # a request naming another host (a page's DNS rebinding) is refused
    async with httpx.AsyncClient() as http:
        r = await http.post(
            url, headers={"Host": "evil.example", "Content-Type": "application/json"}, content=b"{}"
        )
    assert r.status_code in (400, 403, 421), (r.status_code, r.text)
    log = (tmp_path / "mcp.stderr").read_text()
    assert f"streamable HTTP on {url}" in log, log

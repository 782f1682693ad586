"""Unit tests of `atoll mcp` (atoll.integrations.mcp) without a server: the tools' input schemas,
argument errors (answered before any call leaves), the cut of a streamed exec's output, the
progress relay and the hints on errors about the key and the URL. The tools against a control
plane are in tests/component/test_mcp.py, over stdio against real sandboxes in
tests/integration/test_mcp.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("mcp", reason="the `mcp` extra is not installed: make install (pip install -e '.[mcp]')")

from mcp import Client  # noqa: E402

import atoll  # noqa: E402
from atoll import errors  # noqa: E402
from atoll.integrations import mcp as atoll_mcp  # noqa: E402

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


def _no_calls(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"no request should leave: {request.method} {request.url}")


@contextlib.asynccontextmanager
async def in_process():
    """The server in process (the SDK's in-memory client) over an atoll client that must not be
    used. (A context manager, not a fixture: the SDK's task groups must end in the task that
    started them.)"""
    async with atoll.AsyncClient(
        base_url="http://atoll", api_key="k", transport=httpx.MockTransport(_no_calls), retries=0
    ) as client:
        async with Client(atoll_mcp.build_server(client)) as c:
            yield c


async def test_tools_and_their_schemas():
    async with in_process() as mcp_client:
        tools = {t.name: t for t in (await mcp_client.list_tools()).tools}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.description and tool.output_schema is None, tool.name
        for name, prop in tool.input_schema["properties"].items():
            assert prop.get("description"), (tool.name, name)
    assert tools["exec"].input_schema["required"] == ["sandbox_id", "cmd"]
    cmd = tools["exec"].input_schema["properties"]["cmd"]
    assert {"type": "string"} in cmd["anyOf"] and {"type": "array", "items": {"type": "string"}} in cmd[
        "anyOf"
    ]
    count = tools["fork_sandbox"].input_schema["properties"]["count"]
    assert (count["minimum"], count["maximum"], count["default"]) == (1, atoll_mcp.MAX_FORKS, 1)
    tier = tools["pause_sandbox"].input_schema["properties"]["tier"]
    assert tier["enum"] == ["memory", "disk", "archive"] and tier["default"] == "memory"
    assert tools["list_sandboxes"].annotations.read_only_hint is True
    assert tools["delete_sandbox"].annotations.destructive_hint is True


@pytest.mark.parametrize(
    ("tool", "args", "starts"),
    [
        ("exec", {"cmd": "ls"}, "invalid_request: exec: sandbox_id: missing (required)"),
        ("exec", {"sandbox_id": "sb-0000000000000000"}, "invalid_request: exec: cmd: missing (required)"),
        ("exec", {"sandbox_id": "sb-0000000000000000", "cmd": 7}, "invalid_request: exec: cmd: cmd must be"),
        (
            "exec",
            {"sandbox_id": "sb-0000000000000000", "cmd": "  "},
            "invalid_request: exec: cmd: cmd must be",
        ),
        (
            "exec",
            {"sandbox_id": "sb-0000000000000000", "cmd": [""]},
            "invalid_request: exec: cmd: cmd must be",
        ),
        (
            "exec",
            {"sandbox_id": "sb-0000000000000000", "cmd": "ls", "timeout_s": 0},
            "invalid_request: exec: timeout_s: Input should be greater than 0 (got 0)",
        ),
        ("exec", {"sandbox_id": "", "cmd": "ls"}, "invalid_request: exec: sandbox_id:"),
        (
            "fork_sandbox",
            {"sandbox_id": "sb-0000000000000000", "count": 0},
            "invalid_request: fork_sandbox: count:",
        ),
        (
            "fork_sandbox",
            {"sandbox_id": "sb-0000000000000000", "count": 51},
            "invalid_request: fork_sandbox: count:",
        ),
        ("create_sandbox", {"timeout_s": -5}, "invalid_request: create_sandbox: timeout_s:"),
        ("create_sandbox", {"metadata": {"a": 1}}, "invalid_request: create_sandbox: metadata.a:"),
        (
            "read_file",
            {"sandbox_id": "sb-0000000000000000", "path": "/x", "encoding": "latin-1"},
            "invalid_request: read_file: encoding:",
        ),
        (
            "write_file",
            {"sandbox_id": "sb-0000000000000000", "path": "/x"},
            "invalid_request: write_file: content: missing",
        ),
        (
            "write_file",
            {"sandbox_id": "sb-0000000000000000", "path": "/x", "content": "!!", "encoding": "base64"},
            "invalid_request: write_file: content is not valid base64",
        ),
        (
            "preview_url",
            {"sandbox_id": "sb-0000000000000000", "port": 0},
            "invalid_request: preview_url: port:",
        ),
        (
            "exec",
            {"sandbox_id": "sb-0000000000000000", "cmd": "ls", "timeout": 5},
            "invalid_request: exec: no argument named 'timeout'; its arguments are cmd, cwd, sandbox_id, timeout_s",
        ),
        ("exec", {"sandbox_id": "../../v1/workers", "cmd": "ls"}, "sandbox_not_found: no sandbox has the id"),
        ("delete_sandbox", {"sandbox_id": "SB-0000000000000000"}, "sandbox_not_found: no sandbox has the id"),
    ],
)
async def test_bad_arguments_are_refused_before_any_call(tool, args, starts):
    async with in_process() as mcp_client:
        result = await mcp_client.call_tool(tool, args)
    text = result.content[0].text
    assert result.is_error and text.startswith(starts), text
    assert "\n" not in text and "pydantic" not in text and "Traceback" not in text, text


def test_a_streamed_output_is_cut_like_the_servers():
    out = "é" * 1000  # 2 bytes each: the cut must not split one
    result = atoll.ExecResult(exit_code=0, stdout=out, stderr="short")
    cut = atoll_mcp.capped(result, limit=101)
    assert cut.stderr == "short" and cut.stderr_truncated_bytes == 0
    head, _, tail = cut.stdout.partition("\n…[atoll mcp: ")
    assert head == "é" * 25 and tail.endswith("\n" + "é" * 25), cut.stdout[:200]
    assert cut.stdout_truncated_bytes == 2000 - 100 and "1900 bytes of stdout truncated" in tail
    answer = atoll_mcp.exec_answer(cut)
    assert answer["stdout_truncated_bytes"] == 1900 and answer["stderr_truncated_bytes"] == 0
    whole = atoll_mcp.exec_answer(result)
    assert "stdout_truncated_bytes" not in whole and whole["stdout"] == out


class _Ctx:
    def __init__(self):
        self.sent: list[tuple[float, float | None, str | None]] = []

    async def report_progress(self, progress, total=None, message=None):
        self.sent.append((progress, total, message))


async def test_output_progress_labels_chunks_and_stops_at_its_limit():
    ctx = _Ctx()
    relay = atoll_mcp.OutputProgress(ctx, limit=10)  # type: ignore[arg-type]
    await relay.stdout("abc")
    await relay.stderr("")  # nothing to send
    await relay.stderr("défg")
    await relay.stdout("hijk")  # past 10 bytes: one notice, then silence
    await relay.stdout("more")
    assert [m for _, _, m in ctx.sent[:2]] == ["[stdout] abc", "[stderr] défg"]
    assert len(ctx.sent) == 3 and "not streamed" in ctx.sent[2][2]
    values = [v for v, _, _ in ctx.sent]
    assert values == [3, 8, 9]


def test_error_text_says_where_the_key_and_the_url_come_from():
    client = atoll.AsyncClient(base_url="http://atoll.example:7080", api_key="k")
    text = atoll_mcp.error_text(errors.Unauthorized("missing, wrong key", code="unauthorized"), client)
    assert text.startswith("unauthorized: missing, wrong key") and "ATOLL_API_KEY" in text
    text = atoll_mcp.error_text(errors.APIConnectionError("refused"), client)
    assert text.startswith("connection_error: refused") and "http://atoll.example:7080" in text
    text = atoll_mcp.error_text(errors.SandboxNotFound("sandbox sb-x does not exist"), client)
    assert text == "sandbox_not_found: sandbox sb-x does not exist"


def test_a_ca_file_that_cannot_be_used_stops_it_at_start(tmp_path):
    env = {**os.environ, "ATOLL_URL": "https://127.0.0.1:9", "ATOLL_CA_FILE": str(tmp_path / "none.pem")}
    p = subprocess.run(
        [sys.executable, "-m", "atoll", "mcp"], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr.startswith("error: bad_ca_file: the CA file") and "none.pem" in p.stderr, p.stderr

"""`atoll mcp`'s tools (atoll.integrations.mcp) against the real control plane over a fake worker: the
server in process (the `mcp` SDK's in-memory client) over the SDK's AsyncClient on FakeAtoll's
ASGI transport. What each tool sends and answers, and every kind of failure as a tool error:
atoll's codes, the tool's own refusals, a wrong key, an unreachable server, a bug of its own.
Over stdio against real sandboxes (and progress streaming): tests/integration/test_mcp.py."""

from __future__ import annotations

import base64
import contextlib
import json

import pytest

pytest.importorskip("mcp", reason="the `mcp` extra is not installed: make install (pip install -e '.[mcp]')")

from mcp import Client  # noqa: E402

import atoll  # noqa: E402
from atoll.core import worker_api as api  # noqa: E402
from atoll.integrations import mcp as atoll_mcp  # noqa: E402
from tests.component.conftest import KEY  # noqa: E402


@contextlib.asynccontextmanager
async def served(fake, *, api_key: str = KEY, base_url: str = "http://atoll", transport=True):
    async with atoll.AsyncClient(
        base_url=base_url,
        api_key=api_key,
        transport=fake.transport if transport else None,
        retries=0,
    ) as client:
        async with Client(atoll_mcp.build_server(client)) as c:
            yield c


async def call(c, tool: str, args: dict) -> tuple[bool, str]:
    result = await c.call_tool(tool, args)
    assert len(result.content) == 1 and result.content[0].type == "text", result.content
    return result.is_error, result.content[0].text


async def ok(c, tool: str, args: dict):
    error, text = await call(c, tool, args)
    assert not error, (tool, text)
    return json.loads(text) if text[:1] in "[{" else text


async def refused(c, tool: str, args: dict) -> str:
    error, text = await call(c, tool, args)
    assert error, (tool, text)
    assert "Traceback" not in text and "\n" not in text, text
    return text


async def test_every_tool_through_the_control_plane(fake):
    seen: list[api.ExecSpec] = []

    def handler(spec):
        seen.append(spec)
        return api.ExecResult(
            exit_code=2, stdout="out", stderr="err", duration_ms=7, timed_out=False, stdout_truncated_bytes=5
        )

    fake.worker.exec_handler = handler
    async with served(fake) as c:
        sb = await ok(c, "create_sandbox", {"metadata": {"who": "mcp"}, "env": {"A": "1"}, "timeout_s": 600})
        sid = sb["id"]
        assert (sb["state"], sb["metadata"], sb["env"], sb["template"]) == (
            "running",
            {"who": "mcp"},
            {"A": "1"},
            "base",
        )
        assert sb["expires_at"] is not None

        r = await ok(c, "exec", {"sandbox_id": sid, "cmd": "echo out; exit 2", "timeout_s": 5, "cwd": "/tmp"})
        assert r == {
            "exit_code": 2,
            "stdout": "out",
            "stderr": "err",
            "timed_out": False,
            "duration_ms": 7,
            "stdout_truncated_bytes": 5,
            "stderr_truncated_bytes": 0,
        }
        await ok(c, "exec", {"sandbox_id": sid, "cmd": ["ls", "-l", "a b"]})
        assert (seen[0].cmd, seen[0].timeout_s, seen[0].cwd) == ("echo out; exit 2", 5, "/tmp")
        assert seen[1].cmd == ["ls", "-l", "a b"]

        assert await ok(c, "write_file", {"sandbox_id": sid, "path": "/w/t.txt", "content": "héllo"}) == {
            "path": "/w/t.txt",
            "bytes": 6,
        }
        assert await ok(c, "read_file", {"sandbox_id": sid, "path": "/w/t.txt"}) == "héllo"
        # a relative path lands under the working directory, and the answer says where
        rel = await ok(c, "write_file", {"sandbox_id": sid, "path": "rel.txt", "content": "r"})
        assert rel["path"].startswith("/") and rel["path"].endswith("/rel.txt"), rel
        assert await ok(c, "read_file", {"sandbox_id": sid, "path": rel["path"]}) == "r"
        raw = bytes([0xFF, 0xFE, 0x00])
        b64 = base64.b64encode(raw).decode()
        await ok(c, "write_file", {"sandbox_id": sid, "path": "/w/b", "content": b64, "encoding": "base64"})
        assert await ok(c, "read_file", {"sandbox_id": sid, "path": "/w/b", "encoding": "base64"}) == b64
        err = await refused(c, "read_file", {"sandbox_id": sid, "path": "/w/b"})
        assert err.startswith("not_text: /w/b is not UTF-8 text (byte 0 of 3)"), err
        err = await refused(c, "read_file", {"sandbox_id": sid, "path": "/w/none"})
        assert err.startswith("file_not_found:"), err
        # the API's own limits come back with its codes (the fixture's ATOLL_MAX_FILE_MB is 1 KiB)
        err = await refused(c, "write_file", {"sandbox_id": sid, "path": "/w/big", "content": "x" * 5000})
        assert err.startswith("payload_too_large:"), err

        assert [x["id"] for x in await ok(c, "list_sandboxes", {})] == [sid]
        assert await ok(c, "list_sandboxes", {"metadata": {"who": "else"}}) == []
        assert await ok(c, "list_sandboxes", {"state": "standby"}) == []

        pv = await ok(c, "preview_url", {"sandbox_id": sid, "port": 3000, "expires_in_s": 60})
        assert pv["port"] == 3000 and f"3000-{sid}" in pv["url"] and pv["token"] and pv["signed_url"]

        paused = await ok(c, "pause_sandbox", {"sandbox_id": sid})
        assert (paused["state"], paused["standby_tier"]) == ("standby", "memory")
        assert [x["id"] for x in await ok(c, "list_sandboxes", {"state": "standby"})] == [sid]
        await ok(c, "exec", {"sandbox_id": sid, "cmd": "true"})  # resumes it
        paused = await ok(c, "pause_sandbox", {"sandbox_id": sid, "tier": "disk"})
        assert paused["standby_tier"] == "disk"
        await ok(c, "exec", {"sandbox_id": sid, "cmd": "true"})

        copies = await ok(c, "fork_sandbox", {"sandbox_id": sid, "count": 2})
        assert len({x["id"] for x in copies} | {sid}) == 3 and all(x["state"] == "running" for x in copies)

        for victim in [sid, *(x["id"] for x in copies)]:
            assert await ok(c, "delete_sandbox", {"sandbox_id": victim}) == {"id": victim, "deleted": True}
        assert await ok(c, "list_sandboxes", {}) == []
        for tool, args in (
            ("exec", {"cmd": "true"}),
            ("read_file", {"path": "/w/t.txt"}),
            ("delete_sandbox", {}),
        ):
            err = await refused(c, tool, {"sandbox_id": sid, **args})
            assert err.startswith(f"sandbox_not_found: sandbox {sid} does not exist"), err
        err = await refused(c, "create_sandbox", {"template": "no-such-template"})
        assert err.startswith("template_not_found:"), err


async def test_read_file_refuses_a_file_over_its_limit(fake, monkeypatch):
    monkeypatch.setattr(atoll_mcp, "MAX_READ_BYTES", 10)
    async with served(fake) as c:
        sid = (await ok(c, "create_sandbox", {}))["id"]
        await ok(c, "write_file", {"sandbox_id": sid, "path": "/f", "content": "0123456789"})
        assert await ok(c, "read_file", {"sandbox_id": sid, "path": "/f"}) == "0123456789"
        await ok(c, "write_file", {"sandbox_id": sid, "path": "/f", "content": "0123456789A"})
        err = await refused(c, "read_file", {"sandbox_id": sid, "path": "/f"})
        assert err.startswith("payload_too_large: /f is larger than 10 bytes") and "head -c" in err, err


async def test_a_wrong_key_and_an_unreachable_server_say_how_to_fix_them(fake):
    async with served(fake, api_key="not-the-key") as c:
        for _ in range(2):  # it keeps serving
            err = await refused(c, "list_sandboxes", {})
            assert err.startswith("unauthorized:") and "ATOLL_API_KEY" in err, err
    async with served(fake, base_url="http://127.0.0.1:1", transport=False) as c:
        err = await refused(c, "list_sandboxes", {})
        assert err.startswith("connection_error:") and "http://127.0.0.1:1" in err and "ATOLL_URL" in err, err


async def test_a_failure_of_its_own_is_internal_error_without_a_traceback(fake, monkeypatch, caplog):
    def broken(result):
        raise KeyError("exit_code")

    monkeypatch.setattr(atoll_mcp, "exec_answer", broken)
    async with served(fake) as c:
        sid = (await ok(c, "create_sandbox", {}))["id"]
        err = await refused(c, "exec", {"sandbox_id": sid, "cmd": "true"})
    assert err == "internal_error: atoll mcp's exec failed: KeyError: 'exit_code'", err
    assert any(r.exc_info and "tool exec failed" in r.getMessage() for r in caplog.records)  # the log has it

"""E2B's code interpreter routes on the E2B port (atoll.e2b.interpreter, mounted by e2b.app): a
request with `E2b-Sandbox-Port: 49999` to `/execute` or `/contexts…` is relayed to the service's
port through the seam object's `open_port`; the service is started (`start_process`) when nothing
listens yet; `/execute`'s NDJSON streams back as it comes; the service's errors arrive as E2B's
`{"code", "message"}`; `/execute` needs the access token and `/contexts` does not. The service
here is a stub HTTP/1.1 server on loopback; the real one (atoll.guest.interpreter) in a real
sandbox is tests/integration/test_e2b_sdk.py's interpreter test."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from atoll.core import grants
from atoll.core import worker_api as api
from atoll.e2b import app as e2b_app
from atoll.e2b import interpreter
from atoll.shared import portstream

TOKEN_KEY = b"test-token-key"
SID = "sb-hhhhhhhhhhhhhhhh"
TOKEN = grants.e2b_access_token(TOKEN_KEY, SID)
LINES = [
    {"type": "number_of_executions", "execution_count": 1},
    {"type": "stdout", "text": "hi\n", "timestamp": 1},
    {"type": "result", "text": "2", "is_main_result": True},
    {"type": "end_of_execution"},
]


async def _stub(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list) -> None:
    """One keep-alive connection of a stub service: answers each request until the caller closes."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = dict(x.split(": ", 1) for x in lines[1:] if x)
            body = await reader.readexactly(int(headers.get("Content-Length", "0")))
            seen.append((method, path, json.loads(body) if body else None))
            if path == "/execute":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                for line in LINES:
                    data = json.dumps(line).encode() + b"\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                writer.write(b"0\r\n\r\n")
            elif path == "/contexts" and method == "GET":
                data = json.dumps([{"id": "c1", "language": "python", "cwd": "/home/user"}]).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            else:
                data = json.dumps({"error": f"context {path.split('/')[2]!r} was not found"}).encode()
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        seen.append("closed by the caller")
    finally:
        writer.close()


class Seam:
    """The seam object's two verbs the routes use, over the stub service."""

    def __init__(self, port: int):
        self.port = port
        self.listening = False
        self.started: list[api.ExecSpec] = []
        self.opened: list[tuple[str, int]] = []

    async def open_port(self, sid: str, port: int) -> api.PortStream:
        self.opened.append((sid, port))
        if not self.listening:
            raise ConnectionRefusedError(f"nothing listens on port {port}")
        return portstream.StreamPort(*await asyncio.open_connection("127.0.0.1", self.port))

    async def start_process(self, sid: str, spec: api.ExecSpec) -> api.ProcessStarted:
        self.started.append(spec)
        asyncio.get_running_loop().call_later(0.2, setattr, self, "listening", True)
        return api.ProcessStarted(pid=7)

    async def get_process(self, sid: str, pid: int) -> api.ProcessInfo:
        return api.ProcessInfo(pid=pid, cmd=None, running=True, exit_code=None, background=True, started_at=0)


@pytest.fixture
async def e2b():
    seen: list = []
    server = await asyncio.start_server(lambda r, w: _stub(r, w, seen), "127.0.0.1", 0)
    seam = Seam(server.sockets[0].getsockname()[1])
    asked: list[dict] = []

    def seam_for(request, sid: str):
        asked.append(dict(request.headers))
        return seam

    app = e2b_app.create_app(
        e2b_app.Settings(api_url="http://127.0.0.1:9", token_key=TOKEN_KEY), seam_for=seam_for
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://e2b",
        headers={"E2b-Sandbox-Id": SID, "E2b-Sandbox-Port": "49999"},
    ) as c:
        yield c, seam, seen, asked
    server.close()


async def test_execute_starts_the_service_then_relays_the_ndjson(e2b):
    c, seam, seen, _ = e2b
    r = await c.post(
        "/execute", json={"code": "x + 1", "context_id": None}, headers={"X-Access-Token": TOKEN}
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-ndjson"
    assert [json.loads(line) for line in r.text.splitlines()] == LINES  # no blank lines
    assert [s.cmd for s in seam.started] == [interpreter.SERVICE_CMD]
    assert seam.opened[0] == (SID, grants.GRANT_PORTS[0])
    assert seen[0] == ("POST", "/execute", {"code": "x + 1", "context_id": None})
    # running now: no second start
    r = await c.post("/execute", json={"code": "1"}, headers={"X-Access-Token": TOKEN})
    assert r.status_code == 200 and len(seam.started) == 1
    await asyncio.sleep(0.05)
    assert seen.count("closed by the caller") == 2  # the edge closes each connection first


async def test_execute_needs_the_access_token(e2b):
    c, seam, seen, _ = e2b
    for headers in ({}, {"X-Access-Token": "wrong"}):
        r = await c.post("/execute", json={"code": "1"}, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["code"] == 401 and "X-Access-Token" in r.json()["message"]
    assert seen == [] and seam.opened == []


async def test_contexts_are_accepted_by_sandbox_id_and_errors_keep_their_status(e2b):
    c, seam, seen, asked = e2b
    seam.listening = True
    r = await c.get("/contexts")  # 2.11.5 sends no X-Access-Token here
    assert r.status_code == 200, r.text
    assert r.json() == [{"id": "c1", "language": "python", "cwd": "/home/user"}]
    assert asked[-1] == {"x-access-token": TOKEN}  # the grant is asked with the sandbox's own token
    r = await c.delete("/contexts/nope")
    assert r.status_code == 404 and r.json() == {"code": 404, "message": "context 'nope' was not found"}
    assert seam.started == []


async def test_other_ports_and_paths_are_not_the_interpreters(e2b):
    c, seam, _, _ = e2b
    r = await c.post("/execute", json={"code": "1"}, headers={"E2b-Sandbox-Port": "8080"})
    assert r.status_code == 404 and seam.opened == []
    assert not interpreter.wants({"path": "/executes", "headers": [(b"e2b-sandbox-port", b"49999")]})
    assert interpreter.wants({"path": "/contexts/c1/restart", "headers": [(b"e2b-sandbox-port", b"49999")]})


async def test_a_service_that_never_listens_is_a_502_naming_the_template(e2b, monkeypatch):
    c, seam, _, _ = e2b
    monkeypatch.setattr(interpreter, "START_TIMEOUT_S", 0.3)

    async def never(sid, spec):
        seam.started.append(spec)
        return api.ProcessStarted(pid=7)

    async def exited(sid, pid):
        return api.ProcessInfo(pid=pid, cmd=None, running=False, exit_code=1, background=True, started_at=0)

    monkeypatch.setattr(seam, "start_process", never)
    monkeypatch.setattr(seam, "get_process", exited)
    r = await c.post("/execute", json={"code": "1"}, headers={"X-Access-Token": TOKEN})
    assert r.status_code == 502, r.text
    assert "code-interpreter-v1" in r.json()["message"] and "exit code 1" in r.json()["message"]


async def test_a_caller_that_disconnects_closes_the_connection_into_the_sandbox():
    """run_code's `timeout` ends the SDK's request mid-execution: the edge closes its connection
    into the sandbox at once (the service then interrupts the kernel), not after the execution."""
    got_request = asyncio.Event()
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        got_request.set()
        with contextlib.suppress(ConnectionError):  # a long cell: no answer, until the edge closes
            while await reader.read(1 << 16):
                pass
        closed.set()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    seam = Seam(server.sockets[0].getsockname()[1])
    seam.listening = True
    app = e2b_app.create_app(
        e2b_app.Settings(api_url="http://127.0.0.1:9", token_key=TOKEN_KEY),
        seam_for=lambda request, sid: seam,
    )
    body = json.dumps({"code": "import time; time.sleep(600)"}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await got_request.wait()
        return {"type": "http.disconnect"}

    sent: list = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/execute",
        "raw_path": b"/execute",
        "query_string": b"",
        "headers": [
            (b"e2b-sandbox-id", SID.encode()),
            (b"e2b-sandbox-port", b"49999"),
            (b"x-access-token", TOKEN.encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    try:
        await asyncio.wait_for(app(scope, receive, send), 10)
        await asyncio.wait_for(closed.wait(), 5)
    finally:
        server.close()
    assert got_request.is_set() and closed.is_set()

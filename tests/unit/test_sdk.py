"""Unit tests of the Python SDK (`atoll.Client`, `atoll.AsyncClient`, `atoll.errors`).

Hermetic: an in-memory fake of the REST API (`FakeAtoll`) is served through
`httpx.MockTransport`. Also pins `atoll.__all__`, checks that the sync and async surfaces
match, that `_sync/` is what `scripts/unasync_sdk.py` generates, and that importing the
SDK pulls in no server code.
"""

from __future__ import annotations

import inspect
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import atoll
from atoll import errors
from atoll._client import _async, _base, _sync

ROOT = Path(__file__).resolve().parents[2]
URL = "http://atoll.test"
NDJSON = "application/x-ndjson"


def _error(status: int, code: str, message: str, **extra) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"code": code, "message": message, "request_id": "req_1", **extra}}
    )


class FakeAtoll:
    """An in-memory stand-in for the server's REST API, recording every request."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict] = {}
        self.files: dict[tuple[str, str], bytes] = {}
        self.procs: dict[str, list[dict]] = {}
        self.requests: list[httpx.Request] = []
        self.exec_result = {
            "exit_code": 3,
            "stdout": "out\n",
            "stderr": "err\n",
            "duration_ms": 7,
            "timed_out": False,
        }
        self.stream_lines: list[dict] = [
            {"stdout": "a"},
            {"stderr": "x"},
            {"stdout": "b\n"},
            {"exit_code": 0, "timed_out": False, "duration_ms": 9},
        ]
        self.override: httpx.Response | None = None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    def body(self, request: httpx.Request | None = None) -> dict:
        return json.loads((request or self.last).content)

    def add(self, sid: str, **fields) -> dict:
        self.sandboxes[sid] = {
            "id": sid,
            "state": "running",
            "standby_tier": None,
            "standby_reason": None,
            "template": "base",
            "metadata": {},
            "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z",
            "worker_id": "w1",
            **fields,
        }
        return self.sandboxes[sid]

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.override is not None:
            return self.override
        method, path = request.method, request.url.path
        if path == "/healthz":
            return httpx.Response(200, json={"status": "ok", "version": "test"})
        if path == "/v1/templates":
            return httpx.Response(200, json={"items": [{"name": "base", "status": "ready"}]})
        if path == "/v1/sandboxes" and method == "POST":
            body = json.loads(request.content or b"{}")
            sb = self.add(f"sb_{len(self.sandboxes) + 1}", **body)
            return httpx.Response(201, json=sb)
        if path == "/v1/sandboxes":
            items = [
                sb
                for sb in self.sandboxes.values()
                if request.url.params.get("state") in (None, sb["state"])
                and all(
                    sb["metadata"].get(k[len("metadata.") :]) == v
                    for k, v in request.url.params.items()
                    if k.startswith("metadata.")
                )
            ]
            return httpx.Response(200, json={"items": items})
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)(?:/(.+))?", path)
        assert m, path
        sid, rest = m.group(1), m.group(2) or ""
        sb = self.sandboxes.get(sid)
        if sb is None:
            return _error(404, "sandbox_not_found", f"sandbox {sid} not found")
        return self._sandbox_route(request, sb, rest)

    def _sandbox_route(self, request: httpx.Request, sb: dict, rest: str) -> httpx.Response:
        method, sid = request.method, sb["id"]
        path = request.url.params.get("path")
        if rest == "" and method == "GET":
            return httpx.Response(200, json=sb)
        if rest == "" and method == "DELETE":
            del self.sandboxes[sid]
            return httpx.Response(204)
        if rest == "pause":
            tier = json.loads(request.content)["tier"]
            sb.update(state="standby", standby_tier=tier, standby_reason="api")
            return httpx.Response(200, json=sb)
        if rest == "resume":
            sb.update(state="running", standby_tier=None, standby_reason=None)
            return httpx.Response(200, json=sb)
        if rest == "exec":
            body = json.loads(request.content)
            if body.get("background"):
                pid = 100 + len(self.procs.setdefault(sid, []))
                self.procs[sid].append({"pid": pid, "cmd": body["cmd"], "running": True, "exit_code": None})
                return httpx.Response(200, json={"pid": pid})
            if NDJSON in request.headers.get("accept", ""):
                lines = "".join(json.dumps(obj) + "\n" for obj in self.stream_lines)
                return httpx.Response(200, content=lines.encode(), headers={"content-type": NDJSON})
            return httpx.Response(200, json=self.exec_result)
        if rest == "processes":
            items = [{k: v for k, v in p.items() if k != "output"} for p in self.procs.get(sid, [])]
            return httpx.Response(200, json={"items": items})
        if rest.startswith("processes/"):
            _, pid_text, *verb = rest.split("/")
            pid = int(pid_text)
            for proc in self.procs.get(sid, []):
                if proc["pid"] == pid:
                    return self._process_route(request, proc, verb[0] if verb else "")
            return _error(404, "process_not_found", f"no process {pid}")
        if rest == "files" and method == "PUT":
            self.files[(sid, path)] = request.content
            return httpx.Response(204)
        if rest == "files" and (sid, path) not in self.files:
            return _error(404, "file_not_found", f"{path}: no such file")
        if rest == "files" and method == "GET":
            return httpx.Response(200, content=self.files[(sid, path)])
        if rest == "files" and method == "DELETE":
            del self.files[(sid, path)]
            return httpx.Response(204)
        if rest == "files/list":
            items = [
                {"name": p.rsplit("/", 1)[1], "path": p, "type": "file", "size": len(data)}
                for (s, p), data in sorted(self.files.items())
                if s == sid and p.rsplit("/", 1)[0] == path.rstrip("/")
            ]
            return httpx.Response(200, json={"items": items})
        raise AssertionError(f"unexpected {method} {request.url}")

    def _process_route(self, request: httpx.Request, proc: dict, verb: str) -> httpx.Response:
        """A fake process echoes its stdin as its output; a signal ends it with 128+N."""
        out = proc.setdefault("output", b"")
        if verb == "" and request.method == "DELETE":
            proc.update(running=False, exit_code=-9)
            return httpx.Response(204)
        if verb == "":
            return httpx.Response(200, json={k: v for k, v in proc.items() if k != "output"})
        if verb == "stdin":
            if not proc["running"]:
                return _error(409, "process_exited", "it has exited")
            proc["output"] = out + request.content
            return httpx.Response(
                200, json={"written": len(request.content), "eof": "eof" in request.url.params}
            )
        if verb == "signal":
            proc.update(running=False, exit_code=143)
            return httpx.Response(200, json={k: v for k, v in proc.items() if k != "output"})
        if verb == "wait":
            if proc["running"]:
                return _error(409, "process_running", "still running")
            return httpx.Response(200, json={k: v for k, v in proc.items() if k != "output"})
        if verb == "output":
            start = int(request.url.params.get("offset", "0"))
            lines = [{"stdout": out[start:].decode(), "offset": len(out)}] if start < len(out) else []
            if not proc["running"]:
                lines.append(
                    {"exit_code": proc["exit_code"], "timed_out": False, "duration_ms": 1, "offset": len(out)}
                )
            body = "".join(json.dumps(obj) + "\n" for obj in lines).encode()
            return httpx.Response(200, content=body, headers={"content-type": NDJSON})
        raise AssertionError(f"unexpected {request.method} {request.url}")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("ATOLL_URL", raising=False)
    monkeypatch.delenv("ATOLL_API_KEY", raising=False)
    # retried answers (503, connection errors) wait for nothing here (tests/unit/test_sdk_retries.py)
    monkeypatch.setattr(_base, "sleep", lambda s: None)

    async def no_wait(s):
        return None

    monkeypatch.setattr(_base, "asleep", no_wait)


@pytest.fixture
def fake() -> FakeAtoll:
    return FakeAtoll()


@pytest.fixture
def client(fake):
    with atoll.Client(URL, "key", transport=fake.transport()) as c:
        yield c


def _aclient(fake: FakeAtoll) -> atoll.AsyncClient:
    return atoll.AsyncClient(URL, "key", transport=fake.transport())


# ---------------------------------------------------------------- package surface


EXPECTED_ALL = """
    APIConnectionError APITimeoutError AsyncClient AsyncFiles AsyncProcess AsyncSandbox AtollError BuildFailed Client
    Conflict DiskFull ExecResult FileEntry FileNotFound Files InvalidRequest InvalidState NotFound
    PayloadTooLarge PermissionDenied Preview Process ProcessInfo ProcessNotFound QuotaExceeded Sandbox SandboxBusy SandboxNotFound
    Secret SecretNotFound ServerError Template
    TemplateNotFound Unauthorized __version__ errors
""".split()


def test_all_is_pinned():
    assert atoll.__all__ == EXPECTED_ALL
    for name in atoll.__all__:
        assert getattr(atoll, name) is not None
    assert atoll.Client is _sync.Client and atoll.AsyncSandbox is _async.AsyncSandbox
    with pytest.raises(AttributeError):
        atoll.NoSuchThing  # noqa: B018


def test_sdk_imports_no_server_code():
    code = (
        "import sys, atoll\n"
        "assert 'httpx' not in sys.modules, 'import atoll must stay light'\n"
        "import atoll._client, atoll.cli.main\n"
        "atoll.Client\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'sqlalchemy', 'uvicorn', 'pydantic')\n"
        "       or m.startswith(('atoll.core', 'atoll.controlplane', 'atoll.worker', 'atoll.up'))]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_sync_client_is_generated_from_async():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "unasync_sdk.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


PAIRS = [
    (_sync.Client, _async.AsyncClient),
    (_sync.Sandboxes, _async.AsyncSandboxes),
    (_sync.Templates, _async.AsyncTemplates),
    (_sync.Sandbox, _async.AsyncSandbox),
    (_sync.Files, _async.AsyncFiles),
    (_sync.Process, _async.AsyncProcess),
    (_sync.Terminal, _async.AsyncTerminal),
    (_sync.Tenants, _async.AsyncTenants),
    (_sync.Keys, _async.AsyncKeys),
]


def _public(cls: type) -> dict[str, object]:
    names = {n for n in dir(cls) if not n.startswith("_")} | {
        "__enter__",
        "__exit__",
        "__aenter__",
        "__aexit__",
    }
    return {n: inspect.getattr_static(cls, n) for n in names if hasattr(cls, n)}


def _shape(func) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_sync_and_async_surfaces_match(sync_cls, async_cls):
    sync_members, async_members = _public(sync_cls), _public(async_cls)
    rename = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
    assert {rename.get(n, n) for n in async_members} == set(sync_members)
    for name, async_member in async_members.items():
        sync_member = sync_members[rename.get(name, name)]
        assert type(sync_member) is type(async_member), name
        if not inspect.isfunction(async_member):
            continue
        assert _shape(sync_member) == _shape(async_member), name
        if name != "__init__" and sync_member is not async_member:  # skip shared, I/O-free helpers
            assert inspect.iscoroutinefunction(async_member) or inspect.isasyncgenfunction(async_member), name
            assert not inspect.iscoroutinefunction(sync_member) and not inspect.isasyncgenfunction(
                sync_member
            )


# ---------------------------------------------------------------- configuration


def test_config_from_env_and_arguments(monkeypatch, fake):
    monkeypatch.setenv("ATOLL_URL", "http://env.test:1234/")
    monkeypatch.setenv("ATOLL_API_KEY", "env-key")
    with atoll.Client(transport=fake.transport()) as c:
        assert c.base_url == "http://env.test:1234"
        c.health()
    assert str(fake.last.url) == "http://env.test:1234/healthz"
    assert fake.last.headers["authorization"] == "Bearer env-key"
    assert fake.last.headers["user-agent"].startswith("atoll-python/")
    with atoll.Client("http://arg.test", "arg-key", transport=fake.transport()) as c:
        c.templates.list()
    assert str(fake.last.url) == "http://arg.test/v1/templates"
    assert fake.last.headers["authorization"] == "Bearer arg-key"


def test_defaults_without_env(fake):
    with atoll.Client(transport=fake.transport()) as c:
        assert c.base_url == "http://127.0.0.1:7080"
        assert (c.timeout, c.create_timeout) == (60.0, 600.0)
        c.health()
    assert "authorization" not in fake.last.headers


# ---------------------------------------------------------------- sandboxes


def test_create_sends_only_given_fields_with_long_timeout(client, fake):
    sb = client.sandboxes.create()
    assert fake.body() == {"template": "base"}
    assert fake.last.extensions["timeout"]["read"] == 600.0
    assert isinstance(sb, atoll.Sandbox) and sb.id == "sb_1" and sb.state == "running"
    sb2 = client.sandboxes.create(
        "py", env={"A": "1"}, metadata={"team": "x"}, idle_timeout_s=5, memory_mb=256, cpus=0.5, disk_mb=1024
    )
    assert fake.body() == {
        "template": "py",
        "env": {"A": "1"},
        "metadata": {"team": "x"},
        "idle_timeout_s": 5,
        "memory_mb": 256,
        "cpus": 0.5,
        "disk_mb": 1024,
    }
    assert (sb2.template, sb2.metadata, sb2.env, sb2.memory_mb) == ("py", {"team": "x"}, {"A": "1"}, 256)
    assert sb2.data["worker_id"] == "w1" and sb2["worker_id"] == "w1"
    assert sb2.created_at == "2026-01-01T00:00:00Z" and sb2.standby_tier is None
    client.sandboxes.create(request_timeout=5)
    assert fake.last.extensions["timeout"]["read"] == 5


def test_get_list_delete(client, fake):
    fake.add("sb_a", metadata={"team": "x"})
    fake.add("sb_b", state="standby", standby_tier="disk")
    sb = client.sandboxes.get("sb_a")
    assert sb.id == "sb_a" and fake.last.extensions["timeout"]["read"] == 60.0
    assert [s.id for s in client.sandboxes.list()] == ["sb_a", "sb_b"]
    assert [s.id for s in client.sandboxes.list(state="standby")] == ["sb_b"]
    assert [s.id for s in client.sandboxes.list(metadata={"team": "x"})] == ["sb_a"]
    assert fake.last.url.params["metadata.team"] == "x"
    client.sandboxes.delete("sb_b")
    with pytest.raises(errors.SandboxNotFound):
        client.sandboxes.get("sb_b")


def test_sandbox_methods_update_in_place(client, fake):
    sb = client.sandboxes.create(metadata={"k": "v"})
    snapshot = sb.to_dict()
    assert sb.pause(tier="disk") is sb
    assert fake.body() == {"tier": "disk"}
    assert (sb.state, sb.standby_tier, sb.standby_reason) == ("standby", "disk", "api")
    assert snapshot["state"] == "running"
    sb.resume()
    assert (sb.state, sb.standby_tier) == ("running", None)
    fake.sandboxes[sb.id]["state"] = "standby"
    assert sb.refresh().state == "standby"
    assert repr(sb) == "Sandbox(id='sb_1', state='standby')"
    sb.delete()
    assert sb.state == "deleted" and sb.id not in fake.sandboxes


def test_sandbox_context_manager_deletes(client, fake):
    with client.sandboxes.create() as sb:
        assert sb.id in fake.sandboxes
    assert sb.id not in fake.sandboxes


def test_templates_and_health(client):
    templates = client.templates.list()
    assert templates[0].name == "base" and templates[0]["status"] == "ready"
    assert client.health()["status"] == "ok"


# ---------------------------------------------------------------- exec


def test_exec_plain(client, fake):
    sb = client.sandboxes.create()
    result = sb.exec("echo hi | cat", cwd="/tmp", env={"X": "1"}, timeout_s=10, user="nobody")
    assert fake.body() == {
        "cmd": "echo hi | cat",
        "cwd": "/tmp",
        "env": {"X": "1"},
        "timeout_s": 10,
        "user": "nobody",
    }
    assert fake.last.extensions["timeout"]["read"] == 70.0
    assert isinstance(result, atoll.ExecResult)
    assert result == atoll.ExecResult(
        exit_code=3, stdout="out\n", stderr="err\n", timed_out=False, duration_ms=7
    )
    assert not result.ok
    sb.exec(("ls", "-l"))
    assert fake.body() == {"cmd": ["ls", "-l"]}
    with pytest.raises(ValueError):
        sb.exec([])


def test_exec_streaming_calls_callbacks(client, fake):
    sb = client.sandboxes.create()
    out, err = [], []
    result = sb.exec(["sh", "-c", "x"], on_stdout=out.append, on_stderr=err.append)
    assert fake.last.headers["accept"] == NDJSON
    assert out == ["a", "b\n"] and err == ["x"]
    assert (result.exit_code, result.stdout, result.stderr, result.duration_ms) == (0, "ab\n", "x", 9)
    assert result.ok
    # Only one callback: the other stream is still accumulated.
    result = sb.exec("x", on_stderr=err.append)
    assert result.stdout == "ab\n"


def test_exec_callbacks_fire_as_lines_arrive():
    log: list[str] = []

    def lines():
        for obj in ({"stdout": "1"}, {"stderr": "2"}, {"exit_code": 0}):
            log.append(f"sent {obj}")
            yield (json.dumps(obj) + "\n").encode()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=lines(), headers={"content-type": NDJSON})

    with atoll.Client(URL, transport=httpx.MockTransport(handler)) as c:
        sb = atoll.Sandbox(c, {"id": "sb_1"})
        sb.exec("x", on_stdout=lambda t: log.append(f"out {t}"), on_stderr=lambda t: log.append(f"err {t}"))
    assert log == ["sent {'stdout': '1'}", "out 1", "sent {'stderr': '2'}", "err 2", "sent {'exit_code': 0}"]


def test_exec_stream_lines_split_only_at_newline():
    """Output holding U+0085 or U+2028 raw (valid in JSON strings) broke the SDK and the CLI:
    httpx's iter_lines splits at every Unicode line break. Chunks also split lines anywhere."""
    text = "a\u0085b\u2028c\u2029d\x1ce\n"
    body = (json.dumps({"stdout": text}, ensure_ascii=False) + "\n" + json.dumps({"exit_code": 0})).encode()

    def chunks():
        for i in range(0, len(body), 3):
            yield body[i : i + 3]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chunks(), headers={"content-type": NDJSON})

    out: list[str] = []
    with atoll.Client(URL, transport=httpx.MockTransport(handler)) as c:
        result = atoll.Sandbox(c, {"id": "sb_1"}).exec("x", on_stdout=out.append)
    assert "".join(out) == text and result.stdout == text and result.exit_code == 0


def test_exec_stream_error_and_truncation(client, fake):
    sb = client.sandboxes.create()
    fake.stream_lines = [
        {"stdout": "partial"},
        {"error": {"code": "runtime_error", "message": "stream broke"}},
    ]
    with pytest.raises(errors.ServerError) as info:
        sb.exec("x", on_stdout=lambda _: None)
    assert info.value.code == "runtime_error" and info.value.message == "stream broke"
    fake.stream_lines = [{"stdout": "partial"}]
    with pytest.raises(errors.ServerError, match="stream_incomplete"):
        sb.exec("x", on_stdout=lambda _: None)


def test_exec_stream_falls_back_to_plain_json(client, fake):
    sb = client.sandboxes.create()
    fake.override = httpx.Response(200, json=fake.exec_result)
    out = []
    result = sb.exec("x", on_stdout=out.append)
    assert out == ["out\n"] and result.exit_code == 3 and result.stderr == "err\n"


def test_exec_background_and_processes(client, fake):
    sb = client.sandboxes.create()
    proc = sb.exec("sleep 100", background=True)
    assert isinstance(proc, atoll.Process) and proc.pid == 100
    assert fake.body() == {"cmd": "sleep 100", "background": True}
    infos = sb.processes()
    assert infos[0].pid == 100 and infos[0].running and infos[0]["cmd"] == "sleep 100"
    assert isinstance(infos[0], atoll.ProcessInfo)
    proc.kill()
    assert fake.last.method == "DELETE" and fake.last.url.path == "/v1/sandboxes/sb_1/processes/100"
    info = proc.info()
    assert not info.running and info.exit_code == -9
    with pytest.raises(errors.ProcessNotFound):
        sb.kill_process(555)
    with pytest.raises(ValueError):
        sb.exec("x", background=True, on_stdout=print)


def test_process_handle_stdin_output_signal_wait(client, fake):
    sb = client.sandboxes.create()
    proc = sb.exec("cat", background=True)
    assert proc.send_stdin("héllo\n") == len("héllo\n".encode())
    assert fake.last.content == "héllo\n".encode() and fake.last.url.path.endswith("/processes/100/stdin")
    proc.send_stdin(b"more", eof=True)
    assert fake.last.url.params["eof"] == "1"
    with pytest.raises(errors.ProcessRunning):
        proc.wait(timeout=0.01)
    events = list(proc.output(follow=False))
    assert [(e.kind, e.text, e.offset) for e in events] == [("stdout", "héllo\nmore", 11)]
    assert proc.offset == 11 and fake.last.url.params["follow"] == "0"
    assert list(proc.output(follow=False)) == []  # resumes where the last output() stopped
    handle = sb.processes.get(100)
    assert handle.pid == 100 and handle.running
    info = handle.signal("TERM")
    assert fake.body() == {"signal": "TERM"} and not info.running
    assert handle.wait() == 143
    events = list(handle.output(offset=7))  # "héllo\n" is 7 bytes
    assert [e.kind for e in events] == ["stdout", "exit"] and events[0].text == "more"
    assert events[-1].exit_code == 143
    with pytest.raises(errors.ProcessExited):
        handle.send_stdin("late")
    with pytest.raises(errors.ProcessNotFound):
        sb.processes.get(555)
    assert [p.pid for p in sb.processes.list()] == [100]


def test_exec_stdin_shell_and_check(client, fake):
    sb = client.sandboxes.create(shell="sh")
    assert fake.body()["shell"] == "sh" and sb.shell == "sh"
    res = sb.exec("cat", stdin="in", shell="bash")
    assert fake.body() == {"cmd": "cat", "stdin": "in", "shell": "bash"} and res.exit_code == 3
    with pytest.raises(errors.CommandFailed) as info:
        sb.exec("false", check=True)
    err = info.value
    assert (err.exit_code, err.stdout, err.stderr) == (3, "out\n", "err\n")
    assert isinstance(err, errors.AtollError) and "exited with code 3" in str(err)
    fake.exec_result = {**fake.exec_result, "exit_code": 0}
    assert sb.exec("true", check=True).ok
    fake.stream_lines[-1] = {"exit_code": 2, "timed_out": False, "duration_ms": 9}
    with pytest.raises(errors.CommandFailed):  # the streamed path checks too
        sb.exec("x", check=True, on_stdout=lambda t: None)
    with pytest.raises(ValueError):
        sb.exec("x", background=True, check=True)
    with pytest.raises(TypeError):
        sb.exec("x", stdin=b"bytes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- files


def test_files_roundtrip(client, fake, tmp_path):
    sb = client.sandboxes.create()
    sb.files.write("/work/a.txt", "héllo")
    assert fake.last.headers["content-type"] == "application/octet-stream"
    assert fake.last.url.params["path"] == "/work/a.txt"
    assert sb.files.read("/work/a.txt") == "héllo".encode()
    sb.files.write("/work/b.bin", b"\x00\x01")
    entries = sb.files.list("/work")
    assert [(e.name, e.path, e.type, e.size) for e in entries] == [
        ("a.txt", "/work/a.txt", "file", 6),
        ("b.bin", "/work/b.bin", "file", 2),
    ]
    assert isinstance(entries[0], atoll.FileEntry) and entries[0]["size"] == 6
    sb.files.remove("/work/a.txt")
    with pytest.raises(errors.FileNotFound) as info:
        sb.files.read("/work/a.txt")
    assert (info.value.status_code, info.value.request_id) == (404, "req_1")


def test_files_streamed_upload_and_download(client, fake, tmp_path):
    sb = client.sandboxes.create()
    big = bytes(range(256)) * 20_000  # 5 MB: several upload chunks
    local = tmp_path / "big.bin"
    local.write_bytes(big)
    with local.open("rb") as f:
        sb.files.write("/big", f)
    assert fake.last.headers["content-length"] == str(len(big))
    assert fake.files[("sb_1", "/big")] == big
    sb.files.write("/gen", (part for part in [b"ab", "cd"]))
    assert fake.last.headers["transfer-encoding"] == "chunked"
    assert fake.files[("sb_1", "/gen")] == b"abcd"
    sink = io.BytesIO()
    assert sb.files.read_to("/big", sink) == len(big)
    assert sink.getvalue() == big
    chunks = list(sb.files.stream("/big", chunk_size=1 << 20))
    assert len(chunks) == 5 and b"".join(chunks) == big
    with pytest.raises(TypeError):
        sb.files.write("/x", 42)
    with pytest.raises(errors.FileNotFound):
        list(sb.files.stream("/missing"))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (400, "invalid_request", errors.InvalidRequest),
        (400, "invalid_path", errors.InvalidRequest),
        (422, "invalid_request", errors.InvalidRequest),
        (401, "unauthorized", errors.Unauthorized),
        (404, "sandbox_not_found", errors.SandboxNotFound),
        (404, "template_not_found", errors.TemplateNotFound),
        (404, "file_not_found", errors.FileNotFound),
        (404, "process_not_found", errors.ProcessNotFound),
        (404, "not_found", errors.NotFound),
        (409, "sandbox_busy", errors.SandboxBusy),
        (409, "invalid_state", errors.InvalidState),
        (409, "something_new", errors.Conflict),
        (413, "payload_too_large", errors.PayloadTooLarge),
        (403, "permission_denied", errors.PermissionDenied),
        (403, "read_only_path", errors.PermissionDenied),
        (403, "unauthorized", errors.Unauthorized),
        (400, "io_error", errors.InvalidRequest),
        (507, "disk_full", errors.DiskFull),
        (507, "something_new", errors.DiskFull),
        (500, "runtime_error", errors.ServerError),
        (500, "internal_error", errors.ServerError),
        (503, "whatever", errors.Unavailable),
        (503, "worker_unavailable", errors.Unavailable),
        (503, "resume_failed", errors.ResumeFailed),
        (418, "teapot", errors.AtollError),
    ],
)
def test_error_mapping(client, fake, status, code, cls):
    fake.override = _error(status, code, "boom", retryable=True)
    with pytest.raises(cls) as info:
        client.sandboxes.get("sb_x")
    err = info.value
    assert type(err) is cls and isinstance(err, errors.AtollError)
    assert (err.code, err.message, err.status_code) == (code, "boom", status)
    assert (err.request_id, err.retryable) == ("req_1", True)
    assert str(err) == f"{code}: boom"


def test_error_without_json_envelope(client, fake):
    fake.override = httpx.Response(502, text="<html>Bad Gateway</html>", headers={"x-request-id": "req_9"})
    with pytest.raises(errors.ServerError) as info:
        client.health()
    assert info.value.code == "http_502" and "Bad Gateway" in info.value.message
    assert info.value.retryable and info.value.request_id == "req_9"
    fake.override = httpx.Response(401, json={"detail": "nope"})
    with pytest.raises(errors.Unauthorized, match="http_401"):
        client.health()


def test_error_defaults_and_bad_success_body(client, fake):
    assert errors.SandboxBusy("busy").retryable and not errors.InvalidState("x").retryable
    assert errors.SandboxBusy("busy").code == "sandbox_busy"
    fake.override = httpx.Response(200, text="not json")
    with pytest.raises(errors.ServerError, match="bad_response"):
        client.health()


def _raising(exc: Exception) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return httpx.MockTransport(handler)


def test_connection_errors_name_the_url():
    with atoll.Client("http://down.test:9", transport=_raising(httpx.ConnectError("refused"))) as c:
        with pytest.raises(errors.APIConnectionError) as info:
            c.sandboxes.list()
    err = info.value
    assert isinstance(err, ConnectionError) and err.code == "connection_error"
    assert "http://down.test:9" in err.message and "atoll up" in err.message and "make run" in err.message
    with atoll.Client("http://slow.test", transport=_raising(httpx.ReadTimeout("slow"))) as c:
        with pytest.raises(errors.APITimeoutError) as info:
            c.health()
    assert isinstance(info.value, errors.APIConnectionError) and isinstance(info.value, TimeoutError)
    assert info.value.code == "timeout"


# ---------------------------------------------------------------- async client


async def test_async_lifecycle_exec_and_files(fake):
    async with _aclient(fake) as client:
        sb = await client.sandboxes.create(metadata={"a": "b"})
        assert isinstance(sb, atoll.AsyncSandbox) and sb.metadata == {"a": "b"}
        assert fake.last.extensions["timeout"]["read"] == 600.0
        assert [s.id for s in await client.sandboxes.list(state="running")] == [sb.id]
        result = await sb.exec("echo")
        assert result.exit_code == 3 and result.stdout == "out\n"
        await sb.files.write("/f", b"data")
        assert await sb.files.read("/f") == b"data"
        assert [e.name for e in await sb.files.list("/")] == ["f"]
        await sb.pause()
        assert sb.standby_tier == "memory"
        await sb.resume()
        assert (await sb.refresh()).state == "running"
        await sb.delete()
        assert sb.state == "deleted"


async def test_async_streaming_accepts_sync_and_async_callbacks(fake):
    out, err = [], []

    async def on_stderr(text: str) -> None:
        err.append(text)

    async with _aclient(fake) as client:
        sb = await client.sandboxes.create()
        result = await sb.exec("x", on_stdout=out.append, on_stderr=on_stderr)
    assert out == ["a", "b\n"] and err == ["x"]
    assert (result.stdout, result.stderr, result.exit_code) == ("ab\n", "x", 0)


async def test_async_files_streaming(fake):
    async def chunks():
        yield b"ab"
        yield "cd"

    async with _aclient(fake) as client, await client.sandboxes.create() as sb:
        await sb.files.write("/a", chunks())
        await sb.files.write("/b", io.BytesIO(b"xyz"))
        await sb.files.write("/c", [b"1", b"2"])
        assert fake.files[("sb_1", "/a")] == b"abcd"
        assert fake.files[("sb_1", "/b")] == b"xyz"
        assert fake.files[("sb_1", "/c")] == b"12"
        assert [c async for c in sb.files.stream("/a", chunk_size=1)] == [b"a", b"b", b"c", b"d"]
        sink = io.BytesIO()
        assert await sb.files.read_to("/b", sink) == 3 and sink.getvalue() == b"xyz"
    assert "sb_1" not in fake.sandboxes


async def test_async_background_and_errors(fake):
    async with _aclient(fake) as client:
        sb = await client.sandboxes.create()
        proc = await sb.exec(["sleep", "9"], background=True)
        assert isinstance(proc, atoll.AsyncProcess) and proc.pid == 100
        await proc.kill()
        assert (await proc.info()).exit_code == -9
        with pytest.raises(errors.SandboxNotFound):
            await client.sandboxes.get("nope")
        fake.stream_lines = [{"error": {"code": "sandbox_busy", "message": "busy", "retryable": True}}]
        with pytest.raises(errors.SandboxBusy):
            await sb.exec("x", on_stdout=print)
    failing = atoll.AsyncClient("http://down.test", transport=_raising(httpx.ConnectError("refused")))
    with pytest.raises(errors.APIConnectionError, match="down.test"):
        await failing.health()
    await failing.aclose()


# ---------------------------------------------------------------- issue 5: output limits, raw paths


def test_exec_result_truncation_fields():
    r = atoll.ExecResult.from_json({"exit_code": 0, "stdout": "a", "stdout_truncated_bytes": 7})
    assert r.stdout_truncated_bytes == 7 and r.stderr_truncated_bytes == 0 and r.truncated
    old_server = atoll.ExecResult.from_json({"exit_code": 0, "stdout": "a"})
    assert old_server.stdout_truncated_bytes == 0 and not old_server.truncated


def test_file_entry_raw_path_and_bytes_params():
    from atoll._client import _base

    e = atoll.FileEntry({"name": "a\ufffd", "path": "/r/a\ufffd", "path_b64": "L3IvYf8="})
    assert e.raw_path == b"/r/a\xff"
    assert atoll.FileEntry({"name": "b", "path": "/r/b"}).raw_path == b"/r/b"
    assert _base.path_params(b"/r/a\xff") == {"path_b64": "L3IvYf8="}
    assert _base.path_params("/r/b") == {"path": "/r/b"}
    body = _base.exec_body(
        "true", background=False, timeout_s=None, cwd=None, env=None, user=None, max_output_bytes=9
    )
    assert body == {"cmd": "true", "max_output_bytes": 9}


def test_plain_http_clients_load_no_ca_bundle(monkeypatch):
    """An http:// client gets an empty verifying TLS context (httpx would load the CA bundle, the
    largest part of a CLI command's start); https:// and a TLS proxy keep httpx's default."""
    import ssl

    from atoll._client import _base

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    ctx = _base.tls_verify("http://127.0.0.1:7080")
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.get_ca_certs() == [] and ctx.cert_store_stats()["x509_ca"] == 0
    assert _base.tls_verify("https://atoll.example") is True
    monkeypatch.setenv("HTTP_PROXY", "https://proxy.test:3128")
    assert _base.tls_verify("http://127.0.0.1:7080") is True


@pytest.mark.parametrize("bad", [".", ".."])
def test_a_dot_segment_is_refused_before_any_request(bad):
    """An HTTP client resolves `.`/`..` away: `sb.kill_pty("..")` was `DELETE /v1/sandboxes/{id}`."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    client = atoll.Client("http://atoll.test", "k", transport=httpx.MockTransport(handler))
    sb = atoll.Sandbox(client, {"id": "sb-aaaaaaaaaaaaaaaa", "state": "running"})
    for call in (
        lambda: sb.kill_pty(bad),
        lambda: client.workers.get(bad),
        lambda: client.workers.drain(bad),
        lambda: client.sandboxes.delete(bad),
        lambda: client.secrets.delete(bad),
    ):
        with pytest.raises(ValueError, match="'.' and '..' name no atoll object"):
            call()
    assert seen == []
    assert (
        _base.sandbox_path("sb-aaaaaaaaaaaaaaaa", "pty", "a/b")
        == "/v1/sandboxes/sb-aaaaaaaaaaaaaaaa/pty/a%2Fb"
    )

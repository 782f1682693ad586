"""The code interpreter service inside a `code-interpreter-v1` sandbox (issue 22 item 2): E2B's
`/execute` and `/contexts` routes (docs/e2b-compat.md §5) over real Jupyter kernels.

Runs as `python3 /opt/atoll/interpreter.py [PORT]` with the template's Debian python (ipykernel,
jupyter_client, matplotlib: worker.images.templates' recipe); worker.host.agent_pack copies this
file beside the guest agent, and the E2B edge starts it on first use (e2b.interpreter) and reaches
it through the worker's port tunnel. Standard library plus jupyter_client, imported
lazily, so the host can import this module for its pure parts (`result_of`, `lines_of`, tested in
tests/unit/test_interpreter.py).

Why this shape: a checkpoint of this runsc fails on a TCP endpoint registered with epoll, and the
worker's checkpoint gate (guest.agent.gate) keeps any process holding both an epoll and a TCP socket
in the memory tier. So the service is two processes: the HTTP front (`main`: a stdlib
`ThreadingHTTPServer`, a poll() loop and a thread per connection, no ZeroMQ, so TCP and no epoll)
relays each call as JSON lines over a Unix socket to the broker (`broker`, started by the front,
ending with it: the kernels, jupyter_client and ZeroMQ, epoll over Unix sockets and no TCP). The
kernels speak ZeroMQ's `ipc` transport (Unix sockets under /tmp), never TCP, and run without
ipykernel's debugger and fork pipe (both TCP sockets: KERNEL_MAIN). A sandbox with kernels then keeps its interpreter
state in every standby tier.

Routes (JSON in; HTTP/1.1 answers with a length, `/execute`'s chunked):
- `POST /execute` `{code, context_id?, language?, env_vars?}` → 200 NDJSON, one object per line:
  `{"type":"number_of_executions","execution_count"}`, `{"type":"stdout"|"stderr","text",
  "timestamp"}`, `{"type":"result", text/html/png/…, "is_main_result"}`, `{"type":"error","name",
  "value","traceback"}`, and last `{"type":"end_of_execution"}`.
- `POST /contexts` `{language?, cwd?}` → `{id, language, cwd}`; `GET /contexts` → a list;
  `POST /contexts/{id}/restart`; `DELETE /contexts/{id}`; `GET /health`.
Errors are `{"error": message}` with 400 (bad input) or 404 (no such context).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import secrets
import socket
import socketserver
import subprocess
import sys
import threading
import time
import typing

PORT = 49990
"""Where the service listens inside the sandbox (E2B's 49999 is atoll's guest agent port)."""
INSTALLED_PATH = "/opt/atoll/interpreter.py"
"""Where a sandbox finds this file: the guest agent's read-only directory (worker.host.agent_pack
copies it there), so a new atoll brings a new service without rebuilding the template layer."""
DEFAULT_CWD = "/home/user"
"""E2B's default working directory of a context; the user's home, then /, when it is missing."""
MAX_BODY = 16 * 1024 * 1024
KERNEL_START_TIMEOUT_S = 120.0
LANGUAGES = ("python", "python3")
KERNEL_MAIN = """
import sys
sys.modules["debugpy"] = None  # ipykernel's debugger opens a TCP socket: off
from ipykernel import iostream
_init = iostream.IOPubThread.__init__
def _no_pipe(self, socket, pipe=False, **kw):
    _init(self, socket, pipe=False, **kw)  # the fork pipe is a TCP listener on loopback: off
iostream.IOPubThread.__init__ = _no_pipe
from ipykernel import kernelapp
kernelapp.launch_new_instance()
"""
"""The kernel's program: ipykernel without its debugger and without the pipe that carries the
output of forked child processes (both are TCP sockets in epoll; output printed by a child made with
os.fork/multiprocessing is therefore not captured)."""
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
"""Jupyter's MIME bundle keys → the fields of e2b_code_interpreter's `Result`; others go to `extra`."""


# ---- the pure mapping (Jupyter IOPub messages → E2B's NDJSON lines) ------------------------------
def result_of(data: dict, is_main: bool) -> dict:
    """One `result` line from a MIME bundle (execute_result or display_data)."""
    out: dict[str, typing.Any] = {"type": "result", "is_main_result": is_main}
    extra: dict[str, typing.Any] = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        elif field == "json" and not isinstance(value, dict):
            extra[mime] = value
        else:
            out[field] = value.rstrip("\n") if field == "png" and isinstance(value, str) else value
    if extra:
        out["extra"] = extra
    return out


def lines_of(msg_type: str, content: dict, now_ns: int) -> list[dict]:
    """The NDJSON lines one IOPub message of an execution gives (none for status and the rest)."""
    if msg_type == "stream":
        name = content.get("name")
        if name not in ("stdout", "stderr"):
            return []
        return [{"type": name, "text": content.get("text", ""), "timestamp": now_ns}]
    if msg_type == "execute_result":
        return [result_of(content.get("data") or {}, True)]
    if msg_type == "display_data":
        return [result_of(content.get("data") or {}, False)]
    if msg_type == "error":
        tb = content.get("traceback") or []
        return [
            {
                "type": "error",
                "name": str(content.get("ename", "")),
                "value": str(content.get("evalue", "")),
                "traceback": ANSI.sub("", "\n".join(str(t) for t in tb)),
            }
        ]
    if msg_type == "execute_input":
        n = content.get("execution_count")
        return [{"type": "number_of_executions", "execution_count": n}] if isinstance(n, int) else []
    return []


def env_code(env_vars: dict[str, str] | None) -> str:
    """Python that sets `env_vars` in the kernel for one execution, keeping the old values, or
    (None) puts the kept values back."""
    if env_vars is not None:
        keys = json.dumps(sorted(env_vars))
        return (
            "import os as _o\n"
            f"_atoll_env = {{_k: _o.environ.get(_k) for _k in {keys}}}\n"
            f"_o.environ.update({json.dumps(env_vars)})\n"
            "del _o"
        )
    return (
        "import os as _o\n"
        "for _k, _v in _atoll_env.items():\n"
        "    _o.environ.pop(_k, None) if _v is None else _o.environ.__setitem__(_k, _v)\n"
        "del _o, _atoll_env"
    )


# ---- kernels --------------------------------------------------------------------------------------
class BadRequest(Exception):
    status = 400


class NotFound(Exception):
    status = 404


def _kernel_manager_class() -> type:
    from jupyter_client.manager import KernelManager

    class NoDebuggerKernelManager(KernelManager):
        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            return [sys.executable, "-c", KERNEL_MAIN, "-f", self.connection_file]

    return NoDebuggerKernelManager


class Context:
    """One Jupyter kernel (a context) and its client; one execution at a time."""

    def __init__(self, language: str, cwd: str):
        self.id = secrets.token_hex(8)
        self.language = "python"
        self.cwd = cwd
        self.lock = threading.Lock()
        run = os.path.join("/tmp", f"atoll-kernel-{self.id}")
        os.makedirs(run, mode=0o700, exist_ok=True)
        # ipc, never tcp: a TCP endpoint in epoll stops this runsc's checkpoint (module docstring)
        self.km = _kernel_manager_class()(
            transport="ipc",
            ip=os.path.join(run, "k"),
            connection_file=os.path.join(run, "kernel.json"),
        )
        self.km.start_kernel(cwd=_existing_dir(cwd))
        self.client = self.km.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT_S)

    def view(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self) -> None:
        with self.lock:
            self.km.restart_kernel(now=True)
            self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT_S)

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.km.shutdown_kernel(now=True)

    def _silent(self, code: str) -> None:
        msg_id = self.client.execute(code, silent=True, store_history=False)
        self._drain(msg_id, lambda line: None)

    def _drain(self, msg_id: str, emit: typing.Callable[[dict], None]) -> None:
        while True:
            msg = self.client.get_iopub_msg()
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg.get("content") or {}
            if kind == "status" and content.get("execution_state") == "idle":
                return
            for line in lines_of(kind, content, time.time_ns()):
                emit(line)

    def execute(self, code: str, env_vars: dict[str, str], emit: typing.Callable[[dict], None]) -> None:
        with self.lock:
            if env_vars:
                self._silent(env_code(env_vars))
            try:
                msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
                try:
                    self._drain(msg_id, emit)
                except (BrokenPipeError, ConnectionError):
                    self.km.interrupt_kernel()  # the caller left: stop its code, keep the state
                    self._drain(msg_id, lambda line: None)
                    raise
            finally:
                if env_vars:
                    self._silent(env_code(None))


class Kernels:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.contexts: dict[str, Context] = {}
        self.default: Context | None = None
        self.default_ready = threading.Event()

    def start_default(self) -> None:
        try:
            ctx = Context("python", DEFAULT_CWD)
            with self.lock:
                self.contexts[ctx.id] = ctx
                self.default = ctx
        finally:
            self.default_ready.set()

    def get_default(self) -> Context:
        self.default_ready.wait(KERNEL_START_TIMEOUT_S)
        with self.lock:
            if self.default is None:
                self.default = Context("python", DEFAULT_CWD)
                self.contexts[self.default.id] = self.default
            return self.default

    def get(self, cid: str) -> Context:
        with self.lock:
            ctx = self.contexts.get(cid)
        if ctx is None:
            raise NotFound(f"context {cid[:40]!r} was not found")
        return ctx

    def create(self, language: str | None, cwd: str | None) -> Context:
        _language(language)
        ctx = Context("python", cwd or DEFAULT_CWD)
        with self.lock:
            self.contexts[ctx.id] = ctx
        return ctx

    def remove(self, cid: str) -> None:
        ctx = self.get(cid)
        with self.lock:
            self.contexts.pop(cid, None)
            if self.default is ctx:
                self.default = None
        ctx.shutdown()


def _existing_dir(cwd: str) -> str:
    for d in (cwd, os.path.expanduser("~"), "/"):
        if os.path.isdir(d):
            return d
    return "/"


def _language(language: object) -> None:
    if language is not None and (not isinstance(language, str) or language.lower() not in LANGUAGES):
        raise BadRequest(f"language {language!r} is not served by atoll's code interpreter; use python")


def _str_dict(v: object, what: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise BadRequest(f"{what} must be an object of strings")
    return v


# ---- the broker: kernels behind a Unix socket ---------------------------------------------------
def route(
    kernels: Kernels, method: str, path: str, body: dict, emit: typing.Callable[[dict], None]
) -> tuple[int, typing.Any] | None:
    """One call: (status, JSON answer), or None after `/execute` streamed its lines through `emit`
    (the first being `{"status": 200, "stream": true}`). Raises BadRequest / NotFound."""
    path = path.split("?", 1)[0].rstrip("/")
    if method == "GET" and path == "/health":
        return 200, {"ok": True}
    if method == "POST" and path == "/execute":
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        cid, language = body.get("context_id"), body.get("language")
        if cid is not None and not isinstance(cid, str):
            raise BadRequest("context_id must be a string")
        _language(language)
        env_vars = _str_dict(body.get("env_vars"), "env_vars")
        ctx = kernels.get(cid) if cid else kernels.get_default()
        emit({"status": 200, "stream": True})
        ctx.execute(code, env_vars, emit)
        emit({"type": "end_of_execution"})
        return None
    if path == "/contexts" and method == "GET":
        return 200, [c.view() for c in list(kernels.contexts.values())]
    if path == "/contexts" and method == "POST":
        cwd = body.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise BadRequest("cwd must be a string")
        return 200, kernels.create(body.get("language"), cwd).view()
    if (m := re.fullmatch(r"/contexts/([^/]+)/restart", path)) and method == "POST":
        kernels.get(m.group(1)).restart()
        return 200, {}
    if (m := re.fullmatch(r"/contexts/([^/]+)", path)) and method == "DELETE":
        kernels.remove(m.group(1))
        return 200, {}
    return 404, {"error": f"{method} {path} is not a route of the code interpreter"}


class BrokerHandler(socketserver.StreamRequestHandler):
    """One call from the HTTP front: a JSON line in; JSON lines out, then the connection ends."""

    def handle(self) -> None:
        started = False

        def emit(line: dict) -> None:
            nonlocal started
            started = True
            self.wfile.write(json.dumps(line).encode() + b"\n")
            self.wfile.flush()

        try:
            req = json.loads(self.rfile.readline())
            out = route(self.server.kernels, req["method"], req["path"], req.get("body") or {}, emit)  # type: ignore[attr-defined]
            if out is not None:
                emit({"status": out[0], "json": out[1]})
        except (BadRequest, NotFound) as e:
            emit({"status": e.status, "json": {"error": str(e)}})
        except (BrokenPipeError, ConnectionError):
            pass
        except Exception as e:  # noqa: BLE001 - the caller gets the reason, never a traceback
            if not started:
                with contextlib.suppress(OSError):
                    emit(
                        {
                            "status": 500,
                            "json": {"error": f"the code interpreter failed: {type(e).__name__}: {e}"[:2000]},
                        }
                    )


def broker(sock_path: str) -> None:
    """The process holding the kernels: ZeroMQ (epoll inside) and Unix sockets only, no TCP."""
    kernels = Kernels()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)
    server = socketserver.ThreadingUnixStreamServer(sock_path, BrokerHandler)
    server.daemon_threads = True
    server.kernels = kernels  # type: ignore[attr-defined]
    threading.Thread(target=kernels.start_default, daemon=True).start()
    threading.Thread(target=_exit_with_parent, args=(kernels,), daemon=True).start()
    server.serve_forever()


def _exit_with_parent(kernels: Kernels) -> None:
    """The front ended (killed): end the kernels and this process too."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1)
    for ctx in list(kernels.contexts.values()):
        with contextlib.suppress(Exception):
            ctx.km.shutdown_kernel(now=True)
    os._exit(0)


# ---- the HTTP front: TCP, a poll() loop, no epoll ------------------------------------------------
class Handler(http.server.BaseHTTPRequestHandler):
    """Parses HTTP and relays each call to the broker; holds no kernel and imports no ZeroMQ, so this
    process has TCP sockets and no epoll (the checkpoint gate's rule), the broker the reverse."""

    broker_path: str
    disable_nagle_algorithm = True  # small NDJSON chunks go out at once
    server_version = "atoll-interpreter/1"
    protocol_version = "HTTP/1.1"
    """Keep-alive answers (a length, or chunks): the caller closes first, so no TCP TIME_WAIT is
    left inside the sandbox (the checkpoint trap of /work/shared/DESIGN.md)."""

    def log_message(self, format: str, *args: typing.Any) -> None:  # noqa: A002 - stdlib's name
        pass

    def _body(self) -> dict:
        n = int(self.headers.get("content-length") or 0)
        if n > MAX_BODY:
            raise BadRequest(f"the request body is over {MAX_BODY} bytes")
        raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        return data

    def _json(self, status: int, obj: typing.Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _call(self, method: str) -> None:
        try:
            body = self._body() if method == "POST" else {}
        except BadRequest as e:
            self._json(400, {"error": str(e)})
            return
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.broker_path)
            req = {"method": method, "path": self.path, "body": body}
            conn.sendall(json.dumps(req).encode() + b"\n")
            lines = conn.makefile("rb")
            first = json.loads(lines.readline() or b"null")
            if not isinstance(first, dict):
                self._json(502, {"error": "the code interpreter's kernels ended the call without an answer"})
            elif not first.get("stream"):
                self._json(int(first.get("status", 500)), first.get("json"))
            else:
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for line in lines:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except OSError as e:
            self._json(502, {"error": f"the code interpreter's kernels cannot be reached: {e}"})
        finally:
            conn.close()

    def do_GET(self) -> None:
        self._call("GET")

    def do_POST(self) -> None:
        self._call("POST")

    def do_DELETE(self) -> None:
        self._call("DELETE")


def main(argv: list[str]) -> None:
    if len(argv) > 2 and argv[1] == "--broker":
        broker(argv[2])
        return
    port = int(argv[1]) if len(argv) > 1 else PORT
    sock_path = f"/tmp/atoll-interpreter-{port}.sock"
    # ThreadingHTTPServer: a poll() loop (selectors.PollSelector), no epoll on its TCP socket
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)  # a second start fails here
    server.daemon_threads = True
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--broker", sock_path], close_fds=True
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(sock_path) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    Handler.broker_path = sock_path
    threading.Thread(target=lambda: (child.wait(), os._exit(1)), daemon=True).start()  # no broker, no service
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv)

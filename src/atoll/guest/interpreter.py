"""The code interpreter service inside a `code-interpreter-v1` sandbox (issue 22 item 2): E2B's
`/execute` and `/contexts` routes (docs/e2b-compat.md §5) over real Jupyter kernels.

Runs as `python3 /opt/atoll/interpreter.py [PORT]` with the template's Debian python (ipykernel,
jupyter_client, matplotlib: worker.images.templates' recipe); worker.host.agent_pack copies this
file beside the guest agent, and the E2B edge starts it on first use (e2b.interpreter) and reaches
it through the worker's port tunnel. Standard library plus jupyter_client, imported
lazily, so the host can import this module for its pure parts (`result_of`, `lines_of`, tested in
tests/unit/test_interpreter.py).

Why this shape: a checkpoint of this runsc fails on a TCP endpoint registered with epoll, so the
HTTP server is `http.server.ThreadingHTTPServer` (a poll() loop and one thread per request, no
asyncio) and the kernels speak to it over ZeroMQ's `ipc` transport (Unix sockets under /tmp), never
TCP: a sandbox with a kernel then keeps its interpreter state in every standby tier.

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

import http.server
import json
import os
import re
import secrets
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


class Context:
    """One Jupyter kernel (a context) and its client; one execution at a time."""

    def __init__(self, language: str, cwd: str):
        from jupyter_client.manager import KernelManager

        self.id = secrets.token_hex(8)
        self.language = "python"
        self.cwd = cwd
        self.lock = threading.Lock()
        run = os.path.join("/tmp", f"atoll-kernel-{self.id}")
        os.makedirs(run, mode=0o700, exist_ok=True)
        # ipc, never tcp: a TCP endpoint in epoll stops this runsc's checkpoint (module docstring)
        self.km = KernelManager(
            transport="ipc", ip=os.path.join(run, "k"), connection_file=os.path.join(run, "kernel.json")
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


# ---- HTTP -----------------------------------------------------------------------------------------
class Handler(http.server.BaseHTTPRequestHandler):
    kernels: Kernels
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

    def _route(self, method: str) -> None:
        try:
            path = self.path.split("?", 1)[0].rstrip("/")
            if method == "GET" and path == "/health":
                self._json(200, {"ok": True})
            elif method == "POST" and path == "/execute":
                self._execute(self._body())
            elif path == "/contexts" and method == "GET":
                self._json(200, [c.view() for c in list(self.kernels.contexts.values())])
            elif path == "/contexts" and method == "POST":
                body = self._body()
                cwd = body.get("cwd")
                if cwd is not None and not isinstance(cwd, str):
                    raise BadRequest("cwd must be a string")
                self._json(200, self.kernels.create(body.get("language"), cwd).view())
            elif (m := re.fullmatch(r"/contexts/([^/]+)/restart", path)) and method == "POST":
                self.kernels.get(m.group(1)).restart()
                self._json(200, {})
            elif (m := re.fullmatch(r"/contexts/([^/]+)", path)) and method == "DELETE":
                self.kernels.remove(m.group(1))
                self._json(200, {})
            else:
                self._json(404, {"error": f"{method} {path} is not a route of the code interpreter"})
        except (BadRequest, NotFound) as e:
            self._json(e.status, {"error": str(e)})
        except (BrokenPipeError, ConnectionError):
            pass
        except Exception as e:  # noqa: BLE001 - the caller gets the reason, never a traceback
            try:
                self._json(500, {"error": f"the code interpreter failed: {type(e).__name__}: {e}"[:2000]})
            except OSError:
                pass

    def _execute(self, body: dict) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        cid, language = body.get("context_id"), body.get("language")
        if cid is not None and not isinstance(cid, str):
            raise BadRequest("context_id must be a string")
        _language(language)
        env_vars = _str_dict(body.get("env_vars"), "env_vars")
        ctx = self.kernels.get(cid) if cid else self.kernels.get_default()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

        def emit(line: dict) -> None:
            data = json.dumps(line).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        ctx.execute(code, env_vars, emit)
        emit({"type": "end_of_execution"})
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")


def main(argv: list[str]) -> None:
    port = int(argv[1]) if len(argv) > 1 else PORT
    kernels = Kernels()
    Handler.kernels = kernels
    # ThreadingHTTPServer: a poll() loop (selectors.PollSelector), no epoll on its TCP socket
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=kernels.start_default, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv)

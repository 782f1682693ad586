"""The code interpreter service inside a `code-interpreter-v1` sandbox (issue 22 item 2): E2B's
`/execute` and `/contexts` routes (docs/e2b-compat.md §5) over real Jupyter kernels.

Runs as `python3 /opt/atoll/interpreter.py [PORT]` with the template's Debian python (ipykernel,
jupyter_client, matplotlib: worker.images.templates' recipe); worker.host.agent_pack copies this
file beside the guest agent, and the E2B edge starts it on first use (e2b.interpreter) and reaches
it through the worker's port tunnel. Standard library plus ipykernel, imported lazily and only by
the kernel processes, so the host can import this module for its pure parts (`result_of`,
`lines_of`, `set_env`, tested in tests/unit/test_interpreter.py).

Why this shape: a checkpoint of this runsc fails on a TCP endpoint registered with epoll, and the
worker's checkpoint gate (guest.agent.gate) keeps any process holding both an epoll and a TCP socket
in the memory tier. So the service is two kinds of process. The HTTP front (`main`: a stdlib
`ThreadingHTTPServer`, a poll() loop and a thread per connection, no ZeroMQ, so TCP and no epoll)
owns the contexts, and relays each call as JSON lines over a Unix socket pair to the context's
kernel process (`kernel_main`: one per context, no TCP). A sandbox with kernels then keeps its
interpreter state in every standby tier.

The kernel process runs ipykernel's own in-process kernel (`ipykernel.inprocess`: the
`IPythonKernel` of every Jupyter notebook, its shell, display hooks, inline matplotlib and
tracebacks, driven by jupyter_client's `KernelClient` interface) on its main thread, with its
IOPub thread left unstarted so that each message is published in the thread that makes it (what
ipykernel does in a forked child). A Jupyter kernel of its own process would instead pass every
`execute_request` through a chain of ZeroMQ messages between the client's and the kernel's
threads (shell, IOPub, busy/idle), each a few syscalls and thread wake-ups, which cost ~50 µs a
syscall on this runsc's ptrace platform (docs/benchmarks.md: 20–90 ms for `1+1`, against ~5 ms
here). Output written to the standard streams goes out every `FLUSH_INTERVAL_S` (one flusher
thread, as ipykernel's IOPub thread does), output written to file descriptors 1 and 2 (child
processes, C code) is captured as ipykernel does it (a pipe and a watcher thread). An interrupt is
a SIGINT to the kernel process (what jupyter_client's `interrupt_kernel` sends); a restart ends the
process and starts another. The kernel runs without ipykernel's debugger (debugpy opens a TCP
socket); output printed by a child made with `os.fork`/`multiprocessing` in a cell is not captured.

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
import select
import signal
import socket
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
FLUSH_INTERVAL_S = 0.2
"""How long text written to sys.stdout/sys.stderr may wait before it is sent (ipykernel's
`OutStream.flush_interval`)."""
END_LINE = b'{"type": "end_of_execution"}\n'
"""The last line of an execution, from the kernel process to the front (and on to the caller)."""
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


def set_env(environ: typing.MutableMapping[str, str], env_vars: dict[str, str]) -> dict[str, str | None]:
    """Set `env_vars` in `environ` (the kernel's os.environ) for one execution; the old values,
    for `restore_env`."""
    saved = {k: environ.get(k) for k in env_vars}
    environ.update(env_vars)
    return saved


def restore_env(environ: typing.MutableMapping[str, str], saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v


# ---- the kernel process: one per context, ipykernel in process, no TCP --------------------------
class KernelHost:
    """ipykernel's in-process kernel on this process's main thread, serving the front's requests
    (one JSON line each) on `chan` and answering with NDJSON lines, the last one END_LINE."""

    def __init__(self, chan: socket.socket):
        self.chan = chan
        self.send_lock = threading.Lock()
        self.lock = threading.RLock()
        """Serializes publishing: each message is put on the kernel's in-process IOPub socket and
        taken off it again by the same call (ipykernel's `_io_dispatch`), from the main thread, the
        flusher or the descriptor watchers."""
        self.current: str | None = None
        """The msg_id of the execute_request running now, whose IOPub messages go to the front."""
        self.pid = os.getpid()
        self.pending: list[typing.Any] = []
        self.wake = threading.Condition()
        sys.modules["debugpy"] = None  # type: ignore[assignment]  # its debugger opens a TCP socket
        # ipykernel's kernel application sets this default (kernelapp.init_gui_pylab): plt.show()
        # and figures left at the end of a cell become image/png display_data
        os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # kernelapp.init_signal: the kernel's
        # pre_handler_hook turns SIGINT into KeyboardInterrupt while a request is handled
        self.kernel, self.client = self._make_kernel()
        threading.Thread(target=self._flusher, name="flusher", daemon=True).start()

    def _make_kernel(self) -> tuple[typing.Any, typing.Any]:
        from ipykernel import iostream
        from ipykernel.inprocess.blocking import BlockingInProcessKernelClient
        from ipykernel.inprocess.channels import InProcessChannel
        from ipykernel.inprocess.ipkernel import InProcessKernel
        from ipykernel.inprocess.socket import DummySocket

        host = self

        class Stream(iostream.OutStream):
            """ipykernel's stream, flushed by the flusher thread instead of the IOPub thread's loop."""

            def _schedule_flush(self) -> None:
                if self._flush_pending:
                    return
                self._flush_pending = True
                with host.wake:
                    host.pending.append(self)
                    host.wake.notify()

            def _flush(self) -> None:
                with host.lock:
                    super()._flush()

        class Channel(InProcessChannel):
            """A channel whose messages are handled at once: IOPub → the front, the rest dropped
            (the shell replies: an execution's end is its IOPub `idle`)."""

            def call_handlers(self, msg: dict) -> None:
                if self is self.client._iopub_channel:
                    host.publish(msg)

        class Client(BlockingInProcessKernelClient):
            shell_channel_class = Channel
            iopub_channel_class = Channel

            def _dispatch_to_kernel(self, msg: dict) -> None:
                if msg["header"]["msg_type"] == "execute_request":
                    host.current = msg["header"]["msg_id"]
                super()._dispatch_to_kernel(msg)

        socket_ = DummySocket()
        # not started: IOPubThread.schedule() then runs each send in the caller's thread
        pub = iostream.IOPubThread(socket_)
        schedule = pub.schedule

        def locked_schedule(f: typing.Callable[[], None]) -> None:
            with self.lock:
                schedule(f)

        pub.schedule = locked_schedule  # type: ignore[method-assign]
        kernel = InProcessKernel(_underlying_iopub_socket=socket_, iopub_thread=pub)
        kernel.stdout = Stream(kernel.session, pub, "stdout")  # watchfd: fd 1 too
        kernel.stderr = Stream(kernel.session, pub, "stderr")
        sys.stdout, sys.stderr = kernel.stdout, kernel.stderr  # threads of a cell print there too
        client = Client(kernel=kernel, session=kernel.session)
        client.start_channels()
        return kernel, client

    def _flusher(self) -> None:
        while True:
            with self.wake:
                while not self.pending:
                    self.wake.wait()
            time.sleep(FLUSH_INTERVAL_S)
            with self.wake:
                streams, self.pending = self.pending, []
            for stream in streams:
                with contextlib.suppress(Exception):
                    stream.flush()

    def publish(self, msg: dict) -> None:
        """One IOPub message: the current execution's lines to the front."""
        if os.getpid() != self.pid or self.current is None:
            return  # a forked child's copy, or output after its execution ended
        if msg.get("parent_header", {}).get("msg_id") != self.current:
            return
        for line in lines_of(msg["msg_type"], msg.get("content") or {}, time.time_ns()):
            self.send(json.dumps(line).encode() + b"\n")

    def send(self, data: bytes) -> None:
        with self.send_lock:
            self.chan.sendall(data)

    def execute(self, code: str, env_vars: dict[str, str]) -> None:
        saved = set_env(os.environ, env_vars)
        try:
            self.client.execute(code, store_history=True, allow_stdin=False)
        except KeyboardInterrupt:  # an interrupt outside the cell's code: the kernel goes on
            self.send(
                json.dumps(lines_of("error", {"ename": "KeyboardInterrupt", "evalue": ""}, 0)[0]).encode()
                + b"\n"
            )
        finally:
            self.current = None
            restore_env(os.environ, saved)
        self.send(END_LINE)

    def serve(self) -> None:
        self.send(b'{"ready": true}\n')
        for raw in self.chan.makefile("rb"):
            req = json.loads(raw)
            self.execute(req["code"], req.get("env_vars") or {})
        os._exit(0)  # the front ended: so does this kernel


def kernel_main(fd: int) -> None:
    """`interpreter.py --kernel FD`: the kernel of one context, on the socket `fd` to the front."""
    chan = socket.socket(fileno=fd)
    sys.argv = [sys.argv[0]]
    KernelHost(chan).serve()


# ---- the front's contexts ------------------------------------------------------------------------
class BadRequest(Exception):
    status = 400


class NotFound(Exception):
    status = 404


class CallerLeft(Exception):
    """The HTTP caller went away during an execution (its read deadline, a cancel)."""


class Context:
    """One context: a kernel process and the socket pair to it; one execution at a time."""

    def __init__(self, cwd: str):
        self.id = secrets.token_hex(8)
        self.language = "python"
        self.cwd = cwd
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.chan: socket.socket | None = None
        self.buf = b""
        self.ending: str | None = None
        """Why the kernel is being ended under a running execution ("restarted", "removed")."""
        self._start()

    def view(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--kernel", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                cwd=_existing_dir(self.cwd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.chan, self.buf = mine, b""
        mine.settimeout(KERNEL_START_TIMEOUT_S)
        try:
            ready = self._line()
        except (OSError, TimeoutError):
            ready = None
        mine.settimeout(None)
        if ready != b'{"ready": true}\n':
            self._stop()
            raise RuntimeError(
                f"the kernel did not start within {KERNEL_START_TIMEOUT_S:.0f} s "
                "(python3 with ipykernel, jupyter_client and matplotlib is needed)"
            )

    def _stop(self) -> None:
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _line(self, watch: socket.socket | None = None) -> bytes | None:
        """The kernel's next line (b"" when it ended), or None when `watch` (the caller's socket,
        silent during an execution) becomes readable first: the caller left."""
        assert self.chan is not None
        while b"\n" not in self.buf:
            if watch is not None:
                poller = select.poll()
                poller.register(self.chan, select.POLLIN)
                poller.register(watch, select.POLLIN)
                if not any(fd == self.chan.fileno() for fd, _ in poller.poll()):
                    return None
            data = self.chan.recv(1 << 16)
            if not data:
                return b""
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"

    def restart(self) -> None:
        """A new kernel process (an execution running now ends with an error line)."""
        with self._taken("restarted"):
            self._stop()
            self._start()

    @contextlib.contextmanager
    def _taken(self, why: str) -> typing.Iterator[None]:
        # a restart or a delete does not wait for the running execution: it ends the kernel
        proc = self.proc
        if not self.lock.acquire(blocking=False):
            self.ending = why
            if proc is not None:
                with contextlib.suppress(OSError):
                    proc.kill()
            self.lock.acquire()
        try:
            self.ending = None
            yield
        finally:
            self.lock.release()

    def shutdown(self) -> None:
        with self._taken("removed"):
            self._stop()

    def execute(
        self,
        code: str,
        env_vars: dict[str, str],
        emit: typing.Callable[[bytes], None],
        caller: socket.socket | None = None,
    ) -> None:
        """Runs `code`, passing each NDJSON line (END_LINE last) to `emit`. When the caller leaves
        (`caller` readable, or `emit` fails), the kernel is interrupted and CallerLeft raised once
        it is idle again."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._stop()
                self._start()
            assert self.chan is not None
            self.chan.sendall(json.dumps({"code": code, "env_vars": env_vars}).encode() + b"\n")
            left = False
            while True:
                line = self._line(None if left else caller)
                if line is None or line == b"":
                    if line == b"":  # the kernel process ended during the execution
                        self._died(emit, left)
                        return
                    left = True
                    self._interrupt()
                    continue
                if not left:
                    try:
                        emit(line)
                    except OSError:
                        left = True
                        self._interrupt()
                if line == END_LINE:
                    break
            if left:
                raise CallerLeft()

    def _interrupt(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.send_signal(signal.SIGINT)

    def _died(self, emit: typing.Callable[[bytes], None], left: bool) -> None:
        code = self.proc.wait() if self.proc is not None else None
        self._stop()
        if left:
            raise CallerLeft()
        if self.ending is not None:
            why = f"the context {self.id} was {self.ending} during the execution"
        else:
            why = (
                f"the kernel of context {self.id} ended during the execution (exit code {code}); "
                "its state is lost, the next execution starts a new kernel"
            )
        error = {"type": "error", "name": "KernelDied", "value": why, "traceback": ""}
        emit(json.dumps(error).encode() + b"\n")
        emit(END_LINE)


class Contexts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.contexts: dict[str, Context] = {}
        self.default: Context | None = None
        self.default_ready = threading.Event()

    def start_default(self) -> None:
        try:
            ctx = Context(DEFAULT_CWD)
            with self.lock:
                self.contexts[ctx.id] = ctx
                self.default = ctx
        finally:
            self.default_ready.set()

    def get_default(self) -> Context:
        self.default_ready.wait(KERNEL_START_TIMEOUT_S)
        with self.lock:
            if self.default is None:
                self.default = Context(DEFAULT_CWD)
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
        ctx = Context(cwd or DEFAULT_CWD)
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


# ---- the HTTP front: TCP, a poll() loop, no epoll ------------------------------------------------
class Handler(http.server.BaseHTTPRequestHandler):
    """The routes over the contexts; imports no ZeroMQ, so this process has TCP sockets and no
    epoll (the checkpoint gate's rule), the kernel processes the reverse."""

    contexts: Contexts
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

    def _execute(self, body: dict) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        cid, language = body.get("context_id"), body.get("language")
        if cid is not None and not isinstance(cid, str):
            raise BadRequest("context_id must be a string")
        _language(language)
        env_vars = _str_dict(body.get("env_vars"), "env_vars")
        ctx = self.contexts.get(cid) if cid else self.contexts.get_default()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

        ended = False

        def emit(line: bytes) -> None:
            nonlocal ended
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            if line == END_LINE:
                ended = True
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        try:
            ctx.execute(code, env_vars, emit, self.connection)
        except CallerLeft:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - the answer has begun: the reason as its last lines
            if not ended:
                failed = {"type": "error", "name": type(e).__name__, "value": str(e)[:2000], "traceback": ""}
                emit(json.dumps(failed).encode() + b"\n")
                emit(END_LINE)

    def _call(self, method: str) -> None:
        try:
            body = self._body() if method == "POST" else {}
            path = self.path.split("?", 1)[0].rstrip("/")
            if method == "POST" and path == "/execute":
                self._execute(body)
            else:
                self._json(*route(self.contexts, method, path, body))
        except (BadRequest, NotFound) as e:
            self._json(e.status, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - the caller gets the reason, never a traceback
            self._json(500, {"error": f"the code interpreter failed: {type(e).__name__}: {e}"[:2000]})

    def do_GET(self) -> None:
        self._call("GET")

    def do_POST(self) -> None:
        self._call("POST")

    def do_DELETE(self) -> None:
        self._call("DELETE")


def route(contexts: Contexts, method: str, path: str, body: dict) -> tuple[int, typing.Any]:
    """Every call but `/execute`: (status, JSON answer). Raises BadRequest / NotFound."""
    if method == "GET" and path == "/health":
        return 200, {"ok": True}
    if path == "/contexts" and method == "GET":
        return 200, [c.view() for c in list(contexts.contexts.values())]
    if path == "/contexts" and method == "POST":
        cwd = body.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise BadRequest("cwd must be a string")
        return 200, contexts.create(body.get("language"), cwd).view()
    if (m := re.fullmatch(r"/contexts/([^/]+)/restart", path)) and method == "POST":
        contexts.get(m.group(1)).restart()
        return 200, {}
    if (m := re.fullmatch(r"/contexts/([^/]+)", path)) and method == "DELETE":
        contexts.remove(m.group(1))
        return 200, {}
    return 404, {"error": f"{method} {path} is not a route of the code interpreter"}


def main(argv: list[str]) -> None:
    if len(argv) > 2 and argv[1] == "--kernel":
        kernel_main(int(argv[2]))
        return
    port = int(argv[1]) if len(argv) > 1 else PORT
    # ThreadingHTTPServer: a poll() loop (selectors.PollSelector), no epoll on its TCP socket
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)  # a second start fails here
    server.daemon_threads = True
    Handler.contexts = Contexts()
    threading.Thread(target=Handler.contexts.start_default, daemon=True).start()
    server.serve_forever(poll_interval=None)  # no wake-up twice a second: nothing calls shutdown()


if __name__ == "__main__":
    main(sys.argv)

"""The `Agent` object: the state the handlers share, and `dispatch`, which routes each request to
the handler for its method and path (404 not_found with the list of routes otherwise).

The handlers are mixins by area: `handlers_status` (health, identity, gate), `handlers_exec` (exec,
processes), `handlers_files` (files). `__main__` makes the one Agent; `connection.Conn` calls
`dispatch` for every request.
"""

from __future__ import annotations

import itertools
import os
import pwd
import time

from .common import log
from .connection import Conn, Request
from .errors import ApiError
from .handlers_exec import ExecHandlers
from .handlers_fileops import FileOpsHandlers
from .handlers_files import FileHandlers
from .handlers_procs import ProcHandlers
from .handlers_status import StatusHandlers
from .processes import ProcessTable
from .ptys import PtyHandlers

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_ROUTES_HELP = (
    "the agent serves GET /health, GET /stats, POST /identity, POST /exec, GET /processes, DELETE /processes/<pid>, "
    "GET /processes/<pid>[/output], POST /processes/<pid>/stdin|signal|wait, "
    "GET|PUT|DELETE /files?path=, GET /files/list?path=, GET /files/stat|watch?path=, POST /files/mkdir|chmod?path=, "
    "POST /files/move?from=&to=, GET|PUT /files/tar?path=, GET /gate, POST /gate/final, POST|GET /pty, GET|DELETE /pty/<id>, "
    "GET /pty/<id>/attach"
)

_FILE_OPS = {
    ("GET", "/files/stat"): "stat_file",
    ("POST", "/files/mkdir"): "make_dir",
    ("POST", "/files/move"): "move_file",
    ("POST", "/files/chmod"): "chmod_file",
    ("GET", "/files/watch"): "watch_files",
    ("PUT", "/files/tar"): "write_tar",
    ("GET", "/files/tar"): "read_tar",
}


class Agent(StatusHandlers, ExecHandlers, FileHandlers, FileOpsHandlers, PtyHandlers, ProcHandlers):
    """The agent's state (identity, environment for commands, the process table) and its route table.

    One instance per process, made by `__main__`; every `connection.Conn` calls `dispatch`.
    """

    def __init__(self, host: str, port: int):
        self.host = host
        self.port = port
        self.pid = os.getpid()
        self.started = time.monotonic()
        self.sandbox_id = os.environ.get("ATOLL_SANDBOX_ID", "")
        try:
            self.generation = int(os.environ.get("ATOLL_GENERATION", "0") or 0)
        except ValueError:
            log(f"ignoring ATOLL_GENERATION={os.environ.get('ATOLL_GENERATION')!r}: not an integer")
            self.generation = 0
        self.procs = ProcessTable()
        self.ptys: dict = {}  # terminals (ptys.Session by pty id)
        self._log_dir_ready = False
        self._log_names = itertools.count()
        self._tmp_names = itertools.count()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
        env.setdefault("PATH", DEFAULT_PATH)
        env.setdefault("LANG", "C.UTF-8")
        try:
            env["HOME"] = pwd.getpwuid(os.geteuid()).pw_dir
        except KeyError:
            env.setdefault("HOME", "/root" if os.geteuid() == 0 else "/")
        self.base_env = env
        self.default_shell = os.environ.get("ATOLL_AGENT_SHELL") or None
        """The shell of string commands that name none (ATOLL_AGENT_SHELL; unset: bash when present).
        A checkout's tests set it to sh: a host's login profile is no business of theirs."""
        self.default_cwd: str | None = None
        """The template's workdir (POST /identity): the cwd of commands that name none."""

    # ---- routing

    def dispatch(self, conn: Conn, req: Request) -> None:
        method, path = req.method, req.path
        if len(path) > 1:
            path = path.rstrip("/")
        if path == "/health" and method == "GET":
            return self.health(conn)
        if path == "/stats" and method == "GET":
            return self.stats(conn)
        if path == "/exec" and method == "POST":
            return self.exec(conn, req)
        if path == "/files":
            if method == "GET":
                return self.read_file(conn, req)
            if method == "PUT":
                return self.write_file(conn, req)
            if method == "DELETE":
                return self.delete_file(conn, req)
        if path == "/files/list" and method == "GET":
            return self.list_dir(conn, req)
        if path.startswith("/files/") and (method, path) in _FILE_OPS:
            return getattr(self, _FILE_OPS[method, path])(conn, req)
        if path == "/processes" and method == "GET":
            return self.list_processes(conn)
        if path == "/processes/kill-all" and method == "POST":
            return self.kill_everything(conn)
        if path.startswith("/processes/") and method == "DELETE":
            return self.kill_process(conn, path[len("/processes/") :])
        if path == "/pty" or path.startswith("/pty/"):
            return self._route_pty(conn, req, method, path)
        if path.startswith("/processes/"):
            pid, _, verb = path[len("/processes/") :].partition("/")
            if method == "GET" and not verb:
                return self.process_info(conn, pid)
            if method == "GET" and verb == "output":
                return self.process_output(conn, req, pid)
            if method == "POST" and verb == "stdin":
                return self.process_stdin(conn, req, pid)
            if method == "POST" and verb == "signal":
                return self.process_signal(conn, req, pid)
            if method == "POST" and verb == "wait":
                return self.process_wait(conn, req, pid)
        if path == "/identity" and method == "POST":
            return self.identity(conn, req)
        if path == "/gate" and method == "GET":
            return self.gate(conn)
        if path == "/gate/final" and method == "POST":
            return self.final_gate(conn)
        raise ApiError(404, "not_found", f"no route for {method} {req.path}; {_ROUTES_HELP}")

    def _route_pty(self, conn: Conn, req: Request, method: str, path: str) -> None:
        parts = path.split("/")[2:]  # "/pty/<id>/attach" -> [<id>, "attach"]
        if not parts and method == "POST":
            return self.open_pty(conn, req)
        if not parts and method == "GET":
            return self.list_ptys(conn)
        if len(parts) == 1 and method == "GET":
            return self.get_pty(conn, parts[0])
        if len(parts) == 1 and method == "DELETE":
            return self.kill_pty(conn, parts[0])
        if len(parts) == 2 and parts[1] == "attach" and method == "GET":
            return self.attach_pty(conn, req, parts[0])
        raise ApiError(404, "not_found", f"no route for {method} {req.path}; {_ROUTES_HELP}")

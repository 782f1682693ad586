"""The exec and process handlers: validating an exec request, spawning the command through the
ProcessTable, collecting its output with poll() in the serving thread (no epoll: see the package
docstring), timeouts, background commands with their log files, and killing process trees.

`ExecHandlers` is mixed into `routing.Agent`, which routes POST /exec, GET /processes and
DELETE /processes/<pid> here; `__main__` calls `kill_all` on SIGTERM/SIGINT.
"""

from __future__ import annotations

import os
import pwd
import queue
import select
import signal
import socket
import time

from . import execspec, procio, shells
from .capture import PIPE_READ, Capture, Stream, drain_leftovers
from .common import PIPE, dumps
from .connection import Conn, Request, json_body
from .deadlines import DEADLINES
from .errors import ApiError, PeerGone, SpawnFailed, invalid
from .processes import NotRunnable, Proc, remove_log, spawn_error
from .proctree import kill_tree
from .threads import pool

LOG_DIR = "/tmp/.atoll"
TIMEOUT_EXIT_CODE = 137  # 128 + SIGKILL, what a shell reports for a killed command
EXIT_DRAIN_GRACE_S = 0.3


class Launch:
    """A checked exec request resolved in this sandbox: what `_spawn` starts."""

    __slots__ = (
        "argv",
        "cmd",
        "cwd",
        "env",
        "timeout",
        "background",
        "user",
        "user_kwargs",
        "max_output",
        "stdin",
    )


class ExecHandlers:
    """POST /exec, GET /processes and DELETE /processes/<pid>; `kill_all` for SIGTERM.

    A mixin of `routing.Agent`, whose __init__ sets what these methods use: `procs` (the
    ProcessTable), `base_env`, `_log_dir_ready` and `_log_names`.
    """

    def list_processes(self, conn: Conn) -> None:
        conn.send_json(200, {"items": self.procs.items()})

    def _exec_spec(self, body: dict) -> Launch:
        """What a POST /exec body starts: its fields checked (execspec.from_json), then resolved in
        this sandbox (the directory exists, the user is known, the shell that runs a string)."""
        try:
            req, background = execspec.from_json(body)
        except execspec.Invalid as e:
            raise invalid(str(e)) from None
        spec = Launch()
        cmd = req.cmd
        argv = [None, cmd] if isinstance(cmd, str) else list(cmd)  # the shell is chosen below
        spec.argv, spec.cmd = argv, cmd

        cwd = req.cwd
        if cwd is not None:
            if not os.path.isdir(cwd):
                raise invalid(
                    f"cwd {cwd!r} does not exist or is not a directory; create it first (mkdir -p) "
                    "or pass an existing directory"
                )
        elif self.default_cwd and os.path.isdir(self.default_cwd):
            cwd = self.default_cwd
        spec.cwd = cwd
        spec.timeout = req.timeout_s
        spec.background = background
        spec.max_output = req.max_output_bytes

        user = req.user
        env = dict(self.base_env)
        spec.user_kwargs = {}
        if user is not None:
            try:
                pw = pwd.getpwnam(user)
            except KeyError:
                raise invalid(
                    f"unknown user {user!r}: no such entry in /etc/passwd; create it in the template "
                    "(useradd) or omit 'user' to run as the agent's user"
                ) from None
            if pw.pw_uid != os.geteuid() or pw.pw_gid != os.getegid():
                try:
                    groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
                except OSError:
                    groups = []
                spec.user_kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": groups}
            env["HOME"] = pw.pw_dir or "/"
            env["USER"] = env["LOGNAME"] = pw.pw_name
        spec.user = user
        if req.env:
            env.update(req.env)
        spec.env = env
        if argv[0] is None:
            spec.argv = shells.argv(req.shell or self.default_shell, cmd, env)
        elif req.shell is not None:
            shells.argv(req.shell, "", env)  # validated, though an argv runs without a shell
        # "replace": a JSON string may hold a lone surrogate, which has no UTF-8 form
        spec.stdin = None if req.stdin is None else req.stdin.encode("utf-8", "replace")
        return spec

    def _spawn(self, spec: Launch, *, stdout, stderr, notify=None, stdin=None):
        # Every process of the sandbox carries its current identity (set again after a restore).
        env = spec.env
        if self.sandbox_id:
            env = {**env, "ATOLL_SANDBOX_ID": self.sandbox_id, "ATOLL_GENERATION": str(self.generation)}
        try:
            return self.procs.spawn(
                spec.argv,
                cmd=spec.cmd,
                background=spec.background,
                cwd=spec.cwd,
                env=env,
                user_kwargs=spec.user_kwargs,
                stdout=stdout,
                stderr=stderr,
                notify=notify,
                stdin=stdin,
                deadline_s=spec.timeout,
            )
        except OSError as e:
            raise spawn_error(e, spec.argv, spec.cwd, spec.user) from None
        except ValueError as e:
            raise invalid(f"cannot start the command: {e}") from None
        except SpawnFailed as e:
            raise ApiError(500, "runtime_error", f"could not start {spec.argv[0]!r}: {e}") from None

    def exec(self, conn: Conn, req: Request) -> None:
        spec = self._exec_spec(json_body(req))
        streaming = "application/x-ndjson" in req.headers.get("accept", "").lower()
        if spec.background:
            return self._exec_background(conn, spec, follow=streaming)
        started = time.monotonic()
        q = queue.SimpleQueue()
        stdin_r = stdin_w = None
        if spec.stdin is not None:
            stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        try:
            proc, popen = self._spawn(spec, stdout=PIPE, stderr=PIPE, notify=q, stdin=stdin_r)
        except NotRunnable as e:
            if stdin_w is not None:
                os.close(stdin_w)
            duration = round((time.monotonic() - started) * 1000)
            if streaming:
                conn.start_chunked("application/x-ndjson")
                conn.write_chunk(dumps({"stderr": e.message}) + b"\n")
                conn.write_chunk(
                    dumps({"exit_code": e.exit_code, "timed_out": False, "duration_ms": duration}) + b"\n"
                )
                conn.end_chunked()
            else:
                conn.send_json(
                    200,
                    {
                        "exit_code": e.exit_code,
                        "stdout": "",
                        "stderr": e.message,
                        "duration_ms": duration,
                        "timed_out": False,
                        "stdout_truncated_bytes": 0,
                        "stderr_truncated_bytes": 0,
                    },
                )
            return
        except BaseException:
            if stdin_w is not None:
                os.close(stdin_w)
            raise
        finally:
            if stdin_r is not None:
                os.close(stdin_r)
        if stdin_w is not None:
            procio.feed_soon(procio.StdinPipe(stdin_w), spec.stdin, proc.ended.is_set, pool.submit)
        pipes = [popen.stdout, popen.stderr]
        try:
            sink = Stream(conn) if streaming else Capture(spec.max_output)
            if streaming:
                conn.start_chunked("application/x-ndjson")
            exit_code, timed_out = self._collect(proc, pipes, q, sink, started, spec.timeout, conn.sock)
        except BaseException:
            # The caller went away (or the agent failed): cancel the command rather than orphan it.
            self.procs.forget(proc)
            kill_tree(proc.pid, root_alive=proc.exit_code is None)
            for f in pipes:
                f.close()
            raise
        self.procs.forget(proc)
        if pipes:
            pool.submit(drain_leftovers, pipes)
        duration = round((time.monotonic() - started) * 1000)
        if streaming:
            for kind in ("stdout", "stderr"):
                sink.add_final(kind)
            conn.end_chunked(
                dumps({"exit_code": exit_code, "timed_out": timed_out, "duration_ms": duration}) + b"\n"
            )
        else:
            stdout, stdout_dropped = sink.result("stdout")
            stderr, stderr_dropped = sink.result("stderr")
            conn.send_json(
                200,
                {
                    "exit_code": exit_code,
                    "stdout": stdout,
                    "stderr": stderr,
                    "duration_ms": duration,
                    "timed_out": timed_out,
                    "stdout_truncated_bytes": stdout_dropped,
                    "stderr_truncated_bytes": stderr_dropped,
                },
            )

    @staticmethod
    def _collect(proc: Proc, pipes: list, q, sink, started: float, timeout, client=None) -> tuple[int, bool]:
        """Feed the command's output to `sink` until it exited and its pipes closed.

        The pipes are read with poll() in this thread (poll registers nothing that outlives the call,
        unlike epoll; one thread instead of two readers cuts ~50 futex calls per exec from GIL
        hand-offs). Closed pipes are removed from `pipes`; any left open when this returns belong to
        a descendant that outlived the command by more than EXIT_DRAIN_GRACE_S.
        """
        deadline = started + timeout if timeout else None
        timed_out = False
        kinds = {pipes[0].fileno(): "stdout", pipes[1].fileno(): "stderr"}
        files = {f.fileno(): f for f in pipes}
        poller = select.poll()
        for fd in kinds:
            poller.register(fd, select.POLLIN)
        # Watch the caller's connection too: if it goes away (reset by the worker because the API
        # client disconnected), the command is killed rather than left running unobserved.
        client_fd = client.fileno() if client is not None else -1
        if client_fd >= 0:
            poller.register(client_fd, select.POLLIN | getattr(select, "POLLRDHUP", 0x2000))
        check = 0.02  # how often to look for the command's own exit while its pipes stay open
        grace_end = None
        while kinds:
            now = time.monotonic()
            if deadline is not None and not timed_out and now >= deadline:
                timed_out = True
                kill_tree(proc.pid, root_alive=proc.exit_code is None)
                continue
            if grace_end is None and proc.exit_code is not None:
                grace_end = now + EXIT_DRAIN_GRACE_S
            if grace_end is not None and now >= grace_end:
                break  # a descendant still holds the pipes: leave it running
            wait = check
            if deadline is not None and not timed_out:
                wait = min(wait, deadline - now)
            if grace_end is not None:
                wait = min(wait, grace_end - now)
            events = poller.poll(max(1, int(wait * 1000) + 1))
            if not events:
                check = min(check * 2, 0.5)
                continue
            for fd, _ in events:
                if fd == client_fd:
                    try:
                        gone = client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    poller.unregister(client_fd)
                    client_fd = -1
                    if gone:
                        kill_tree(proc.pid, root_alive=proc.exit_code is None)
                        raise PeerGone()
                    continue
                try:
                    data = os.read(fd, PIPE_READ)
                except OSError:
                    data = b""
                if data:
                    sink.add(kinds[fd], data)
                else:
                    poller.unregister(fd)
                    sink.end(kinds.pop(fd))
                    f = files.pop(fd)
                    pipes.remove(f)
                    f.close()
        while proc.exit_code is None:  # pipes closed: wait for the exit status from the reaper
            wait = None
            if deadline is not None and not timed_out:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    timed_out = True
                    kill_tree(proc.pid)
                    continue
            try:
                q.get(timeout=wait) if wait is not None else q.get()
            except queue.Empty:
                pass
        return (TIMEOUT_EXIT_CODE if timed_out else proc.exit_code), timed_out

    def _exec_background(self, conn: Conn, spec: Launch, follow: bool = False) -> None:
        """Start a background command: answer {pid, log_path}; or, with `follow` (Accept:
        application/x-ndjson), that object as the first line of a chunked answer that goes on as
        GET /processes/<pid>/output?follow=1 does (one round trip instead of two)."""
        if not self._log_dir_ready:
            try:
                os.makedirs(LOG_DIR, mode=0o755, exist_ok=True)
            except OSError as e:
                raise ApiError(
                    500, "runtime_error", f"cannot create the log directory {LOG_DIR}: {e}"
                ) from None
            self._log_dir_ready = True
        tmp_log = f"{LOG_DIR}/spawn-{os.getpid()}-{next(self._log_names)}.log"
        try:
            fd = os.open(tmp_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._log_dir_ready = False
            raise ApiError(500, "runtime_error", f"cannot create the log file {tmp_log}: {e}") from None
        # stdin is a pipe the agent holds (POST /processes/<pid>/stdin) or feeds `stdin` into; an
        # empty `stdin` (E2B's `stdin: false`) is /dev/null and a pipe already closed (no pipe
        # made, fed and closed: ~0.1 ms a syscall under gVisor). stdout and stderr go through
        # procio.Pump into the process's OutputLog and its log file.
        no_input = spec.stdin is not None and not spec.stdin
        stdin_r, stdin_w = (None, None) if no_input else os.pipe2(os.O_CLOEXEC)
        wake = procio.ExitWake()
        try:
            try:
                proc, popen = self._spawn(spec, stdout=PIPE, stderr=PIPE, stdin=stdin_r, notify=wake)
            except NotRunnable as e:
                raise invalid(f"cannot start the background command: {e.message.strip()}") from None
        except BaseException:
            try:
                os.unlink(tmp_log)
            except OSError:
                pass
            os.close(fd)
            if stdin_w is not None:
                os.close(stdin_w)
            wake.close()
            raise
        finally:
            if stdin_r is not None:
                os.close(stdin_r)
        proc.output = procio.OutputLog()
        proc.stdin = procio.StdinPipe(stdin_w)
        pumping = procio.Pump(proc, [popen.stdout, popen.stderr], proc.output, fd, wake)
        if not follow:
            pool.submit(pumping.run)
        if spec.stdin:
            procio.feed_soon(proc.stdin, spec.stdin, proc.ended.is_set, pool.submit)
        log_path = f"{LOG_DIR}/proc-{proc.pid}.log"
        try:
            os.replace(tmp_log, log_path)
        except OSError:
            log_path = tmp_log
        proc.log_path = log_path
        if spec.timeout:
            timer = DEADLINES.call_later(spec.timeout, self._background_timeout, proc)
            proc.timer = timer
            if proc.exit_code is not None:
                timer.cancel()
        if not follow:
            conn.send_json(200, {"pid": proc.pid, "log_path": log_path})
            return
        try:
            conn.start_chunked("application/x-ndjson", dumps({"pid": proc.pid, "log_path": log_path}) + b"\n")
        except BaseException:
            pool.submit(pumping.run)  # the caller left at once: the process runs on
            raise
        self._follow_pumping(conn, proc, pumping)  # type: ignore[attr-defined]  # handlers_procs's, in routing.Agent

    def _background_timeout(self, proc: Proc) -> None:
        if proc.exit_code is None and self.procs.get(proc.pid) is proc:
            proc.timed_out = True
            kill_tree(proc.pid)

    def kill_process(self, conn: Conn, pid_text: str) -> None:
        try:
            pid = int(pid_text)
        except ValueError:
            raise invalid(f"process id must be an integer, got {pid_text!r}") from None
        proc = self.procs.get(pid)
        if proc is None:
            raise ApiError(
                404,
                "process_not_found",
                f"no process with pid {pid} was started by the agent (or it was already removed); "
                "list them with GET /processes",
            )
        kill_tree(pid, root_alive=proc.exit_code is None)
        if proc.background:  # a foreground record belongs to its exec call, which reports the exit
            self.procs.forget(proc)
            if proc.timer is not None:
                proc.timer.cancel()
            remove_log(proc)
            if proc.output is not None:  # forgotten: the reaper will not report it; end its pump
                proc.ended.set()
                if proc.notify is not None:
                    proc.notify.put(("exit", None))
        conn.send_no_content()

    def kill_everything(self, conn: Conn) -> None:
        """POST /processes/kill-all: every user process dies (the worker's relief when the sandbox
        nears its host task limit): atoll-init and with it its namespace, or, without an init, the
        process groups the agent started."""
        if self.procs.init is not None:
            self.procs.init.kill_all()
        else:
            self.kill_all()
        conn.send_no_content()

    def kill_all(self) -> None:
        for pid in self.procs.all_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

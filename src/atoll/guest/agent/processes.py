"""The processes the agent started (PID 1 duties): their records, spawning them, and the reaper thread
that is the only caller of waitpid in the agent.

`routing.Agent` owns one ProcessTable (`agent.procs`); `handlers_exec` spawns through it, lists its
records and kills them; `__main__` starts the reaper. `spawn_error` maps a failed spawn to what a shell
reports (126/127, `NotRunnable`) or to an ApiError.
"""

from __future__ import annotations

import errno
import itertools
import os
import queue
import signal
import threading
import time

from . import proctree, zygote
from .common import format_exc, log
from .errors import ApiError, NotRunnable, SpawnFailed, invalid
from .initclient import InitClient

MAX_PROCESS_RECORDS = 1000


class Proc:
    __slots__ = ("pid", "cmd", "background", "started_at", "exit_code", "notify", "log_path", "timer")
    # background handles (procio), and how it ended
    __slots__ += ("output", "stdin", "timed_out", "ended", "ended_at", "signal")

    def __init__(self, pid: int, cmd, background: bool, notify, log_path):
        self.pid = pid
        self.cmd = cmd
        self.background = background
        self.started_at = time.time()
        self.exit_code: int | None = None
        self.notify = notify  # queue that receives ("exit", code), for foreground commands
        self.log_path = log_path
        self.timer = None
        self.output = None  # procio.OutputLog of a background process
        self.stdin = None  # procio.StdinPipe while its stdin is a pipe the agent holds
        self.timed_out = False
        self.ended = threading.Event()  # set once the exit status is in
        self.ended_at: float | None = None
        self.signal: int | None = None  # the signal that ended it (exit_code is then 128 + it)

    def info(self) -> dict:
        item = {
            "pid": self.pid,
            "cmd": self.cmd,
            "running": self.exit_code is None,
            "exit_code": self.exit_code,
            "background": self.background,
            "started_at": self.started_at,
        }
        if self.signal is not None:
            item["signal"] = self.signal
        if self.background:
            item["log_path"] = self.log_path
            item["stdin_open"] = self.stdin is not None and not self.stdin.closed
            item["timed_out"] = self.timed_out
            if self.output is not None:
                item["output_bytes"] = self.output.end
        return item


_REAPER_OWNS_STATUS = -(1 << 30)  # returncode given to inert Popen objects; never reported


def _popen(argv, **kwargs):
    """Start a command beside the agent (no atoll-init: a checkout run on the host, or an init that
    could not start), in a new session. subprocess is imported here, not at start (~0.5 MB of every
    idle sandbox's agent, where atoll-init spawns). Every fd the agent opens is non-inheritable
    (PEP 446; checked by a test), so close_fds=False spares the child the scan of /proc/self/fd
    (~0.3 ms per spawn in gVisor)."""
    import subprocess  # noqa: PLC0415

    try:
        popen = subprocess.Popen(argv, close_fds=False, start_new_session=True, **kwargs)
    except subprocess.SubprocessError as e:
        raise SpawnFailed(str(e)) from None
    # The reaper owns this pid's exit status: make the Popen inert so neither it nor subprocess's
    # _cleanup() ever waits on the pid (which may be reused later).
    popen.returncode = _REAPER_OWNS_STATUS
    return popen


class ProcessTable:
    """Records of the processes the agent started, and the reaper that collects every exit status.

    The reaper is the only caller of waitpid. A child can exit before its spawner registered it, so
    a reaped pid that is not (yet) in the table is matched after the spawns that were in flight at
    reap time have finished; if still unknown it was an orphan and its status is dropped.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._procs: dict[int, Proc] = {}
        self._inflight: set[int] = set()
        self._tickets = itertools.count()
        self._seq = 0  # bumped after every spawn, so the reaper notices new children
        self.init: InitClient | None = None  # commands run under atoll-init (see zygote)
        self.proc_root = "/proc"  # where the agent reads its own namespace's processes
        # exits atoll-init reports, delivered by a thread of their own (see _exit_reported)
        self._init_exits: queue.SimpleQueue = queue.SimpleQueue()
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def start_init(self) -> None:
        """Run commands in a child PID namespace under atoll-init."""
        client = InitClient(self._exit_reported, self._init_restarting)
        self.proc_root = zygote.mount_agent_proc()
        client.start_first()
        self.init = client
        proctree.remote = client.kill_tree
        self.start_exit_delivery()

    def start_exit_delivery(self) -> None:
        threading.Thread(target=self._deliver_init_exits, name="init-exits", daemon=True).start()

    def _deliver_init_exits(self) -> None:
        while True:
            pid, code, sig = self._init_exits.get()
            try:
                self._deliver_code(pid, code, signal=sig)
            except Exception:
                log("delivering an exit status from atoll-init failed:\n" + format_exc())

    def start_reaper(self) -> None:
        threading.Thread(target=self._reap_forever, name="reaper", daemon=True).start()

    def _exit_reported(self, pid: int, code: int, sig: int | None = None) -> None:
        """Called by the init client's reader thread: queue the exit and return at once. Delivering
        may wait for the spawns in flight to register their pids (an exit can arrive right after
        its spawn's answer, before the spawner registered it), and those spawns wait for answers
        that only this reader thread reads: delivering here would hold every spawn up for
        `_deliver_code`'s 60 s (it did, whenever a command was killed just before the next exec).
        The usual case, a registered command that is still running, is delivered here at once."""
        try:
            if self._deliver_code(pid, code, signal=sig, wait=False):
                return
        except Exception:
            log("delivering an exit status from atoll-init failed:\n" + format_exc())
            return
        self._init_exits.put((pid, code, sig))

    def _init_restarting(self) -> None:
        """The init died with its namespace: every command still running was killed with it."""
        with self._cond:
            running = [p for p in self._procs.values() if p.exit_code is None]
        for p in running:  # (never waits: one that got its code meanwhile is left as it is)
            self._deliver_code(p.pid, 128 + 9, signal=9, wait=False)

    def spawn(
        self,
        argv,
        *,
        cmd,
        background,
        cwd,
        env,
        user_kwargs,
        stdout,
        stderr,
        notify=None,
        stdin=None,
        deadline_s=None,
    ):
        stdin = self._devnull if stdin is None else stdin
        ticket = next(self._tickets)
        with self._cond:
            self._inflight.add(ticket)
        try:
            if self.init is not None:
                popen = self.init.spawn(
                    argv,
                    cwd=cwd,
                    env=env,
                    user_kwargs=user_kwargs,
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    deadline_s=deadline_s,
                )
                return self._register(popen, cmd, background, notify)
            popen = _popen(
                argv,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                env=env,
                bufsize=0,
                **user_kwargs,
            )
            return self._register(popen, cmd, background, notify)
        finally:
            with self._cond:
                self._inflight.discard(ticket)
                self._seq += 1
                self._cond.notify_all()

    def spawn_terminal(self, argv, *, cmd, cwd, env, user_kwargs, slave: int, notify):
        """Start a terminal's command (ptys) with the pty `slave` as stdin, stdout, stderr and its
        controlling terminal (setsid + TIOCSCTTY), through atoll-init like every command."""
        ticket = next(self._tickets)
        with self._cond:
            self._inflight.add(ticket)
        try:
            if self.init is not None:
                popen = self.init.spawn(
                    argv,
                    cwd=cwd,
                    env=env,
                    user_kwargs=user_kwargs,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    ctty=True,
                )
            else:
                popen = _popen(
                    argv,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    cwd=cwd,
                    env=env,
                    preexec_fn=zygote.take_controlling_tty,
                    **user_kwargs,
                )
            return self._register(popen, cmd, False, notify)
        finally:
            with self._cond:
                self._inflight.discard(ticket)
                self._seq += 1
                self._cond.notify_all()

    def signal_group(self, pgid: int, sig: int) -> None:
        """killpg in the commands' PID namespace (pgid as `ps` shows it)."""
        if self.init is not None:
            self.init.signal_group(pgid, sig)
            return
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass

    def _register(self, popen, cmd, background: bool, notify):
        proc = Proc(popen.pid, cmd, background, notify, None)
        with self._cond:
            stale = self._procs.pop(popen.pid, None)  # the pid was reused
            self._procs[popen.pid] = proc
            evicted = self._evict_locked() if background else []
            # started by an init that died before this registration (the command killed it, as
            # `kill -9 1` does): _init_restarting may have looked before it was here
            current = getattr(self.init, "epoch", None)
            lost = current is not None and getattr(popen, "epoch", current) != current
        if lost:
            self._deliver_code(popen.pid, 128 + 9, signal=9, wait=False)
        for old in ([stale] if stale else []) + evicted:
            remove_log(old)
        return proc, popen

    def _evict_locked(self) -> list[Proc]:
        finished = [p for p in self._procs.values() if p.background and p.exit_code is not None]
        evicted = finished[: max(0, len(finished) - MAX_PROCESS_RECORDS)]
        for p in evicted:
            del self._procs[p.pid]
        return evicted

    def _reap_forever(self) -> None:
        while True:
            with self._cond:
                seq = self._seq
            try:
                pid, status = os.waitpid(-1, os.WUNTRACED if self.init is not None else 0)
            except ChildProcessError:
                with self._cond:
                    if self._seq == seq:
                        # No children. Wake on the next spawn, or now and then in case runsc-exec'd
                        # processes leave orphans to PID 1.
                        self._cond.wait(5.0)
                continue
            except Exception as e:  # never let the reaper die
                log(f"reaper: waitpid failed: {e!r}")
                time.sleep(0.1)
                continue
            init = self.init
            if init is not None and pid == init.pid:
                if os.WIFSTOPPED(status):  # user code sent SIGSTOP to its PID 1: let it go on
                    log(f"atoll-init (pid {pid}) was stopped by signal {os.WSTOPSIG(status)}; continuing it")
                    os.kill(pid, signal.SIGCONT)
                else:
                    init.died()
                continue
            if os.WIFSTOPPED(status):
                continue  # not ours to judge (only atoll-init is watched with WUNTRACED)
            if init is not None:
                # With an init the commands are its children, their exits come from it, and their
                # pids are its namespace's: what PID 1 reaps here is the process that started an
                # init (it exits once the init forked) or an orphan of `runsc exec`, never a command
                # (delivering it would wait up to 60 s for spawns in flight, which may be waiting
                # for the init restart this thread triggers, and could hit a command's pid).
                continue
            try:
                self._deliver(pid, status)
            except Exception:
                log("reaper: delivering an exit status failed:\n" + format_exc())

    def _deliver(self, pid: int, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        sig = None
        if code < 0:
            sig, code = -code, 128 - code  # killed by signal N -> 128+N, like a shell
        self._deliver_code(pid, code, signal=sig)

    def _deliver_code(self, pid: int, code: int, *, signal: int | None = None, wait: bool = True) -> bool:
        """Record `pid`'s exit and tell whoever waits for it. A pid not (yet) in the table waits for
        the spawns in flight to register theirs — unless `wait` is False: then False is returned
        and nothing is done, for the caller to hand the exit to a thread that may wait."""
        with self._cond:
            if not wait:
                proc = self._procs.get(pid)
                if proc is None or proc.exit_code is not None:
                    return False
            pending = set(self._inflight)
            deadline = time.monotonic() + 60.0
            proc = self._procs.get(pid)
            while (proc is None or proc.exit_code is not None) and (pending & self._inflight):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 1.0))
                proc = self._procs.get(pid)
            if proc is None or proc.exit_code is not None:
                return True  # an orphan (PID 1 inherits them) or a forgotten record
            proc.exit_code = code
            proc.signal = signal
            proc.ended_at = time.time()
            notify, timer = proc.notify, proc.timer
        proc.ended.set()
        if timer is not None:
            timer.cancel()
        if notify is not None:
            notify.put(("exit", code))
        return True

    def get(self, pid: int) -> Proc | None:
        with self._cond:
            return self._procs.get(pid)

    def forget(self, proc: Proc) -> None:
        with self._cond:
            if self._procs.get(proc.pid) is proc:
                del self._procs[proc.pid]

    def items(self) -> list[dict]:
        with self._cond:
            procs = list(self._procs.values())
        procs.sort(key=lambda p: p.started_at)
        return [p.info() for p in procs]

    def all_pids(self) -> list[int]:
        return list(self._procs)


def remove_log(proc: Proc) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    if proc.log_path:
        try:
            os.unlink(proc.log_path)
        except OSError:
            pass


def spawn_error(e: OSError, argv: list[str], cwd, user) -> Exception:
    """Map a Popen failure to what a shell would report (126/127) or to an API error."""
    name = argv[0]
    if e.filename is not None and e.filename == name:  # exec() itself failed
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            if "/" in name:
                return NotRunnable(127, f"{name}: No such file or directory\n")
            return NotRunnable(127, f"{name}: command not found\n")
        if isinstance(e, (PermissionError, IsADirectoryError)):
            return NotRunnable(126, f"{name}: Permission denied\n")
        if e.errno == errno.ENOEXEC:
            return NotRunnable(126, f"{name}: cannot execute: Exec format error\n")
        return NotRunnable(126, f"{name}: {e.strerror or e}\n")
    if cwd is not None and isinstance(e, (FileNotFoundError, NotADirectoryError, PermissionError)):
        return invalid(f"cannot change to cwd {cwd!r}: {e.strerror}; pass an existing, accessible directory")
    if user is not None and isinstance(e, PermissionError):
        return invalid(
            f"cannot start the command as user {user!r}: {e.strerror}; the agent must run as root to switch users"
        )
    return ApiError(500, "runtime_error", f"could not start {name!r}: {e}")

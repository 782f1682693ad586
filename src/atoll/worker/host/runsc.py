"""Adapter over the `runsc` CLI (gVisor 20221219 from Debian, ptrace platform).

Every runsc that starts or restores a sandbox runs
  * in its own session (the gofer otherwise joins the caller's process group, and Ctrl-C to atoll
    would kill the sandbox),
  * with stdio redirected to a log file (a detached sandbox holds the caller's pipes open),
  * inside a private mount namespace with an empty tmpfs over /proc/sys/net (gVisor issue #10704:
    this runsc refuses `--network=sandbox` because it misreads rmem_default on new kernels).
Checkpoints run through a small shell wrapper that writes a `done` marker only on success, so a
worker killed mid-checkpoint can tell on restart whether the image is complete.
The log file (`runsc.log` of a sandbox) is the worker's: made 0600, and given back to the worker's
user after each start or restore (runsc hands its stdio files to the sandbox's user, `nobody`).
It goes with the sandbox's directory at its delete; `keep_log` copies the log of a failure that
killed a sandbox (a checkpoint) to `$ATOLL_HOME/logs/` first, and `cause` gives runsc's own words
about it, short enough for the record's `failure_reason`.
Called by worker.service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil

from atoll.core import errors
from atoll.worker.host import hostcmd

RUNSC = os.environ.get("ATOLL_RUNSC", "runsc")
_NET_WORKAROUND = "mount -t tmpfs tmpfs /proc/sys/net && exec "


def base_flags(root: str) -> list[str]:
    return [RUNSC, f"--root={root}", "--platform=ptrace", "--network=sandbox"]


def binary_identity() -> str:
    """The runsc binary this worker starts sandboxes with, as its path, size and modification time:
    a package upgrade changes them (hashing its ~40 MB at every look would cost ~0.1 s). Part of
    every snapshot's runtime key (worker.host.snapshots.RuntimeKey): the sentry is this binary."""
    path = os.path.realpath(shutil.which(RUNSC) or RUNSC)
    try:
        st = os.stat(path)
    except OSError:
        return f"{path} (missing)"
    return f"{path} {st.st_size} {st.st_mtime_ns}"


def _open_log(log_path: str) -> int:
    """The log opened for appending, 0600 (an older one is made 0600 too)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _reclaim_log(log_path: str) -> None:
    """Give the log back to the worker's user: starting a sandbox, runsc chowns its stdio files to
    the sandbox's user (nobody); the sandbox keeps writing through the descriptor it holds."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(log_path)
        if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            os.chown(log_path, os.geteuid(), os.getegid())
        if st.st_mode & 0o077:
            os.chmod(log_path, 0o600)


async def _start_logged(argv: list[str], log_path: str) -> asyncio.subprocess.Process:
    """Start argv in its own session, stdin from /dev/null, stdout and stderr appended to log_path."""
    fd = _open_log(log_path)
    try:
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True
        )
    finally:
        os.close(fd)


async def _spawn_detached(argv: list[str], log_path: str, timeout: float) -> None:
    script = _NET_WORKAROUND + shlex.join(argv)
    proc = await _start_logged(["unshare", "-m", "--propagation", "private", "sh", "-c", script], log_path)
    try:
        rc = await asyncio.wait_for(proc.wait(), timeout)
    except asyncio.CancelledError:
        # runsc goes on in its own session: let it finish, so whoever cleans up after this
        # cancelled call (a `runsc delete`) finds the container as runsc left it, not half-made
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), timeout)
        raise
    except TimeoutError:
        raise errors.RuntimeFailure(
            f"runsc {argv[len(base_flags(''))]} did not finish within {timeout}s"
        ) from None
    finally:
        _reclaim_log(log_path)
    if rc != 0:
        raise errors.RuntimeFailure(
            f"runsc {argv[len(base_flags(''))]} failed (exit {rc})", detail=f"runsc log: {tail(log_path)}"
        )


def tail(path: str, n: int = 600) -> str:
    """Last meaningful runsc log lines (error text rather than Go stack traces)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no runsc log)"
    keep = [ln for ln in lines if ln.strip() and not ln.startswith(("\t", "goroutine ", "created by "))]
    text = " | ".join(keep[-4:])
    # gVisor prints whole Go structs in errors; the cause is at the end.
    return text[-n:]


# A Go stack frame (`pkg.(*T).method(0xc000…, …)`): no blank before its first parenthesis.
_FRAME = re.compile(r"^\S+\(.*\)$")
_PANIC = ("panic:", "fatal error:")
KEPT_LOG_BYTES = 1 << 20
"""The end of runsc's log that `keep_log` copies (a sandbox's log also holds its whole history)."""
KEPT_LOGS = 100
"""Copies `keep_log` leaves in a logs directory: the newest (a flood of failures cannot fill the
disk with them)."""


def cause(path: str, home: str | None = None, n: int = 400) -> str:
    """runsc's own words about its last failure, for a record's `failure_reason`: the last Go panic
    or fatal error in the log, if any, and its last line that is not part of a stack trace; the
    worker's `home` written as `$ATOLL_HOME` (no host paths for the caller); at most `n` chars."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no runsc log)"
    # not indented (a stack trace's file lines are; so is a re-raised panic under the first)
    words = [
        ln.strip()
        for ln in lines
        if ln.strip()
        and not ln.startswith(("\t", " ", "goroutine ", "created by ", "["))
        and not _FRAME.match(ln)
    ]
    if not words:
        return "(runsc wrote nothing)"
    said = [ln for ln in words if ln.startswith(_PANIC)][-1:]
    if words[-1] not in said:
        said.append(words[-1])
    text = " | ".join(said)
    if home:
        text = text.replace(os.path.realpath(home), "$ATOLL_HOME").replace(home, "$ATOLL_HOME")
    return text if len(text) <= n else text[: n - 1] + "…"


def keep_log(log_path: str, logs_dir: str, name: str) -> str | None:
    """Copy the end of a sandbox's runsc log (KEPT_LOG_BYTES) to `logs_dir/name` (0600; the
    directory 0700), where it outlives the sandbox; the oldest copies beyond KEPT_LOGS go. Returns
    the copy's path (None: there was no log, or it could not be written — said in the caller's log)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - KEPT_LOG_BYTES))
            data = f.read()
        os.makedirs(logs_dir, mode=0o700, exist_ok=True)
        dest = os.path.join(logs_dir, name)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        kept = sorted(os.scandir(logs_dir), key=lambda e: e.stat().st_mtime_ns, reverse=True)
        for old in kept[KEPT_LOGS:]:
            with contextlib.suppress(OSError):
                os.unlink(old.path)
        return dest
    except OSError:
        return None


async def run(root: str, bundle: str, cid: str, log_path: str) -> None:
    await _spawn_detached(base_flags(root) + ["run", "--bundle", bundle, "--detach", cid], log_path, 60)


async def restore(root: str, bundle: str, cid: str, image_dir: str, log_path: str) -> None:
    await _spawn_detached(
        base_flags(root) + ["restore", "--bundle", bundle, "--detach", f"--image-path={image_dir}", cid],
        log_path,
        300,
    )


def checkpoint_argv(root: str, cid: str, image_dir: str) -> list[str]:
    return base_flags(root) + ["checkpoint", f"--image-path={image_dir}", cid]


async def start_checkpoint(root: str, cid: str, image_dir: str, log_path: str) -> asyncio.subprocess.Process:
    """Start `runsc checkpoint` detached from atoll; `<image_dir>/done` appears only on success."""
    os.makedirs(image_dir, exist_ok=True)
    done = os.path.join(image_dir, "done")
    script = f"{shlex.join(checkpoint_argv(root, cid, image_dir))} && echo ok > {shlex.quote(done)}"
    return await _start_logged(["sh", "-c", script], log_path)


async def state(root: str, cid: str) -> dict | None:
    """runsc's view of a container ({"status": "running"|"paused"|"stopped"|"created", "pid": ...})."""
    rc, out, _ = await hostcmd.run(RUNSC, f"--root={root}", "state", cid, check=False, timeout=30)
    if rc != 0:
        return None
    try:
        return json.loads(out)
    except ValueError:
        return None


def sandbox_pid(root: str, cid: str) -> int | None:
    """PID of the sentry, read from runsc's state file (never asks the sandbox: it may be frozen)."""
    try:
        with open(os.path.join(root, f"{cid}_sandbox:{cid}.state")) as f:
            return int(json.load(f)["sandbox"]["pid"])
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def pid_alive(pid: int | None) -> bool:
    if not pid or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


async def delete(root: str, cid: str) -> None:
    """`runsc delete --force`, in its own session: a stop signal to atoll's process group must not
    kill it half-way (that left a deleted sandbox's sentry running)."""
    await hostcmd.run(
        RUNSC, f"--root={root}", "delete", "--force", cid, check=False, timeout=60, new_session=True
    )


async def kill(root: str, cid: str) -> None:
    await hostcmd.run(RUNSC, f"--root={root}", "kill", "--all", cid, "KILL", check=False, timeout=30)


async def signal(root: str, cid: str, sig: str) -> None:
    """Send `sig` (e.g. "CONT") to the container's init process, the guest agent; best effort (a
    hung sentry times out and that is all)."""
    with contextlib.suppress(errors.AtollError):
        await hostcmd.run(RUNSC, f"--root={root}", "kill", cid, sig, check=False, timeout=10)

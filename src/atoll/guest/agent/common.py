"""Small helpers shared by the agent's modules: logging to stderr, compact JSON, printable file names
and bounded reads of /proc files. Imported by nearly every other module of the package; imports none.
"""

from __future__ import annotations

import json
import math
import os
import sys

PIPE = -1
"""A command's stdout or stderr as a pipe to the agent: subprocess.PIPE's value (the agent does not
import subprocess at start: ~0.5 MB of every idle sandbox), so Popen takes it too."""


def log(message: str) -> None:
    try:
        sys.stderr.write(f"atoll-agent: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def format_exc() -> str:
    import traceback  # only on failures: keeps start-up imports small

    return traceback.format_exc()


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def printable(name: str) -> str:
    """A file name as valid Unicode (names that are not UTF-8 come from os.* with surrogate escapes)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def limit_cpus(cpus) -> None:
    """Narrow the calling thread's CPU affinity to ceil(cpus) CPUs (children inherit it), so that
    `nproc`, sched_getaffinity and the thread pools sized by them match the sandbox's CPU quota.
    The quota (cgroup on the host) is what limits; this only makes programs see it. None or a bad
    value leaves the mask alone."""
    try:
        n = math.ceil(float(cpus))
        available = list(range(os.cpu_count() or 1))  # all of them: the mask may widen again
    except (TypeError, ValueError, OSError):
        return
    if n >= 1:
        try:
            os.sched_setaffinity(0, available[: max(1, min(n, len(available)))])
        except OSError as e:
            log(f"cannot narrow the CPU affinity to {n} CPUs: {e}")


def read_small(path: str, limit: int = 65536) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


_libc = None


def libc():
    """The C library (ctypes), loaded once: mounts, setns, prctl of the agent and atoll-init."""
    global _libc
    if _libc is None:
        import ctypes  # noqa: PLC0415 - only where a libc call is made

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc

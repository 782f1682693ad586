"""cgroup v1 access for one sandbox: freezer (memory-tier standby), memory and cpu accounting.

runsc places the sandbox's processes in the cgroup named by the bundle's `cgroupsPath`; the worker
freezes that cgroup directly (0.3–3 ms) instead of `runsc pause` (~30 ms of CLI start-up).
Called by worker.service.
"""

from __future__ import annotations

import contextlib
import os
import time

from atoll.core import errors

ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("freezer", "memory", "cpu", "cpuacct", "pids", "cpuset", "devices", "blkio")


def _p(controller: str, cgpath: str, leaf: str = "") -> str:
    return os.path.join(ROOT, controller, cgpath.lstrip("/"), leaf)


def freezer_state(cgpath: str) -> str | None:
    try:
        with open(_p("freezer", cgpath, "freezer.state")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _write(path: str, cgpath: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        raise errors.RuntimeFailure(
            f"freezer cgroup {cgpath} is missing; the sandbox is not running"
        ) from None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def freeze(cgpath: str, timeout: float = 5.0) -> None:
    """Freeze every task of the cgroup; on failure thaw it again and raise FreezeTimeout.

    A v1 freezer can stay in FREEZING while tasks are being created (gVisor's ptrace platform starts
    stub processes as the sandbox forks). As runc does, write FROZEN again on every poll (that
    freezes newcomers) and, when stuck for a while, thaw briefly and start over.
    """
    path = _p("freezer", cgpath, "freezer.state")
    deadline = time.monotonic() + timeout
    spins = 0
    while True:
        _write(path, cgpath, "FROZEN")
        # A fork that was under way when the last task froze can add a child after the state read
        # FROZEN, which turns it back to FREEZING for a moment: take FROZEN only when a second read,
        # after yielding the CPU, still says so.
        if _read(path) == "FROZEN":
            time.sleep(0)
            if _read(path) == "FROZEN":
                return
        spins += 1
        if time.monotonic() > deadline:
            with contextlib.suppress(errors.AtollError):
                thaw(cgpath)
            raise errors.FreezeTimeout(
                f"the sandbox's processes could not be frozen within {timeout}s (cgroup {cgpath} "
                "stayed FREEZING, usually because they kept starting processes); it was left "
                "running: retry the pause"
            )
        if spins % 200 == 0:  # stuck: cancel and retry from scratch, as runc does for cgroup v1
            _write(path, cgpath, "THAWED")
            time.sleep(0.01)
        else:
            # The kernel usually settles within a millisecond: spin briefly, then back off.
            time.sleep(0 if spins < 50 else 0.001)


def thaw(cgpath: str, timeout: float = 5.0) -> None:
    path = _p("freezer", cgpath, "freezer.state")
    _write(path, cgpath, "THAWED")
    deadline = time.monotonic() + timeout
    spins = 0
    while _read(path) not in ("THAWED", ""):
        if time.monotonic() > deadline:
            raise errors.RuntimeFailure(f"cgroup {cgpath} did not reach THAWED within {timeout}s")
        spins += 1
        time.sleep(0 if spins < 50 else 0.001)


def has_tasks(cgpath: str) -> bool:
    try:
        with open(_p("freezer", cgpath, "cgroup.procs")) as f:
            return bool(f.read().strip())
    except FileNotFoundError:
        return False


def set_cpu_limit(cgpath: str, cpus: float | None, period_us: int = 100000) -> None:
    """CFS quota for the sandbox: `cpus` cores, or no limit (None)."""
    quota = -1 if cpus is None else max(1000, int(cpus * period_us))
    try:
        with open(_p("cpu", cgpath, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period_us))
        with open(_p("cpu", cgpath, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(quota))
    except FileNotFoundError:
        raise errors.RuntimeFailure(f"cpu cgroup {cgpath} is missing; the sandbox is not running") from None


def oom_kills(cgpath: str) -> int:
    """How often the host's OOM killer struck inside this cgroup (0 if unknown)."""
    try:
        with open(_p("memory", cgpath, "memory.oom_control")) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (FileNotFoundError, ValueError):
        pass
    return 0


def hierarchies() -> list[str]:
    """Every cgroup hierarchy mounted under ROOT (the v1 controllers, name=systemd, a v2 `unified`):
    runsc creates the sandbox's cgroup in each of them, so each must be cleaned."""
    try:
        return sorted(e.name for e in os.scandir(ROOT) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return list(CONTROLLERS)


def pids_usage(cgpath: str) -> tuple[int, int] | None:
    """(pids.current, pids.max) of a sandbox's host pids cgroup; None if unknown or unlimited."""
    try:
        with open(_p("pids", cgpath, "pids.current")) as f:
            current = int(f.read())
        with open(_p("pids", cgpath, "pids.max")) as f:
            text = f.read().strip()
    except (FileNotFoundError, ValueError):
        return None
    return (current, int(text)) if text.isdigit() else None


def pids_limit_hits(cgpath: str) -> tuple[int, int | None]:
    """(how often a fork or clone failed at the pids limit of this cgroup, that limit); (0, None) if unknown."""
    hits, limit = 0, None
    try:
        with open(_p("pids", cgpath, "pids.events")) as f:
            for line in f:
                if line.startswith("max "):
                    hits = int(line.split()[1])
        with open(_p("pids", cgpath, "pids.max")) as f:
            text = f.read().strip()
            limit = int(text) if text.isdigit() else None
    except (FileNotFoundError, ValueError):
        pass
    return hits, limit


def remove(cgpath: str) -> None:
    """Remove the sandbox's (empty) cgroups after runsc deleted it; ignore what is already gone."""
    for c in hierarchies():
        _rmdir_tree(_p(c, cgpath))


def _rmdir_tree(path: str) -> bool:
    """rmdir a cgroup and its child cgroups, deepest first; False if one is still busy (has tasks)."""
    try:
        children = [e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return True
    ok = all([_rmdir_tree(c) for c in children])
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return ok


def tasks(cgpath: str) -> set[int]:
    """PIDs in the cgroup, in any hierarchy."""
    out: set[int] = set()
    for c in hierarchies():
        with contextlib.suppress(OSError, ValueError):
            with open(_p(c, cgpath, "cgroup.procs")) as f:
                out.update(int(x) for x in f.read().split())
    return out


def exists(cgpath: str) -> bool:
    return any(os.path.isdir(_p(c, cgpath)) for c in hierarchies())


def installation_parent(install_id: str) -> str:
    """The cgroup all of an installation's sandboxes live under (see service.Runtime.cgroup)."""
    return f"/atoll-{install_id}"


def installation_leaves(install_id: str) -> dict[str, list[str]]:
    """Leaf cgroup name (`<sandbox id>-<generation>`) -> the hierarchies it exists in."""
    out: dict[str, list[str]] = {}
    for c in hierarchies():
        try:
            names = [e.name for e in os.scandir(_p(c, installation_parent(install_id))) if e.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            out.setdefault(n, []).append(c)
    return out


def remove_empty_parents(install_id: str) -> list[str]:
    """rmdir the installation's parent cgroup in every hierarchy where it has no child left (the
    kernel refuses to remove a cgroup with children or tasks, so a running sandbox keeps its own)."""
    removed = []
    for c in hierarchies():
        p = _p(c, installation_parent(install_id))
        try:
            os.rmdir(p)
            removed.append(p)
        except OSError:
            pass
    return removed


def cpu_seconds(cgpath: str) -> float | None:
    """CPU time the sandbox's cgroup has used (cpuacct), None when it is gone. Read with os.open/
    os.read (no text wrapper: ~7 µs instead of ~15): the monitor reads it for every running sandbox
    every pass (bench/bench_idle.py)."""
    try:
        fd = os.open(_p("cpuacct", cgpath, "cpuacct.usage"), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return int(os.read(fd, 64)) / 1e9
    except ValueError:
        return None
    finally:
        os.close(fd)


def usage(cgpath: str) -> tuple[float, int, int] | None:
    """(CPU seconds used, memory bytes in use, host tasks) of a sandbox's cgroups; None when gone."""
    try:
        with open(_p("cpuacct", cgpath, "cpuacct.usage")) as f:
            cpu_ns = int(f.read())
        with open(_p("memory", cgpath, "memory.usage_in_bytes")) as f:
            mem = int(f.read())
        with open(_p("pids", cgpath, "pids.current")) as f:
            tasks = int(f.read())
    except (FileNotFoundError, ValueError):
        return None
    return cpu_ns / 1e9, mem, tasks

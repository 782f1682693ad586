"""Killing a command's whole process tree: its session, its process group and every descendant found
through /proc ppid links (a `setsid` child leaves the group but not the tree).

Called by `handlers_exec` on timeouts, on DELETE /processes/<pid> and when a caller goes away mid-exec.
"""

from __future__ import annotations

import os
import signal

from .common import read_small

# Set by the agent when commands run under atoll-init (see zygote): pids are then the child
# namespace's, so the init itself kills the tree. None in the init and when spawning directly.
remote = None


def _scan_stats(proc_root: str = "/proc") -> list[tuple[int, bytes, int, int, int]]:
    """(pid, state, ppid, pgrp, session) of every process visible in /proc; unreadable ones skipped."""
    out = []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            data = read_small(f"{proc_root}/{name}/stat", 4096)
            fields = data[data.rindex(b")") + 2 :].split()
            out.append((int(name), fields[0], int(fields[1]), int(fields[2]), int(fields[3])))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _tree_members(root: int, *, root_alive: bool) -> set[int]:
    """Live processes in root's session or process group, plus their descendants by ppid.

    Descendants of the root itself are followed only while it is alive (a dead root's pid could
    have been reused by an unrelated process).
    """
    stats = _scan_stats()
    children: dict[int, list[int]] = {}
    live = set()
    members = set()
    for pid, state, ppid, pgrp, sid in stats:
        if state in (b"Z", b"X"):
            continue
        live.add(pid)
        children.setdefault(ppid, []).append(pid)
        if pgrp == root or sid == root:
            members.add(pid)
    stack = list(members)
    if root_alive:
        stack.append(root)
    seen = set(stack)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    seen &= live
    seen.discard(os.getpid())
    seen.discard(1)
    return seen


def kill_tree(root: int, *, root_alive: bool = True) -> None:
    """SIGKILL a command's session/process group and every descendant (re-scanned a few times for forks)."""
    if remote is not None:
        return remote(root, root_alive=root_alive)
    for _ in range(3):
        victims = _tree_members(root, root_alive=root_alive)
        if root_alive:
            victims.add(root)
        try:
            os.killpg(root, signal.SIGKILL)
        except OSError:
            pass
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        root_alive = False  # it has been sent SIGKILL; later rounds only sweep up stragglers

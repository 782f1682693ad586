"""Find and remove the runtime objects of one installation that no live sandbox owns.

An installation's objects on the host, and how each names its sandbox:
  runsc processes (CLI, sentry, gofer) with `--root=<home>/runsc`  — the container id
      `atoll-<install id>-<id>-<generation>` or a path under `<home>/sandboxes/<sandbox id>/`
  runsc state entries `<home>/runsc/<cid>_sandbox:<cid>.{state,lock}` — the container id
  network namespaces `/run/netns/atoll-<install id>-<id>[-h]`
  cgroups `/sys/fs/cgroup/<hierarchy>/atoll-<install id>/<sandbox id>-<generation>`
  mounts below `<home>` and sandbox directories `<home>/sandboxes/<sandbox id>`.
`scan` finds them all in one pass (`HostObjects`, also what reconciliation compares the worker's
runtime records with); `remove` removes those whose sandbox is an orphan (and mounts and processes
that name no sandbox at all); `sweep` = both, for the sandboxes not in a live set, then the
installation's parent cgroups once empty; `remove_sandbox` removes one sandbox's (every
generation's), whatever `runsc delete` left. Everything removed is logged.

Called by worker.recovery (start-up and periodic reconciliation: the live set is the worker's
runtime records), worker.sandboxes (delete) and `purge_installation` (live set empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import time
import typing
from dataclasses import dataclass

from atoll.core import errors, ids
from atoll.worker.host import cgroups, netns, runsc, storage

log = logging.getLogger(__name__)

_RUNSC_DAEMONS = (b"runsc-sandbox", b"runsc-gofer")


@dataclass(frozen=True)
class Installation:
    home: str
    """The installation's ATOLL_HOME (a real path)."""
    install_id: str

    @property
    def runsc_root(self) -> str:
        return os.path.join(self.home, "runsc")

    @property
    def sandboxes(self) -> str:
        return os.path.join(self.home, "sandboxes")

    @property
    def stores(self) -> str:
        """Volumes and drives (worker.host.stores): their mounts belong to no sandbox and are
        never swept."""
        return os.path.join(self.home, "stores")

    @property
    def prefix(self) -> str:
        """Start of every host-wide runtime name (container ids, netns) of this installation."""
        return f"atoll-{self.install_id}-"

    def owner(self, name: str) -> str | None:
        """The sandbox id a runtime name, container id, cgroup leaf or path names (None if none)."""
        if name.startswith(self.prefix):
            m = re.match(r"([0-9a-z]{16})(?:-|$)", name[len(self.prefix) :])
            return "sb-" + m.group(1) if m else None
        m = re.match(r"(sb-[0-9a-z]{16})(?:-\d+)?$", name)
        if m and ids.is_sandbox_id(m.group(1)):
            return m.group(1)
        base = self.sandboxes + "/"
        if name.startswith(base):
            sid = name[len(base) :].split("/", 1)[0]
            return sid if ids.is_sandbox_id(sid) else None
        return None


@dataclass
class Process:
    pid: int
    argv: list[bytes]
    sandbox_id: str | None

    @property
    def daemon(self) -> bool:
        """A sentry or gofer (always some sandbox's), rather than a runsc command."""
        return self.argv[0] in _RUNSC_DAEMONS


def processes(inst: Installation) -> list[Process]:
    """runsc processes rooted in this installation's runsc root, with the sandbox each serves."""
    root_flag = f"--root={inst.runsc_root}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if root_flag not in argv or not os.path.basename(argv[0]).startswith(b"runsc"):
            continue
        sid = None
        for arg in argv[1:]:
            text = arg.decode(errors="replace").split("=", 1)[-1]
            sid = inst.owner(text)
            if sid:
                break
        out.append(Process(int(pid), argv, sid))
    return out


async def kill(procs: typing.Sequence[Process], timeout: float = 10) -> None:
    """SIGKILL `procs` (thawing their freezer cgroup first: a frozen process cannot die) and wait
    until they are gone."""
    for p in procs:
        with contextlib.suppress(OSError, ValueError, errors.AtollError):
            with open(f"/proc/{p.pid}/cgroup") as f:
                for line in f:
                    _, ctrl, path = line.rstrip("\n").split(":", 2)
                    if ctrl == "freezer" and cgroups.freezer_state(path) in ("FROZEN", "FREEZING"):
                        cgroups.thaw(path, timeout=2)
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(runsc.pid_alive(p.pid) for p in procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _state_entries(inst: Installation) -> dict[str, list[str]]:
    """runsc state entries by container id."""
    out: dict[str, list[str]] = {}
    try:
        names = os.listdir(inst.runsc_root)
    except FileNotFoundError:
        return out
    for n in names:
        cid = n.split("_sandbox:", 1)[0]
        if "_sandbox:" in n and cid.startswith(inst.prefix):
            out.setdefault(cid, []).append(os.path.join(inst.runsc_root, n))
    return out


async def remove_cgroup(cgpath: str, timeout: float = 5) -> bool:
    """Remove an orphan sandbox's cgroup in every hierarchy, killing what still runs in it (the
    ptrace platform's stub processes, a process that escaped the command-line match) and waiting
    for exiting tasks to leave it."""
    deadline = time.monotonic() + timeout
    while True:
        cgroups.remove(cgpath)
        pids = cgroups.tasks(cgpath)
        if not pids and not cgroups.exists(cgpath):
            return True
        if time.monotonic() > deadline:
            return False
        await kill([Process(pid, [b""], None) for pid in pids], timeout=1)
        await asyncio.sleep(0.02)


@dataclass
class HostObjects:
    """Everything of one installation found on the host in one scan (see the module docstring)."""

    processes: list[Process]
    states: dict[str, list[str]]  # container id -> runsc state files
    netns: list[str]
    mounts: list[str]  # deepest first
    cgroups: dict[str, list[str]]  # leaf -> hierarchies
    dirs: list[str]  # sandbox ids with a directory

    _index: dict[str, dict[str, list[str]]] | None = None

    def by_owner(self, inst: Installation) -> dict[str, dict[str, list[str]]]:
        """sandbox id -> kind -> what exists for it (sentry = its runsc sandbox daemon), built once
        (a reconciliation asks for every runtime; one pass over the objects, not one per runtime)."""
        if self._index is None:
            index: dict[str, dict[str, list[str]]] = {}

            def add(sid: str | None, kind: str, what: str) -> None:
                if sid:
                    index.setdefault(sid, {}).setdefault(kind, []).append(what)

            for p in self.processes:
                if p.argv[0] == b"runsc-sandbox":
                    add(p.sandbox_id, "sentry", str(p.pid))
                add(p.sandbox_id, "process", str(p.pid))
            for cid in self.states:
                add(inst.owner(cid), "state", cid)
            for n in self.netns:
                add(inst.owner(n), "netns", n)
            for m in self.mounts:
                add(inst.owner(m), "mounts", m)
            for leaf in self.cgroups:
                add(inst.owner(leaf), "cgroups", leaf)
            for d in self.dirs:
                add(d, "dir", d)
            self._index = index
        return self._index

    def owner_ids(self, inst: Installation) -> set[str]:
        """The sandbox ids anything found here belongs to."""
        return set(self.by_owner(inst))

    def of(self, inst: Installation, sid: str) -> dict[str, list[str]]:
        """What exists for sandbox `sid`, by kind."""
        return self.by_owner(inst).get(sid, {})


def scan(inst: Installation) -> HostObjects:
    """One pass over /proc, runsc's root, /run/netns, mountinfo, the cgroup hierarchies and the
    sandboxes directory: what of this installation exists on the host."""
    try:
        netns_names = sorted(n for n in os.listdir(netns.NETNS_DIR) if n.startswith(inst.prefix))
    except FileNotFoundError:
        netns_names = []
    try:
        dirs = sorted(d for d in os.listdir(inst.sandboxes) if ids.is_sandbox_id(d))
    except FileNotFoundError:
        dirs = []
    return HostObjects(
        processes=processes(inst),
        states=_state_entries(inst),
        netns=netns_names,
        mounts=[m for m in storage.mounts_under(inst.home) if not m.startswith(inst.stores + "/")],
        cgroups=cgroups.installation_leaves(inst.install_id),
        dirs=dirs,
    )


async def remove(
    inst: Installation,
    found: HostObjects,
    orphan: typing.Callable[[str | None], bool],
    *,
    parents: bool,
) -> list[str]:
    """Remove what of `found` belongs to orphans (`orphan(sandbox_id)`; None = names no sandbox)."""
    removed: list[str] = []

    def note(what: str, sid: str | None) -> None:
        removed.append(what)
        log.info("sweep removed %s", what, extra={"sandbox_id": sid})

    # 1. processes first: nothing else can be removed while a sentry or gofer holds it
    doomed = [p for p in found.processes if orphan(p.sandbox_id) and (p.sandbox_id or p.daemon)]
    await kill(doomed)
    for p in doomed:
        note(f"runsc process {p.pid} ({p.argv[0].decode(errors='replace')})", p.sandbox_id)
    # 2. runsc's state entries (their processes are gone, so `runsc delete` would add only time)
    for cid, paths in sorted(found.states.items()):
        if orphan(inst.owner(cid)):
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            note(f"runsc state of {cid}", inst.owner(cid))
    # 3. network namespaces (each sandbox has a pair: <name> and <name>-h)
    for name in found.netns:
        if not name.endswith("-h") and orphan(inst.owner(name)):
            await netns.delete(name)
            note(f"network namespace {name}", inst.owner(name))
    for name in found.netns:  # a host side whose sandbox side is gone
        if name.endswith("-h") and orphan(inst.owner(name)) and netns.exists(name):
            await netns.delete(name[:-2])
            note(f"network namespace {name}", inst.owner(name))
    # 4. mounts below the home that belong to no live sandbox
    for mp in found.mounts:
        sid = inst.owner(mp)
        if orphan(sid):
            await storage.unmount(mp)
            note(f"mount {mp}", sid)
    # 5. cgroups (the processes are gone, so they are empty), then empty parents
    for leaf, hierarchies in sorted(found.cgroups.items()):
        sid = inst.owner(leaf)
        if orphan(sid) and sid is not None:
            if await remove_cgroup(f"{cgroups.installation_parent(inst.install_id)}/{leaf}"):
                note(f"cgroup {leaf} ({', '.join(hierarchies)})", sid)
            else:
                log.warning("sweep: cgroup %s is still busy; kept", leaf, extra={"sandbox_id": sid})
    if parents:  # not beside running creates: runsc makes a new sandbox's parent and leaf in two steps
        for path in cgroups.remove_empty_parents(inst.install_id):
            note(f"empty cgroup {path}", None)
    # 6. sandbox directories
    for sid in found.dirs:
        if not orphan(sid):
            continue
        path = os.path.join(inst.sandboxes, sid)
        if storage.mounts_under(path) or storage.is_mounted(path):
            log.warning(
                "sweep: %s is still mounted; kept for the next sweep", path, extra={"sandbox_id": sid}
            )
            continue
        await asyncio.to_thread(shutil.rmtree, path, True)
        note(f"directory {path}", sid)
    return removed


async def sweep(inst: Installation, live: typing.Collection[str], *, parents: bool = True) -> list[str]:
    """Remove everything of the installation that no sandbox in `live` owns; return what went."""
    keep = set(live)
    return await remove(inst, scan(inst), lambda sid: sid not in keep, parents=parents)


async def remove_sandbox(inst: Installation, sid: str) -> list[str]:
    """Remove whatever of sandbox `sid` is still on the host (any generation): processes, runsc
    state, network namespaces, cgroups, mounts, its directory."""
    return await remove(inst, scan(inst), lambda owner: owner == sid, parents=False)

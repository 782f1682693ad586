"""The worker's record of each runtime it holds, persisted as `$ATOLL_HOME/sandboxes/<id>/runtime.json`.

A `Runtime` carries what the worker needs to run, pause, restore and find one sandbox on its host
(its spec, generation, phase, sentry pid). Its phase changes only through `RuntimeStore.advance`,
which walks the core phase table (core.lifecycle.PHASE_TRANSITIONS) and writes the file (fsync'd,
atomically) before the step is acknowledged, so a restarted worker reattaches from it. Freeze and
thaw are written without fsync: after a restart the freezer cgroup itself says which it is; for the
same reason a thaw is written ~50 ms later (`soon`), off the resume's path (the write cost ~0.8 ms
of a ~3 ms memory-tier resume).
Called by every worker module that changes a sandbox (sandboxes, tiers, recovery, node).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field

from atoll.core import errors, ids
from atoll.core.lifecycle import Phase, Step, advance
from atoll.worker.host import storage

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the worker knows about one sandbox on this host."""

    sandbox_id: str
    name: str
    template: str
    memory_mb: int
    cpus: float
    env: dict[str, str]
    disk_mb: int
    user: str | None = None
    generation: int = 0
    phase: Phase = Phase.CREATING
    failure: str | None = None
    sentry_pid: int | None = None
    temporary: bool = False
    """Made by the worker for itself (a template image's boot); never reported, deleted at start."""
    history: list[str] = field(default_factory=list)
    """The last few steps (for the log of a reattach that finds something unexpected)."""
    network: dict = field(default_factory=dict)
    """Its egress policy in wire form (core.netpolicy): the gateway is given it again on reattach."""
    trust_pem: str = ""
    """The installation's root CA, installed in its root file system (worker.trust)."""
    build_id: str = ""
    """The user template build it was made from ("" for a built-in template)."""
    lower: str = ""
    """The overlay lowerdir stack of its root file system (a fork's copies mount the same)."""
    workdir: str | None = None
    """The template's workdir: the default cwd of its commands."""
    runtime_key: str = ""
    """The runtime key (worker.host.snapshots.RuntimeKey) its memory was made under: this worker's
    at a cold boot, the template image's or the parent's at a restore or a fork; kept by its own
    checkpoints. "" for records of versions that did not say (unknown: treated as another key)."""
    agent_dir: str = ""
    """The host directory bind-mounted at /opt/atoll: the guest agent's files of the version its
    memory was made with (set at its start, a fork's is the parent's), so that its agent and
    atoll-init keep running those after the worker is upgraded. "" for records of versions that
    kept one directory for all (`$ATOLL_HOME/agent` itself, see `Sandboxes.agent_dir_of`)."""
    mounts: list[dict] = field(default_factory=list)
    """Volumes and drives bind-mounted into it (`{kind, name, path, read_only}`): every bundle
    written for it (boot, restore) has them, so each checkpoint restores with the same layout."""
    archive_key: str = ""
    """The object key of its archive (worker.runtimes.archiving) while it may have objects in the
    archive tier's store: set when an archive begins, cleared once they are removed."""
    archive_kept: bool = False
    """Its archive stays in the store although it runs again (a resume with `keep_archive`: the
    control plane may restore it from there on another worker if this one is lost); removed by its
    next archive's sweep or its delete, not by the garbage loop."""

    @property
    def cid(self) -> str:
        """runsc's container id of the current generation (ids are unique per host)."""
        return f"{self.name}-{self.generation}"

    def cgroup(self, install_id: str) -> str:
        return f"/atoll-{install_id}/{self.sandbox_id}-{self.generation}"


class RuntimeStore:
    """The runtimes of one installation: in memory, backed by one runtime.json per sandbox."""

    def __init__(self, home: str, install_id: str):
        self.root = os.path.join(home, "sandboxes")
        self.install_id = install_id
        self._cache: dict[str, Runtime] = {}
        self._pending: dict[str, asyncio.TimerHandle] = {}

    def dir(self, sid: str) -> str:
        return os.path.join(self.root, sid)

    def path(self, sid: str, *parts: str) -> str:
        return os.path.join(self.root, sid, *parts)

    def new(
        self,
        sid: str,
        *,
        template: str,
        memory_mb: int,
        cpus: float,
        env: dict[str, str],
        disk_mb: int,
        user: str | None = None,
        temporary: bool = False,
        network: dict | None = None,
        trust_pem: str = "",
        build_id: str = "",
        lower: str = "",
        workdir: str | None = None,
        runtime_key: str = "",
        agent_dir: str = "",
        mounts: list[dict] | None = None,
    ) -> Runtime:
        """Record a runtime about to be made (phase creating), before anything exists on the host:
        whatever a crash leaves is then owned by a record, and a reattach or sweep finds it."""
        rt = Runtime(
            sandbox_id=sid,
            name=ids.runtime_name(self.install_id, sid),
            template=template,
            memory_mb=memory_mb,
            cpus=cpus,
            env=env,
            disk_mb=disk_mb,
            user=user,
            temporary=temporary,
            network=dict(network or {}),
            trust_pem=trust_pem,
            build_id=build_id,
            lower=lower,
            workdir=workdir,
            runtime_key=runtime_key,
            agent_dir=agent_dir,
            mounts=list(mounts or []),
        )
        storage.private_dir(self.dir(sid))
        self._cache[sid] = rt
        self.save(rt)
        return rt

    def save(self, rt: Runtime, durable: bool = True) -> None:
        """Write runtime.json (0600: it holds the sandbox's env) atomically."""
        pending = self._pending.pop(rt.sandbox_id, None)
        if pending is not None:
            pending.cancel()
        path = self.path(rt.sandbox_id, "runtime.json")
        tmp = path + ".tmp"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(asdict(rt), f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def save_soon(self, rt: Runtime, delay: float = 0.05) -> None:
        """Write runtime.json (not fsync'd) `delay` seconds from now, unless a save() comes first;
        only for a phase a reattach reads from the host anyway (a thaw)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.save(rt, durable=False)
            return
        if rt.sandbox_id not in self._pending:
            self._pending[rt.sandbox_id] = loop.call_later(delay, self._save_pending, rt.sandbox_id)

    def _save_pending(self, sid: str) -> None:
        self._pending.pop(sid, None)
        rt = self._cache.get(sid)
        if rt is None or rt.phase == Phase.DELETING:
            return
        try:
            self.save(rt, durable=False)
        except FileNotFoundError:
            pass  # deleted meanwhile
        except OSError as e:
            log.warning("runtime.json of %s could not be written: %s", sid, e)

    def advance(
        self,
        rt: Runtime,
        step: Step,
        *,
        failure: str | None = None,
        durable: bool = True,
        soon: bool = False,
    ) -> None:
        """Move `rt` along the phase table and persist it (a failed runtime keeps its cause); with
        `soon`, a little later (save_soon)."""
        rt.phase = advance(rt.phase, step)
        if step == Step.FAIL:
            rt.failure = failure or rt.failure or "the sandbox's runtime failed"
        rt.history = [*rt.history[-7:], step.value]
        log.debug("runtime.%s", step.value, extra={"sandbox_id": rt.sandbox_id, "phase": rt.phase.value})
        if soon:
            self.save_soon(rt)
            return
        try:
            self.save(rt, durable=durable)
        except FileNotFoundError:
            if rt.phase != Phase.DELETING:  # a delete may already have removed the directory
                raise

    def fail(self, rt: Runtime, cause: str) -> None:
        """Mark `rt` failed with `cause` (no-op when it already failed or is being deleted)."""
        if rt.phase in (Phase.FAILED, Phase.DELETING):
            return
        with contextlib.suppress(OSError):
            self.advance(rt, Step.FAIL, failure=cause)

    def load(self, sid: str) -> Runtime | None:
        try:
            with open(self.path(sid, "runtime.json")) as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("runtime.json of %s is unreadable (%s); treated as missing", sid, e)
            return None
        data["phase"] = Phase(data.get("phase", "failed"))
        known = set(Runtime.__dataclass_fields__)
        return Runtime(**{k: v for k, v in data.items() if k in known})

    def get(self, sid: str) -> Runtime:
        rt = self._cache.get(sid)
        if rt is None:
            rt = self.load(sid)
            if rt is None:
                raise errors.SandboxNotFound(f"sandbox {sid} has no runtime on this worker")
            self._cache[sid] = rt
        return rt

    def find(self, sid: str) -> Runtime | None:
        try:
            return self.get(sid)
        except errors.SandboxNotFound:
            return None

    def forget(self, sid: str) -> None:
        self._cache.pop(sid, None)
        pending = self._pending.pop(sid, None)
        if pending is not None:
            pending.cancel()

    def all(self) -> list[Runtime]:
        """Every runtime recorded on disk (loaded once, then served from memory)."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        out = []
        for sid in names:
            if not ids.is_sandbox_id(sid):
                continue
            rt = self.find(sid)
            if rt is not None:
                out.append(rt)
        return out

    def cached(self) -> list[Runtime]:
        return list(self._cache.values())

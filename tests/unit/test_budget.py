"""worker.runtimes.budget.DiskBudget.enforce over real sandbox directories on disk (tmp_path), with
the runtime store, snapshots and archiver replaced by small stand-ins: which sandboxes a pass
archives, in what order, and that it ends under the budget when it can."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import types

from atoll.core.lifecycle import Phase
from atoll.worker.runtimes.budget import DiskBudget, sandbox_disk_bytes

MB = 2**20


@dataclasses.dataclass
class _Rt:
    sandbox_id: str
    phase: Phase
    temporary: bool = False


class _World:
    """Sandbox directories under `root`, each holding `image` (its checkpoint) of real bytes."""

    def __init__(self, root: str):
        self.root = root
        self.rts: list[_Rt] = []
        self.created: dict[str, float] = {}
        self.archived: list[str] = []
        self.on_archive: list = []  # callables run inside an archive (what lands meanwhile)
        self.store_failed = False

    def add(self, sid: str, phase: Phase, mb: int, at: float) -> None:
        os.makedirs(os.path.join(self.root, sid), exist_ok=True)
        with open(os.path.join(self.root, sid, "image"), "wb") as f:
            f.write(os.urandom(mb * MB))
        self.rts.append(_Rt(sid, phase))
        self.created[sid] = at

    # RuntimeStore
    def cached(self) -> list[_Rt]:
        return list(self.rts)

    def dir(self, sid: str) -> str:
        return os.path.join(self.root, sid)

    # SnapshotStore
    def committed(self, sid: str):
        if sid not in self.created:
            return None
        return types.SimpleNamespace(manifest=types.SimpleNamespace(created_at=self.created[sid]))

    # Archiver
    async def archive(self, rt: _Rt) -> str | None:
        os.unlink(os.path.join(self.root, rt.sandbox_id, "image"))
        rt.phase = Phase.ARCHIVED
        self.archived.append(rt.sandbox_id)
        if self.on_archive:
            self.on_archive.pop(0)()
        return None

    def used(self) -> int:
        return sum(sandbox_disk_bytes(self.dir(rt.sandbox_id)) for rt in self.rts)


def _budget(w: _World, mb: int) -> DiskBudget:
    locks: dict[str, asyncio.Lock] = {}
    return DiskBudget(
        mb * MB,
        w,
        w,
        w,
        lambda sid: locks.setdefault(sid, asyncio.Lock()),
        lambda ev: None,  # type: ignore[arg-type]
    )


async def test_a_pass_archives_the_longest_idle_first_and_never_a_running_one(tmp_path):
    w = _World(str(tmp_path))
    w.add("sb-running", Phase.RUNNING, 4, 0)
    w.add("sb-frozen", Phase.FROZEN, 4, 0)
    for i in range(6):
        w.add(f"sb-{i}", Phase.CHECKPOINTED, 2, 100 + i)
    # 8 + 12 MB used, budget 14 MB: the three longest idle go
    assert await _budget(w, 14).enforce() == ["sb-0", "sb-1", "sb-2"]
    assert w.used() <= 14 * MB
    phases = {rt.sandbox_id: rt.phase for rt in w.rts}
    assert phases["sb-running"] == Phase.RUNNING and phases["sb-frozen"] == Phase.FROZEN


async def test_a_pass_ends_under_the_budget_when_sandboxes_land_during_it(tmp_path):
    """Pauses to the disk tier go on while a pass archives (a burst of them): the pass counted what
    it freed from its first measure only, ended 'under' and left the worker over its budget until
    the next pass, 5 s later, and so on for as long as the burst lasted (bench_budget: 1.3-1.9x
    the budget throughout). It measures again and goes on while it can still archive."""
    w = _World(str(tmp_path))
    for i in range(6):
        w.add(f"sb-{i}", Phase.CHECKPOINTED, 2, 100 + i)
    # while the first two archives run, two more sandboxes land in the disk tier
    w.on_archive = [
        lambda: w.add("sb-late-a", Phase.CHECKPOINTED, 2, 200),
        lambda: w.add("sb-late-b", Phase.CHECKPOINTED, 2, 201),
    ]
    moved = await _budget(w, 6).enforce()
    assert w.used() <= 6 * MB, (moved, w.used() / MB)
    assert moved == ["sb-0", "sb-1", "sb-2", "sb-3", "sb-4"]  # the longest idle, in order


async def test_a_pass_that_can_archive_nothing_more_stops(tmp_path):
    w = _World(str(tmp_path))
    w.add("sb-running", Phase.RUNNING, 8, 0)
    w.add("sb-0", Phase.CHECKPOINTED, 2, 100)
    assert await _budget(w, 4).enforce() == ["sb-0"]  # still over (a running one): nothing more to do
    assert await _budget(w, 4).enforce() == []

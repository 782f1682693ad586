"""`Manager`: what the control plane's helpers with a manager of their own ask of `SandboxManager`
(controlplane.lifecycle), named once, so that none of them imports it — lifecycle makes and
starts them, and an import back would tie them all into one cycle.

Used (as a type) by controlplane.evacuation (a worker's drain), lost_workers (the sandboxes of a
worker gone for good), snapshots (named snapshots) and previews (preview URLs). Their per-sandbox
bookkeeping (lock, in-flight count, activity, persisting, steps) is the `ledger`'s; the verbs are
the manager's (`Steps`: create, delete, pause, resume) and, under a sandbox's lock the caller
already holds, the `*_locked` ones and `adopt_elsewhere`.
"""

from __future__ import annotations

import typing

from atoll.controlplane.ledger import Steps

if typing.TYPE_CHECKING:
    from atoll.controlplane import db as dbm
    from atoll.controlplane.leases import Leadership
    from atoll.controlplane.ledger import Ledger
    from atoll.controlplane.pools import Pools
    from atoll.controlplane.quotas import Quotas
    from atoll.controlplane.workers import WorkerRegistry
    from atoll.core import worker_api as api
    from atoll.core.lifecycle import Tier


class Manager(Steps, typing.Protocol):
    db: dbm.Database
    ledger: Ledger
    workers: WorkerRegistry
    quotas: Quotas
    leader: Leadership
    pools: Pools

    def get(self, sid: str) -> dbm.SandboxRecord: ...

    def worker(self, rec: dbm.SandboxRecord) -> api.WorkerAPI:
        """The worker that holds `rec` (its WorkerAPI)."""
        ...

    def busy(self, sid: str) -> bool:
        """Whether a call or a lifecycle step of the sandbox is under way."""
        ...

    async def pause_locked(
        self, rec: dbm.SandboxRecord, tier: Tier, only_if_idle: bool, end_streams: bool = False
    ) -> dbm.SandboxRecord: ...

    async def resume_locked(self, rec: dbm.SandboxRecord) -> dbm.SandboxRecord: ...

    async def move_archived_locked(
        self, rec: dbm.SandboxRecord, gone: str, avoid: str | None = None
    ) -> str | None: ...

    async def adopt_elsewhere(self, rec: dbm.SandboxRecord, gone: str, avoid: str | None) -> None: ...

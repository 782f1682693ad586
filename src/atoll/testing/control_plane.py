"""`FakeAtoll`: the real control plane in process (its FastAPI app, records, lifecycle and tier
policy) over `FakeWorker`s — an atoll without root or runsc, for tests of code that drives atoll.

    async with atoll.testing.FakeAtoll(tmp_path) as fake:
        client = atoll.AsyncClient(base_url="http://atoll", api_key=fake.api_key, transport=fake.transport)
        sandbox = await client.sandboxes.create()
        fake.worker.exec_handler = lambda spec: ExecResult(0, "hi\\n", "", 1, False)

`fake.http` is an httpx.AsyncClient on the API (the key already set); `fake.worker` the first fake
worker (`fake.workers` all of them); `fake.manager` the control plane's SandboxManager.
`authority` (controlplane.authority.Authority) is the installation's CA: its root goes in every
spec's `trust_pem` and to each worker at adoption, as in `atoll up`; without one, neither.
The records are SQLite in `directory` unless `database_url` names another database (a
`postgresql://…` one, e.g. from atoll.testing.postgres); two FakeAtolls given the same URL are two
control planes sharing their records, as two `atoll server` processes would (give them the same
`secrets_key`, the installation's: API keys, secrets and list cursors are keyed with it; default a
new one each). Of several, the one holding the `leader` lease (controlplane.leases; `lease_ttl_s`,
default ATOLL_LEASE_TTL_S or 15 s) runs the tier policy, the pools' keeper and the meter.
"""

from __future__ import annotations

import asyncio
import os
import typing

import httpx

from atoll.controlplane import app as app_mod
from atoll.controlplane import db, leases, lifecycle, metering, metrics, policy
from atoll.controlplane import secrets as secrets_mod
from atoll.controlplane.authority import Authority
from atoll.testing.fake_worker import FakeWorker


class FakeAtoll:
    def __init__(
        self,
        directory: str | os.PathLike,
        workers: typing.Sequence[FakeWorker] | None = None,
        *,
        api_key: str = "fake-key",
        max_file_bytes: int = 64 * 1024 * 1024,
        max_exec_output_bytes: int = app_mod.DEFAULT_MAX_EXEC_OUTPUT_BYTES,
        tier_policy: bool = True,
        reconcile_s: float = 30.0,
        default_pool: int = 0,
        authority: Authority | None = None,
        database_url: str | None = None,
        secrets_key: bytes | None = None,
        lease_ttl_s: float | None = None,
    ):
        self.dir = os.fspath(directory)
        os.makedirs(self.dir, exist_ok=True)
        self.workers = list(workers) if workers is not None else [FakeWorker()]
        self.api_key = api_key
        m = metrics.Metrics()
        database = db.open_database(database_url or f"sqlite:///{os.path.join(self.dir, 'atoll.db')}")
        self.manager = lifecycle.SandboxManager(
            database,
            m,
            secrets=secrets_mod.SecretStore(database, secrets_key) if secrets_key is not None else None,
            reconcile_s=reconcile_s,
            default_pool=default_pool,
            authority=authority,
            lease_ttl_s=lease_ttl_s or float(os.environ.get("ATOLL_LEASE_TTL_S") or leases.DEFAULT_TTL_S),
        )
        m.bind_state_counts(self.manager.counts)
        self.app = app_mod.create_app(
            self.manager,
            api_key=api_key,
            max_file_bytes=max_file_bytes,
            max_exec_output_bytes=max_exec_output_bytes,
        )
        self.meter = metering.Meter(self.manager, m)
        """Usage accrual (controlplane.metering); tests may set `meter.clock` before start."""
        self.app.state.meter = self.meter
        self.transport = httpx.ASGITransport(app=self.app)
        self.http = httpx.AsyncClient(
            transport=self.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {api_key}"}
        )
        self.policy = policy.TierPolicy(self.manager) if tier_policy else None
        self._policy_task: asyncio.Task | None = None

    @property
    def worker(self) -> FakeWorker:
        return self.workers[0]

    async def start(self) -> FakeAtoll:
        await self.manager.start()
        for w in self.workers:
            await self.manager.workers.attach_local(w)
        self.app.state.ctx.started = True
        if self.policy is not None:
            self._policy_task = asyncio.ensure_future(self.policy.run())
        self.meter.start()
        return self

    async def stop(self) -> None:
        if self._policy_task is not None:
            self._policy_task.cancel()
            await self.policy.aclose()  # type: ignore[union-attr]
        await self.meter.aclose()
        await self.http.aclose()
        await self.app.state.audit.aclose()
        await self.manager.stop()
        self.manager.db.engine.dispose()  # its pooled connections closed (a database can be dropped)

    async def __aenter__(self) -> FakeAtoll:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

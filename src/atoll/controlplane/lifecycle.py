"""Sandbox lifecycle: the core state machine walked against the workers, persisted first.

`SandboxManager` owns the records and, per sandbox, one lock for lifecycle steps (create, pause,
resume, delete: a delete during a pause waits for it, concurrent callers share one resume), the
count of calls in flight (a long-running command is activity) and the last activity time. It talks
to each sandbox's worker only through the seam (core.worker_api), which says what a step reached;
every record change goes through `check_transition` — steps, worker events and reconciliation
alike. Reconciliation (`worker_joined`, at each worker's adoption and periodically) makes the
records follow what the worker really holds: a record whose runtime vanished becomes failed, a
runtime no live record owns is deleted, an unacknowledged create is adopted or dropped.
Every step is logged as `sandbox.<verb>.started/complete/failed` with its duration.
Called by the API routers and controlplane.policy; it is the listener of controlplane.workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import typing

from atoll.controlplane import (
    auth,
    dbretry,
    evacuation,
    idempotency,
    leases,
    lifetime,
    lost_workers,
    metrics,
    schemas,
)
from atoll.controlplane import db as dbm
from atoll.controlplane import quotas as quotas_mod
from atoll.controlplane import snapshots as snapshots_mod
from atoll.controlplane.authority import Authority
from atoll.controlplane.ledger import Ledger
from atoll.controlplane.pools import Pools
from atoll.controlplane.secrets import SecretStore
from atoll.controlplane.stores import StoreService
from atoll.controlplane.templates import TemplateService
from atoll.controlplane.workers import WorkerHandle, WorkerRegistry
from atoll.core import errors, ids, mounts, netpolicy, placement, preview
from atoll.core import worker_api as api
from atoll.core.lifecycle import (
    FAILED,
    PAUSE_VERB,
    PUBLIC_STATUS,
    TIER_ORDER,
    Phase,
    State,
    Status,
    Tier,
    Verb,
    check_transition,
    path_to,
    status,
)

log = logging.getLogger(__name__)

SHARED_CREATE_GRACE_S = 15.0
"""On shared records, a `creating` record younger than this whose runtime a worker does not hold
is left alone by reconciliation: another server may be making it there (it holds the lock)."""
RESUME_STEP = {Tier.MEMORY: "resume_memory", Tier.DISK: "resume_disk", Tier.ARCHIVE: "resume_archive"}


WAKE_WAIT_S = 60.0
"""How long a sandbox found running when its move was cut short waits for its new worker to be
ready before it is resumed there (`_wake_moved`; after that its next call resumes it)."""


class SandboxManager:
    def __init__(
        self,
        database: dbm.Database,
        m: metrics.Metrics,
        *,
        lost_after_s: float = 15.0,
        gone_after_s: float = 0.0,
        reconcile_s: float = 30.0,
        default_network: dict | None = None,
        secrets: SecretStore | None = None,
        authority: Authority | None = None,
        default_pool: int = 0,
        lease_ttl_s: float = leases.DEFAULT_TTL_S,
    ):
        self.db = database
        self.leader = leases.Leadership(leases.Leases(database), lease_ttl_s)
        """This server's hold on the `leader` lease: the background loops (tier policy and
        lifetimes, pool keepers, lost workers, metering) run only while it is held
        (controlplane.leases); requests are served either way."""
        self.secrets = secrets
        self.keys: auth.Keys | None = None
        """Tenants and API keys (set by controlplane.app, which checks every request's key)."""
        """The secret store (None: this manager takes no secrets, as in some tests)."""
        self.authority = authority
        """The installation's CA (None: sandboxes get no CA and no HTTPS interception)."""
        self.m = m
        self.default_network = netpolicy.parse(default_network).to_wire()
        """The installation's egress policy for a sandbox created without one."""
        self.workers = WorkerRegistry(database, self, lost_after_s=lost_after_s, reconcile_s=reconcile_s)
        self.workers.token_key = secrets.key if secrets is not None else None
        self.ledger = Ledger(database, m, self.workers, secrets=secrets, default_network=self.default_network)
        self.quotas = self.ledger.quotas
        """Tenant quotas: admission of creates, claims, stores, pools and builds."""
        """Per-sandbox bookkeeping (locks, calls in flight, activity, records, persisting)."""
        self.usage = self.ledger.usage
        self.templates = TemplateService(self.ledger, self, schemas.DEFAULT_MEMORY_MB)
        """User templates and their builds."""
        self.pools = Pools(
            self.ledger, self, self.templates, schemas.DEFAULT_MEMORY_MB, default_pool, leader=self.leader
        )
        """Warm pools a create claims from (`default_pool`: the size of the built-in `base`'s)."""
        self.templates.pool_stop, self.templates.pool_resume = self.pools.stop, self.pools.resume
        self.stores = StoreService(database, self.ledger, self.quotas)
        self.snapshots = snapshots_mod.Snapshots(self)
        """Volumes and drives (controlplane.stores)."""
        self.templates.on_ready = self.pools.wake
        self.idempotency = idempotency.Keys(database)
        """Idempotency-Key of creates (controlplane.idempotency)."""
        self.evacuations = evacuation.Evacuator(self)
        """Drains that move every sandbox off a worker (controlplane.evacuation)."""
        self._elsewhere: dict[str, set[str]] = {}
        """Per worker, the runtimes its last reconciliation found whose record names another
        worker (shared records: deleted only when the next pass finds them so again, `_orphan`)."""
        self._diverged: dict[str, dict[str, Phase]] = {}
        """Per worker, the phases its last reconciliation found that their records do not say
        (shared records: followed only when the next pass finds them again, `worker_joined`)."""
        self.gone = lost_workers.GoneWorkers(self, gone_after_s)
        """What becomes of the sandboxes of a worker lost for ATOLL_WORKER_GONE_S."""
        self.leader.ticks.append(self.ledger.share_activity)  # every server: the holder reads it (refresh)
        self.leader.renewed.append(self.ledger.refresh)
        self.leader.listeners.append(self._leading)

    def _leading(self, held: bool) -> None:
        """The `leader` lease was taken (or lost): its loops act on every record, so read those
        other servers made or changed since, and let the pools' keeper look at once."""
        if held:
            self.ledger.refresh()
            self.pools.wake()

    def get(self, sid: str) -> dbm.SandboxRecord:
        return self.ledger.get(sid)

    def list(self, state: str | None, metadata: dict[str, str]) -> list[dbm.SandboxRecord]:
        if state is not None and state not in {s.value for s in State}:
            raise errors.InvalidRequest(
                f"unknown state filter {state!r}; use one of: {', '.join(s.value for s in State)}"
            )
        recs = self.db.list(tenant_id=auth.list_tenant(), state=state)
        return [r for r in recs if not r.pooled and all(r.metadata_.get(k) == v for k, v in metadata.items())]

    def live(self) -> list[dbm.SandboxRecord]:
        return self.ledger.live()

    def worker(self, rec: dbm.SandboxRecord) -> api.WorkerAPI:
        return self.ledger.worker(rec)

    async def move_archived_locked(
        self, rec: dbm.SandboxRecord, gone: str, avoid: str | None = None
    ) -> str | None:
        """A sandbox in the archive tier moves to another worker, which adopts it from the shared
        object store (its template layers follow); it resumes there on the next call. None when it
        moved, else why not (the record untouched). Under the sandbox's lock: controlplane.evacuation
        holds it across the archive, the move and the resume of a drain; `avoid`: the worker it
        moves off."""
        try:
            await self.adopt_elsewhere(rec, gone, avoid)
        except errors.AtollError as e:
            log.warning("sandbox.move.refused: %s", e.message, extra={"sandbox_id": rec.id, "from": gone})
            return e.message
        return None

    async def adopt_elsewhere(self, rec: dbm.SandboxRecord, gone: str, avoid: str | None) -> None:
        """Another worker adopts `rec`'s archive from the store and the record names it (the
        record's state is the caller's to set); raises what refused it, the record untouched."""
        handle = self.ledger.place(
            None,
            rec.memory_mb,
            cpus=rec.cpus,
            tenant=rec.tenant_id,
            avoid=avoid,
            what=f"move {rec.id} from {gone}",
        )
        filer_sizes = self.stores.sizes(
            [mounts.Mount(**m) for m in rec.mounts or () if m.get("kind") == "drive"], rec.tenant_id
        )
        worker = self.workers.api_for_worker(handle)
        # Once adopted, the archive is the new worker's (adoption.claim): a server stopped before
        # the record names it must not leave that copy to be deleted as unowned, with the archive.
        # The record says where it is going first; that worker's reconciliation finishes the move.
        adopted_before = rec.moving_to == handle.id  # by a move cut short before its record
        rec.moving_to = handle.id
        self.ledger.save(rec, ["moving_to"], durable=True)
        try:
            outcome = await worker.adopt(
                rec.id,
                tuple(
                    api.MountSpec(
                        m["kind"],
                        mounts.worker_name(rec.tenant_id, m["name"]),
                        m["path"],
                        bool(m.get("read_only")),
                        size_mb=filer_sizes.get(m["name"], 0),
                    )
                    for m in rec.mounts or ()
                ),
            )
        except errors.Unavailable as e:
            if e.retryable:  # not sent; else its outcome is unknown: a copy the worker made after
                self._moving_nowhere(rec)  # all is its reconciliation's to finish
            raise
        except errors.Conflict as e:
            if not (adopted_before and e.code == "invalid_state"):
                self._moving_nowhere(rec)
                raise
            # "already exists on this worker": its copy is that adoption's (which holds the archive)
            outcome = api.AdoptOutcome(layers_fetched=0, duration_ms=0.0)
        except errors.AtollError:
            self._moving_nowhere(rec)
            raise
        rec.worker_id, rec.moving_to = handle.id, None
        self.ledger.save(rec, ["worker_id", "moving_to"], durable=True)
        log.info(
            "sandbox.moved: archived on %s, adopted by %s (%d layer(s) fetched, %.0f ms)",
            gone,
            handle.name,
            outcome.layers_fetched,
            outcome.duration_ms,
            extra={"sandbox_id": rec.id},
        )
        try:
            if rec.network:
                await worker.set_network(rec.id, rec.network)
            if self.secrets is not None and rec.secrets:
                await worker.set_secrets(rec.id, self.secrets.bindings(rec.tenant_id, rec.secrets))
        except errors.AtollError as e:  # delivered again when the worker is adopted next
            log.warning("sandbox.moved: policy not delivered: %s", e.message, extra={"sandbox_id": rec.id})

    def _moving_nowhere(self, rec: dbm.SandboxRecord) -> None:
        """An adoption refused: the record goes nowhere after all (best effort: a `moving_to` left
        behind only names a worker that holds no copy)."""
        rec.moving_to = None
        try:
            self.ledger.save(rec, ["moving_to"])
        except errors.AtollError as e:
            log.warning("sandbox.move: moving_to stays: %s", e.message, extra={"sandbox_id": rec.id})

    def allocated(self, worker_id: str) -> dict[str, float]:
        return self.ledger.allocated(worker_id)

    # ---- start / stop --------------------------------------------------------------------------
    async def start(self) -> None:
        for rec in self.db.list(include_deleted=False):
            self.ledger.seen(rec)
        self.workers.load()
        await self.leader.start()
        self.pools.start()
        self.gone.start()

    async def stop(self) -> None:
        """Let go of the workers; sandboxes keep running. Deletions in flight get a few seconds
        (the worker, or the next reconciliation, finishes the rest)."""
        await self.evacuations.aclose()
        await self.gone.aclose()
        await self.pools.aclose()
        if self.ledger.reaps:
            await asyncio.wait(list(self.ledger.reaps), timeout=10)
        await self.leader.aclose()  # released: another server takes over at its next try
        await self.workers.aclose()

    # ---- create / delete -----------------------------------------------------------------------
    async def create(
        self,
        req: typing.Any,
        *,
        pooled: bool = False,
        on_placed: typing.Callable[[str], None] | None = None,
    ) -> dbm.SandboxRecord:
        """A new sandbox: from a warm pool when the template has one ready (claimed: the caller's
        settings applied after the restore), else restored from its template's snapshot on a
        worker placement picks. `pooled`: made for the pool (not listed until claimed). It belongs
        to the caller's tenant (an admin's: `tenant_id` in the body or query, else default).
        `on_placed(id)`: called once its worker is chosen, just before its record is written and
        the worker asked (the Idempotency-Key names it from then on: controlplane.idempotency)."""
        tenant = auth.acting_tenant(getattr(req, "tenant_id", None))
        if self.keys is not None and tenant != ids.DEFAULT_TENANT:
            self.keys.tenant(tenant)  # 404 tenant_not_found for an admin naming an unknown one
        if pooled:  # the pool's own: counted against a tenant when claimed
            return await self._create(req, pooled, tenant, None, on_placed)
        snap = None
        if getattr(req, "snapshot", None):
            snap = self.snapshots.resolve(req.snapshot, tenant)
            req = _from_snapshot(req, snap)
        with (
            self.snapshots.copying(snap) if snap is not None else contextlib.nullcontext(),
            self.quotas.admitting(tenant, req.memory_mb) as ticket,
        ):
            return await self._create(req, pooled, tenant, ticket, on_placed, snap)

    async def _create(
        self,
        req: typing.Any,
        pooled: bool,
        tenant: str,
        ticket: quotas_mod.Ticket | None,
        on_placed: typing.Callable[[str], None] | None = None,
        snap: dbm.SnapshotRecord | None = None,
    ) -> dbm.SandboxRecord:
        among: set[str] | None = None
        if snap is not None:  # its template's build is the snapshot's, whatever the template serves now
            among = self.snapshots.workers_for_create(snap)
            build = None
        else:
            build = self.templates.serving(req.template, tenant)
        want = mounts.parse(
            [m.model_dump() for m in req.volumes] if getattr(req, "volumes", None) else None,
            [m.model_dump() for m in req.drives] if getattr(req, "drives", None) else None,
        )
        if (
            not pooled and not want and snap is None
        ):  # a pool member cannot take a mount (runsc restores its layout)
            claimed = await self.pools.claim(req, build, tenant)
            if claimed is not None:
                return claimed
        network = (
            netpolicy.parse(req.network.model_dump()).to_wire() if req.network else dict(self.default_network)
        )
        requested = getattr(req, "secrets", None)
        if requested and self.secrets is None:
            raise errors.InvalidRequest("this server keeps no secrets; create the sandbox without `secrets`")
        bound = self.secrets.placeholders(tenant, requested, dict(req.env)) if self.secrets else {}
        sid = ids.new_sandbox_id()
        pin = await self.stores.attach(want, sid, tenant) if want else None
        try:  # until the record exists, a failure must not leave its volumes taken
            filer_sizes = self.stores.sizes([m for m in want if m.kind == "drive"], tenant) if want else {}
            handle = self.ledger.place(
                None if snap is not None else build.id if build is not None else req.template,
                req.memory_mb,
                snap.worker_id if snap is not None and among is None else pin,
                fetchable=self.templates.placeable(build) if build is not None else False,
                prefer=snap.worker_id if snap is not None else None,
                among=among,
                cpus=req.cpus,
                tenant=tenant,
                what=f"create {sid}",
            )
            assert handle.info is not None
            now = dbm.utcnow()
            rec = dbm.SandboxRecord(
                id=sid,
                tenant_id=tenant,
                worker_id=handle.id,
                state=State.CREATING.value,
                template=req.template,
                metadata_={**req.metadata, "atoll.snapshot": snap.id} if snap else dict(req.metadata),
                env=dict(req.env),
                user=req.user or ((build.info or {}).get("user") if build is not None else None),
                shell=getattr(req, "shell", None),
                network=network,
                secrets=bound or None,
                memory_mb=req.memory_mb,
                cpus=req.cpus,
                disk_mb=req.disk_mb or handle.info.default_disk_mb,
                idle_timeout_s=req.idle_timeout_s,
                disk_after_s=req.disk_after_s,
                archive_after_s=getattr(req, "archive_after_s", 0.0),
                created_at=now,
                updated_at=now,
                last_activity_at=now,
                build_id=snap.build_id if snap else build.id if build is not None else None,
                workdir=snap.source.get("workdir")
                if snap
                else (build.info or {}).get("workdir")
                if build is not None
                else None,
                pooled=pooled,
                expires_at=None if pooled else lifetime.deadline(getattr(req, "timeout_s", None), now),
                on_timeout=getattr(req, "on_timeout", "pause"),
                on_worker_lost=getattr(req, "on_worker_lost", "fail"),
                mounts=_mount_dicts(want) or None,
                compat=req.compat() if hasattr(req, "compat") else None,
            )
            spec = api.SandboxSpec(
                sandbox_id=sid,
                template=req.template,
                memory_mb=req.memory_mb,
                cpus=req.cpus,
                disk_mb=rec.disk_mb,
                env={**req.env, **{var: b["placeholder"] for var, b in bound.items()}},
                user=req.user,
                network=network,
                secrets=self.secrets.bindings(tenant, bound) if self.secrets and bound else (),
                trust_pem=self.authority.root_pem.decode() if self.authority else "",
                build_id=(snap.build_id or "") if snap else build.id if build is not None else "",
                snapshot_id=snap.id if snap else "",
                mounts=tuple(
                    api.MountSpec(
                        m.kind,
                        mounts.worker_name(tenant, m.name),
                        m.path,
                        m.read_only,
                        size_mb=filer_sizes.get(m.name, 0),
                    )
                    for m in want
                ),
            )
        except BaseException:
            self.stores.release_all(sid, _mount_dicts(want), tenant)
            raise
        async with self.ledger.lock(sid), self.ledger.step("create", sid):
            if on_placed is not None:
                on_placed(sid)  # the key names it before its record exists, never after
            try:  # the record exists before the runtime does (placement is recorded)
                self.quotas.insert(rec, ticket)
            except BaseException:
                self.stores.release_all(sid, _mount_dicts(want), tenant)
                raise
            self.ledger.cache[sid] = rec
            try:
                await self.workers.api_for(handle.id).create(spec)
            except errors.Unavailable as e:
                self.ledger.fail(rec, f"its worker {handle.name!r} became unreachable during the create")
                raise errors.Unavailable(f"sandbox {sid} could not be created: {e.message}") from None
            except errors.AtollError as e:
                self.ledger.fail(rec, e.message, e.detail)
                self.stores.release_all(sid, rec.mounts, rec.tenant_id)  # its runtime is stopped
                if isinstance(e, errors.NotFound | errors.InvalidRequest) or e.code == "snapshot_unavailable":
                    raise  # the snapshot cannot be restored there (damaged, another runsc): 409, said why
                raise errors.RuntimeFailure(f"sandbox {sid} could not be started: {e.message}") from None
            try:
                self.ledger.persist(rec, Verb.START)
            except dbretry.UNAVAILABLE as e:
                # it runs on its worker; its record says `creating` until the database is back
                fields = ["state", "standby_tier", "standby_reason", "standby_since"]
                dbretry.later(f"record the start of {sid}", lambda: self.ledger.save(rec, fields))
                self.ledger.activity[sid] = time.monotonic()
                raise errors.DatabaseUnavailable(
                    f"sandbox {sid} was started but the records database could not take it "
                    f"({dbm.cause(e)}); it is recorded once the database is back — retry with the "
                    "same Idempotency-Key to get it (without one, list the sandboxes)",
                    made=sid,
                ) from None
            self.ledger.activity[sid] = time.monotonic()
        return rec

    async def set_network(self, sid: str, body: object) -> dict:
        """Replace a sandbox's egress policy, live (its worker's gateway applies it to new
        connections and DNS questions at once; no resume needed)."""
        network = netpolicy.parse(body).to_wire()
        async with self.ledger.lock(sid):
            rec = self.get(sid)
            if rec.state in (State.FAILED, State.DELETED, State.CREATING):
                raise errors.Conflict(
                    f"sandbox {sid} is {rec.state}; its network can change while it runs or is in standby",
                    code="invalid_state",
                )
            stored = await self.worker(rec).set_network(sid, network)
            rec.network = stored
            self.ledger.save(rec, ["network"])
        log.info("sandbox.network.updated", extra={"sandbox_id": sid, **stored})
        return stored

    async def secret_changed(self, name: str, tenant: str | None = None) -> None:
        """A secret was replaced or deleted: every live sandbox bound to it gets its bindings
        again (a worker that cannot be reached now gets them when it is adopted again)."""
        if self.secrets is None:
            return
        for rec in self.live():
            if rec.tenant_id != (tenant or auth.acting_tenant()):
                continue
            if not rec.secrets or not any(b.get("secret") == name for b in rec.secrets.values()):
                continue
            try:
                await self.worker(rec).set_secrets(rec.id, self.secrets.bindings(rec.tenant_id, rec.secrets))
            except errors.AtollError as e:
                log.warning(
                    "secret change not delivered to its sandbox (it is delivered when its worker is adopted again): %s",
                    e.message,
                    extra={"sandbox_id": rec.id, "secret": name},
                )

    async def authorize_worker(self, handle: WorkerHandle, worker: api.WorkerAPI) -> None:
        """First at adoption, before the worker's inventory is read: its CA (an intermediate of
        the installation's, with the root every spec's `trust_pem` carries). The inventory marks
        `stale_runtime` the pooled sandboxes made trusting another root (the CA was made again)."""
        if self.authority is not None:
            await worker.set_authority(self.authority.for_worker(handle.name))

    def worker_ready(self, handle: WorkerHandle) -> None:
        """A worker was adopted (ready, or draining): a drain's evacuation that a server restart or
        its loss cut short goes on (controlplane.evacuation `resume`)."""
        if handle.state == "draining":
            self.evacuations.resume(handle)

    def worker_cordoned(self, handle: WorkerHandle, draining: bool) -> None:
        """Another server drained or undrained a worker this server holds (through its row): the
        evacuation it asked for runs here, or the one under way stops."""
        if draining:
            done = self.evacuations.runs.get(handle.id)
            if done is not None and not done.active:  # an earlier drain's: the record's is newer
                del self.evacuations.runs[handle.id]
            self.evacuations.resume(handle)
        else:
            self.evacuations.stop(handle.id)

    def refresh_records(self) -> None:
        """On shared records, every OTHERS_EVERY_S (controlplane.workers): read what other servers
        made or changed, so placement and the workers' views count it."""
        if self.ledger.shared:
            self.ledger.refresh()

    async def configure_worker(self, handle: WorkerHandle, worker: api.WorkerAPI) -> None:
        """At adoption, once the records follow the worker's inventory: the secret bindings of its
        live sandboxes (a worker keeps them in memory only)."""
        if self.secrets is None:
            return
        for rec in self.live():
            if rec.worker_id == handle.id and rec.secrets and rec.state != State.CREATING:
                try:
                    await worker.set_secrets(rec.id, self.secrets.bindings(rec.tenant_id, rec.secrets))
                except errors.AtollError as e:
                    log.warning("secret bindings not delivered: %s", e.message, extra={"sandbox_id": rec.id})

    def set_preview(self, sid: str, port: int, public: bool) -> dbm.SandboxRecord:
        try:
            preview.check_port(port)
        except preview.BadTarget as e:
            raise errors.InvalidRequest(str(e)) from None
        rec = self.get(sid)
        if rec.state in (State.DELETED,):
            raise errors.SandboxNotFound(f"sandbox {sid} was deleted")
        ports = set((rec.previews or {}).get("public", []))
        (ports.add if public else ports.discard)(port)
        rec.previews = {"public": sorted(ports)}
        self.ledger.save(rec, ["previews"])
        log.info("sandbox.preview.updated", extra={"sandbox_id": sid, "port": port, "public": public})
        return rec

    async def delete(self, sid: str) -> None:
        rec = self.get(sid)
        async with self.ledger.lock(sid), self.ledger.step("delete", sid):
            rec = self.get(sid)
            worker_id = rec.worker_id
            self.ledger.persist(rec, Verb.DELETE, deleted_at=dbm.utcnow())
            self.stores.detaching(sid, rec.mounts, rec.tenant_id)
        # runsc delete takes 1.5–2 s; the record is already gone for the caller.
        self.ledger.track(asyncio.ensure_future(self._reap(sid, worker_id, rec.mounts, rec.tenant_id)))

    async def _reap(self, sid: str, worker_id: str, rec_mounts: list | None = None, tenant: str = "") -> None:
        try:
            await self.workers.api_for(worker_id).delete(sid)
        except errors.Unavailable as e:
            log.info("sandbox.reap.deferred: %s", e.message, extra={"sandbox_id": sid})
        except Exception:
            log.exception("sandbox.reap.failed", extra={"sandbox_id": sid})
        # Its volumes are free: it is gone from its worker, or that worker cannot be reached now
        # (a worker is adopted again only after its orphan runtimes are deleted).
        self.stores.release_all(sid, rec_mounts, tenant)
        if not self.ledger.lock(sid).locked():
            self.ledger.locks.pop(sid, None)
        self.ledger.inflight.pop(sid, None)

    # ---- standby -------------------------------------------------------------------------------
    async def pause(
        self, sid: str, tier: Tier, *, only_if_idle: bool = False, end_streams: bool = False
    ) -> dbm.SandboxRecord:
        """`end_streams`: the worker ends the sandbox's output follows and watches rather than
        being busy with them (E2B's pause); the calls this server holds still make it busy."""
        self.get(sid)
        async with self.ledger.lock(sid):
            return await self.pause_locked(self.get(sid), tier, only_if_idle, end_streams)

    async def pause_locked(
        self, rec: dbm.SandboxRecord, tier: Tier, only_if_idle: bool, end_streams: bool = False
    ) -> dbm.SandboxRecord:
        sid = rec.id
        cur = status(rec.state, rec.standby_tier)
        if cur.state == State.STANDBY:
            assert cur.tier is not None
            if cur.tier == tier:
                return rec
            if TIER_ORDER[tier] < TIER_ORDER[cur.tier]:
                raise errors.Conflict(
                    f"sandbox {sid} is in the {cur.tier.value} tier; pausing to {tier.value} would need a "
                    f"resume first — call POST /v1/sandboxes/{sid}/resume, then pause",
                    code="invalid_state",
                )
        else:
            check_transition(cur, PAUSE_VERB[tier])
            if self.ledger.inflight.get(sid):
                raise errors.SandboxBusy(
                    f"sandbox {sid} has {self.ledger.inflight[sid]} exec/file call(s) in progress; "
                    "wait for them to finish (or kill the process) and retry the pause"
                )
        async with self.ledger.step(f"pause_{tier.value}", sid):
            outcome = await self.ledger.guard(
                rec, self.worker(rec).pause(sid, tier, only_if_idle=only_if_idle, end_streams=end_streams)
            )
            self._apply_pause(rec, cur, outcome)
        if outcome.busy:
            raise errors.SandboxBusy(outcome.reason or f"sandbox {sid} could not be paused now; retry")
        return rec

    def _apply_pause(self, rec: dbm.SandboxRecord, before: Status, outcome: api.PauseOutcome) -> None:
        now = dbm.utcnow()
        if outcome.tier is None:
            if before.state == State.STANDBY:  # thawed for the gate and not frozen again: it runs
                self.ledger.persist(rec, Verb.RESUME)
            if not outcome.busy:  # declined: it is active (open connections)
                self.ledger.activity[rec.id] = time.monotonic()
            return
        since = rec.standby_since if before.state == State.STANDBY else now
        if before == status(State.STANDBY, outcome.tier):  # stayed (a gated disk pause from memory)
            rec.standby_reason = outcome.reason
            self.ledger.save(rec, ["standby_reason"])
            return
        self.ledger.persist(
            rec,
            PAUSE_VERB[outcome.tier],
            standby_reason=outcome.reason,
            standby_since=since,
        )

    async def resume(self, sid: str) -> dbm.SandboxRecord:
        rec = self.get(sid)
        if rec.state == State.RUNNING and not self.ledger.lock(sid).locked():
            self.ledger.activity[sid] = time.monotonic()
            return rec
        async with self.ledger.lock(sid):
            return await self.resume_locked(self.get(sid))

    async def resume_locked(self, rec: dbm.SandboxRecord) -> dbm.SandboxRecord:
        """`resume` under the sandbox's lock (also controlplane.evacuation's, after a move)."""
        sid = rec.id
        if rec.state == State.RUNNING:  # someone else resumed it while we waited: share it
            return rec
        cur = status(rec.state, rec.standby_tier)
        check_transition(cur, Verb.RESUME)
        assert cur.tier is not None
        if cur.tier != Tier.MEMORY:  # a memory-tier sandbox holds its slot already
            await self._take_slot(rec, cur.tier)
        try:
            return await self._resume_on_worker(rec, cur)
        except errors.Unavailable as e:
            if e.retryable:
                raise
            # The worker stopped answering mid-restore (it died, or its link did). A resume is
            # safe to repeat: the record stays in standby, the worker finishes or undoes the
            # restore when it is back (worker.runtimes.recovery) and the record follows it; the
            # call that wanted the sandbox never reached it.
            raise errors.Unavailable(
                f"sandbox {sid} was being resumed from the {cur.tier} tier when its worker stopped "
                f"answering ({e.message}); it stays in standby and nothing was run in it — retry "
                "once the worker is back (GET /v1/workers)",
                detail=e.detail,
                retryable=True,
            ) from None
        finally:
            self.ledger.resuming.pop(sid, None)

    async def _take_slot(self, rec: dbm.SandboxRecord, tier: Tier) -> None:
        """A slot for `rec`'s resume from the disk or archive tier on its worker; when that worker's
        slots are all taken, an archived sandbox moves to a worker with room first (through the
        object store, as a drain moves it), a disk-tier one is refused (503 no_worker): its state
        is on that worker's disk."""
        short = self.ledger.slot_shortage(rec.worker_id)
        if short is not None:
            h = self.workers.handles.get(rec.worker_id)
            if tier != Tier.ARCHIVE or h is None:
                raise errors.Unavailable(
                    f"sandbox {rec.id} is in the {tier} tier, which only its worker can resume, and "
                    f"{short}; {placement.SLOTS_FIX}; or archive it (POST /v1/sandboxes/{rec.id}/pause "
                    '{"tier": "archive"}): an archived sandbox resumes on any worker with a free slot',
                    code="no_worker",
                )
            if any(m.get("kind") == "volume" for m in rec.mounts or ()):
                raise errors.Unavailable(
                    f"sandbox {rec.id} mounts a volume, which keeps it on its worker, and {short}; "
                    f"{placement.SLOTS_FIX}",
                    code="no_worker",
                )
            try:
                await self.adopt_elsewhere(rec, h.name, avoid=h.id)
            except errors.Unavailable as e:
                raise errors.Unavailable(
                    f"sandbox {rec.id} is archived on a full worker ({short}) and no other worker can "
                    f"adopt it: {e.message}",
                    code=e.code,
                ) from None
            if h.worker is not None:  # the new holder owns the archive: the full one drops its copy
                try:
                    await h.worker.delete(rec.id)
                except errors.AtollError as e:
                    log.warning(
                        "sandbox.resume: the old copy stays on %s until its reconciliation: %s",
                        h.name,
                        e.message,
                        extra={"sandbox_id": rec.id},
                    )
        self.ledger.resuming[rec.id] = rec.worker_id

    async def _resume_on_worker(self, rec: dbm.SandboxRecord, cur: Status) -> dbm.SandboxRecord:
        sid = rec.id
        assert cur.tier is not None
        async with self.ledger.step(RESUME_STEP[cur.tier], sid) as fields:
            # `on_worker_lost: "restore"`: its archive stays in the store to come back from
            keep = rec.on_worker_lost == "restore"
            call = asyncio.ensure_future(self.worker(rec).resume(sid, keep_archive=keep))
            if cur.tier == Tier.MEMORY:
                # the record is written while the thawed sandbox wakes and answers: a runtime
                # failure then marks it failed from running; any other error puts it back.
                # Two turns of the loop let the call get that far first: an in-process worker
                # sends its health ping (one turn) and thaws (the next), a remote one's request
                # is on the wire. Writing before the thaw instead cost ~1 ms per resume.
                for _ in range(2):
                    await asyncio.sleep(0)
                since, reason = rec.standby_since, rec.standby_reason
                self.ledger.persist(rec, Verb.RESUME)
                try:
                    outcome = await self.ledger.guard(rec, call)
                except errors.AtollError as e:
                    if rec.state == State.RUNNING and not isinstance(
                        e, errors.RuntimeFailure | errors.SandboxDied
                    ):
                        self.ledger.persist(rec, Verb.FREEZE, standby_since=since, standby_reason=reason)
                    raise
            else:
                try:
                    outcome = await self.ledger.guard(rec, call)
                except errors.ResumeFailed as e:
                    raise self.ledger.resume_failed(rec, e.message, e.detail) from None
                self.ledger.persist(rec, Verb.RESUME, resume_error=None, resume_failures=0)
            fields["worker_ms"] = outcome.duration_ms  # the worker's own part of the resume
        self.ledger.activity[sid] = time.monotonic()
        return rec

    @contextlib.asynccontextmanager
    async def activity(self, sid: str, resume: bool = True):
        """Wrap an exec/file call: resume if in standby, count it as activity while it runs.
        `resume=False` (the E2B port's grants for sandboxes without auto-resume): a sandbox in
        standby, or paused by a step in progress, is 409 invalid_state instead."""
        rec = self.get(sid)
        self.ledger.refuse_if_failed(rec)
        self.ledger.inflight[sid] = self.ledger.inflight.get(sid, 0) + 1
        try:
            # A pause (or another step) in flight holds the lock: wait for it, then resume if needed,
            # so a call never reaches a sandbox that is being checkpointed under it.
            if rec.state != State.RUNNING or self.ledger.lock(sid).locked():
                if not resume:
                    async with self.ledger.lock(sid):  # the step in progress ends first
                        rec = self.get(sid)
                    if rec.state == State.STANDBY:
                        raise errors.Conflict(
                            f"sandbox {sid} is in standby and this call was asked not to resume it "
                            "(resume: false); resume it first (POST /v1/sandboxes/{id}/resume)",
                            code="invalid_state",
                        )
                rec = await self.resume(sid)
            self.ledger.activity[sid] = time.monotonic()
            yield self.worker(rec)
        except errors.SandboxDied as e:
            self.ledger.fail(rec, e.message)
            raise
        finally:
            self.ledger.inflight[sid] = self.ledger.inflight.get(sid, 1) - 1
            self.ledger.activity[sid] = time.monotonic()

    def idle_for(self, sid: str, now: float) -> float:
        return now - self.ledger.activity.get(sid, now)

    def busy(self, sid: str) -> bool:
        return bool(self.ledger.inflight.get(sid)) or self.ledger.lock(sid).locked()

    # ---- reconciliation and worker events ------------------------------------------------------
    async def worker_joined(self, handle: WorkerHandle, inventory: api.Inventory, started: float) -> None:
        """Make the records of `handle`'s sandboxes follow its inventory (taken at `started`, a
        UTC timestamp): records changed since are left for the next pass."""
        for b in list(handle.builds.values()):  # builds that moved while nobody listened
            self.templates.on_build(handle.id, b)
        if self.ledger.shared:  # other servers may have failed, moved or made its sandboxes since
            self.ledger.refresh()
        held = {r.sandbox_id: r for r in inventory.runtimes}
        self.pools.outdated(r.sandbox_id for r in inventory.runtimes if r.stale_runtime)
        stale: list[api.RuntimeReport] = []
        # On shared records another server may call this worker too (it borrows it): a step of
        # its own is done on the worker before it writes the record (the move of a sandbox here
        # too). A periodic pass acts on such a difference only when the previous pass found it
        # too (not at adoption: a worker taken over again drops at once the copies that moved off
        # it while it was gone, before it serves; nothing moves onto a worker not yet adopted).
        periodic = self.ledger.shared and handle.state in ("ready", "draining")
        last_phases = self._diverged.get(handle.id, {}) if periodic else {}
        phases: dict[str, Phase] = {}
        for rec in [r for r in self.ledger.cache.values() if r.worker_id == handle.id]:
            report = held.pop(rec.id, None)
            if self.ledger.lock(rec.id).locked() or _changed_since(rec, started):
                continue
            if report is None:
                self._vanished(rec, handle)
            elif lost_workers.failed_as_gone(rec):
                # failed while this worker was gone: the copy it kept never runs again
                if not report.busy and report.phase != Phase.FAILED:
                    stale.append(report)
            elif not report.busy:
                if periodic and PUBLIC_STATUS[report.phase] != status(rec.state, rec.standby_tier):
                    phases[rec.id] = report.phase
                    if last_phases.get(rec.id) != report.phase:
                        continue  # found again by the next pass if nobody records it meanwhile
                self._follow(rec, report, handle)
        if periodic:
            self._diverged[handle.id] = phases
        last = self._elsewhere.get(handle.id, set()) if periodic else None
        seen: set[str] = set()
        unowned = [
            r for r in held.values() if not r.busy and self._orphan(r.sandbox_id, handle.id, last, seen)
        ]
        if periodic:
            self._elsewhere[handle.id] = seen
        arrived = [r for r in unowned if self._adopted_here(r, handle)]
        orphans = stale + [r for r in unowned if r not in arrived]
        for r in arrived:
            await self._finish_move(self.ledger.cache[r.sandbox_id], handle)
        for r in orphans:
            log.info(
                "reconcile: deleting a runtime no live record owns",
                extra={"sandbox_id": r.sandbox_id, "worker": handle.name, "phase": r.phase.value},
            )
        await self.snapshots.reconcile(handle, inventory)
        if orphans and handle.worker is not None:
            worker = handle.worker
            results = await asyncio.gather(
                *(worker.delete(r.sandbox_id) for r in orphans), return_exceptions=True
            )
            for r, res in zip(orphans, results, strict=True):
                if isinstance(res, BaseException):
                    log.warning("reconcile: deleting %s failed: %r", r.sandbox_id, res)

    def _orphan(
        self, sid: str, worker_id: str, last: set[str] | None = None, seen: set[str] | None = None
    ) -> bool:
        """No live record owns this runtime on `worker_id`: none at all, or the sandbox moved to
        another worker (a drain or a removal: the copy left behind is dropped; its archive in the
        store names the new holder, so the old worker's delete leaves it alone). On shared records
        (`last`: what the previous pass found so) another server may be moving it *here* (the
        worker's `adopt` first, then the record): a runtime whose record names another worker is
        an orphan only when the previous pass found it so too; `seen` collects them."""
        if self.ledger.lock(sid).locked():
            return False
        if sid in self.ledger.cache:
            if self.ledger.cache[sid].worker_id == worker_id:
                return False
            if last is None:
                return True
            if seen is not None:
                seen.add(sid)
            return sid in last
        rec = self.db.get(sid)
        return rec is None or rec.state == State.DELETED

    def _adopted_here(self, report: api.RuntimeReport, handle: WorkerHandle) -> bool:
        """An unowned copy on `handle` that is a move through the object store cut short between
        the adoption and the record (`adopt_elsewhere`: `moving_to` names the worker before its
        `adopt`, `worker_id` once adopted; a server stopped in between) — a drain's, a lost worker's
        sandbox settled elsewhere (archive tier, or `on_worker_lost: "restore"`), a resume off a
        full worker: archived here, its live record moving here. This worker holds the archive now
        (adoption.claim): deleting the copy would remove the objects the record still points at,
        so the move is finished instead. A stale copy (the sandbox moved off this worker earlier)
        is not: its record is moving nowhere, or elsewhere."""
        rec = self.ledger.cache.get(report.sandbox_id)
        if rec is None or rec.worker_id == handle.id or report.phase != Phase.ARCHIVED:
            return False
        return rec.moving_to == handle.id and rec.state in (State.RUNNING, State.STANDBY)

    async def _finish_move(self, rec: dbm.SandboxRecord, handle: WorkerHandle) -> None:
        """Record `rec` on `handle`, which adopted it (`_adopted_here`); the evacuation resumed on
        its old worker then counts it moved (and wakes it if it was running), and the old
        worker's copy is dropped by its reconciliation (its archive removal leaves the objects:
        their manifest names this worker; it is asked at once when this server holds it). A
        sandbox restored from its last archive (a lost worker's `on_worker_lost: "restore"`) is
        recorded in the archive tier, as controlplane.lost_workers does, and one that was running
        is resumed here. A record another server wrote meanwhile is left as is (and the copy too):
        the next pass looks again."""
        gone = rec.worker_id
        old = self.workers.handles.get(gone)
        restored = (rec.state, rec.standby_tier) != (State.STANDBY, Tier.ARCHIVE)
        was_running = rec.state == State.RUNNING
        rec.worker_id, rec.moving_to = handle.id, None
        try:
            self.ledger.save(rec, ["worker_id", "moving_to"], durable=True)
        except errors.AtollError as e:
            rec.worker_id, rec.moving_to = gone, handle.id
            log.warning(
                "reconcile: finishing a cut-short move failed: %s", e.message, extra={"sandbox_id": rec.id}
            )
            return
        log.info(
            "sandbox.moved: adopted by %s before the server recorded it; its record names it now",
            handle.name,
            extra={"sandbox_id": rec.id, "from": gone, "worker": handle.name},
        )
        if restored:
            self.ledger.persist(
                rec,
                Verb.ARCHIVE,
                standby_since=dbm.utcnow(),
                standby_reason=lost_workers.restored_reason(
                    f"its worker {old.name if old else gone!r} was lost"
                ),
            )
            if was_running:
                self.ledger.track(asyncio.ensure_future(self._wake_moved(rec.id, handle)))
        if rec.network and handle.worker is not None:
            try:
                await handle.worker.set_network(rec.id, rec.network)
            except errors.AtollError as e:  # delivered again when the worker is adopted next
                log.warning(
                    "sandbox.moved: policy not delivered: %s", e.message, extra={"sandbox_id": rec.id}
                )
        if old is not None and old.worker is not None:  # else its reconciliation drops it
            try:
                await old.worker.delete(rec.id)
            except errors.AtollError as e:
                log.warning(
                    "sandbox.moved: the old copy stays on %s until its reconciliation: %s",
                    old.name,
                    e.message,
                    extra={"sandbox_id": rec.id},
                )

    async def _wake_moved(self, sid: str, handle: WorkerHandle) -> None:
        """Resume a sandbox that was running when its move was cut short (as the move would have),
        once `handle` (whose reconciliation found it) is ready: up to WAKE_WAIT_S, else it resumes
        on its next call."""
        deadline = time.monotonic() + WAKE_WAIT_S
        while handle.state == "joining" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            async with self.ledger.lock(sid):
                rec = self.get(sid)
                if rec.state == State.STANDBY:
                    await self.resume_locked(rec)
        except errors.AtollError as e:  # it resumes on its next call, or says why not
            log.warning("sandbox.moved: not resumed yet: %s", e.message, extra={"sandbox_id": sid})

    def _vanished(self, rec: dbm.SandboxRecord, handle: WorkerHandle) -> None:
        if rec.state == State.FAILED:
            return
        if rec.state == State.CREATING:
            if self.ledger.shared and _changed_since(rec, time.time() - SHARED_CREATE_GRACE_S):
                return  # another server sharing the records may be making it on this worker now
            # a create whose worker never made the runtime (the server stopped before it asked):
            # it was never acknowledged, so nothing of it is kept
            log.info(
                "reconcile: dropping an unfinished create",
                extra={"sandbox_id": rec.id, "worker": handle.name},
            )
            self.idempotency.forget(rec.id)  # a retry of its create makes it anew
            self.ledger.persist(
                rec,
                Verb.DELETE,
                deleted_at=dbm.utcnow(),
                failure_reason="the create was interrupted before the worker made the sandbox",
            )
            return
        self.ledger.fail(
            rec,
            f"its runtime is gone from worker {handle.name!r} (found by reconciliation); "
            "delete it and create a new one",
        )

    def _follow(self, rec: dbm.SandboxRecord, report: api.RuntimeReport, handle: WorkerHandle) -> None:
        observed = PUBLIC_STATUS[report.phase]
        current = status(rec.state, rec.standby_tier)
        if current == FAILED or observed == current:
            return
        if observed == FAILED:
            self.ledger.fail(rec, report.failure or f"its runtime failed on worker {handle.name!r}")
            return
        try:
            verbs = path_to(current, observed)
        except errors.Conflict:
            log.warning(
                "reconcile: no transition from %s to %s", current, observed, extra={"sandbox_id": rec.id}
            )
            return
        log.info(
            "reconcile: %s -> %s", current, observed, extra={"sandbox_id": rec.id, "worker": handle.name}
        )
        for verb in verbs:
            changes = {"standby_since": dbm.utcnow()} if verb in (Verb.FREEZE, Verb.CHECKPOINT) else {}
            self.ledger.persist(rec, verb, **changes)
        self.ledger.activity[rec.id] = time.monotonic()

    async def worker_event(self, handle: WorkerHandle, ev: api.WorkerEvent) -> None:
        if isinstance(ev, api.BuildChanged):
            self.templates.on_build(handle.id, ev.build)
            return
        if isinstance(ev, api.UsageReport):
            for u in ev.items:
                if u.sandbox_id in self.ledger.cache:
                    self.usage[u.sandbox_id] = u
            self.ledger.retained[handle.id] = ev
            return
        sid = getattr(ev, "sandbox_id", None)
        rec = self.ledger.cache.get(sid) if sid else None
        if rec is None or rec.worker_id != handle.id:
            return
        if isinstance(ev, api.SandboxDied):
            self.ledger.fail(rec, ev.cause)
        elif isinstance(ev, api.SandboxActivity):
            self.ledger.activity[rec.id] = time.monotonic()
        elif isinstance(ev, api.RuntimeChanged) and not self.ledger.lock(rec.id).locked():
            self._follow(rec, api.RuntimeReport(rec.id, ev.phase, 0), handle)
            if ev.phase == Phase.CHECKPOINTED and ev.reason and rec.standby_tier == Tier.DISK:
                self.ledger.resume_failed(rec, ev.reason)  # a restore of the worker's own (a compaction)

    def counts(self) -> dict[str, int]:
        return self.db.count_by_state()


def _mount_dicts(want: typing.Sequence[mounts.Mount]) -> list[dict]:
    return [{"kind": m.kind, "name": m.name, "path": m.path, "read_only": m.read_only} for m in want]


def _changed_since(rec: dbm.SandboxRecord, started: float) -> bool:
    t = rec.updated_at
    if t is None:
        return False
    if t.tzinfo is None:  # SQLite hands datetimes back naive; they are UTC
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp() > started


def _from_snapshot(req: typing.Any, snap: dbm.SnapshotRecord) -> typing.Any:
    """A create `req` naming snapshot `snap`, with what it takes from the snapshot: the template,
    and unless given the user, shell, disk size, CPUs — and the memory size, which a memory snapshot
    fixes (another one asked is 400); a smaller disk than the snapshot's is 400 too (its files are
    on it)."""
    given = req.model_fields_set
    if req.volumes or req.drives:
        raise errors.InvalidRequest(
            "a sandbox made from a snapshot mounts no volumes or drives (the snapshot holds its files "
            "without them); create it without `volumes`/`drives`"
        )
    if "template" in given and req.template != snap.template:
        raise errors.InvalidRequest(
            f"snapshot {snap.id} is of template {snap.template!r}: a sandbox made from it has that "
            f"template (asked {req.template!r}); leave `template` out"
        )
    src = snap.source or {}
    update: dict[str, typing.Any] = {"template": snap.template}
    if snap.memory:
        if "memory_mb" in given and req.memory_mb != snap.memory_mb:
            raise errors.InvalidRequest(
                f"snapshot {snap.id} holds the memory of a {snap.memory_mb} MB sandbox: a sandbox made "
                f"from it has memory_mb={snap.memory_mb} (asked {req.memory_mb}); leave memory_mb out, or "
                "take a files-only snapshot (memory: false), which takes any size"
            )
        update["memory_mb"] = snap.memory_mb
    elif "memory_mb" not in given and src.get("memory_mb"):
        update["memory_mb"] = src["memory_mb"]
    if "disk_mb" in given and req.disk_mb is not None and req.disk_mb < (src.get("disk_mb") or 0):
        raise errors.InvalidRequest(
            f"snapshot {snap.id} holds a {src['disk_mb']} MB disk: a sandbox made from it has at least "
            f"that (asked disk_mb={req.disk_mb}); leave disk_mb out, or ask {src['disk_mb']} or more"
        )
    for field, key in (("cpus", "cpus"), ("disk_mb", "disk_mb"), ("user", "user"), ("shell", "shell")):
        if field not in given and src.get(key) is not None:
            update[field] = src[key]
    return req.model_copy(update=update)

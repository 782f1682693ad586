"""Warm pools: per template, sandboxes restored from its current build ahead of demand and kept
frozen (memory tier: no CPU, counted against their worker's memory), claimed by creates.

A user template's pool is `{min, max, schedule?, memory_mb}` on the template's record. The built-in
`base` has one pool too, set by the server's ATOLL_DEFAULT_POOL (`min` = `max` = that number, the
default memory size; 0: none) and filled once a worker reports `base` ready: a create that names no
template claims from it. Its desired size is the
largest of `min` and the floors of the schedule entries whose UTC window holds now
(`{"from": "08:00", "to": "20:00", "min": 5}`; a window may wrap past midnight; from = to, an
empty window, is refused), capped at
`max`. The keeper (`run`) refills one sandbox at a time per pool in the background, never on a
create's path, on the server holding the `leader` lease only (controlplane.leases); it removes pooled sandboxes of superseded builds, those beyond `max`, and those
their worker's inventory calls `stale_runtime` (not what a create makes now: a worker restarted
with another guest agent or runsc keeps its frozen sandboxes, and their memory holds the old agent;
one restarted with another ATOLL_SANDBOX_CA_FILE, or under a new installation CA, keeps sandboxes
that trust the old certificates; `outdated`, at each adoption and reconciliation), and those on a
draining worker (never claimed: the pool refills on the ready workers). A claim
(`claim`) takes a frozen one of the template's current build and memory size, thaws it and gives it
the caller's environment, CPU count, egress policy, secrets, metadata and timeouts — its id,
hostname and generation are already its own (it was made as itself). Pooled sandboxes are not
listed by GET /v1/sandboxes and the idle policy leaves them alone. Called by the lifecycle's create
and the pool routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import re
import time
import typing

from atoll.controlplane import auth, lifetime, schemas
from atoll.controlplane import db as dbm
from atoll.controlplane.templates import BUILTIN, POOLED_BUILTIN, pool_key
from atoll.core import errors, ids, netpolicy
from atoll.core import worker_api as api
from atoll.core.lifecycle import State, Tier, Verb

if typing.TYPE_CHECKING:
    from atoll.controlplane.leases import Leadership
    from atoll.controlplane.ledger import Ledger, Steps
    from atoll.controlplane.templates import TemplateService

log = logging.getLogger(__name__)

MAX_POOL = 200
PASS_EVERY_S = 1.0
REFILL_AFTER_CLAIM_S = 0.3
"""A refill waits this long after the last claim: during a burst of claims the restores of refills
(CPU-bound, ~0.3 s each) would otherwise compete with the claims on a small host."""
_HHMM = re.compile(r"([01]\d|2[0-3]):([0-5]\d)")


def check(body: object, default_memory_mb: int) -> dict:
    """A pool's settings from `PUT /v1/templates/{name}/pool`, or a 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise errors.InvalidRequest("the pool must be a JSON object {min, max, schedule?}")
    unknown = set(body) - {"min", "max", "schedule", "memory_mb"}
    if unknown:
        raise errors.InvalidRequest(
            f"unknown pool field(s) {sorted(unknown)}; accepted: min, max, schedule, memory_mb"
        )

    def count(key: str, default: int | None) -> int:
        v = body.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_POOL:
            raise errors.InvalidRequest(f"pool {key}={v!r} must be an integer from 0 to {MAX_POOL}")
        return v

    lo = count("min", 0)
    hi = count("max", max(lo, 1) if "max" not in body else None)
    if lo > hi:
        raise errors.InvalidRequest(f"pool min={lo} is more than max={hi}; min must be at most max")
    memory = body.get("memory_mb", default_memory_mb)
    if isinstance(memory, bool) or not isinstance(memory, int) or not 64 <= memory <= 65536:
        raise errors.InvalidRequest(f"pool memory_mb={memory!r} must be an integer from 64 to 65536")
    schedule = body.get("schedule") or []
    if not isinstance(schedule, list) or len(schedule) > 24:
        raise errors.InvalidRequest("pool schedule must be a list of at most 24 {from, to, min} windows")
    out = []
    for i, w in enumerate(schedule):
        if not isinstance(w, dict) or set(w) - {"from", "to", "min"} or not {"from", "to", "min"} <= set(w):
            raise errors.InvalidRequest(
                f'pool schedule[{i}] must be {{"from": "HH:MM", "to": "HH:MM", "min": N}} (UTC)'
            )
        for k in ("from", "to"):
            if not isinstance(w[k], str) or not _HHMM.fullmatch(w[k]):
                raise errors.InvalidRequest(f"pool schedule[{i}].{k}={w[k]!r} is not a UTC time HH:MM")
        if w["from"] == w["to"]:  # [a, a) holds no minute: accepted, it never applied
            raise errors.InvalidRequest(
                f"pool schedule[{i}] is an empty window: from and to are both {w['from']!r} (a window "
                "holds from <= now < to, UTC, and may wrap past midnight, e.g. 22:00-06:00); for a "
                "floor all day, raise the pool's min instead"
            )
        m = w["min"]
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= hi:
            raise errors.InvalidRequest(
                f"pool schedule[{i}].min={m!r} must be an integer from 0 to max ({hi})"
            )
        out.append({"from": w["from"], "to": w["to"], "min": m})
    return {"min": lo, "max": hi, "schedule": out, "memory_mb": memory}


def desired(cfg: dict, now: dt.datetime) -> int:
    minute = now.hour * 60 + now.minute
    want = cfg.get("min", 0)
    for w in cfg.get("schedule", []):
        a = int(w["from"][:2]) * 60 + int(w["from"][3:])
        b = int(w["to"][:2]) * 60 + int(w["to"][3:])
        inside = a <= minute < b if a <= b else (minute >= a or minute < b)
        if inside:
            want = max(want, w["min"])
    return min(want, cfg.get("max", 0))


class _Taken(Exception):
    """A pool member another server sharing the records claimed between our read and our claim."""


class Pools:
    def __init__(
        self,
        ledger: Ledger,
        steps: Steps,
        templates: TemplateService,
        default_memory_mb: int,
        default_pool: int = 0,
        *,
        leader: Leadership | None = None,
    ):
        self.m = ledger
        self.leader = leader
        """The keeper runs only while this server holds the `leader` lease (None: always)."""
        self.steps = steps
        self.templates = templates
        self.default_memory_mb = default_memory_mb
        self._errors: dict[str, str | None] = {}
        self._claims: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._refilling: set[str] = set()
        self._last_claim = 0.0
        self._stopped: set[str] = set()
        self._outdated: set[str] = set()
        """Pool members whose worker says they are not what a create makes now (`outdated`)."""
        self.builtin: dict[str, dict] = {
            name: {
                "min": default_pool if name in POOLED_BUILTIN else 0,
                "max": default_pool if name in POOLED_BUILTIN else 0,
                "schedule": [],
                "memory_mb": default_memory_mb,
            }
            for name in BUILTIN
        }
        """The built-in templates' pools (ATOLL_DEFAULT_POOL; min 0 keeps none)."""

    def _config(self, name: str, tenant: str) -> dict | None:
        if name in BUILTIN:
            cfg = self.builtin[name]
            return cfg if cfg["max"] else None
        rec = self.m.db.get_template(tenant, name)
        return rec.pool if rec is not None else None

    # ---- settings -------------------------------------------------------------------------------
    def set(self, name: str, body: object) -> dict:
        if name in BUILTIN:
            raise errors.InvalidRequest(
                f"the pool of the built-in template {name!r} is set by the server's ATOLL_DEFAULT_POOL "
                f"(now {self.builtin[name]['min']}); restart the server with another value (0: no pool)"
            )
        rec = self.templates.record(name)
        key = pool_key(rec.tenant_id, name)
        pool = check(body, self.default_memory_mb)
        self.m.quotas.check_pool(rec.tenant_id, name, pool["max"])
        self._stopped.discard(key)
        rec.pool = pool
        rec.pool_error = None
        self.m.db.put_template(rec)
        self._errors.pop(key, None)
        self._wake.set()
        log.info(
            "pool.set", extra={"template": name, **{k: v for k, v in rec.pool.items() if k != "schedule"}}
        )
        return self.view(name)

    def outdated(self, sandbox_ids: typing.Iterable[str]) -> None:
        """A worker's inventory named these sandboxes `stale_runtime` (made under another guest
        agent or runsc, or trusting other CA certificates than a new sandbox): the pooled ones
        among them are not claimed from now on, and the keeper replaces them."""
        pooled = {sid for sid in sandbox_ids if (rec := self.m.cache.get(sid)) is not None and rec.pooled}
        if pooled - self._outdated:
            log.info(
                "pool: %d member(s) were made under an earlier guest agent or runsc, or trust other CA "
                "certificates than a new sandbox; replacing them",
                len(pooled - self._outdated),
            )
            self._outdated |= pooled
            self._wake.set()

    def _members(self, name: str, tenant: str) -> list[dbm.SandboxRecord]:
        """A pool's members: a built-in template's pool is shared (its members are the default
        tenant's until claimed), a user template's is its tenant's. Read from the ledger's index
        of pool members by template: a claim costs the same with 10 or 10,000 sandboxes."""
        return [
            r
            for r in self.m.cache.pooled(name)
            if r.pooled
            and r.template == name
            and (name in BUILTIN or r.tenant_id == tenant)
            and r.state != State.DELETED
        ]

    def view(self, name: str) -> dict:
        tenant = auth.acting_tenant()
        if name in BUILTIN:
            pool, build_id, stored_error = self._config(name, tenant), None, None
            counted = ids.DEFAULT_TENANT
        else:
            rec = self.templates.record(name)
            pool, build_id, stored_error = rec.pool, rec.current_build, rec.pool_error
            tenant = counted = rec.tenant_id
        key = pool_key(tenant, name)
        cfg = pool or {"min": 0, "max": 0, "schedule": [], "memory_mb": self.default_memory_mb}
        members = self._members(name, tenant)
        ready = [r for r in members if r.state == State.STANDBY and r.id not in self._claims]
        return {
            "template": name,
            "min": cfg["min"],
            "max": cfg["max"],
            "schedule": cfg.get("schedule", []),
            "memory_mb": cfg.get("memory_mb", self.default_memory_mb),
            "desired": desired(cfg, dt.datetime.now(dt.UTC)) if pool else 0,
            "ready": len(ready),
            "starting": len(members) - len(ready),
            "claimed": self.m.db.pool_claimed(counted, name),  # persisted: survives restarts
            "build_id": build_id,
            "last_error": self._errors.get(key) or stored_error,
        }

    # ---- claims ---------------------------------------------------------------------------------
    async def claim(
        self, req: schemas.CreateSandbox, build: dbm.BuildRecord | None, tenant: str
    ) -> dbm.SandboxRecord | None:
        """A pooled sandbox for this create, its caller's settings applied and now `tenant`'s;
        None when none fits (the create then restores one from the snapshot). `build`: the
        template's current build (None for a built-in template)."""
        cfg = self._config(req.template, tenant)
        if not cfg or req.memory_mb != cfg.get("memory_mb") or req.disk_mb is not None:
            return None
        for rec in self._members(req.template, tenant):
            sid = rec.id
            if (
                rec.build_id != (build.id if build is not None else None)
                or sid in self._outdated
                or rec.state != State.STANDBY
                or rec.standby_tier != Tier.MEMORY
                or sid in self._claims
                or self.m.lock(sid).locked()
                or not self._on_ready_worker(rec)  # a draining worker's members are dropped
            ):
                continue
            self._claims.add(sid)
            try:
                return await self._claim(rec, req, tenant)
            except _Taken:
                continue  # another server sharing the records claimed it first: the next one
            except errors.AtollError as e:
                log.warning("pool.claim.failed: %s", e.message, extra={"sandbox_id": sid})
                self._errors[pool_key(tenant, req.template)] = f"a claim failed: {e.message}"
                with contextlib.suppress(errors.AtollError):
                    await self.steps.delete(sid)
                return None
            finally:
                self._claims.discard(sid)
                self._wake.set()
        return None

    def _on_ready_worker(self, rec: dbm.SandboxRecord) -> bool:
        h = self.m.workers.handles.get(rec.worker_id)
        return h is not None and h.state == "ready"

    def _draining(self, rec: dbm.SandboxRecord) -> bool:
        h = self.m.workers.handles.get(rec.worker_id)
        return h is not None and h.state == "draining"

    async def _claim(
        self, rec: dbm.SandboxRecord, req: schemas.CreateSandbox, tenant: str
    ) -> dbm.SandboxRecord:
        m = self.m
        pool_tenant = rec.tenant_id
        sid = rec.id
        network = (
            netpolicy.parse(req.network.model_dump()).to_wire() if req.network else dict(m.default_network)
        )
        bound = (
            m.secrets.placeholders(tenant, req.secrets, dict(req.env))
            if req.secrets and m.secrets is not None
            else {}
        )
        if req.secrets and m.secrets is None:
            raise errors.InvalidRequest("this server keeps no secrets; create the sandbox without `secrets`")
        env = {**req.env, **{var: b["placeholder"] for var, b in bound.items()}}
        worker = m.worker(rec)
        async with m.lock(sid), m.step("claim", sid) as fields:
            if m.shared:
                # taken in the records before the worker is touched: another server sharing them
                # that read this member too finds its copy stale (or, reading it again, not
                # pooled) and claims another one instead of this, which is now the caller's
                rec.pooled, rec.tenant_id = False, tenant
                try:
                    m.save(rec, ["pooled", "tenant_id"])
                except errors.SandboxChanged:
                    raise _Taken from None
                m.cache[sid] = rec  # out of the pool's index here too
            if network != rec.network:
                rec.network = await worker.set_network(sid, network)
            if bound and m.secrets is not None:
                await worker.set_secrets(sid, m.secrets.bindings(tenant, bound))
            outcome = await m.guard(rec, worker.claim(sid, env, req.cpus))
            fields["worker_ms"] = outcome.duration_ms
            now = dbm.utcnow()
            m.persist(
                rec,
                Verb.RESUME,
                pooled=False,
                tenant_id=tenant,
                metadata_=dict(req.metadata),
                env=dict(req.env),
                user=req.user or rec.user,
                shell=getattr(req, "shell", None),
                secrets=bound or None,
                cpus=req.cpus,
                idle_timeout_s=req.idle_timeout_s,
                disk_after_s=req.disk_after_s,
                archive_after_s=getattr(req, "archive_after_s", 0.0),
                created_at=now,
                last_activity_at=now,
                network=rec.network,
                expires_at=lifetime.deadline(req.timeout_s, now),
                on_timeout=req.on_timeout,
                on_worker_lost=getattr(req, "on_worker_lost", "fail"),
                compat=req.compat() if hasattr(req, "compat") else None,
            )
            m.touch(sid)
        m.db.count_pool_claim(pool_tenant, rec.template)
        self._last_claim = time.monotonic()
        return rec

    # ---- the keeper -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    def wake(self, _name: str = "") -> None:
        self._wake.set()

    async def run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PASS_EVERY_S):
                    await self._wake.wait()
            self._wake.clear()
            if self._closing:  # (a cancel that raced a wake-up may be lost in asyncio's waits)
                return
            await asyncio.sleep(0.01)  # a set event returns without yielding: never starve the loop
            if not self._leading():
                continue
            try:
                await self._pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pool pass failed")

    def _leading(self) -> bool:
        return self.leader is None or self.leader.held

    def _pools(self) -> list[tuple[str, str, dict | None, str | None]]:
        """(tenant, template, pool settings, current build) of every template that may have pool
        members, of every tenant."""
        out: list[tuple[str, str, dict | None, str | None]] = [
            (ids.DEFAULT_TENANT, n, self._config(n, ids.DEFAULT_TENANT), None) for n in BUILTIN
        ]
        for t in self.m.db.templates(None):
            out.append((t.tenant_id, t.name, t.pool, t.current_build))
        return out

    def _servable(self, name: str, build: str | None) -> bool:
        """Whether a refill can start: a user template has a ready build; a built-in one is ready
        (layer and snapshot made) on a ready worker, so that refills restore instead of booting."""
        if name not in BUILTIN:
            return build is not None
        for h in self.m.workers.ready():
            t = h.templates.get(name)
            if t is not None and t.status == "ready":
                return True
        return False

    async def _pass(self) -> None:
        now = dt.datetime.now(dt.UTC)
        # the deleted and the claimed go
        self._outdated = {
            sid for sid in self._outdated if (r := self.m.cache.get(sid)) is not None and r.pooled
        }
        for tenant, name, cfg, current in self._pools():
            key = pool_key(tenant, name)
            if key in self._stopped:  # being deleted
                continue
            if not self._leading():  # the lease was lost: another server keeps the pools now
                return
            members = self._members(name, tenant)
            stale = [
                r
                for r in members
                if not cfg
                or r.build_id != current
                or r.state == State.FAILED
                or r.id in self._outdated
                or self._draining(r)  # refilled on the ready workers
            ]
            keep = [r for r in members if r not in stale]
            extra = keep[desired(cfg, now) :] if cfg else []  # a window closed, min lowered: shrink
            for r in [*stale, *extra]:
                if r.id not in self._claims and not self.m.lock(r.id).locked():
                    with contextlib.suppress(errors.AtollError):
                        await self.steps.delete(r.id)
            if not cfg or not self._servable(name, current):
                continue
            if len(keep) < desired(cfg, now):
                quiet = time.monotonic() - self._last_claim
                if quiet < REFILL_AFTER_CLAIM_S:
                    await asyncio.sleep(REFILL_AFTER_CLAIM_S - quiet)
                    self._wake.set()
                    continue
                if await self._refill(tenant, name, cfg):
                    self._wake.set()  # next one soon, after other pools had their turn

    async def stop(self, key: str) -> None:
        """No more refills of the pool `key` (templates.pool_key: its template is being
        deleted); waits for one in flight."""
        self._stopped.add(key)
        for _ in range(600):
            if key not in self._refilling:
                return
            await asyncio.sleep(0.05)

    def resume(self, key: str) -> None:
        self._stopped.discard(key)
        self._wake.set()

    async def _refill(self, tenant: str, name: str, cfg: dict) -> bool:
        """One pooled sandbox more; False when none was made."""
        key = pool_key(tenant, name)
        if key in self._stopped:
            return False
        req = schemas.CreateSandbox(
            template=name, memory_mb=cfg.get("memory_mb", self.default_memory_mb), tenant_id=tenant
        )
        self._refilling.add(key)
        try:
            rec = await self.steps.create(req, pooled=True)
            # one command before the freeze: a restored sentry makes its first process's host-side
            # machinery (ptrace stubs) and reads the interpreter's files into its page cache then,
            # ~20 ms of each that would otherwise be the claimer's (/usr/bin/python3 is in every
            # template: the guest agent runs on it; named by path, whatever PATH the template sets)
            await self.m.worker(rec).exec(
                rec.id,
                api.ExecSpec(cmd=["/usr/bin/python3", "-c", "pass"], max_output_bytes=1024, timeout_s=30),
            )
            await self.steps.pause(rec.id, Tier.MEMORY)
        except errors.AtollError as e:
            self._errors[key] = e.message
            log.warning("pool.refill.failed: %s", e.message, extra={"template": name, "tenant": tenant})
            await asyncio.sleep(2.0)  # a failing pool does not spin
            return False
        finally:
            self._refilling.discard(key)
        self._errors[key] = None
        return True

    async def aclose(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

"""User templates on the control plane: records of templates and their builds, which worker builds
each, which build serves creates, logs, deletion.

A build (`build`) validates the spec (core.templatespec), picks a worker (placement, like a
sandbox; for a template FROM another, the worker holding the parent build when it has room) and
asks it to build (`WorkerAPI.build_template`); the worker's BuildChanged events move the build
record (`on_build`). A worker with a shared object store publishes each ready build there
(worker.images.buildpack; `in_store` in the build's info): then any worker can take a create from
it, fetching the build by id (`placeable`). A build on no ready worker and not in the store is a
409 build_unavailable (build the template again), never a 500.
A template's `current_build` is its newest ready build: creates start from it, and a failed or
running rebuild leaves it serving. One build of a template runs at a time. Deleting a template is
refused while a sandbox made from it lives; its pool's sandboxes go with it. Called by
controlplane.routes_templates, controlplane.lifecycle (creates) and controlplane.pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import typing

from atoll.controlplane import auth
from atoll.controlplane import db as dbm
from atoll.core import errors, ids, templatespec
from atoll.core import worker_api as api
from atoll.core.lifecycle import State

if typing.TYPE_CHECKING:
    from atoll.controlplane.ledger import Ledger, Steps

log = logging.getLogger(__name__)

BUILTIN = ("base", "code-interpreter-v1")
"""Templates each worker builds for itself (worker.images.templates); `code-interpreter-v1` only
when the worker runs with ATOLL_E2B_CODE_INTERPRETER on (its default)."""
POOLED_BUILTIN = ("base",)
"""The built-in templates ATOLL_DEFAULT_POOL keeps a warm pool of."""


async def _no_pool_stop(name: str) -> None:
    return None


class TemplateService:
    def __init__(self, ledger: Ledger, steps: Steps, default_memory_mb: int):
        self.m = ledger
        self.steps = steps
        self.pool_stop: typing.Callable[[str], typing.Awaitable[None]] = _no_pool_stop
        self.pool_resume: typing.Callable[[str], None] = lambda name: None
        """Stop and resume a template's pool (set by the manager: the pools are made with this
        service, and know it; it does not know them)."""
        self.db = ledger.db
        self.default_memory_mb = default_memory_mb
        self.on_ready: typing.Callable[[str], None] = lambda name: None
        """Called when a template gets a new current build (the pools refill with it)."""

    # ---- reading --------------------------------------------------------------------------------
    def record(self, name: str, tenant: str | None = None) -> dbm.TemplateRecord:
        """The caller's template `name` (`tenant`: another's, for the server's own loops)."""
        tenant = tenant or auth.acting_tenant()
        if name in BUILTIN:
            raise errors.InvalidRequest(
                f"template {name!r} is built in, not one you built: each worker builds it for itself "
                f"on first use, so it has no build records here; GET /v1/templates/{name} shows its "
                f"status, progress and error, GET /v1/templates/{name}/pool its warm pool (sized by "
                "the server's ATOLL_DEFAULT_POOL); it cannot be rebuilt or deleted"
            )
        rec = self.db.get_template(tenant, name)
        if rec is None:
            known = ", ".join([*BUILTIN, *(t.name for t in self.db.templates(tenant))])
            raise errors.TemplateNotFound(f"template {name!r} does not exist; templates: {known}")
        return rec

    def serving(self, name: str, tenant: str | None = None) -> dbm.BuildRecord | None:
        """The build creates of `name` start from; None for a built-in template. Raises for a user
        template without a ready build."""
        if name in BUILTIN:
            return None
        rec = self.record(name, tenant)
        build = self.db.get_build(rec.current_build) if rec.current_build else None
        if build is None:
            latest = self.db.get_build(rec.latest_build) if rec.latest_build else None
            state = latest.status if latest else "missing"
            raise errors.Conflict(
                f"template {name!r} has no ready build yet (its build is {state}"
                + (f": {latest.error}" if latest is not None and latest.error else "")
                + "); wait for GET /v1/templates/{name} to say ready, or build it again",
                code="invalid_state",
            )
        return build

    def placeable(self, build: dbm.BuildRecord) -> bool:
        """Whether a create from `build` may go to a worker that does not hold it (it is in the
        object store: that worker fetches it). Raises when no ready worker holds it and it is not
        in the store: 503 worker_unavailable when a registered worker holding it is not ready (it
        may come back), else 409 build_unavailable."""
        if (build.info or {}).get("in_store"):
            return True
        holders = [
            h
            for h in self.m.workers.handles.values()
            if (b := h.builds.get(build.id)) is not None and b.status == "ready"
        ]
        if any(h.state == "ready" and h.worker is not None for h in holders):
            return False
        fix = (
            "build the template again (POST /v1/templates with its spec, or `atoll template build`); "
            "with an object store shared by the workers (ATOLL_S3_* or ATOLL_ARCHIVE_DIR) a build "
            "is published there and any worker can create from it"
        )
        if holders:
            names = ", ".join(f"{h.name} ({h.state})" for h in holders)
            raise errors.Unavailable(
                f"template {build.template!r}: its build {build.id} is only on worker {names}, which "
                f"is not ready, and not in the object store; wait for that worker to come back, or {fix}",
                code="worker_unavailable",
            )
        raise errors.BuildUnavailable(
            f"template {build.template!r}: its build {build.id} is on no worker (the worker that "
            f"built it is gone) and not in the object store; {fix}"
        )

    def view(self, rec: dbm.TemplateRecord) -> dict:
        latest = self.db.get_build(rec.latest_build) if rec.latest_build else None
        current = self.db.get_build(rec.current_build) if rec.current_build else None
        live = self._live_info(latest) if latest else None
        info = (current.info if current else None) or {}
        if current is None and latest is not None:
            # No build serves yet (the first one failed or runs): show what was submitted, with
            # what the worker resolved so far over it (the FROM template's env, ...); `{}` read
            # as if the spec had set nothing.
            resolved = latest.info or {}
            submitted = latest.spec
            info = {
                **resolved,
                "env": {**(submitted.get("env") or {}), **(resolved.get("env") or {})},
                **{k: resolved.get(k) or submitted.get(k) for k in ("workdir", "user", "start")},
            }
        return {
            "name": rec.name,
            "status": (live.status if live else latest.status) if latest else "missing",
            "build_id": latest.id if latest else None,
            "error": (live.error if live else latest.error) if latest else None,
            "progress": (live.progress if live else latest.progress) if latest else "",
            "current_build_id": rec.current_build,
            "from": (latest.spec if latest else {}).get("from"),
            "start_mode": info.get("start_mode", ""),
            "start_reason": info.get("start_reason", ""),
            "env": info.get("env", {}),
            "workdir": info.get("workdir"),
            "user": info.get("user"),
            "start": info.get("start"),
            "steps": info.get("steps", 0),
            "cached_steps": (live.cached_steps if live else info.get("cached_steps", 0)),
            "size_bytes": info.get("size_bytes"),
            "in_store": bool(info.get("in_store")),
            "builds": [b.id for b in self.db.builds(rec.name, rec.tenant_id)],
            "in_use": self.in_use(rec.name),
            "created_at": _iso(rec.created_at),
            "updated_at": _iso(rec.updated_at),
            "built_at": _iso(current.finished_at) if current else None,
        }

    def _live_info(self, build: dbm.BuildRecord) -> api.BuildInfo | None:
        with contextlib.suppress(errors.AtollError):
            h = self.m.workers.get(build.worker_id)
            return h.builds.get(build.id)
        return None

    def list(self) -> list[dict]:
        return [self.view(r) for r in self.db.templates(auth.list_tenant())]

    def in_use(self, name: str, tenant: str | None = None) -> int:
        tenant = tenant or auth.acting_tenant()
        return sum(
            1
            for r in self.m.live()
            if r.template == name and r.tenant_id == tenant and not r.pooled and r.state != State.DELETED
        )

    # ---- building -------------------------------------------------------------------------------
    async def build(self, spec: templatespec.TemplateSpec) -> dbm.BuildRecord:
        if spec.name in BUILTIN:
            raise errors.InvalidRequest(f"template {spec.name!r} is built in; choose another name")
        tenant = auth.acting_tenant()
        self.m.quotas.check_build(tenant)
        rec = self.db.get_template(tenant, spec.name)
        if rec is not None and rec.latest_build:
            latest = self.db.get_build(rec.latest_build)
            if latest is not None and latest.status == "building":
                live = self._live_info(latest)
                if live is None or live.status == "building":
                    raise errors.Conflict(
                        f"template {spec.name!r} is being built (build {latest.id}); wait for it to "
                        f"finish (GET /v1/templates/{spec.name}) and build again",
                        code="template_exists",
                    )
        parent = None
        if spec.from_kind == "template":
            if spec.from_ == spec.name:
                raise errors.InvalidRequest(f"template {spec.name!r} cannot be built FROM itself")
            try:
                parent = self.serving(spec.from_, tenant)
            except errors.TemplateNotFound:
                raise errors.InvalidRequest(
                    f"from={spec.from_!r}: no such template; use `base`, a template of yours "
                    "(GET /v1/templates) or oci-archive:/path/on/the/worker"
                ) from None
            except errors.Conflict as e:
                raise errors.InvalidRequest(f"from={spec.from_!r}: {e.message}") from None
        # FROM oci-archive: the worker reads the path when it builds. Whether a host path exists is
        # never checked here: a 400 for a missing one and a failed build for an unreadable one told
        # callers which paths exist (the worker gives every such path one answer).
        if parent is not None:  # a worker holding the parent build, or any when it is in the store
            handle = self.m.place(
                parent.id,
                self.default_memory_mb,
                fetchable=self.placeable(parent),
                prefer=parent.worker_id,
                what=f"build of {spec.name}",
            )
        else:
            handle = self.m.place("base", self.default_memory_mb)
        bid = ids.new_build_id()
        now = dbm.utcnow()
        build = dbm.BuildRecord(
            id=bid,
            tenant_id=tenant,
            template=spec.name,
            worker_id=handle.id,
            status="building",
            spec=spec.to_wire(),
            parent_build=parent.id if parent else None,
            created_at=now,
        )
        if rec is None:
            rec = dbm.TemplateRecord(tenant_id=tenant, name=spec.name, created_at=now)
        rec.latest_build = bid
        self.db.put_build(build)
        self.db.put_template(rec)
        assert handle.worker is not None
        try:
            await handle.worker.build_template(
                api.TemplateBuild(
                    build_id=bid,
                    spec=build.spec,
                    parent_build=parent.id if parent else "",
                    memory_mb=self.default_memory_mb,
                )
            )
        except errors.AtollError as e:
            build.status, build.error, build.finished_at = "failed", e.message, dbm.utcnow()
            self.db.put_build(build)
            raise
        log.info(
            "template.build.started", extra={"template": spec.name, "build_id": bid, "worker": handle.name}
        )
        return build

    def on_build(self, handle_id: str, info: api.BuildInfo) -> None:
        """A worker's BuildChanged: the build record follows; a ready build becomes current."""
        build = self.db.get_build(info.build_id)
        if build is None or build.worker_id != handle_id:
            return
        if (
            build.status == info.status
            and build.progress == info.progress
            and bool((build.info or {}).get("in_store")) == info.in_store
        ):
            return
        build.status, build.error, build.progress = info.status, info.error, info.progress
        build.info = {
            "start_mode": info.start_mode,
            "start_reason": info.start_reason,
            "steps": info.steps,
            "cached_steps": info.cached_steps,
            "size_bytes": info.size_bytes,
            "env": dict(info.env),
            "workdir": info.workdir,
            "user": info.user,
            "start": info.start,
            "in_store": info.in_store,
        }
        if info.status in ("ready", "failed"):
            build.finished_at = dbm.utcnow()
        self.db.put_build(build)
        if info.status == "ready":
            rec = self.db.get_template(build.tenant_id, build.template)
            if rec is not None:
                current = self.db.get_build(rec.current_build) if rec.current_build else None
                if current is None or _ts(current.created_at) <= _ts(build.created_at):
                    rec.current_build = build.id
                    self.db.put_template(rec)
                    log.info("template.build.ready", extra={"template": rec.name, "build_id": build.id})
                    self.on_ready(rec.name)
        elif info.status == "failed":
            log.info(
                "template.build.failed",
                extra={"template": build.template, "build_id": build.id, "error": info.error},
            )

    def build_record(self, name: str, build_id: str) -> dbm.BuildRecord:
        if name in BUILTIN:
            raise errors.InvalidRequest(
                f"template {name!r} is built in: each worker builds its layer for itself on first use "
                f"(mmdebstrap), outside the builds of /v1/templates/{name}/builds, so there is no "
                f"build {build_id!r} or build log to stream; GET /v1/templates/{name} shows its "
                "status, progress and, if it failed, the error with the last lines of its output "
                "(the worker's log has all of it). Build logs are for templates you build with "
                "POST /v1/templates"
            )
        rec = self.record(name)
        build = self.db.get_build(build_id) if ids.is_build_id(build_id) else None
        if build is None or build.template != name or build.tenant_id != rec.tenant_id:
            raise errors.NotFound(
                f"template {name!r} has no build {build_id!r}; its builds are listed in GET /v1/templates/{name}",
                code="template_not_found",
            )
        return build

    def worker_of(self, build: dbm.BuildRecord) -> api.WorkerAPI:
        return self.m.workers.api_for(build.worker_id)

    # ---- deleting -------------------------------------------------------------------------------
    async def delete(self, name: str) -> None:
        if name in BUILTIN:
            raise errors.InvalidRequest(f"template {name!r} is built in and cannot be deleted")
        rec = self.record(name)
        tenant = rec.tenant_id
        users = [r.id for r in self.m.live() if r.template == name and r.tenant_id == tenant and not r.pooled]
        if users:
            raise errors.Conflict(
                f"template {name!r} is in use by {len(users)} sandbox(es) ({', '.join(users[:5])}); "
                "delete them first",
                code="template_in_use",
            )
        children = [
            t.name
            for t in self.db.templates(tenant)
            if t.name != name
            and any(
                b.parent_build and self._template_of(b.parent_build) == name
                for b in self.db.builds(t.name, tenant)
            )
        ]
        if children:
            raise errors.Conflict(
                f"template {name!r} is the parent of {', '.join(children)}; delete those first",
                code="template_in_use",
            )
        await self.pool_stop(pool_key(tenant, name))
        try:
            for r in [r for r in self.m.live() if r.template == name and r.tenant_id == tenant and r.pooled]:
                await self.steps.delete(r.id)
            if self.m.reaps:  # the pool's runtimes go before their build does
                await asyncio.wait(list(self.m.reaps), timeout=30)
        except BaseException:
            self.pool_resume(pool_key(tenant, name))
            raise
        for b in self.db.builds(name, tenant):
            # the worker that built it, and those that fetched it from the store
            holders = [
                b.worker_id,
                *(h.id for h in self.m.workers.ready() if h.id != b.worker_id and b.id in h.builds),
            ]
            for wid in holders:
                try:
                    await self.m.workers.api_for(wid).delete_build(b.id)
                except errors.AtollError as e:
                    log.warning(
                        "template.delete: build %s not removed from worker %s: %s", b.id, wid, e.message
                    )
        self.db.delete_template(rec.tenant_id, name)
        self.pool_resume(pool_key(tenant, name))  # a template of that name made later may have a pool again
        log.info("template.deleted", extra={"template": name})

    def _template_of(self, build_id: str) -> str | None:
        b = self.db.get_build(build_id)
        return b.template if b else None


def pool_key(tenant: str, name: str) -> str:
    """The pools' name of a template's pool: a built-in template's is shared by every tenant."""
    return name if name in BUILTIN else f"{tenant}/{name}"


def _ts(t: dt.datetime | None) -> float:
    if t is None:
        return 0.0
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def _iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.isoformat().replace("+00:00", "Z")

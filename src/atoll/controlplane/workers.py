"""The workers the control plane knows: registration, heartbeats, `lost`, and what each holds.

A worker joins in one of two ways: `attach_local` (the in-process worker of `atoll up`) or
`register` (an `atoll worker` process over HTTP: protocol version checked, a fresh token issued,
a `RemoteWorker` made for it). Either way it is *adopted*: it is given the installation's CA (the
listener's `authorize_worker`: the worker judges by it whether its pooled sandboxes trust what a
new one would, so before its inventory is read), its inventory is read, the records are reconciled
with that inventory (the listener's `worker_joined`), and only then is it `ready`; its events are consumed from then on, and it is reconciled again every `reconcile_s`.

States: joining → ready; ready → lost (no heartbeat for `lost_after_s`, or it said it stops) →
joining when it registers again (same name and installation: the same worker id, its sandboxes
taken back); ready ⇄ draining (an operator's choice: no new sandboxes). A worker of the same name
from another installation is refused (`worker_conflict`). Tokens live only in memory: a restarted
server shows every remote worker `lost` until it registers again (each does within a heartbeat).
Called by controlplane.lifecycle (which is the listener) and controlplane.routes_workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hmac
import logging
import math
import secrets
import ssl
import time
import typing
from dataclasses import dataclass, field

from atoll.controlplane import auth
from atoll.controlplane import db as dbm
from atoll.controlplane.remote_worker import RemoteWorker
from atoll.core import errors, ids, secretbox, wire
from atoll.core import worker_api as api

log = logging.getLogger(__name__)

LOCAL = "local"
DRAINING = "draining: no new sandboxes are placed here"


HEARTBEAT_WRITE_S = 5.0
"""How often a heartbeat's time is written to the shared workers table (PostgreSQL only)."""
OTHERS_EVERY_S = 5.0
"""How often a server sharing the records looks for workers other servers made (PostgreSQL)."""
HELD_ELSEWHERE = "its heartbeats reach another server sharing the records (not this one)"
BORROWED = "held by another server sharing the records; this one calls it with the token that server stored"
BORROWED_EVENTS = (api.UsageReport, api.SandboxActivity)
"""The events of a worker another server holds that this one acts on too (`_consume`)."""
BORROW_TIMEOUT_S = 10.0
"""How long a server waits for a borrowed worker's `info` before it tries again (next pass)."""


class Listener(typing.Protocol):
    async def authorize_worker(self, handle: WorkerHandle, worker: api.WorkerAPI) -> None: ...

    async def worker_joined(self, handle: WorkerHandle, inventory: api.Inventory, started: float) -> None: ...

    async def worker_event(self, handle: WorkerHandle, ev: api.WorkerEvent) -> None: ...

    async def configure_worker(self, handle: WorkerHandle, worker: api.WorkerAPI) -> None: ...

    def worker_ready(self, handle: WorkerHandle) -> None: ...

    def worker_cordoned(self, handle: WorkerHandle, draining: bool) -> None: ...

    def refresh_records(self) -> None: ...


@dataclass
class WorkerHandle:
    id: str
    name: str
    record: dbm.WorkerRecord
    worker: api.WorkerAPI | None = None
    info: api.WorkerInfo | None = None
    state: str = "lost"  # joining | ready | lost | draining
    reason: str | None = None
    local: bool = False
    epoch: str | None = None
    last_seen: float = 0.0
    templates: dict[str, api.TemplateInfo] = field(default_factory=dict)
    builds: dict[str, api.BuildInfo] = field(default_factory=dict)
    """User template builds it holds (BuildChanged events keep it current)."""
    tasks: list[asyncio.Task] = field(default_factory=list)
    lost_since: float | None = None
    """When this server last saw it become `lost` (wall clock; None while it is not): after
    ATOLL_WORKER_GONE_S, controlplane.lost_workers settles its sandboxes."""
    cordoned_at: float = 0.0
    """When (monotonic) this server last drained or undrained it: a row read before then does not
    undo that (`follow`)."""
    borrowed: str | None = None
    """The sealed token this server calls it with while another server sharing the records holds
    it (None: this server holds it, or cannot call it). A borrowed worker serves every call of its
    sandboxes here too; its record, events, heartbeats and reconciliation stay its holder's."""

    @property
    def usable(self) -> bool:
        return self.worker is not None and self.state in ("ready", "draining")


def check_info(info: api.WorkerInfo) -> None:
    """What a registering worker says about itself must be sane before it is recorded or shown:
    names and versions that any client can print, capacities that are not negative."""

    def text(what: str, value: str, limit: int = 256) -> None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise errors.InvalidRequest(f"info.{what} is not valid Unicode text") from None
        if len(value) > limit or not value.isprintable():
            raise errors.InvalidRequest(
                f"info.{what} {value[:80]!r} must be printable text of at most {limit} characters"
            )

    if not ids.is_worker_name(info.name):
        raise errors.InvalidRequest(
            f"worker name {info.name[:80]!r} is not valid; use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if not ids.INSTALLATION_RE.fullmatch(info.installation):
        raise errors.InvalidRequest(f"info.installation {info.installation[:80]!r} is not an installation id")
    text("version", info.version, 64)
    cap = info.capacity
    if min(cap.memory_mb, cap.cpus, cap.disk_mb, cap.slots) < 0 or info.default_disk_mb < 0:
        raise errors.InvalidRequest(f"info.capacity {cap} has a negative value")
    # NaN and infinity are not capacities (NaN would also make GET /v1/workers invalid JSON)
    limits = {"memory_mb": 2**40, "cpus": 65536, "disk_mb": 2**50, "slots": 100_000}
    for k, hi in limits.items():
        v = getattr(cap, k)
        if not math.isfinite(v) or v > hi:
            raise errors.InvalidRequest(f"info.capacity.{k}={v!r} is not a finite number from 0 to {hi}")
    if not math.isfinite(info.default_disk_mb) or info.default_disk_mb > limits["disk_mb"]:
        raise errors.InvalidRequest(f"info.default_disk_mb={info.default_disk_mb!r} is out of range")
    if len(info.templates) > 1000:
        raise errors.InvalidRequest("info.templates lists more than 1000 templates")
    for t in info.templates:
        if t.status not in ("missing", "building", "ready", "failed"):
            raise errors.InvalidRequest(
                f"info.templates: status {t.status[:40]!r} of {t.name[:64]!r} is unknown"
            )
        text("templates.name", t.name, 64)
        for what in ("hash", "progress", "description"):
            text(f"templates.{what}", getattr(t, what), 4096)
        if t.error is not None:
            text("templates.error", t.error, 4096)
        for pkg in t.packages:
            text("templates.packages", pkg, 256)


class WorkerRegistry:
    def __init__(
        self, database: dbm.Database, listener: Listener, *, lost_after_s: float, reconcile_s: float
    ):
        self.db = database
        self.listener = listener
        self.lost_after_s = lost_after_s
        self.reconcile_s = reconcile_s
        self.handles: dict[str, WorkerHandle] = {}
        self._by_name: dict[str, str] = {}
        self._loop: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set whenever a worker becomes ready or its templates change
        self.worker_tls: ssl.SSLContext | None = None  # https:// workers are called with it (main)
        self.shared = database.dialect != "sqlite"
        """Other servers may share the records (PostgreSQL): heartbeats are written to the
        workers table (every HEARTBEAT_WRITE_S), and a worker another server hears from is never
        marked lost, nor its sandboxes settled, by this one (`held_elsewhere`)."""
        self._seen_written: dict[str, float] = {}
        self._wrote_beat: dict[str, dt.datetime] = {}
        """The last heartbeat time this server wrote of each worker: reading it back is not
        another server hearing from it (`held_elsewhere`)."""
        self.token_key: bytes | None = None
        """The installation's secrets key (set by the manager): a worker's token is stored sealed
        with it on shared records, and other servers' workers' tokens are unsealed with it."""

    # ---- records --------------------------------------------------------------------------------
    def held_elsewhere(self, rec: dbm.WorkerRecord | None) -> bool:
        """Whether another server sharing the records heard this worker's heartbeat lately
        (within ATOLL_WORKER_LOST_S): it is alive there, whatever this server knows of it."""
        if not self.shared or rec is None or rec.last_heartbeat_at is None:
            return False
        at = _utc(rec.last_heartbeat_at)
        mine = self._wrote_beat.get(rec.id)
        if mine is not None and at <= mine:
            return False  # this server's own write, read back
        # heartbeats are written every HEARTBEAT_WRITE_S: the row is that much older between writes;
        # both times are the database's clock (`Database.now`), whatever this server's says
        return (self.db.now() - at).total_seconds() < self.lost_after_s + HEARTBEAT_WRITE_S

    def load(self) -> None:
        """The workers of earlier runs: every one is `lost` until it joins again. One that
        another server sharing the records hears from is left as that server wrote it (lost here
        only: this server has no connection to it, and never settles its sandboxes)."""
        for rec in self.db.workers():
            if self.held_elsewhere(rec):
                self._held_elsewhere_handle(rec)
                continue
            reason = (
                rec.state_reason
                if rec.state == "lost"
                else "waiting for it to register again after a server restart"
            )
            # lost as of now, not of its last heartbeat: the server's own downtime never counts
            # towards ATOLL_WORKER_GONE_S (its workers register again within a heartbeat)
            h = WorkerHandle(
                rec.id, rec.name, rec, state="lost", reason=reason, local=False, lost_since=time.time()
            )
            rec.state, rec.state_reason = "lost", reason
            self.handles[rec.id] = h
            self._by_name[rec.name] = rec.id
            self._save(h)
        self._loop = asyncio.ensure_future(self._watch())

    def _save(self, h: WorkerHandle, *, adopted: bool = False) -> None:
        """Write `h`'s row (not a borrowed one's: that is its holder's). `adopted`: it is ready
        now, drained or not as the row says under its lock — a borrower may have drained it (or
        asked for an evacuation) through the row at this very instant, which a write from this
        server's copy would undo."""
        if h.borrowed is not None:
            return  # its record is its holder's to write

        def cordon(row: dbm.WorkerRecord | None) -> None:
            if row is not None:
                h.record.draining, h.record.evacuation = row.draining, row.evacuation
            h.state, h.reason = ("draining", DRAINING) if h.record.draining else ("ready", None)
            h.record.state, h.record.state_reason = h.state, h.reason

        h.record.state, h.record.state_reason = h.state, h.reason
        if h.state in ("ready", "draining") and not adopted:
            h.record.draining = h.state == "draining"
        self.db.put_worker(h.record, under_lock=cordon if adopted else None)
        if h.record.last_heartbeat_at is not None:
            self._wrote_beat[h.id] = _utc(h.record.last_heartbeat_at)

    def get(self, worker_id: str) -> WorkerHandle:
        if not ids.WORKER_ID_RE.match(worker_id):
            raise errors.InvalidRequest(
                f"malformed worker id {errors.shown(worker_id)}: ids look like 'wk-' followed by 16 lower-case "
                "letters/digits (GET /v1/workers lists them)"
            )
        h = self.handles.get(worker_id)
        if h is None:
            raise errors.WorkerNotFound(f"worker {worker_id} does not exist; list them with GET /v1/workers")
        return h

    def name_of(self, worker_id: str) -> str | None:
        h = self.handles.get(worker_id)
        return h.name if h else None

    def api_for(self, worker_id: str) -> api.WorkerAPI:
        """The worker holding a sandbox, if it can be called now (else 503 worker_unavailable)."""
        h = self.handles.get(worker_id)
        if h is None or not h.usable or h.worker is None:
            name = h.name if h else worker_id
            why = f" ({h.reason})" if h and h.reason else ""
            raise errors.Unavailable(
                f"the sandbox's worker {name!r} is {h.state if h else 'unknown'}{why}; the call was not "
                "sent, so nothing about the sandbox changed — retry once the worker is ready again "
                "(GET /v1/workers)"
            )
        return h.worker

    def api_for_worker(self, h: WorkerHandle) -> api.WorkerAPI:
        if not h.usable or h.worker is None:
            raise errors.Unavailable(
                f"worker {h.name!r} is {h.state}" + (f" ({h.reason})" if h.reason else "")
            )
        return h.worker

    def ready(self) -> list[WorkerHandle]:
        return [h for h in self.handles.values() if h.state == "ready" and h.worker is not None]

    def templates(self) -> list[api.TemplateInfo]:
        """Every template a usable worker reports, once (the best status wins: ready > building >
        missing > failed), so that one worker still building does not hide another one's."""
        rank = {"ready": 0, "building": 1, "missing": 2, "failed": 3}
        best: dict[str, api.TemplateInfo] = {}
        for h in self.handles.values():
            if not h.usable:
                continue
            for t in h.templates.values():
                cur = best.get(t.name)
                if cur is None or rank.get(t.status, 9) < rank.get(cur.status, 9):
                    best[t.name] = t
        return [best[n] for n in sorted(best)]

    # ---- joining ----------------------------------------------------------------------------------
    async def attach_local(self, node: api.WorkerAPI) -> WorkerHandle:
        """The in-process worker of `atoll up`, adopted before the API serves."""
        info = await node.info()
        h = self._handle_for(info.name, info.installation)
        self._replace(h, node, info, local=True)
        await self._adopt(h)
        return h

    def register(self, body: dict, url: str) -> dict:
        """A remote worker registers (or registers again): issue a token, adopt it in the background.
        Everything is checked before anything changes (a refused registration leaves no trace)."""
        try:
            info = wire.load(api.WorkerInfo, body.get("info"), "worker registration")
        except errors.RuntimeFailure as e:
            raise errors.InvalidRequest(
                f"info is not a worker's info: {e.detail or e.message}"[:600]
            ) from None
        check_info(info)
        if info.protocol != api.PROTOCOL_VERSION:
            raise errors.IncompatibleProtocol(
                f"worker {info.name!r} speaks worker protocol {info.protocol}, this server speaks "
                f"{api.PROTOCOL_VERSION}; run the same atoll version on the server and its workers"
            )
        RemoteWorker.address(url)  # refused before anything is recorded
        if url.startswith("https://") and self.worker_tls is None:
            raise errors.InvalidRequest(
                f"worker URL {url!r} is https:// but this server has no CA to check it"
            )
        known = self.handles.get(self._by_name.get(info.name, ""))
        if known is not None and known.local:
            raise errors.Conflict(
                f"worker name {info.name!r} is this server's own in-process worker; give yours another --name",
                code="worker_conflict",
            )
        twin = next(
            (
                h
                for h in self.handles.values()
                if h.record.installation == info.installation and h.name != info.name
            ),
            None,
        )
        if twin is not None:
            raise errors.Conflict(
                f"installation {info.installation} (one ATOLL_HOME) is already registered as worker "
                f"{twin.name!r}; two workers cannot share a home — give this one its own --home, or start "
                f"it as {twin.name!r}",
                code="worker_conflict",
            )
        h = self._handle_for(info.name, info.installation)
        token = ids.new_token()
        remote = RemoteWorker(
            url,
            token,
            info.name,
            on_unreachable=lambda why: self._unreachable(h, remote, why),
            tunnel_port=info.tunnel_port,
            tls=self.worker_tls,
            # its token refused: it registered again since, with another server sharing the
            # records (with this one, `h.worker` is already another): lost here, held elsewhere
            on_refused=lambda why: self._unreachable(h, remote, why),
        )
        self._replace(h, remote, info, local=False)
        h.record.url = url
        h.record.token_sealed = self._seal(h.id, token)
        h.record.last_heartbeat_at = self.db.now()
        h.epoch = secrets.token_hex(8)
        h.last_seen = time.monotonic()
        self._save(h)
        self._adopt_later(h)
        log.info("worker.registered", extra={"worker": h.name, "worker_id": h.id, "url": url})
        return {
            "worker_id": h.id,
            "token": token,
            "epoch": h.epoch,
            "protocol": api.PROTOCOL_VERSION,
            "heartbeat_s": min(3.0, self.lost_after_s / 5),
            "lost_after_s": self.lost_after_s,
        }

    def _registration(self, worker_id: str, epoch: str | None) -> WorkerHandle:
        h = self.handles.get(worker_id)
        if h is None or h.local or not epoch or not h.epoch or not hmac.compare_digest(epoch, h.epoch):
            raise errors.Conflict(
                f"this server does not know registration {epoch!r} of worker {worker_id}; register again",
                code="worker_not_registered",
            )
        return h

    def heartbeat(self, worker_id: str, epoch: str | None) -> dict:
        h = self._registration(worker_id, epoch)
        h.last_seen = time.monotonic()
        h.record.last_heartbeat_at = self.db.now()
        if self.shared and h.last_seen - self._seen_written.get(h.id, 0.0) >= HEARTBEAT_WRITE_S:
            self.db.worker_seen(h.id, h.record.last_heartbeat_at)
            self._wrote_beat[h.id] = _utc(h.record.last_heartbeat_at)
            self._seen_written[h.id] = h.last_seen
        if h.state == "lost":  # came back before it noticed: take it over again
            h.state, h.reason = "joining", "heartbeats resumed"
            self._save(h)
            self._adopt_later(h)
        return {"state": h.state}

    def stopping(self, worker_id: str, epoch: str | None) -> None:
        """The worker says it stops (SIGTERM): lost at once, its sandboxes keep running."""
        h = self._registration(worker_id, epoch)
        self._stop_tasks(h)  # an adoption under way must not mark it ready afterwards
        h.epoch = None
        self._lose(h, "the worker stopped (its sandboxes keep running; they come back when it does)")

    def drain(self, worker_id: str, on: bool, *, evacuate: bool = False) -> WorkerHandle:
        """Cordon (`on`) or uncordon a ready or draining worker. One another server holds is drained
        through its row (`draining`, and with `evacuate` an evacuation to run): its holder follows
        within OTHERS_EVERY_S (`follow`) and runs the evacuation."""
        h = self.get(worker_id)
        if h.borrowed is not None:
            if h.state not in ("ready", "draining"):
                raise errors.Conflict(
                    f"worker {h.name!r} is {h.state}; only a ready worker can be drained or undrained",
                    code="invalid_state",
                )
            values: dict[str, typing.Any] = {"draining": on}
            if on and evacuate:
                ev = {"state": "running", "pending": [], "moved": [], "left": {}, "was_running": []}
                values["evacuation"] = {**ev, "started_at": dbm.utcnow().isoformat()}
            self.db.set_worker_columns(h.id, **values)
            h.record.draining = on
            if "evacuation" in values:
                h.record.evacuation = values["evacuation"]
            h.state, h.reason = ("draining", f"{DRAINING}; {BORROWED}") if on else ("ready", BORROWED)
            h.cordoned_at = time.monotonic()
            return h
        h.cordoned_at = time.monotonic()
        if on and h.state == "ready":
            h.state, h.reason = "draining", DRAINING
        elif not on and h.state == "draining":
            h.state, h.reason = "ready", None
        elif h.state not in ("ready", "draining"):
            raise errors.Conflict(
                f"worker {h.name!r} is {h.state}; only a ready worker can be drained or undrained",
                code="invalid_state",
            )
        self._save(h)
        return h

    def forget(self, worker_id: str) -> WorkerHandle:
        """Remove a lost worker for good (its sandboxes become failed: their host is gone)."""
        h = self.get(worker_id)
        if h.state != "lost" or h.local:
            raise errors.Conflict(
                f"worker {h.name!r} is {h.state}; only a lost remote worker can be removed",
                code="invalid_state",
            )
        if self.held_elsewhere(self.db.get_worker(worker_id)):
            raise errors.Conflict(
                f"worker {h.name!r} is lost here only: another server sharing the records hears its "
                "heartbeats and serves its sandboxes; remove it once no server does (or through the "
                "one that holds it, once it is lost there)",
                code="invalid_state",
            )
        self._stop_tasks(h)
        self.handles.pop(worker_id, None)
        self._by_name.pop(h.name, None)
        with self.db.session.begin() as s:
            rec = s.get(dbm.WorkerRecord, worker_id)
            if rec is not None:
                s.delete(rec)
        return h

    def _handle_for(self, name: str, installation: str) -> WorkerHandle:
        wid = self._by_name.get(name)
        if wid is None:
            # a worker another server sharing the records made (it joined that one after this
            # server started, and moves here now): the same record, not a second one
            stored = self.db.worker_by_name(name)
            if stored is not None:
                self.handles[stored.id] = WorkerHandle(stored.id, name, stored, state="lost", local=False)
                self._by_name[name] = wid = stored.id
        if wid is not None:
            h = self.handles[wid]
            if self.shared:
                # another server may have written it since (a drain and its evacuation, a cordon):
                # take the worker over with the record as the database has it, not this copy
                fresh = self.db.get_worker(wid)
                if fresh is not None:
                    h.record = fresh
            if h.record.installation and h.record.installation != installation:
                raise errors.Conflict(
                    f"a worker named {name!r} with another home (installation {h.record.installation}, "
                    f"this one is {installation}) is registered here; give this worker another --name, "
                    f"or remove the old one once it is lost (DELETE /v1/workers/{wid})",
                    code="worker_conflict",
                )
            return h
        rec = dbm.WorkerRecord(id=ids.new_worker_id(), name=name, state="joining", capacity={})
        h = WorkerHandle(rec.id, name, rec, last_seen=time.monotonic())
        self.handles[rec.id] = h
        self._by_name[name] = rec.id
        return h

    def _replace(self, h: WorkerHandle, worker: api.WorkerAPI, info: api.WorkerInfo, *, local: bool) -> None:
        self._stop_tasks(h)
        old = h.worker
        if old is not None and old is not worker:
            t = asyncio.ensure_future(old.aclose())
            h.tasks.append(t)
        h.worker, h.info, h.local, h.borrowed = worker, info, local, None
        h.state, h.reason = "joining", "reading its inventory"
        h.templates = {t.name: t for t in info.templates}
        h.builds = {b.build_id: b for b in info.builds}
        rec = h.record
        rec.installation, rec.version, rec.protocol = info.installation, info.version, info.protocol
        rec.capacity = wire.dump(info.capacity)
        rec.registered_at = dbm.utcnow()
        self._save(h)

    def _stop_tasks(self, h: WorkerHandle) -> None:
        current = asyncio.current_task()
        for t in h.tasks:
            if t is not current:
                t.cancel()
        h.tasks = [t for t in h.tasks if t is current]

    def _adopt_later(self, h: WorkerHandle) -> None:
        """`_adopt` in the background, detached from the request that asked for it (a registration
        or a heartbeat, under the worker's key): the adoption and what it starts — the
        reconciliation, a drain's evacuation resumed — act for the installation and must see every
        tenant's sandboxes (under the worker key each was "not found")."""
        loop = asyncio.get_running_loop()
        h.tasks.append(loop.create_task(self._adopt(h), context=auth.detached()))

    async def _adopt(self, h: WorkerHandle) -> None:
        """Give the worker its CA, read its inventory, reconcile the records with it, then serve it."""
        worker = h.worker
        assert worker is not None
        try:
            await self.listener.authorize_worker(h, worker)
            started = dbm.utcnow().timestamp()
            inv = await worker.inventory()
            await self.listener.worker_joined(h, inv, started)
            await self.listener.configure_worker(h, worker)
        except Exception as e:
            # lost again, so that its next heartbeat tries again: a handle left `joining` would
            # never be taken over (a heartbeat adopts only a lost one)
            why = e.message if isinstance(e, errors.AtollError) else f"{type(e).__name__}: {e}"
            if h.worker is worker and not h.local:
                self._lose(h, f"could not take it over: {why}")
            log.warning(
                "worker.adopt.failed",
                extra={"worker": h.name, "error": why},
                exc_info=not isinstance(e, errors.AtollError),
            )
            if h.local:
                raise
            return
        if h.worker is not worker:
            return
        # an operator's drain outlasts the worker's restarts (and the server's: it is in the record);
        # ready or draining as the row says when this write locks it (`_save`)
        h.state, h.reason = ("draining", DRAINING) if h.record.draining else ("ready", None)
        h.lost_since = None
        h.last_seen = time.monotonic()
        self._save(h, adopted=True)
        self.changed.set()
        log.info("worker.ready", extra={"worker": h.name, "worker_id": h.id})
        try:  # e.g. a drain's evacuation a server restart cut short goes on
            self.listener.worker_ready(h)
        except Exception:
            log.exception("worker.ready hook failed", extra={"worker": h.name})
        h.tasks.append(asyncio.ensure_future(self._consume(h, worker)))
        h.tasks.append(asyncio.ensure_future(self._reconcile_every(h, worker)))

    async def _consume(self, h: WorkerHandle, worker: api.WorkerAPI, *, borrowed: bool = False) -> None:
        """The worker's events, for as long as it is this handle's worker (reconnecting after a
        broken stream: what was missed meanwhile, the next reconciliation finds). The templates
        and builds it holds are kept on the handle (placement). A `borrowed` worker's events reach
        the listener only when they are not its holder's alone (BORROWED_EVENTS: resource use,
        for metering and metrics on the lease holder, which may be this server, and activity, for
        the idle policy); deaths, phase changes and builds are its holder's to act on (it writes
        the records; this server reads them)."""
        what = "borrowed worker" if borrowed else "worker"
        while h.worker is worker:
            try:
                async for ev in worker.events():
                    if h.worker is not worker:
                        return
                    if isinstance(ev, api.TemplateChanged):
                        h.templates[ev.template.name] = ev.template
                        self.changed.set()
                        continue
                    if isinstance(ev, api.BuildChanged):
                        h.builds[ev.build.build_id] = ev.build
                    if borrowed and not isinstance(ev, BORROWED_EVENTS):
                        continue
                    try:
                        await self.listener.worker_event(h, ev)
                    except Exception:
                        log.exception("%s event failed", what, extra={"worker": h.name})
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a broken stream: try again shortly
                log.debug("%s event stream broke: %r", what, e, extra={"worker": h.name})
            await asyncio.sleep(1.0)

    async def _reconcile_every(self, h: WorkerHandle, worker: api.WorkerAPI) -> None:
        while h.worker is worker:
            await asyncio.sleep(self.reconcile_s)
            if h.state not in ("ready", "draining"):
                continue
            try:
                await self.reconcile(h)
            except errors.AtollError as e:
                log.info("worker.reconcile.skipped", extra={"worker": h.name, "error": e.message})

    async def reconcile(self, h: WorkerHandle) -> None:
        if h.worker is None:
            raise errors.Unavailable(f"worker {h.name!r} is {h.state}")
        started = dbm.utcnow().timestamp()
        inv = await h.worker.inventory()
        await self.listener.worker_joined(h, inv, started)

    def _unreachable(self, h: WorkerHandle, worker: api.WorkerAPI, why: str) -> None:
        """A call found the worker gone (connection refused, reset): lost now, not only when its
        heartbeats stop; it is taken over again when it registers or heartbeats."""
        if h.worker is worker and h.state in ("ready", "draining"):
            self._lose(h, why)

    def _lose(self, h: WorkerHandle, reason: str) -> None:
        """Lost: calls to it answer 503 from now on, and the calls in flight end now with 503 (they
        would wait on a stopped worker forever); its event stream and reconciliation stop until it
        is taken over again."""
        if h.state == "lost":
            return
        if h.borrowed is not None:
            self._unborrow(h, reason)
            return
        log.warning("worker.lost", extra={"worker": h.name, "reason": reason})
        h.state, h.reason, h.lost_since = "lost", reason, time.time()
        if isinstance(h.worker, RemoteWorker):
            self._stop_tasks(h)
            h.worker.abort_calls()
        if self.shared:
            try:
                elsewhere = self.held_elsewhere(self.db.get_worker(h.id))
            except dbm.UNAVAILABLE:
                # the records cannot be read (nor written): lost here; nothing is settled while
                # the database fails or for ATOLL_WORKER_LOST_S after (lost_workers.sweep)
                return
            if elsewhere:
                # it registered with another server since: alive there; its row is that server's
                h.reason, h.lost_since = HELD_ELSEWHERE, None
                return
        self._save(h)

    async def _watch(self) -> None:
        """Mark remote workers whose heartbeats stopped `lost`; on shared records, every
        OTHERS_EVERY_S, look at the workers other servers hold (`others`, in a task of its own: a
        slow worker there never delays this watch)."""
        seen_others = -OTHERS_EVERY_S
        others: asyncio.Task | None = None
        try:
            while True:
                await asyncio.sleep(1.0)
                now = time.monotonic()
                if self.shared and now - seen_others >= OTHERS_EVERY_S and (others is None or others.done()):
                    seen_others = now
                    others = asyncio.ensure_future(self.others())
                for h in self.silent(now):
                    try:
                        self._lose(h, f"no heartbeat for {now - h.last_seen:.0f}s")
                    except Exception:  # one worker's bad record must not stop the watch of the others
                        log.exception("marking worker %s lost failed", h.name)
        finally:
            if others is not None:
                others.cancel()

    async def others(self) -> None:
        """One look at the workers other servers sharing the records hold: list those that joined
        one since this server started (`learn_others`), and call those alive there through their
        stored token (`_borrow`), so that any server serves any sandbox."""
        read_at = time.monotonic()
        try:
            recs = self.db.workers()
            if self.listener is not None:  # placement and views count what other servers placed
                self.listener.refresh_records()
        except Exception:  # noqa: BLE001 - the database may be away: next time
            log.debug("reading the workers other servers hold failed", exc_info=True)
            return
        self.learn_others(recs)
        self.follow(recs, read_at)
        for rec in recs:
            h = self.handles.get(rec.id)
            if h is None:
                continue
            try:
                await self._borrow(h, rec)
            except Exception:  # noqa: BLE001 - one worker must not stop the look at the others
                log.warning(
                    "calling worker %s through another server's registration failed", h.name, exc_info=True
                )

    def follow(self, recs: list[dbm.WorkerRecord], read_at: float) -> None:
        """A worker this server holds that another server drained or undrained through its row
        (a borrower's `drain`): take the cordon over, and run or stop the evacuation here (also
        an evacuation asked for a worker already cordoned)."""
        for rec in recs:
            h = self.handles.get(rec.id)
            if h is None or h.local or h.borrowed is not None or h.worker is None or h.cordoned_at > read_at:
                continue
            if rec.draining and h.state == "ready":
                h.state, h.reason = "draining", DRAINING
            elif not rec.draining and h.state == "draining":
                h.state, h.reason = "ready", None
            elif not (rec.draining and _asked_evacuation(rec, h.record)):
                continue
            h.record.draining, h.record.evacuation = rec.draining, rec.evacuation
            if rec.state != h.state and h.state in ("ready", "draining"):
                # the row's `state` too (this server holds the worker): other servers read it, and
                # an undrain followed here must not leave the row `draining` for them
                h.record.state = h.state
                self.db.set_worker_columns(h.id, state=h.state)
            log.info("worker.cordon.followed", extra={"worker": h.name, "draining": rec.draining})
            self.changed.set()
            if self.listener is not None:
                self.listener.worker_cordoned(h, rec.draining)

    def learn_others(self, recs: list[dbm.WorkerRecord] | None = None) -> None:
        """Workers that joined another server sharing the records since this one started: listed
        here (lost here until `_borrow` can call them; held elsewhere, so never settled by this
        server) so that GET /v1/workers and sandbox objects name them."""
        for rec in self.db.workers() if recs is None else recs:
            if rec.id in self.handles or rec.name in self._by_name:
                continue
            self._held_elsewhere_handle(rec, held=self.held_elsewhere(rec))

    def _held_elsewhere_handle(self, rec: dbm.WorkerRecord, *, held: bool = True) -> WorkerHandle:
        """List a worker another server sharing the records made: lost here (this server has no
        connection to it; `_borrow` may call it later). `held` (another server hears from it):
        never settled by this server, so not counted as lost; else lost as of now, for the reason
        its row gives."""
        h = WorkerHandle(
            rec.id,
            rec.name,
            rec,
            state="lost",
            reason=HELD_ELSEWHERE if held else rec.state_reason,
            local=False,
            lost_since=None if held else time.time(),
        )
        self.handles[rec.id] = h
        self._by_name[rec.name] = rec.id
        return h

    # ---- workers other servers hold ----------------------------------------------------------------
    def _seal(self, worker_id: str, token: str) -> str | None:
        """A worker's token as stored for the other servers sharing the records (None on SQLite)."""
        if not self.shared or self.token_key is None:
            return None
        return secretbox.seal(self.token_key, token, f"worker-token/{worker_id}")

    def owns_record(self, h: WorkerHandle) -> bool:
        """Whether this server may write `h`'s row: it holds the worker, or the worker is lost and
        no other server sharing the records hears from it (reads the row then)."""
        if h.borrowed is not None:
            return False
        if h.local or h.state != "lost":
            return True
        return not self.held_elsewhere(self.db.get_worker(h.id))

    @staticmethod
    def _holds(h: WorkerHandle) -> bool:
        """This server holds the worker: its own, or registered here and not lost (one lost here
        that another server hears from moved there: it is borrowed like any other)."""
        return h.local or (h.worker is not None and h.borrowed is None and h.state != "lost")

    async def _borrow(self, h: WorkerHandle, rec: dbm.WorkerRecord) -> None:
        """Call a worker another server holds with the token that server stored, while that server
        hears its heartbeats: its sandboxes are served here as there (no 503 on the replica a load
        balancer picked). A borrowed worker is never marked lost, settled, reconciled or written by
        this server; it is let go when its holder stops hearing it, its token changes, or a call
        finds it unreachable (the next look borrows it again)."""
        if self._holds(h):
            return  # this server holds it
        held = self.held_elsewhere(rec)
        if held and rec.state not in ("ready", "draining"):
            # its holder is adopting it, or it said it stops (lost there at once, though its
            # heartbeat was heard lately): not called here until its holder says it is ready
            if h.borrowed is not None:
                self._unborrow(h, f"it is {rec.state} on the server that holds it")
            return
        if not held or not rec.url or not rec.token_sealed or self.token_key is None:
            if h.borrowed is not None:
                self._unborrow(h, "its heartbeats no longer reach any server sharing the records")
            return
        state = "draining" if rec.draining or rec.state == "draining" else "ready"
        if h.borrowed == rec.token_sealed and h.worker is not None and h.record.url == rec.url:
            worker = h.worker
            try:  # what it holds now (templates, builds), in case an event was missed
                info = await asyncio.wait_for(worker.info(), BORROW_TIMEOUT_S)
            except (errors.AtollError, TimeoutError) as e:
                if h.worker is worker:
                    self._unborrow(h, f"it did not answer `info`: {getattr(e, 'message', repr(e))}")
                return
            if h.worker is worker:
                h.record, h.info, h.state = rec, info, state
                h.reason = BORROWED if state == "ready" else f"{DRAINING}; {BORROWED}"
                h.templates = {t.name: t for t in info.templates}
                h.builds = {b.build_id: b for b in info.builds}
            return
        try:
            token = secretbox.unseal(self.token_key, rec.token_sealed, f"worker-token/{rec.id}")
        except Exception as e:  # noqa: BLE001 - another key, or a damaged row: say so, leave it lost
            h.reason = f"{HELD_ELSEWHERE}; its stored token cannot be unsealed with this server's secrets key ({type(e).__name__}): give every server the same ATOLL_SECRETS_KEY_FILE"
            return
        remote: RemoteWorker | None = None

        def gone(why: str) -> None:
            if remote is not None and h.worker is remote:
                self._unborrow(h, why)

        try:
            remote = RemoteWorker(
                rec.url, token, rec.name, on_unreachable=gone, tls=self.worker_tls, on_refused=gone
            )
        except errors.AtollError as e:
            h.reason = f"{HELD_ELSEWHERE}; this server cannot call it at {rec.url}: {e.message}"
            return
        try:
            info = await asyncio.wait_for(remote.info(), BORROW_TIMEOUT_S)
        except (errors.AtollError, TimeoutError) as e:
            h.reason = f"{HELD_ELSEWHERE}; it did not answer this server: {getattr(e, 'message', repr(e))}"[
                :600
            ]
            await remote.aclose()
            return
        if info.name != rec.name or info.installation != rec.installation:
            log.warning(
                "worker.borrow.mismatch",
                extra={"worker": rec.name, "answered": info.name, "installation": info.installation},
            )
            h.reason = f"{HELD_ELSEWHERE}; the worker at {rec.url} is {info.name!r}, not {rec.name!r}"
            await remote.aclose()
            return
        if self._holds(h):
            await remote.aclose()  # it registered with this server meanwhile
            return
        old = h.worker
        h.epoch = None  # a registration with this server it left: it registers again to come back
        remote.tunnel_port = info.tunnel_port
        h.worker, h.info, h.borrowed, h.record = remote, info, rec.token_sealed, rec
        h.state, h.lost_since = state, None
        h.reason = BORROWED if state == "ready" else f"{DRAINING}; {BORROWED}"
        h.templates = {t.name: t for t in info.templates}
        h.builds = {b.build_id: b for b in info.builds}
        self._stop_tasks(h)
        if isinstance(old, RemoteWorker):
            h.tasks.append(asyncio.ensure_future(old.aclose()))
        h.tasks.append(asyncio.ensure_future(self._consume(h, remote, borrowed=True)))
        self.changed.set()
        log.info("worker.borrowed", extra={"worker": h.name, "worker_id": h.id, "url": rec.url})

    def _unborrow(self, h: WorkerHandle, why: str) -> None:
        """Stop calling a borrowed worker (calls in flight end with 503): lost here, held elsewhere
        (never settled by this server); the next look borrows it again if it can."""
        worker = h.worker
        h.worker, h.borrowed = None, None
        h.state, h.reason, h.lost_since = (
            "lost",
            f"{HELD_ELSEWHERE}; this server cannot call it now: {why}"[:600],
            None,
        )
        log.info("worker.unborrowed", extra={"worker": h.name, "reason": why})
        self._stop_tasks(h)
        if isinstance(worker, RemoteWorker):
            worker.abort_calls()
            h.tasks.append(asyncio.ensure_future(worker.aclose()))

    def silent(self, now: float) -> list[WorkerHandle]:
        """The remote workers whose heartbeats stopped for ATOLL_WORKER_LOST_S — none while the
        records database failed lately: heartbeats (their key is checked there) could not get
        through then, which says nothing about the workers."""
        if now - self.db.trouble_at < self.lost_after_s:
            return []
        return [
            h
            for h in self.handles.values()
            if not h.local
            and h.borrowed is None
            and h.state in ("ready", "draining", "joining")
            and now - h.last_seen > self.lost_after_s
        ]

    async def aclose(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
        for h in self.handles.values():
            self._stop_tasks(h)
            if h.worker is not None and not h.local:
                with contextlib.suppress(Exception):
                    await h.worker.aclose()


def _asked_evacuation(rec: dbm.WorkerRecord, mine: dbm.WorkerRecord) -> bool:
    """Another server asked, through the row, for an evacuation of a worker this server already
    keeps cordoned: the row holds a running evacuation this server did not write."""
    ev = rec.evacuation
    return isinstance(ev, dict) and ev.get("state") == "running" and ev != mine.evacuation


def _utc(at: dt.datetime) -> dt.datetime:
    """A time read from the records as UTC (SQLite hands them back naive)."""
    return at if at.tzinfo else at.replace(tzinfo=dt.UTC)

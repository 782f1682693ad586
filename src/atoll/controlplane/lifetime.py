"""Sandbox lifetimes and live settings: `timeout_s` / `on_timeout` turned into the persisted
`expires_at`, what the policy does when one ends, and PATCH /v1/sandboxes/{id}.

A lifetime is a wall-clock deadline on the record (db.SandboxRecord.expires_at, so it survives a
control-plane restart). When it passes, the tier policy (controlplane.policy) either deletes the
sandbox (`on_timeout: "delete"`, in any state) or moves it to the disk tier (`"pause"`, the
default, from running or the memory tier; a sandbox already on disk only loses its lifetime).
A "pause" expiry clears the lifetime once the sandbox is on disk: a later resume (any call)
gives a sandbox without a lifetime, which the user extends again with PATCH `timeout_s`. A
checkpoint the gate refuses leaves the sandbox in the memory tier with its lifetime, retried
like the policy's own disk pauses. A pause expiry waits for calls in flight to end; a delete
expiry does not.
Warm pools' sandboxes have no lifetime until claimed (a claim sets the caller's); a fork's copies
inherit the parent's deadline and `on_timeout` (a copy never outlives the bound set on its
parent).

Called by controlplane.lifecycle (create), controlplane.pools (claim), controlplane.forking,
controlplane.policy (expiry) and routes_sandboxes (PATCH).
"""

from __future__ import annotations

import datetime as dt
import logging
import typing

from atoll.controlplane import db as dbm

if typing.TYPE_CHECKING:
    from atoll.controlplane.ledger import Ledger
    from atoll.controlplane.schemas import UpdateSandbox

log = logging.getLogger(__name__)

ON_TIMEOUT = ("pause", "delete")


def deadline(timeout_s: float | None, now: dt.datetime | None = None) -> dt.datetime | None:
    """The end of a lifetime of `timeout_s` seconds from `now` (None: no lifetime)."""
    if timeout_s is None:
        return None
    return (now or dbm.utcnow()) + dt.timedelta(seconds=timeout_s)


def aware(t: dt.datetime) -> dt.datetime:
    """SQLite hands datetimes back naive; they are UTC."""
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def expired(rec: dbm.SandboxRecord, wall: dt.datetime) -> bool:
    return rec.expires_at is not None and not rec.pooled and aware(rec.expires_at) <= wall


def clear(manager: Ledger, rec: dbm.SandboxRecord) -> None:
    """The lifetime is spent (its "pause" happened): the sandbox lives on without one."""
    rec.expires_at = None
    manager.save(rec, ["expires_at"])
    log.info("sandbox.lifetime.cleared", extra={"sandbox_id": rec.id})


def update(manager: Ledger, sid: str, req: UpdateSandbox) -> dbm.SandboxRecord:
    """Apply a PATCH: only the fields sent change; `timeout_s` counts from now, null removes the
    lifetime; `metadata` replaces the labels. Live: the policy reads the record on its next pass.
    Works in every state (the record is all it changes; nothing is resumed)."""
    rec = manager.get(sid)
    sent = req.model_fields_set
    changes: dict[str, typing.Any] = {}
    for name in ("idle_timeout_s", "disk_after_s", "archive_after_s", "on_timeout", "on_worker_lost"):
        if name in sent:
            changes[name] = getattr(req, name)
    if "metadata" in sent:
        changes["metadata_"] = dict(req.metadata or {})
    if "timeout_s" in sent:
        changes["expires_at"] = deadline(req.timeout_s)
    if "on_timeout" in changes and rec.compat:  # E2B's name for it follows (docs/e2b-compat.md)
        changes["compat"] = {**rec.compat, "on_timeout": "kill" if req.on_timeout == "delete" else "pause"}
    for k, v in changes.items():
        setattr(rec, k, v)
    if changes:
        manager.save(rec, list(changes))
    log.info(
        "sandbox.settings.updated",
        extra={"sandbox_id": sid, "fields": sorted(sent), "expires_at": str(rec.expires_at)},
    )
    return rec

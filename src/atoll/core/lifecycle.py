"""The one lifecycle model: the sandbox's states (standby keyed by tier) and the worker's phases,
each with its transition table.

Sandbox (what records and the API say; the control plane writes it):

    creating ──start──▶ running ──freeze──▶ standby(memory) ──checkpoint──▶ standby(disk)
                          ▲  └────────────checkpoint─────────────────────────────┘  │
                          │                                   archive ▼ ▲ unarchive (also from
                          │                                        standby(archive)  running, memory)
                          └───────────────────resume (from any standby tier)────────┘
    + fail (from anything but deleted) ▶ failed;  delete (from anything but deleted) ▶ deleted

A tier is part of the status (`Status(STANDBY, Tier.DISK)`), so "pause to disk" is one verb whose
rows say where it may start; `archive` (the disk tier's snapshot and writable layer in an object
store, worker.host.archive) is one more Tier and its rows.

Worker phase (what one worker knows about one runtime on its host; `worker.runtime` writes it):

    creating ─booted─▶ running ⇄ frozen          running ─begin_checkpoint─▶ checkpointing
    checkpointing ─commit_checkpoint─▶ checkpointed ─begin_restore─▶ restoring ─restored─▶ running
    checkpointing ─abort_checkpoint─▶ running     restoring ─restore_failed─▶ checkpointed
    checkpointed ─begin_archive─▶ archiving ─commit_archive─▶ archived ─unarchived─▶ checkpointed
    archiving ─abort_archive─▶ checkpointed (the store failed: the disk copy is kept)
    + fail ▶ failed, delete ▶ deleting (from every phase but deleting)

`PUBLIC_STATUS` maps a phase to the sandbox status it shows; reconciliation moves a record to the
status its worker observed along `path_to` (every write goes through `check_transition`).
Pure: called by the control plane (records), the worker (runtime phases) and tests.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from atoll.core import errors


class State(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    STANDBY = "standby"
    DELETED = "deleted"
    FAILED = "failed"


class Tier(enum.StrEnum):
    MEMORY = "memory"
    DISK = "disk"
    ARCHIVE = "archive"


@dataclass(frozen=True, slots=True)
class Status:
    """A sandbox's lifecycle status: its state, and the tier when it is in standby."""

    state: State
    tier: Tier | None = None

    def __str__(self) -> str:
        return f"{self.state.value}({self.tier.value})" if self.tier else self.state.value


CREATING = Status(State.CREATING)
RUNNING = Status(State.RUNNING)
STANDBY_MEMORY = Status(State.STANDBY, Tier.MEMORY)
STANDBY_DISK = Status(State.STANDBY, Tier.DISK)
STANDBY_ARCHIVE = Status(State.STANDBY, Tier.ARCHIVE)
FAILED = Status(State.FAILED)
DELETED = Status(State.DELETED)
STATUSES = (CREATING, RUNNING, STANDBY_MEMORY, STANDBY_DISK, STANDBY_ARCHIVE, FAILED, DELETED)
STANDBYS = (STANDBY_MEMORY, STANDBY_DISK, STANDBY_ARCHIVE)


def status(state: str, tier: str | None = None) -> Status:
    """The Status of a record's (state, standby_tier) columns."""
    st = State(state)
    return Status(st, Tier(tier) if st == State.STANDBY and tier else None)


class Verb(enum.StrEnum):
    START = "start"
    FREEZE = "freeze"  # to the memory tier
    CHECKPOINT = "checkpoint"  # to the disk tier
    ARCHIVE = "archive"  # to the archive tier
    UNARCHIVE = "unarchive"  # back on its worker's disk (downloaded; a restore after it failed)
    RESUME = "resume"
    FAIL = "fail"
    DELETE = "delete"


TRANSITIONS: dict[tuple[Status, Verb], Status] = {
    (CREATING, Verb.START): RUNNING,
    (RUNNING, Verb.FREEZE): STANDBY_MEMORY,
    (RUNNING, Verb.CHECKPOINT): STANDBY_DISK,
    (STANDBY_MEMORY, Verb.CHECKPOINT): STANDBY_DISK,
    (RUNNING, Verb.ARCHIVE): STANDBY_ARCHIVE,
    (STANDBY_MEMORY, Verb.ARCHIVE): STANDBY_ARCHIVE,
    (STANDBY_DISK, Verb.ARCHIVE): STANDBY_ARCHIVE,
    (STANDBY_ARCHIVE, Verb.UNARCHIVE): STANDBY_DISK,
    **{(s, Verb.RESUME): RUNNING for s in STANDBYS},
    **{(s, Verb.FAIL): FAILED for s in (CREATING, RUNNING, *STANDBYS)},
    **{(s, Verb.DELETE): DELETED for s in (CREATING, RUNNING, *STANDBYS, FAILED)},
}

# The verb that pauses to a tier, and the order of tiers: pausing to a colder tier moves there, to
# the same tier changes nothing, to a warmer one while in standby is a conflict (resume first).
PAUSE_VERB = {Tier.MEMORY: Verb.FREEZE, Tier.DISK: Verb.CHECKPOINT, Tier.ARCHIVE: Verb.ARCHIVE}
TIER_ORDER = {Tier.MEMORY: 0, Tier.DISK: 1, Tier.ARCHIVE: 2}


def check_transition(current: Status, verb: Verb) -> Status:
    """Return the status after `verb`, or raise Conflict(invalid_state) naming what is allowed."""
    try:
        return TRANSITIONS[(current, verb)]
    except KeyError:
        allowed = sorted(v.value for (s, v) in TRANSITIONS if s == current)
        raise errors.Conflict(
            f"cannot {verb.value} a sandbox in state {current}; allowed from {current}: "
            f"{', '.join(allowed) or 'nothing'}",
            code="invalid_state",
        ) from None


def path_to(current: Status, target: Status) -> list[Verb]:
    """The shortest run of verbs that takes a record from `current` to `target` (reconciliation:
    the record follows what its worker observed); [] when equal. Raises Conflict when no path
    exists (e.g. anything back to creating, or out of deleted)."""
    if current == target:
        return []
    seen: dict[Status, list[Verb]] = {current: []}
    todo = collections.deque([current])
    while todo:
        at = todo.popleft()
        for (src, verb), dst in TRANSITIONS.items():
            if src != at or dst in seen or verb == Verb.DELETE and target != DELETED:
                continue
            seen[dst] = [*seen[at], verb]
            if dst == target:
                return seen[dst]
            todo.append(dst)
    raise errors.Conflict(f"no transition leads from {current} to {target}", code="invalid_state")


# ---- the worker's phases --------------------------------------------------------------------


class Phase(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    FROZEN = "frozen"
    CHECKPOINTING = "checkpointing"
    CHECKPOINTED = "checkpointed"
    RESTORING = "restoring"
    ARCHIVING = "archiving"
    ARCHIVED = "archived"
    FAILED = "failed"
    DELETING = "deleting"


class Step(enum.StrEnum):
    BOOTED = "booted"
    FREEZE = "freeze"
    THAW = "thaw"
    BEGIN_CHECKPOINT = "begin_checkpoint"
    COMMIT_CHECKPOINT = "commit_checkpoint"
    ABORT_CHECKPOINT = "abort_checkpoint"  # the checkpoint did not happen and the sandbox runs on
    BEGIN_RESTORE = "begin_restore"
    RESTORED = "restored"
    RESTORE_FAILED = "restore_failed"  # the image is still committed: it stays checkpointed
    BEGIN_ARCHIVE = "begin_archive"
    COMMIT_ARCHIVE = "commit_archive"  # the object is stored and verified: the disk copy may go
    ABORT_ARCHIVE = "abort_archive"  # the store failed: the disk copy is kept
    UNARCHIVED = "unarchived"  # downloaded, verified and unpacked: on disk again
    ADOPTED = "adopted"  # another worker's archived sandbox, taken over from the store
    FAIL = "fail"
    DELETE = "delete"


PHASE_TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (Phase.CREATING, Step.BOOTED): Phase.RUNNING,
    (Phase.RUNNING, Step.FREEZE): Phase.FROZEN,
    (Phase.FROZEN, Step.THAW): Phase.RUNNING,
    (Phase.RUNNING, Step.BEGIN_CHECKPOINT): Phase.CHECKPOINTING,
    (Phase.CHECKPOINTING, Step.COMMIT_CHECKPOINT): Phase.CHECKPOINTED,
    (Phase.CHECKPOINTING, Step.ABORT_CHECKPOINT): Phase.RUNNING,
    (Phase.CHECKPOINTED, Step.BEGIN_RESTORE): Phase.RESTORING,
    (Phase.RESTORING, Step.RESTORED): Phase.RUNNING,
    (Phase.RESTORING, Step.RESTORE_FAILED): Phase.CHECKPOINTED,
    (Phase.CHECKPOINTED, Step.BEGIN_ARCHIVE): Phase.ARCHIVING,
    (Phase.ARCHIVING, Step.COMMIT_ARCHIVE): Phase.ARCHIVED,
    (Phase.ARCHIVING, Step.ABORT_ARCHIVE): Phase.CHECKPOINTED,
    (Phase.ARCHIVED, Step.UNARCHIVED): Phase.CHECKPOINTED,
    (Phase.CREATING, Step.ADOPTED): Phase.ARCHIVED,
    **{(p, Step.FAIL): Phase.FAILED for p in Phase if p not in (Phase.FAILED, Phase.DELETING)},
    **{(p, Step.DELETE): Phase.DELETING for p in Phase if p != Phase.DELETING},
}

# What a runtime in each phase shows as the sandbox's status. A phase in the middle of a step
# shows where the sandbox still is: a checkpoint that has not committed leaves it running, a
# restore that has not finished leaves it on disk.
PUBLIC_STATUS: dict[Phase, Status] = {
    Phase.CREATING: CREATING,
    Phase.RUNNING: RUNNING,
    Phase.FROZEN: STANDBY_MEMORY,
    Phase.CHECKPOINTING: RUNNING,
    Phase.CHECKPOINTED: STANDBY_DISK,
    Phase.RESTORING: STANDBY_DISK,
    Phase.ARCHIVING: STANDBY_DISK,
    Phase.ARCHIVED: STANDBY_ARCHIVE,
    Phase.FAILED: FAILED,
    Phase.DELETING: DELETED,
}


def advance(phase: Phase, step: Step) -> Phase:
    """The phase after `step`; a step the table does not allow is a bug in the worker (500)."""
    try:
        return PHASE_TRANSITIONS[(phase, step)]
    except KeyError:
        raise errors.RuntimeFailure(
            f"internal error: the worker tried to {step.value} a runtime in phase {phase.value}",
        ) from None

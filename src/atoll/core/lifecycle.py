"""The sandbox lifecycle state machine: states, standby tiers and the allowed transitions.

    creating → running ⇄ standby(memory|disk) → deleted      (+ failed from anywhere but deleted)

Pure: the control plane asks `check_transition` before it persists a new state, tests walk the table.
"""

from __future__ import annotations

import enum

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


# (from_state, verb) -> to_state
TRANSITIONS: dict[tuple[State, str], State] = {
    (State.CREATING, "start"): State.RUNNING,
    (State.CREATING, "fail"): State.FAILED,
    (State.CREATING, "delete"): State.DELETED,
    (State.RUNNING, "pause"): State.STANDBY,
    (State.RUNNING, "fail"): State.FAILED,
    (State.RUNNING, "delete"): State.DELETED,
    (State.STANDBY, "pause"): State.STANDBY,  # memory -> disk
    (State.STANDBY, "resume"): State.RUNNING,
    (State.STANDBY, "fail"): State.FAILED,
    (State.STANDBY, "delete"): State.DELETED,
    (State.FAILED, "delete"): State.DELETED,
}

# Order of tiers: pausing to a "colder" tier moves there; to the same tier changes nothing;
# to a warmer tier while in standby is a conflict (resume first).
TIER_ORDER = {Tier.MEMORY: 0, Tier.DISK: 1}


def check_transition(state: State, verb: str) -> State:
    """Return the state after `verb`, or raise Conflict(invalid_state) naming what is allowed."""
    try:
        return TRANSITIONS[(state, verb)]
    except KeyError:
        allowed = sorted(v for (s, v) in TRANSITIONS if s == state)
        raise errors.Conflict(
            f"cannot {verb} a sandbox in state {state.value!r}; allowed from {state.value!r}: "
            f"{', '.join(allowed) or 'nothing'}",
            code="invalid_state",
        ) from None

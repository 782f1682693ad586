"""The one lifecycle model (core.lifecycle): the sandbox table with tiers, the worker's phase table,
the map between them, and the paths reconciliation walks — checked exhaustively and by hypothesis."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from atoll.core import errors, ids
from atoll.core.lifecycle import (
    CREATING,
    DELETED,
    FAILED,
    PHASE_TRANSITIONS,
    PUBLIC_STATUS,
    RUNNING,
    STANDBY_DISK,
    STANDBY_MEMORY,
    STATUSES,
    TRANSITIONS,
    Phase,
    Step,
    Verb,
    advance,
    check_transition,
    path_to,
    status,
)


def test_table_has_no_exit_from_deleted():
    assert not [k for k in TRANSITIONS if k[0] == DELETED]
    assert not [k for k in PHASE_TRANSITIONS if k[0] == Phase.DELETING]


def test_every_live_state_can_be_deleted_and_fail():
    for s in (CREATING, RUNNING, STANDBY_MEMORY, STANDBY_DISK):
        assert check_transition(s, Verb.DELETE) == DELETED
        assert check_transition(s, Verb.FAIL) == FAILED
    assert check_transition(FAILED, Verb.DELETE) == DELETED


def test_the_tier_is_part_of_the_state():
    assert check_transition(RUNNING, Verb.FREEZE) == STANDBY_MEMORY
    assert check_transition(RUNNING, Verb.CHECKPOINT) == STANDBY_DISK
    assert check_transition(STANDBY_MEMORY, Verb.CHECKPOINT) == STANDBY_DISK
    with pytest.raises(errors.Conflict):  # disk -> memory needs a resume first
        check_transition(STANDBY_DISK, Verb.FREEZE)
    assert status("standby", "disk") == STANDBY_DISK and status("running", None) == RUNNING
    assert str(STANDBY_MEMORY) == "standby(memory)"


def test_invalid_transition_names_allowed_verbs():
    with pytest.raises(errors.Conflict) as e:
        check_transition(RUNNING, Verb.RESUME)
    assert e.value.code == "invalid_state"
    assert "resume" in e.value.message and "freeze" in e.value.message and "checkpoint" in e.value.message


def test_every_phase_shows_a_status_and_its_steps_agree_with_the_sandbox_table():
    """A step of the worker never moves the public status along a path the sandbox table forbids."""
    assert set(PUBLIC_STATUS) == set(Phase)
    for (phase, _step), after in PHASE_TRANSITIONS.items():
        before_s, after_s = PUBLIC_STATUS[phase], PUBLIC_STATUS[after]
        if before_s != after_s:
            path_to(before_s, after_s)  # raises if the sandbox table has no such path


@pytest.mark.parametrize("src,dst", list(itertools.product(STATUSES, STATUSES)))
def test_path_to_walks_the_table(src, dst):
    try:
        verbs = path_to(src, dst)
    except errors.Conflict:
        no_way_back = dst == CREATING or src in (DELETED, FAILED)  # final states, and creating is first
        assert no_way_back and src != dst and dst != DELETED or src == DELETED
        return
    cur = src
    for verb in verbs:
        cur = check_transition(cur, verb)
    assert cur == dst
    assert Verb.DELETE not in verbs or dst == DELETED


def test_worker_steps_out_of_order_are_bugs():
    assert advance(Phase.RUNNING, Step.FREEZE) == Phase.FROZEN
    with pytest.raises(errors.RuntimeFailure, match="checkpointed"):
        advance(Phase.CHECKPOINTED, Step.FREEZE)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = CREATING
        self.history = [CREATING]

    @rule(verb=st.sampled_from(list(Verb)))
    def apply(self, verb):
        if (self.state, verb) in TRANSITIONS:
            self.state = check_transition(self.state, verb)
            self.history.append(self.state)
        else:
            with pytest.raises(errors.Conflict):
                check_transition(self.state, verb)

    @invariant()
    def deleted_is_terminal(self):
        if DELETED in self.history:
            assert self.history[-1] == DELETED

    @invariant()
    def never_back_to_creating(self):
        assert CREATING not in self.history[1:]

    @invariant()
    def failed_only_to_deleted(self):
        if FAILED in self.history:
            assert set(self.history[self.history.index(FAILED) :]) <= {FAILED, DELETED}


TestLifecycle = Lifecycle.TestCase


class Phases(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.phase = Phase.CREATING

    @rule(step=st.sampled_from(list(Step)))
    def step(self, step):
        if (self.phase, step) in PHASE_TRANSITIONS:
            self.phase = advance(self.phase, step)
        else:
            with pytest.raises(errors.RuntimeFailure):
                advance(self.phase, step)

    @invariant()
    def frozen_only_from_running(self):
        assert self.phase in Phase


TestPhases = Phases.TestCase


def test_ids():
    sid = ids.new_sandbox_id()
    assert ids.is_sandbox_id(sid) and len(sid) == 19
    assert not ids.is_sandbox_id("sb-../../etc")
    assert ids.installation_id("/a") != ids.installation_id("/b")
    name = ids.runtime_name(ids.installation_id("/a"), sid)
    assert len(name) <= 30 and name.startswith("atoll-")
    assert ids.WORKER_ID_RE.match(ids.new_worker_id())
    assert ids.new_token() != ids.new_token()

"""The core lifecycle state machine: the transition table walked by a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from atoll.core import errors, ids
from atoll.core.lifecycle import TRANSITIONS, State, check_transition

VERBS = sorted({v for (_s, v) in TRANSITIONS})


def test_table_has_no_exit_from_deleted():
    assert not [k for k in TRANSITIONS if k[0] == State.DELETED]


def test_every_live_state_can_be_deleted_and_fail():
    for s in (State.CREATING, State.RUNNING, State.STANDBY):
        assert check_transition(s, "delete") == State.DELETED
        assert check_transition(s, "fail") == State.FAILED


def test_invalid_transition_names_allowed_verbs():
    with pytest.raises(errors.Conflict) as e:
        check_transition(State.RUNNING, "resume")
    assert e.value.code == "invalid_state"
    assert "resume" in e.value.message and "pause" in e.value.message


class Lifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = State.CREATING
        self.history = [State.CREATING]

    @rule(verb=st.sampled_from(VERBS))
    def apply(self, verb):
        if (self.state, verb) in TRANSITIONS:
            self.state = check_transition(self.state, verb)
            self.history.append(self.state)
        else:
            with pytest.raises(errors.Conflict):
                check_transition(self.state, verb)

    @invariant()
    def deleted_is_terminal(self):
        if State.DELETED in self.history:
            assert self.history[-1] == State.DELETED

    @invariant()
    def never_back_to_creating(self):
        assert State.CREATING not in self.history[1:]


TestLifecycle = Lifecycle.TestCase


def test_ids():
    sid = ids.new_sandbox_id()
    assert ids.is_sandbox_id(sid) and len(sid) == 19
    assert not ids.is_sandbox_id("sb-../../etc")
    assert ids.installation_id("/a") != ids.installation_id("/b")
    name = ids.runtime_name(ids.installation_id("/a"), sid)
    assert len(name) <= 30 and name.startswith("atoll-")

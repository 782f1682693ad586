"""A worker's home belongs to one worker process: a second one on it is refused with a clear
message (it would take the first one's sandboxes for objects nobody owns and sweep them away)."""

from __future__ import annotations

import pytest

from atoll.worker.service.node import HomeInUse, Node
from atoll.worker.service.settings import WorkerSettings


def test_a_second_worker_on_the_same_home_is_refused(tmp_path):
    first = Node(WorkerSettings(home=str(tmp_path)))
    first.claim_home()
    first.claim_home()  # idempotent for its holder
    with pytest.raises(HomeInUse) as e:
        Node(WorkerSettings(home=str(tmp_path))).claim_home()
    assert (
        str(tmp_path) in e.value.message and "--home" in e.value.message and e.value.code == "invalid_state"
    )
    Node(WorkerSettings(home=str(tmp_path / "other"))).claim_home()  # another home is fine

"""core.seam: the worker protocol's table covers the seam exactly, and the generated client is
what the table says (the worker's routes are built from the same table at run time;
test_worker_protocol.py crosses every verb over real HTTP)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from atoll.core import seam
from atoll.core import worker_api as api

ROOT = Path(__file__).resolve().parents[2]


def _protocol_methods() -> set[str]:
    return {n for n, v in vars(api.WorkerAPI).items() if not n.startswith("_") and callable(v)}


def test_every_verb_of_the_seam_is_in_the_table_or_written_by_hand_and_none_twice():
    table = {v.name for v in seam.VERBS}
    hand = set(seam.HAND_WRITTEN)
    assert not table & hand
    assert table | hand == _protocol_methods()
    assert len(table) == len(seam.VERBS)


def test_each_verbs_arguments_are_the_protocols_parameters():
    for verb in seam.VERBS:
        params = [p for p in inspect.signature(getattr(api.WorkerAPI, verb.name)).parameters if p != "self"]
        assert [a.name for a in verb.args] == params, verb.name
        for a in verb.args:
            if a.where == "path":
                assert "{" + a.name + "}" in verb.path, (verb.name, a.name)
        assert verb.wait in ("call", "step", "none")
        if verb.method == "GET":
            assert verb.effect is None and not verb.step, verb.name  # a read changes nothing


def test_no_two_verbs_share_a_method_and_path():
    seen = {(v.method, v.path) for v in seam.VERBS}
    assert len(seen) == len(seam.VERBS)


def test_the_generated_client_is_current():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_seam.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr

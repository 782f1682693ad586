"""core.placement: candidates filtered by template, memory and slots; affinity when it
has room; the least committed of K sampled by memory and CPU; ties to affinity, then tenant
spread; commitments summed from records in one pass."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from atoll.core import errors, placement
from atoll.core.placement import Candidate


def cand(
    name,
    *,
    mem=1000,
    used=0,
    cpus=4.0,
    used_cpus=0.0,
    n=0,
    tenant_n=0,
    limit=None,
    slots_used=None,
    templates=("base",),
):
    return Candidate(
        worker_id=f"id-{name}",
        name=name,
        memory_mb=mem,
        allocated_memory_mb=used,
        templates=frozenset(templates),
        cpus=cpus,
        allocated_cpus=used_cpus,
        sandboxes=n,
        tenant_sandboxes=tenant_n,
        slots=limit or 0,
        allocated_slots=slots_used if slots_used is not None else n,
    )


def decide(cands, **kw):
    kw.setdefault("memory_mb", 100)
    kw.setdefault("template", "base")
    kw.setdefault("k", len(cands))  # every candidate sampled: deterministic
    return placement.decide(cands, **kw)


def test_the_least_committed_wins_by_memory_or_cpu():
    assert decide([cand("a", used=800), cand("b", used=100)]).worker.name == "b"
    # b has the memory but its CPUs are taken: CPU counts
    d = decide([cand("a", used=300), cand("b", used=0, used_cpus=3.9)], cpus=1.0)
    assert d.worker.name == "a" and "least committed" in d.reason


def test_affinity_wins_when_it_has_room_and_not_otherwise():
    d = decide([cand("a"), cand("b", used=500)], prefer="id-b")
    assert d.worker.name == "b" and d.reason.startswith("affinity")
    d = decide([cand("a"), cand("b", used=950)], prefer="id-b")
    assert d.worker.name == "a" and "had no room" in d.reason
    d = decide([cand("a")], prefer="id-gone")  # the worker with affinity is not a candidate
    assert d.worker.name == "a"


def test_a_tie_goes_to_affinity_then_to_fewest_of_the_tenants_sandboxes():
    # 400 vs 420 used: within the tie band; b holds fewer of this tenant's sandboxes
    d = decide([cand("a", used=400, tenant_n=5), cand("b", used=420, tenant_n=1)])
    assert d.worker.name == "b" and "fewest of the tenant" in d.reason
    # outside the band commitment decides, not the tenant
    assert decide([cand("a", used=100, tenant_n=5), cand("b", used=600, tenant_n=0)]).worker.name == "a"


def test_tenant_spread_over_a_burst():
    """Placing 30 sandboxes of one tenant on 3 equal workers, updating counts as they land, spreads
    them within one of even (commitment ties every time, tenant spread decides between the two
    sampled); the same with the tie-break on names alone would not (checked below)."""
    ws = {n: dict(used=0, tenant_n=0, n=0) for n in "abc"}
    rng = random.Random(7)
    for _ in range(30):
        d = placement.decide(
            [cand(n, mem=100_000, **v) for n, v in ws.items()], memory_mb=10, template="base", rng=rng, k=2
        )
        w = ws[d.worker.name]
        w["used"] += 10
        w["tenant_n"] += 1
        w["n"] += 1
    counts = sorted(v["tenant_n"] for v in ws.values())
    assert counts[-1] - counts[0] <= 2, counts
    # without tenant counts (all 0) the same burst goes by name inside the tie band: uneven
    rng = random.Random(7)
    names = [
        placement.decide(
            [cand(n, mem=100_000) for n in "abc"], memory_mb=10, template="base", rng=rng
        ).worker.name
        for _ in range(30)
    ]
    assert names.count("c") == 0


def test_what_cannot_go_anywhere_says_why():
    with pytest.raises(errors.Unavailable, match="no worker is ready"):
        placement.decide([], memory_mb=1, template="base")
    with pytest.raises(errors.TemplateNotFound, match="'py'.*available templates: base"):
        decide([cand("a")], template="py")
    with pytest.raises(errors.InvalidRequest, match="memory_mb=2000 is more than any worker's memory"):
        decide([cand("a")], memory_mb=2000)
    with pytest.raises(errors.Unavailable, match=r"a: slots full \(3 of 3 taken\)") as e:
        decide([cand("a", n=3, limit=3)])
    assert e.value.code == "no_worker" and e.value.retryable
    assert decide([cand("a", n=3, limit=3), cand("b", used=900, n=1, limit=3)]).worker.name == "b"


def test_a_worker_whose_slots_are_full_is_skipped_however_empty_it_is():
    # a has memory and CPUs to spare but its 2 slots are taken; b is busier but has a slot
    full = cand("a", used=0, n=5, slots_used=2, limit=2)
    assert decide([full, cand("b", used=900, used_cpus=3.9, limit=8, n=7)]).worker.name == "b"
    # the worker with affinity is full: it goes elsewhere, and the reason says so
    d = decide([full, cand("b", used=500)], prefer="id-a")
    assert d.worker.name == "b" and "had no room or was not ready" in d.reason
    # slots count what holds resources, not every record: 5 sandboxes, 1 slot taken of 2
    assert decide([cand("a", n=5, slots_used=1, limit=2)]).worker.name == "a"
    # 0 is no limit
    assert decide([cand("a", n=10_000, limit=0)]).worker.name == "a"


def test_no_room_names_the_limit_each_worker_hit_and_the_fix():
    cands = [
        cand("full", n=4, limit=4),
        cand("small", mem=100, n=0, limit=4),
        cand("other", templates=("py",), limit=4),
    ]
    with pytest.raises(errors.Unavailable) as e:
        decide(cands, memory_mb=200)
    msg = e.value.message
    assert e.value.code == "no_worker"
    assert "full: slots full (4 of 4 taken)" in msg
    assert "small: memory 100 MB is less than the 200 MB asked" in msg
    assert "other: does not have template 'base'" in msg
    assert "--slots N" in msg and "ATOLL_WORKER_SLOTS" in msg and "pause" in msg and "add a worker" in msg
    # a move of an archived sandbox (template None): no worker is refused for its templates
    with pytest.raises(errors.Unavailable, match=r"other: slots full \(1 of 1 taken\)"):
        decide([cand("other", templates=("py",), n=1, limit=1)], template=None)


def test_best_of_k_samples_k():
    """With K=2 of 10 workers the emptiest is not always chosen, but never the fullest of a pair."""
    cands = [cand(f"w{i}", used=i * 90) for i in range(10)]
    rng = random.Random(1)
    picks = [placement.decide(cands, memory_mb=10, template="base", rng=rng).worker.name for _ in range(200)]
    assert "w9" not in picks  # the fullest loses every pair it is in
    assert len(set(picks)) > 1


def test_commitments_sum_in_one_pass():
    recs = [
        SimpleNamespace(
            worker_id="w1",
            tenant_id="t1",
            state="running",
            standby_tier=None,
            memory_mb=100,
            cpus=1.0,
            disk_mb=10,
        ),
        SimpleNamespace(
            worker_id="w1",
            tenant_id="t2",
            state="standby",
            standby_tier="memory",
            memory_mb=50,
            cpus=1.0,
            disk_mb=10,
        ),
        SimpleNamespace(
            worker_id="w1",
            tenant_id="t1",
            state="standby",
            standby_tier="disk",
            memory_mb=70,
            cpus=1.0,
            disk_mb=10,
        ),
        SimpleNamespace(
            worker_id="w1",
            tenant_id="t1",
            state="standby",
            standby_tier="archive",
            memory_mb=70,
            cpus=1.0,
            disk_mb=10,
        ),
        SimpleNamespace(
            worker_id="w2",
            tenant_id="t1",
            state="creating",
            standby_tier=None,
            memory_mb=30,
            cpus=0.5,
            disk_mb=5,
        ),
    ]
    c = placement.commitments(recs)
    assert (c["w1"].memory_mb, c["w1"].cpus, c["w1"].disk_mb, c["w1"].sandboxes) == (150, 1.0, 30, 4)
    assert c["w1"].by_tenant == {"t1": 3, "t2": 1}
    assert (c["w2"].memory_mb, c["w2"].cpus) == (30, 0.5)
    # slots: creating, running and the memory tier hold one each; disk and archive standby none
    assert (c["w1"].slots, c["w2"].slots) == (2, 1)

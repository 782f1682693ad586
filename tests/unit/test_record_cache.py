"""The ledger's record cache keeps its index of warm-pool members by template in step with every
write (controlplane.ledger.RecordCache): what `Pools._members` reads instead of every record."""

from __future__ import annotations

from atoll.controlplane import db as dbm
from atoll.controlplane.ledger import RecordCache


def _rec(sid: str, template: str = "base", pooled: bool = True) -> dbm.SandboxRecord:
    return dbm.SandboxRecord(
        id=sid,
        tenant_id="default",
        worker_id="w",
        state="standby",
        standby_tier="memory",
        template=template,
        memory_mb=512,
        cpus=1.0,
        disk_mb=1024,
        idle_timeout_s=0,
        disk_after_s=0,
        pooled=pooled,
    )


def _ids(cache: RecordCache, template: str) -> set[str]:
    return {r.id for r in cache.pooled(template)}


def test_members_are_indexed_by_template_and_leave_when_claimed_deleted_or_replaced():
    cache = RecordCache()
    a, b, other = _rec("sb-a"), _rec("sb-b"), _rec("sb-c", template="py")
    cache["sb-a"], cache["sb-b"], cache["sb-c"] = a, b, other
    for i in range(50):  # unrelated sandboxes are not in the index
        cache[f"sb-x{i}"] = _rec(f"sb-x{i}", pooled=False)
    assert _ids(cache, "base") == {"sb-a", "sb-b"} and _ids(cache, "py") == {"sb-c"}
    assert _ids(cache, "nope") == set()

    a.pooled = False  # a claim changes the record in place, then puts it back (Ledger.persist)
    cache["sb-a"] = a
    assert _ids(cache, "base") == {"sb-b"} and "sb-a" in cache

    cache.pop("sb-b")  # deleted (Ledger.forget) or stale (Ledger.save)
    assert _ids(cache, "base") == set() and cache.pop("sb-b", None) is None
    del cache["sb-c"]
    assert _ids(cache, "py") == set()

    b2 = _rec("sb-b")  # read again from the database (Ledger.get): indexed again, once
    cache["sb-b"] = b2
    cache["sb-b"] = b2
    assert cache.pooled("base") == [b2]

    cache.update({"sb-d": _rec("sb-d")})
    cache.setdefault("sb-e", _rec("sb-e"))
    assert _ids(cache, "base") == {"sb-b", "sb-d", "sb-e"}
    cache.clear()
    assert _ids(cache, "base") == set() and len(cache) == 0


def test_a_failed_member_stays_indexed_for_the_keeper_to_delete():
    cache = RecordCache()
    rec = _rec("sb-f")
    cache["sb-f"] = rec
    rec.state = "failed"
    cache["sb-f"] = rec
    assert cache.pooled("base") == [rec]

"""The records database: a durable save commits with synchronous=FULL and then restores NORMAL."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import event

from atoll.controlplane import db as dbm


def _record(sid: str) -> dbm.SandboxRecord:
    now = dt.datetime.now(dt.UTC)
    return dbm.SandboxRecord(
        id=sid,
        tenant_id="default",
        worker_id="local",
        state="running",
        template="base",
        metadata_={},
        env={},
        user=None,
        memory_mb=512,
        cpus=1.0,
        disk_mb=64,
        idle_timeout_s=0,
        disk_after_s=0,
        created_at=now,
        updated_at=now,
    )


def test_durable_save_is_synchronous_full_only_for_its_commit(tmp_path):
    database = dbm.open_database(f"sqlite:///{tmp_path / 'atoll.db'}")
    statements: list[str] = []
    event.listen(database.engine, "connect", lambda conn, _rec: conn.set_trace_callback(statements.append))
    database.engine.dispose()  # new connections get the trace callback
    rec = _record("sb-aaaaaaaaaaaaaaaa")
    database.add(rec)

    statements.clear()
    rec.state = "deleted"
    database.save(rec, fields=["state"], durable=True)
    full = statements.index("PRAGMA synchronous=FULL")
    update = next(i for i, s in enumerate(statements) if s.startswith("UPDATE"))
    normal = statements.index("PRAGMA synchronous=NORMAL")
    assert full < update < normal
    assert database.get(rec.id).state == "deleted"

    statements.clear()
    rec.state = "failed"
    database.save(rec, fields=["state"])
    assert not any(s.startswith("PRAGMA synchronous") for s in statements)
    with database.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL again

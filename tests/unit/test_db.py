"""The records database: a durable save commits with synchronous=FULL and then restores NORMAL."""

from __future__ import annotations

import datetime as dt
import os

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
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


def test_a_database_at_0008_upgrades_to_count_pool_claims(tmp_path):
    """Migration 0009 adds pool_claims to a database made before it, and its count persists."""
    url = f"sqlite:///{tmp_path / 'atoll.db'}"
    cfg = Config()
    cfg.set_main_option("script_location", os.path.join(os.path.dirname(dbm.__file__), "migrations"))
    cfg.set_main_option("sqlalchemy.url", url)
    cfg.attributes["configure_logger"] = False
    command.upgrade(cfg, "0008")
    assert "pool_claims" not in sa.inspect(sa.create_engine(url)).get_table_names()
    d = dbm.open_database(url)
    assert d.pool_claimed("t", "web") == 0
    d.count_pool_claim("t", "web")
    d.count_pool_claim("t", "web")
    assert dbm.open_database(url).pool_claimed("t", "web") == 2
    command.downgrade(cfg, "0008")  # and back
    assert "pool_claims" not in sa.inspect(sa.create_engine(url)).get_table_names()


def test_every_migration_logs_one_line():
    """Alembic logs `Running upgrade A -> B, <message>` with the docstring's first paragraph: 0009's
    ran over two lines."""
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", os.path.join(os.path.dirname(dbm.__file__), "migrations"))
    scripts = list(ScriptDirectory.from_config(cfg).walk_revisions())
    assert len(scripts) >= 9
    for script in scripts:
        assert script.doc and "\n" not in script.doc, (script.revision, script.doc)

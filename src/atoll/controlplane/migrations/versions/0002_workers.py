"""workers table; sandboxes of the in-process worker of earlier versions move to a worker record

Revision ID: 0002
Revises: 0001
"""

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("installation", sa.String(64), nullable=True),
        sa.Column("url", sa.String(512), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("state_reason", sa.Text, nullable=True),
        sa.Column("draining", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("version", sa.String(64), nullable=True),
        sa.Column("protocol", sa.Integer, nullable=True),
        sa.Column("capacity", sa.JSON, nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
    )
    conn = op.get_bind()
    if conn.execute(sa.text("SELECT 1 FROM sandboxes WHERE worker_id = 'local' LIMIT 1")).first():
        # Before workers had records, `atoll up`'s in-process worker was "local": give it one.
        wid = "wk-" + "".join(secrets.choice(_ALPHABET) for _ in range(16))
        conn.execute(
            sa.text("INSERT INTO workers (id, name, state, capacity) VALUES (:id, 'local', 'lost', '{}')"),
            {"id": wid},
        )
        conn.execute(sa.text("UPDATE sandboxes SET worker_id = :id WHERE worker_id = 'local'"), {"id": wid})


def downgrade() -> None:
    op.drop_table("workers")

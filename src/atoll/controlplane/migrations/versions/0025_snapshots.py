"""snapshots: named snapshots of sandboxes (issue 22), kept on the worker that made them

Revision ID: 0025
Revises: 0024
"""

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False, index=True),
        sa.Column("name", sa.String(128), nullable=True),
        sa.Column("sandbox_id", sa.String(32), nullable=False, index=True),
        sa.Column("template", sa.String(64), nullable=False),
        sa.Column("build_id", sa.String(32), nullable=True),
        sa.Column("worker_id", sa.String(64), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("memory", sa.Boolean, nullable=False),
        sa.Column("memory_mb", sa.Integer, nullable=False),
        sa.Column("source", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "name", name="uq_snapshots_tenant_name"),
    )


def downgrade() -> None:
    op.drop_table("snapshots")

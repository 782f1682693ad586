"""sandboxes table

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False, index=True),
        sa.Column("worker_id", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("standby_tier", sa.String(16), nullable=True),
        sa.Column("standby_reason", sa.Text, nullable=True),
        sa.Column("failure_reason", sa.Text, nullable=True),
        sa.Column("template", sa.String(64), nullable=False),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("env", sa.JSON, nullable=False),
        sa.Column("user", sa.String(64), nullable=True),
        sa.Column("memory_mb", sa.Integer, nullable=False),
        sa.Column("cpus", sa.Float, nullable=False),
        sa.Column("disk_mb", sa.Integer, nullable=False),
        sa.Column("idle_timeout_s", sa.Float, nullable=False),
        sa.Column("disk_after_s", sa.Float, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("standby_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_activity_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("sandboxes")

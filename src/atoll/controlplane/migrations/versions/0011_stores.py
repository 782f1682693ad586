"""volumes and drives: the stores table, sandboxes.mounts

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stores",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("worker_id", sa.String(64), nullable=False),
        sa.Column("size_mb", sa.Integer, nullable=False),
        sa.Column("attached_to", sa.String(32), nullable=True),
        sa.Column("detaching", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("backend", sa.String(16), nullable=False, server_default="local"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("mounts", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("mounts")
    op.drop_table("stores")

"""usage intervals and cursors (controlplane.metering)

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

AMOUNTS = (
    "cpu_seconds",
    "memory_gb_seconds",
    "standby_memory_gb_seconds",
    "snapshot_disk_gb_seconds",
    "snapshot_archive_gb_seconds",
    "volume_gb_seconds",
    "drive_gb_seconds",
    "egress_bytes",
    "ingress_bytes",
    "build_seconds",
)


def upgrade() -> None:
    op.create_table(
        "usage_intervals",
        sa.Column("subject", sa.String(200), primary_key=True),
        sa.Column("start", sa.BigInteger, primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("sandbox_id", sa.String(32), nullable=True),
        *(sa.Column(a, sa.Float, nullable=False, server_default="0") for a in AMOUNTS),
    )
    op.create_index("ix_usage_intervals_start", "usage_intervals", ["start"])
    op.create_index("ix_usage_intervals_tenant_id", "usage_intervals", ["tenant_id"])
    op.create_table(
        "usage_cursors",
        sa.Column("subject", sa.String(200), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("accrued_to", sa.Float, nullable=False),
        sa.Column("state", sa.String(32), nullable=True),
        sa.Column("cpu_generation", sa.Integer, nullable=False, server_default="0"),
        sa.Column("cpu_seen", sa.Float, nullable=False, server_default="0"),
        sa.Column("egress_seen", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("ingress_seen", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("usage_cursors")
    op.drop_index("ix_usage_intervals_tenant_id", "usage_intervals")
    op.drop_index("ix_usage_intervals_start", "usage_intervals")
    op.drop_table("usage_intervals")

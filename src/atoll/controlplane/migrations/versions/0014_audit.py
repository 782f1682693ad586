"""the audit trail

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("tenant_id", sa.String(64), nullable=True),
        sa.Column("action", sa.String(256), nullable=False),
        sa.Column("target", sa.String(512), nullable=True),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("error", sa.String(64), nullable=True),
        sa.Column("request_id", sa.String(32), nullable=True),
        sa.Column("source", sa.String(64), nullable=True),
    )
    op.create_index("ix_audit_at_id", "audit", ["at", "id"])
    op.create_index("ix_audit_tenant_at", "audit", ["tenant_id", "at"])


def downgrade() -> None:
    op.drop_index("ix_audit_tenant_at", "audit")
    op.drop_index("ix_audit_at_id", "audit")
    op.drop_table("audit")

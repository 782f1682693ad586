"""pool claims: pool_claims.claimed, the sandboxes each warm pool handed out (survives a restart)

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pool_claims",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("template", sa.String(64), primary_key=True),
        sa.Column("claimed", sa.Integer, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("pool_claims")

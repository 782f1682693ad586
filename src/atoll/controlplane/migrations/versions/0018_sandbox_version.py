"""sandboxes.version: bumped by every write, so a write from a stale copy matches no row

A write from a copy read before another server wrote matches no row instead of overwriting it.

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("version", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("version")

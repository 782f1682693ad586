"""archive tier: sandboxes.archive_after_s (seconds in standby before the disk tier moves to the archive)

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("archive_after_s", sa.Float, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("archive_after_s")

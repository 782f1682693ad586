"""sandboxes.on_worker_lost: what a sandbox's worker, lost for ATOLL_WORKER_GONE_S, does to it

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("on_worker_lost", sa.String(16), nullable=False, server_default="fail"))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("on_worker_lost")

"""workers.evacuation: a drain's progress, kept so that a restarted server resumes it

JSON (controlplane.evacuation `Evacuation.record`): started_at, resumed_at, finished_at, the
sandboxes still to move, those moved, those that stay with the reason; null: never evacuated.

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as b:
        b.add_column(sa.Column("evacuation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as b:
        b.drop_column("evacuation")

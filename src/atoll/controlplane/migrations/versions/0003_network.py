"""sandboxes.network: each sandbox's egress policy (allow_out / deny_out)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("network", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("network")

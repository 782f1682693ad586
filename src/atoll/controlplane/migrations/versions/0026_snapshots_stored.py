"""snapshots.stored: a named snapshot has a whole copy in the workers' shared object store

Revision ID: 0026
Revises: 0025
"""

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("snapshots") as b:
        b.add_column(sa.Column("stored", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("snapshots") as b:
        b.drop_column("stored")

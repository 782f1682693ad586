"""workers.token_sealed: the worker's current token, sealed, so that every server can call it

Sealed with the installation's secrets key (core.secretbox, the worker id as associated data):
a server sharing the records calls a worker another server holds with it (controlplane.workers,
borrowed workers). Null: not shared (SQLite), or registered before this revision.

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as b:
        b.add_column(sa.Column("token_sealed", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as b:
        b.drop_column("token_sealed")

"""secrets.allow_http: a secret's value goes over plain HTTP only when this says so

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("secrets") as b:
        b.add_column(sa.Column("allow_http", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("secrets") as b:
        b.drop_column("allow_http")

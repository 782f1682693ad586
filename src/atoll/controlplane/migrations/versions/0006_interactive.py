"""interactive work: sandboxes.shell (string commands' shell), expires_at and on_timeout (lifetime)

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("shell", sa.String(16), nullable=True))
        b.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("on_timeout", sa.String(16), nullable=False, server_default="pause"))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("on_timeout")
        b.drop_column("expires_at")
        b.drop_column("shell")

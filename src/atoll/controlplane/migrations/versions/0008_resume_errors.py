"""resume errors: sandboxes.resume_error (why the last disk resume failed) and resume_failures

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("resume_error", sa.Text, nullable=True))
        b.add_column(sa.Column("resume_failures", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("resume_failures")
        b.drop_column("resume_error")

"""secrets (sealed values bound to hosts); sandboxes.secrets (placeholders) and sandboxes.previews

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("hosts", sa.JSON, nullable=False),
        sa.Column("sealed", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("secrets", sa.JSON, nullable=True))
        b.add_column(sa.Column("previews", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("previews")
        b.drop_column("secrets")
    op.drop_table("secrets")

"""user templates and their builds, pools; sandboxes.build_id, workdir, pooled

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "templates",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("current_build", sa.String(32), nullable=True),
        sa.Column("latest_build", sa.String(32), nullable=True),
        sa.Column("pool", sa.JSON, nullable=True),
        sa.Column("pool_error", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "template_builds",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("template", sa.String(64), nullable=False, index=True),
        sa.Column("worker_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("progress", sa.Text, nullable=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("parent_build", sa.String(32), nullable=True),
        sa.Column("info", sa.JSON, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("build_id", sa.String(32), nullable=True))
        b.add_column(sa.Column("workdir", sa.Text, nullable=True))
        b.add_column(sa.Column("pooled", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("pooled")
        b.drop_column("workdir")
        b.drop_column("build_id")
    op.drop_table("template_builds")
    op.drop_table("templates")

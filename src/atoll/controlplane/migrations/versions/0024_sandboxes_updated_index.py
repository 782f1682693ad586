"""Indexes on sandboxes.updated_at (alone and after tenant_id) for the watch stream's poll

`GET /v1/sandboxes/watch` (controlplane.routes_watch) reads, every half second per open stream,
the rows written since its last read (`updated_at > since`, a tenant's or all): without an index
each read scanned the tenant's rows.

Revision ID: 0024
Revises: 0023
"""

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_sandboxes_updated", "sandboxes", ["updated_at"])
    op.create_index("ix_sandboxes_tenant_updated", "sandboxes", ["tenant_id", "updated_at"])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_tenant_updated", table_name="sandboxes")
    op.drop_index("ix_sandboxes_updated", table_name="sandboxes")

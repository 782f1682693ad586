"""sandboxes: indexes in the order lists page in, (created_at, id) and (tenant_id, created_at, id)

Revision ID: 0015
Revises: 0014
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # controlplane.paging reads a page of sandboxes as WHERE (created_at, id) > cursor ORDER BY
    # created_at, id LIMIT n: with these the database walks the index instead of sorting every row
    op.create_index("ix_sandboxes_list", "sandboxes", ["created_at", "id"])
    op.create_index("ix_sandboxes_tenant_list", "sandboxes", ["tenant_id", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_tenant_list", table_name="sandboxes")
    op.drop_index("ix_sandboxes_list", table_name="sandboxes")

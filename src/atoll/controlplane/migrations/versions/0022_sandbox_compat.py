"""sandboxes.compat: the options of a compatibility API a sandbox was created through

A JSON object, null for sandboxes made through atoll's own API. The E2B port (atoll.e2b, issue 22)
keeps E2B's per-sandbox lifecycle there: `{"created_via": "e2b", "auto_resume": bool,
"on_timeout": "kill" | "pause"}` (docs/e2b-compat.md §6.4). Not metadata: the user's labels stay
the user's (listed, filtered, shown by the SDK).

Revision ID: 0022
Revises: 0021
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("compat", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("compat")

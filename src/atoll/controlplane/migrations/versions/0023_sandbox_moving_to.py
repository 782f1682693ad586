"""sandboxes.moving_to: the worker asked to adopt a sandbox from the object store, before it is recorded

Written (durably) before a move through the object store asks the new worker to adopt the sandbox
(a drain, a lost worker's `on_worker_lost`/archive-tier settling, a resume off a full worker) and
cleared when the record names that worker. A server stopped between the adoption and the record
leaves it set: that worker's reconciliation then finishes the move (controlplane.lifecycle
`_adopted_here`) instead of deleting the copy that holds the archive now.

Revision ID: 0023
Revises: 0022
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.add_column(sa.Column("moving_to", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as b:
        b.drop_column("moving_to")

"""Record why a trial failed and how many trials each winner was chosen from.

``winners.trial_count`` of rows written before this revision is backfilled from the trials
table (the trials measured at the winner's key in the winner's environment, at least 1), so an
upgraded database reports the same counts a fresh tune would have.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("trials", sa.Column("error", sa.Text(), nullable=True))
    op.add_column("winners", sa.Column("trial_count", sa.Integer(), nullable=False, server_default="1"))
    op.execute(
        """
        UPDATE winners SET trial_count = COALESCE(NULLIF((
            SELECT COUNT(*) FROM trials
            WHERE trials.environment_id = winners.environment_id
              AND trials.kernel = winners.kernel
              AND trials.kernel_version = winners.kernel_version
              AND trials.key_json = winners.key_json
        ), 0), 1)
        """
    )


def downgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.drop_column("trial_count")
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("error")

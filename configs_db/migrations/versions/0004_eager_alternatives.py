"""Store each winner's eager alternative: the config serving the key's eager calls where it beats the winner there.

``winners.eager_json``: ``{"config": {...}, "ms": ..., "winner_ms": ...}`` as canonical JSON (the
config, and the estimated eager milliseconds per call of it and of the winner), measured in the
winner's run; NULL where the winner serves every call or the row predates this revision. Its
shape is checked where it is written and where it is read (a malformed one is ignored on read and
the winner still served), so the column has no constraint of its own.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision: str | None = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.add_column(sa.Column("eager_json", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.drop_column("eager_json")

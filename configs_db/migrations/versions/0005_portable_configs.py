"""Store the portable default each winner's speedup was measured against.

``winners.portable_config_json``: the default config that ``portable_ms`` timed, as canonical JSON.
A kernel's default can change between releases while its version (its Triton code and space) stays
the same; a winner's speedup then says nothing about the new default, and the runtime does not
serve it. NULL where the row predates this revision (such winners serve as before). Checked where
it is written and where it is read, so the column has no constraint of its own.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision: str | None = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.add_column(sa.Column("portable_config_json", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.drop_column("portable_config_json")

"""Store the peer's time with each winner, and the keys a process served without a winner.

``winners.peer_ms``/``peer_name``: the PyTorch call a user would make instead (for example SDPA
with its fastest backend, or bf16 cuBLAS on the dequantized weight), timed at the winner's key
in the same run; NULL where the kernel names no peer or the row predates this revision.

``misses``: one row per (GPU, kernel, kernel version, key) a serving process resolved without
an exact stored winner, with how often and when it was first and last seen, so that
``tune --missed`` tunes exactly the keys a model called.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision: str | None = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("winners") as batch:
        batch.add_column(sa.Column("peer_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("peer_name", sa.String(64), nullable=True))
        batch.create_check_constraint(op.f("ck_winners_peer_positive"), "peer_ms IS NULL OR peer_ms > 0")
    op.create_table(
        "misses",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("gpu", sa.String(128), nullable=False),
        sa.Column("kernel", sa.String(64), nullable=False),
        sa.Column("kernel_version", sa.String(64), nullable=False),
        sa.Column("key_json", sa.Text(), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_misses")),
        sa.UniqueConstraint("gpu", "kernel", "kernel_version", "key_json", name=op.f("uq_misses_key")),
        sa.CheckConstraint("count > 0", name=op.f("ck_misses_count_positive")),
    )


def downgrade() -> None:
    op.drop_table("misses")
    with op.batch_alter_table("winners") as batch:
        batch.drop_constraint(op.f("ck_winners_peer_positive"), type_="check")
        batch.drop_column("peer_name")
        batch.drop_column("peer_ms")

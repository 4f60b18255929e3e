"""Initial schema: environments, trials and winners.

Constraint names are final (``op.f``): the models' naming convention must not rewrite them.

The first schema recorded neither why a trial failed nor how many trials a winner was chosen
from; revision 0002 adds both.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision: str | None = None
branch_labels = None
depends_on = None

STATUSES = ("ok", "failed-compile", "failed-correctness", "failed-runtime", "pruned")


def upgrade() -> None:
    op.create_table(
        "environments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("gpu", sa.String(128), nullable=False),
        sa.Column("gpu_name", sa.String(128), nullable=False),
        sa.Column("capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("driver", sa.String(64), nullable=False),
        sa.Column("cuda", sa.String(64), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("tritune_version", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_environments")),
        sa.UniqueConstraint(
            "gpu",
            "gpu_name",
            "capability",
            "sm_count",
            "driver",
            "cuda",
            "torch_version",
            "triton_version",
            "tritune_version",
            name=op.f("uq_environments_values"),
        ),
    )
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=False),
        sa.Column("kernel", sa.String(64), nullable=False),
        sa.Column("kernel_version", sa.String(64), nullable=False),
        sa.Column("key_json", sa.Text(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trials")),
        sa.ForeignKeyConstraint(
            ["environment_id"], ["environments.id"], name=op.f("fk_trials_environment_id_environments")
        ),
        sa.UniqueConstraint(
            "environment_id", "kernel", "kernel_version", "key_json", "config_json", name=op.f("uq_trials_measurement")
        ),
        sa.CheckConstraint(
            "status IN ({})".format(", ".join(f"'{s}'" for s in STATUSES)), name=op.f("ck_trials_status_known")
        ),
        sa.CheckConstraint("status <> 'ok' OR time_ms IS NOT NULL", name=op.f("ck_trials_ok_has_time")),
    )
    op.create_table(
        "winners",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("gpu", sa.String(128), nullable=False),
        sa.Column("kernel", sa.String(64), nullable=False),
        sa.Column("kernel_version", sa.String(64), nullable=False),
        sa.Column("key_json", sa.Text(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=False),
        sa.Column("portable_ms", sa.Float(), nullable=False),
        sa.Column("speedup", sa.Float(), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_winners")),
        sa.ForeignKeyConstraint(
            ["environment_id"], ["environments.id"], name=op.f("fk_winners_environment_id_environments")
        ),
        sa.UniqueConstraint("gpu", "kernel", "kernel_version", "key_json", name=op.f("uq_winners_key")),
        sa.CheckConstraint("time_ms > 0 AND portable_ms > 0 AND speedup > 0", name=op.f("ck_winners_positive_numbers")),
    )


def downgrade() -> None:
    op.drop_table("winners")
    op.drop_table("trials")
    op.drop_table("environments")

"""SQLAlchemy models of the config DB: environments, trials, winners and missed keys.

The unique constraints carry the invariants the tuner relies on: one row per environment, a
config measured at most once per key in one environment, and one winner per (GPU, kernel,
kernel version, key). Keys and configs are stored as canonical JSON text (see
:mod:`tritune.configs_db.values`) so that those constraints compare like with like.

These models describe the schema at :data:`tritune.configs_db.storage.SCHEMA_HEAD`; the
migrations in ``migrations/versions`` build the same schema step by step and a test checks that
they agree. Only the storage layer imports this module: the runtime reads winners without it
when there is no database.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, Float, ForeignKey, MetaData, String, Text, UniqueConstraint, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from .records import TRIAL_STATUSES
from .values import Scalar, canonical_json, parse_canonical_json

__all__ = [
    "Base",
    "Environment",
    "Miss",
    "Scalar",
    "Trial",
    "Winner",
    "canonical_json",
    "parse_canonical_json",
    "utcnow",
]

# Named constraints keep migrations reproducible (SQLite batch mode recreates tables by name).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: The columns that identify an environment (all NOT NULL: SQL treats NULLs as distinct in UNIQUE).
ENVIRONMENT_COLUMNS = (
    "gpu",
    "gpu_name",
    "capability",
    "sm_count",
    "driver",
    "cuda",
    "torch_version",
    "triton_version",
    "tritune_version",
)

STATUS_CHECK = "status IN ({})".format(", ".join(f"'{s}'" for s in TRIAL_STATUSES))


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Environment(Base):
    """Where trials were measured: the GPU and every version that can change a timing."""

    __tablename__ = "environments"
    __table_args__ = (UniqueConstraint(*ENVIRONMENT_COLUMNS, name="uq_environments_values"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu: Mapped[str] = mapped_column(String(128))
    gpu_name: Mapped[str] = mapped_column(String(128))
    capability: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int]
    driver: Mapped[str] = mapped_column(String(64))
    cuda: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(64))
    tritune_version: Mapped[str] = mapped_column(String(64))

    @classmethod
    def find(cls, session: Session, **values: Any) -> Environment | None:
        cls._check_values(values)
        query = select(cls).filter_by(**values)
        return session.execute(query).scalar_one_or_none()

    @classmethod
    def get_or_create(cls, session: Session, **values: Any) -> Environment:
        """The environment with exactly these values, inserted if new.

        The insert runs in a savepoint: if another process inserted the same environment in
        between, the unique constraint fires and the row it wrote is returned instead.
        """
        cls._check_values(values)
        found = cls.find(session, **values)
        if found is not None:
            return found
        try:
            with session.begin_nested():
                created = cls(**values)
                session.add(created)
            return created
        except IntegrityError:
            found = cls.find(session, **values)
            if found is None:
                raise
            return found

    @staticmethod
    def _check_values(values: dict[str, Any]) -> None:
        if set(values) != set(ENVIRONMENT_COLUMNS):
            missing = sorted(set(ENVIRONMENT_COLUMNS) - set(values))
            unknown = sorted(set(values) - set(ENVIRONMENT_COLUMNS))
            raise TypeError(f"environment values: missing {missing}, unknown {unknown}")
        for name, value in values.items():
            expected = int if name == "sm_count" else str
            if isinstance(value, bool) or not isinstance(value, expected):
                raise TypeError(f"environment {name}={value!r}: expected {expected.__name__}")


class Trial(Base):
    """One config measured (or refused) at one key in one environment."""

    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint(
            "environment_id", "kernel", "kernel_version", "key_json", "config_json", name="uq_trials_measurement"
        ),
        CheckConstraint(STATUS_CHECK, name="status_known"),
        CheckConstraint("status <> 'ok' OR time_ms IS NOT NULL", name="ok_has_time"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    kernel: Mapped[str] = mapped_column(String(64))
    kernel_version: Mapped[str] = mapped_column(String(64))
    key_json: Mapped[str] = mapped_column(Text)
    config_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(32))
    time_ms: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    @classmethod
    def find(
        cls, session: Session, environment_id: int, kernel: str, kernel_version: str, key_json: str, config_json: str
    ) -> Trial | None:
        query = select(cls).filter_by(
            environment_id=environment_id,
            kernel=kernel,
            kernel_version=kernel_version,
            key_json=key_json,
            config_json=config_json,
        )
        return session.execute(query).scalar_one_or_none()

    @classmethod
    def for_key(
        cls, session: Session, environment_id: int, kernel: str, kernel_version: str, key_json: str
    ) -> list[Trial]:
        """Every trial at one key, oldest first (what a resumed tune must not measure again)."""
        query = (
            select(cls)
            .filter_by(environment_id=environment_id, kernel=kernel, kernel_version=kernel_version, key_json=key_json)
            .order_by(cls.id)
        )
        return list(session.execute(query).scalars())

    @classmethod
    def for_study(cls, session: Session, environment_id: int, kernel: str, kernel_version: str) -> list[Trial]:
        """Every trial of one kernel version in one environment, grouped by key, oldest first."""
        query = (
            select(cls)
            .filter_by(environment_id=environment_id, kernel=kernel, kernel_version=kernel_version)
            .order_by(cls.key_json, cls.id)
        )
        return list(session.execute(query).scalars())


class Winner(Base):
    """The best config of one kernel version at one key on one GPU (what the runtime serves)."""

    __tablename__ = "winners"
    __table_args__ = (
        UniqueConstraint("gpu", "kernel", "kernel_version", "key_json", name="uq_winners_key"),
        CheckConstraint("time_ms > 0 AND portable_ms > 0 AND speedup > 0", name="positive_numbers"),
        CheckConstraint("peer_ms IS NULL OR peer_ms > 0", name="peer_positive"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu: Mapped[str] = mapped_column(String(128))
    kernel: Mapped[str] = mapped_column(String(64))
    kernel_version: Mapped[str] = mapped_column(String(64))
    key_json: Mapped[str] = mapped_column(Text)
    config_json: Mapped[str] = mapped_column(Text)
    time_ms: Mapped[float] = mapped_column(Float)
    portable_ms: Mapped[float] = mapped_column(Float)
    speedup: Mapped[float] = mapped_column(Float)
    trial_count: Mapped[int] = mapped_column(server_default="1")
    #: The peer (the PyTorch call a user would make instead) timed at this key in the same run.
    peer_ms: Mapped[float | None] = mapped_column(Float)
    peer_name: Mapped[str | None] = mapped_column(String(64))
    #: The config serving eager calls where it beats the winner there, with both configs' estimated
    #: eager ms per call: ``{"config": {...}, "ms": ..., "winner_ms": ...}`` as canonical JSON, or
    #: NULL (the winner serves every call). Checked on write and on read, not by a constraint.
    eager_json: Mapped[str | None] = mapped_column(Text)
    #: The portable default that ``portable_ms`` timed, as canonical JSON (``speedup`` is against
    #: it); NULL where the row predates this column. Checked on write and on read.
    portable_config_json: Mapped[str | None] = mapped_column(Text)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    @classmethod
    def find(cls, session: Session, gpu: str, kernel: str, kernel_version: str, key_json: str) -> Winner | None:
        query = select(cls).filter_by(gpu=gpu, kernel=kernel, kernel_version=kernel_version, key_json=key_json)
        return session.execute(query).scalar_one_or_none()

    @classmethod
    def matching(cls, session: Session, gpu: str | None = None, kernel: str | None = None) -> list[Winner]:
        """Winners filtered by GPU and/or kernel, in a stable order."""
        query = select(cls)
        if gpu is not None:
            query = query.where(cls.gpu == gpu)
        if kernel is not None:
            query = query.where(cls.kernel == kernel)
        query = query.order_by(cls.gpu, cls.kernel, cls.kernel_version, cls.key_json)
        return list(session.execute(query).scalars())


class Miss(Base):
    """A key a serving process resolved without an exact stored winner (what ``tune --missed`` tunes)."""

    __tablename__ = "misses"
    __table_args__ = (
        UniqueConstraint("gpu", "kernel", "kernel_version", "key_json", name="uq_misses_key"),
        CheckConstraint("count > 0", name="count_positive"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu: Mapped[str] = mapped_column(String(128))
    kernel: Mapped[str] = mapped_column(String(64))
    kernel_version: Mapped[str] = mapped_column(String(64))
    key_json: Mapped[str] = mapped_column(Text)
    triton_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    count: Mapped[int]
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

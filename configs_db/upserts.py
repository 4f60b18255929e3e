"""Writes that stay correct when several tuner processes share one database.

A trial is inserted with ``ON CONFLICT DO NOTHING`` and a winner with one conditional upsert
(``ON CONFLICT DO UPDATE ... WHERE`` the offer is faster, or the stored winner is stale: measured
under another Triton or torch, or against another portable default than the fresh offer's), so the
database itself decides every race: no read-then-write window exists. SQLite and PostgreSQL
have that syntax through their SQLAlchemy dialects; other databases get a portable fallback
that locks the row (``SELECT ... FOR UPDATE``) and absorbs lost insert races in a savepoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Result, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .errors import StoreError
from .models import Environment, Trial, Winner, utcnow

#: Dialects whose INSERT supports ON CONFLICT through SQLAlchemy.
UPSERT_DIALECTS = ("sqlite", "postgresql")
#: The columns a better offer replaces in the stored winner (the peer's time and the eager alternative
#: were measured in the winner's run and go with it: an offer without them clears the stored ones).
_REPLACED = (
    "config_json",
    "time_ms",
    "portable_ms",
    "speedup",
    "trial_count",
    "environment_id",
    "peer_ms",
    "peer_name",
    "eager_json",
    "portable_config_json",
)


@dataclass(frozen=True)
class WinnerValues:
    """One offered winner, validated and in column form."""

    gpu: str
    kernel: str
    kernel_version: str
    key_json: str
    config_json: str
    time_ms: float
    portable_ms: float
    speedup: float
    trial_count: int
    environment_id: int
    #: The peer timed beside the winner in the same run (``None``: none was).
    peer_ms: float | None = None
    peer_name: str | None = None
    #: The eager alternative measured in the same run, as canonical JSON (``None``: the winner serves all).
    eager_json: str | None = None
    #: The portable default the offer's speedup is against, as canonical JSON (``None``: not recorded).
    portable_config_json: str | None = None

    def columns(self, now: datetime) -> dict[str, Any]:
        values = dict(self.__dict__)
        values.update(created_at=now, updated_at=now)
        return values


def dialect_insert(dialect: str) -> Any:
    """The ``insert`` construct with ``on_conflict_*`` methods for one of :data:`UPSERT_DIALECTS`."""
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert
    from sqlalchemy.dialects.postgresql import insert as postgresql_insert

    return postgresql_insert


def _wrote_row(session: Session, statement: Any) -> bool:
    """Whether one single-row ``INSERT ... ON CONFLICT`` statement inserted or updated its row.

    Where the dialect has ``RETURNING``, the statement returns the row's id and a row back means
    written: PostgreSQL drivers report no row count for a statement with ``RETURNING`` (which
    SQLAlchemy adds there for the primary key anyway). Elsewhere (SQLite before 3.35) the row
    count answers.
    """
    if session.get_bind().dialect.insert_returning:
        return session.execute(statement.returning(statement.table.c.id)).first() is not None
    result: Result[Any] = session.execute(statement)
    return int(cast("CursorResult[Any]", result).rowcount) == 1


def insert_trial(session: Session, values: dict[str, Any]) -> bool:
    """Insert one trials row; ``False`` if the same trial is already stored."""
    dialect = session.get_bind().dialect.name
    if dialect not in UPSERT_DIALECTS:
        return insert_trial_portable(session, values)
    statement = dialect_insert(dialect)(Trial.__table__).values(**values).on_conflict_do_nothing()
    return _wrote_row(session, statement)


def offer_winner(
    session: Session, values: WinnerValues, triton_version: str, torch_version: str, *, measured_here: bool = True
) -> bool:
    """Write the winner unless a better, current one is stored; ``True`` if written.

    A stored winner measured under another Triton or torch version is not current (it serves only
    provisionally): a fresh measurement replaces it even where the old time was lower. So does an
    offer timed against another portable default than the one the stored winner names, where
    ``measured_here``: the offer was just measured, so its default is the running code's, and the
    stored speedup says nothing about that one. A stored winner that names none (written before
    the column existed) serves as before and is replaced by time alone, as is any winner by an
    imported record (``measured_here=False``).
    """
    dialect = session.get_bind().dialect.name
    if dialect not in UPSERT_DIALECTS:
        return offer_portable(session, values, triton_version, torch_version, measured_here=measured_here)
    return offer_upsert(session, values, triton_version, torch_version, dialect, measured_here=measured_here)


def refresh_eager(session: Session, values: WinnerValues) -> bool:
    """Give the stored winner at ``values``' key ``values``' eager alternative where its config is
    ``values``' own; ``True`` if a row was updated.

    For an offer the store did not take, in the offer's transaction (which holds the row from the
    upsert on): a re-tune that measured the stored winner again timed its eager calls as this
    tritune runs them (with eager replay, say), and the stored alternative may date from another
    way of running them. The time stays the stored, faster one; a stored winner of another config
    is left alone.
    """
    statement = (
        update(Winner)
        .where(
            Winner.gpu == values.gpu,
            Winner.kernel == values.kernel,
            Winner.kernel_version == values.kernel_version,
            Winner.key_json == values.key_json,
            Winner.config_json == values.config_json,
        )
        .values(eager_json=values.eager_json, updated_at=utcnow())
    )
    result: Result[Any] = session.execute(statement)
    return int(cast("CursorResult[Any]", result).rowcount) == 1


def insert_trial_portable(session: Session, values: dict[str, Any]) -> bool:
    """``insert_trial`` for databases without ``ON CONFLICT``: insert in a savepoint, absorb the duplicate."""
    try:
        with session.begin_nested():
            session.execute(insert(Trial).values(**values))
        return True
    except IntegrityError:
        existing = Trial.find(
            session,
            values["environment_id"],
            values["kernel"],
            values["kernel_version"],
            values["key_json"],
            values["config_json"],
        )
        if existing is None:
            # Not a duplicate: a foreign key or check constraint refused the row.
            raise
        return False


def _stale_environments(triton_version: str, torch_version: str) -> Any:
    """Environment ids measured under another Triton or torch version than the ones given."""
    return select(Environment.id).where(
        (Environment.triton_version != triton_version) | (Environment.torch_version != torch_version)
    )


def offer_upsert(
    session: Session,
    values: WinnerValues,
    triton_version: str,
    torch_version: str,
    dialect: str,
    *,
    measured_here: bool = True,
) -> bool:
    """``offer_winner`` as one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` statement."""
    table = Winner.__table__
    now = utcnow()
    statement = dialect_insert(dialect)(table).values(**values.columns(now))
    excluded = statement.excluded
    replace = {name: excluded[name] for name in _REPLACED}
    replace["updated_at"] = now
    better = (excluded.time_ms < table.c.time_ms) | table.c.environment_id.in_(
        _stale_environments(triton_version, torch_version)
    )
    if measured_here and values.portable_config_json is not None:
        other_default = table.c.portable_config_json.is_not(None) & (
            table.c.portable_config_json != excluded.portable_config_json
        )
        better = better | other_default
    statement = statement.on_conflict_do_update(
        index_elements=["gpu", "kernel", "kernel_version", "key_json"], set_=replace, where=better
    )
    return _wrote_row(session, statement)


def offer_portable(
    session: Session, values: WinnerValues, triton_version: str, torch_version: str, *, measured_here: bool = True
) -> bool:
    """``offer_winner`` for databases without ``ON CONFLICT``: row lock, then insert or update.

    An insert that loses a race to another process hits the unique constraint inside a
    savepoint; the loop then reads the row that process wrote and compares against it.
    """
    for _ in range(3):
        query = (
            select(Winner)
            .filter_by(gpu=values.gpu, kernel=values.kernel, kernel_version=values.kernel_version)
            .filter_by(key_json=values.key_json)
            .with_for_update()
        )
        held = session.execute(query).scalar_one_or_none()
        now = utcnow()
        if held is None:
            try:
                with session.begin_nested():
                    session.add(Winner(**values.columns(now)))
                return True
            except IntegrityError:
                continue
        held_env = session.get(Environment, held.environment_id)
        stale = held_env is not None and (
            held_env.triton_version != triton_version or held_env.torch_version != torch_version
        )
        other_default = (
            measured_here
            and values.portable_config_json is not None
            and held.portable_config_json is not None
            and held.portable_config_json != values.portable_config_json
        )
        if not (values.time_ms < held.time_ms or stale or other_default):
            return False
        for name in _REPLACED:
            setattr(held, name, getattr(values, name))
        held.updated_at = now
        return True
    raise StoreError(f"winner for {values.kernel} at {values.key_json}: kept losing the race to insert it")

"""The ``misses`` table: keys a serving process resolved without an exact stored winner, and how often.

:func:`write_misses` is the only write a serving process makes to a config DB, and it touches this
table alone: one upsert per key that adds the new count to the stored one, keeps the earliest
``first_seen`` and the latest ``last_seen``, and stamps the latest Triton and torch versions. A DB
that does not exist yet, or is at an older schema revision, is created or upgraded through the
tuner's path (:func:`.storage.upgrade`) when Alembic is importable (the ``tritune[tune]`` extra);
without Alembic :class:`SchemaNeeded` says so and nothing is touched. No folder is created but
tritune's own data folder of the default DB: another SQLite path whose folder does not exist (a
typo in ``TRITUNE_DB``) raises :class:`StoreError` and nothing is written. A DB that refuses writes
(read-only file, folder or mount, a read-only database role) raises :class:`NotWritable`.

:func:`read_misses` is ``tune missed``'s read: read-only, it never creates or upgrades a file, and
a DB at a revision without the table holds no misses. Both are bounded in time like the runtime's
read of winners. SQLAlchemy is imported only when a DB is written or read.

Writes never overlap: one that did not end within its bound keeps running on its own thread (a
driver cannot be interrupted), and the next one waits for it or gives up. Such a write raises
:class:`WriteTimedOut`: it may still land, so its rows must not be offered again (the counts are
advisory; counting a key twice would overstate it). The first write to a DB in a process may create
the file or upgrade its schema, and is given :data:`SETUP_TIMEOUT_S` at least.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .errors import StoreError
from .reader import ABANDON_GRACE_S, _within, database_error_types, display_url, reason_of
from .urls import is_default_db, sqlite_file
from .values import parse_canonical_json, printable

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

__all__ = ["MissRecord", "NotWritable", "SchemaNeeded", "WriteTimedOut", "read_misses", "write_misses"]

#: Revisions whose schema has no ``misses`` table (it came with 0003).
REVISIONS_WITHOUT_MISSES = ("0001", "0002")


class SchemaNeeded(StoreError):
    """The DB does not exist or is at an older revision, and Alembic (``tritune[tune]``) is not installed."""


class NotWritable(StoreError):
    """The DB (its file, folder, mount or the database role) refuses writes."""


class WriteTimedOut(StoreError):
    """A write did not end within its bound; it is left to finish, so its rows may or may not be stored."""


#: Seconds the first write to a DB in this process may take at least: creating the file or upgrading
#: its schema (Alembic) takes longer than a plain upsert.
SETUP_TIMEOUT_S = 15.0

#: Held by a write from its start to its end, on its own thread: an abandoned write still holds it.
_writing = threading.Lock()
#: DB URLs a write of this process succeeded on: at the schema head since, plain writes from then on.
_ready: set[str] = set()


def _after_fork() -> None:
    # A write running in the parent at the fork holds the lock; its thread does not exist in the child.
    global _writing
    _writing = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@dataclass(frozen=True)
class MissRecord:
    """One logged key: the key as stored (canonical JSON), how often and when it was resolved without a winner."""

    gpu: str
    kernel: str
    kernel_version: str
    key_json: str
    triton_version: str
    torch_version: str
    count: int
    first_seen: datetime
    last_seen: datetime

    def key(self) -> dict[str, Any]:
        """The key's fields; ``ValueError`` if the stored JSON is malformed."""
        return parse_canonical_json(self.key_json)


def alembic_available() -> bool:
    return importlib.util.find_spec("alembic") is not None


def _not_writable(exc: BaseException) -> bool:
    text = str(getattr(exc, "orig", None) or exc).lower()
    return any(
        marker in text
        for marker in ("readonly", "read-only", "unable to open database file", "permission denied", "read only")
    )


def write_misses(url: str, rows: Iterable[MissRecord], *, timeout_s: float) -> int:
    """Add ``rows`` to the DB at ``url`` within ``timeout_s`` seconds (:data:`SETUP_TIMEOUT_S` at least
    for this process's first write there); how many rows were written.

    Raises :class:`WriteTimedOut` when the write did not end in time (it may still land),
    :class:`SchemaNeeded`, :class:`NotWritable`, or :class:`StoreError` for anything else (an earlier
    write still running, a lock held past the bound, a corrupt file, a newer schema); nothing is
    half written, and only after :class:`WriteTimedOut` may anything be written later.
    """
    batch = list(rows)
    if not batch:
        return 0
    bound = timeout_s if url in _ready else max(timeout_s, SETUP_TIMEOUT_S)
    deadline = time.monotonic() + bound
    if not _writing.acquire(timeout=bound):
        raise StoreError(f"an earlier write of missed keys to {display_url(url)} has not ended")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["written"] = _write(url, batch, bound)
        except BaseException as exc:  # re-raised in the caller's thread below
            outcome["error"] = exc
        finally:
            _writing.release()

    thread = threading.Thread(target=run, name="tritune-miss-log-write", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()) + ABANDON_GRACE_S)
    if thread.is_alive():
        raise WriteTimedOut(f"no answer from {display_url(url)} within {bound:g} s")
    if "error" in outcome:
        raise outcome["error"]
    _ready.add(url)
    written: int = outcome["written"]
    return written


def _write(url: str, batch: list[MissRecord], timeout_s: float) -> int:
    path = sqlite_file(url)
    own_folder = path is not None and is_default_db(path)
    if path is not None and not own_folder and not path.parent.is_dir():
        # A typo in TRITUNE_DB must not leave folders behind; the tuner creates them.
        raise StoreError(
            f"the config DB's folder {printable(str(path.parent))} does not exist, and a serving process "
            "creates no folder (tune does)"
        )
    if path is not None and not path.exists() and not alembic_available():
        raise SchemaNeeded(f"no config DB at {printable(str(path))}")
    from . import storage

    failures: tuple[type[BaseException], ...] = (OSError, *database_error_types())
    try:
        engine = storage.make_engine(url, timeout_s=timeout_s, create_folder=own_folder)
    except PermissionError as exc:
        raise NotWritable(f"{display_url(url)}: {printable(str(exc))}") from exc
    try:
        with engine.connect() as connection:
            revision = storage.schema_revision(connection)
        if revision != storage.SCHEMA_HEAD:
            if not alembic_available():
                where = "holds no schema" if revision is None else f"is at schema revision {revision}"
                raise SchemaNeeded(f"the config DB {display_url(url)} {where}")
            storage.upgrade(engine)
        with storage.session_scope(engine) as session:
            for row in batch:
                _upsert(session, row)
        return len(batch)
    except StoreError:
        raise
    except failures as exc:
        if _not_writable(exc):
            raise NotWritable(f"{display_url(url)}: {reason_of(exc)}") from exc
        raise StoreError(f"cannot log missed keys to {display_url(url)}: {reason_of(exc)}") from exc
    finally:
        engine.dispose()


def _upsert(session: Session, row: MissRecord) -> None:
    """Insert the key's row, or add to its count and widen its first/last seen (one statement where the
    dialect has ``ON CONFLICT``)."""
    from sqlalchemy import case, select

    from .models import Miss
    from .upserts import UPSERT_DIALECTS, dialect_insert

    values = {
        "gpu": row.gpu,
        "kernel": row.kernel,
        "kernel_version": row.kernel_version,
        "key_json": row.key_json,
        "triton_version": row.triton_version,
        "torch_version": row.torch_version,
        "count": row.count,
        "first_seen": row.first_seen,
        "last_seen": row.last_seen,
    }
    dialect = session.get_bind().dialect.name
    if dialect in UPSERT_DIALECTS:
        table = Miss.__table__
        statement = dialect_insert(dialect)(table).values(**values)
        excluded = statement.excluded
        statement = statement.on_conflict_do_update(
            index_elements=["gpu", "kernel", "kernel_version", "key_json"],
            set_={
                "count": table.c.count + excluded.count,
                "first_seen": case(
                    (excluded.first_seen < table.c.first_seen, excluded.first_seen), else_=table.c.first_seen
                ),
                "last_seen": case(
                    (excluded.last_seen > table.c.last_seen, excluded.last_seen), else_=table.c.last_seen
                ),
                "triton_version": excluded.triton_version,
                "torch_version": excluded.torch_version,
            },
        )
        session.execute(statement)
        return
    query = select(Miss).filter_by(
        gpu=row.gpu, kernel=row.kernel, kernel_version=row.kernel_version, key_json=row.key_json
    )
    held = session.execute(query.with_for_update()).scalar_one_or_none()
    if held is None:
        session.add(Miss(**values))
        return
    held.count += row.count
    held.first_seen = min(_aware(held.first_seen), row.first_seen)
    held.last_seen = max(_aware(held.last_seen), row.last_seen)
    held.triton_version, held.torch_version = row.triton_version, row.torch_version


def _aware(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def read_misses(url: str, *, gpu: str | None = None, kernel: str | None = None, timeout_s: float) -> list[MissRecord]:
    """The logged misses (of one GPU and/or kernel when given), most frequent first; read-only.

    A SQLite file that does not exist, an empty DB and a DB at a revision without the table hold
    none. Anything that cannot be read as a config DB raises :class:`StoreError` saying why.
    """
    path = sqlite_file(url)
    if path is not None and not path.exists():
        return []
    from . import models, storage  # noqa: F401  (imported in the caller's thread: the bound is for the DB)

    late = f"no answer from {display_url(url)} within {timeout_s:g} s"

    def read() -> list[MissRecord]:
        engine = storage.make_engine(url, read_only=True, timeout_s=timeout_s)
        try:
            return _read(engine, gpu, kernel)
        except StoreError:
            raise
        except database_error_types() as exc:
            raise StoreError(f"cannot read {display_url(url)} as a config DB: {reason_of(exc)}") from exc
        finally:
            engine.dispose()

    return _within(timeout_s + ABANDON_GRACE_S, read, late)


def _read(engine: Engine, gpu: str | None, kernel: str | None) -> list[MissRecord]:
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from . import storage
    from .models import Miss

    with Session(engine) as session, session.begin():
        revision = storage.schema_revision(session.connection())
        if revision is None or revision in REVISIONS_WITHOUT_MISSES:
            return []
        query = select(Miss)
        if gpu is not None:
            query = query.where(Miss.gpu == gpu)
        if kernel is not None:
            query = query.where(Miss.kernel == kernel)
        query = query.order_by(Miss.count.desc(), Miss.gpu, Miss.kernel, Miss.key_json)
        return [
            MissRecord(
                gpu=miss.gpu,
                kernel=miss.kernel,
                kernel_version=miss.kernel_version,
                key_json=miss.key_json,
                triton_version=miss.triton_version,
                torch_version=miss.torch_version,
                count=int(miss.count),
                first_seen=_aware(miss.first_seen),
                last_seen=_aware(miss.last_seen),
            )
            for miss in session.execute(query).scalars()
        ]

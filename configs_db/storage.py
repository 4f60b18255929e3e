"""Engines, sessions and schema upgrades for the config DB.

SQLite is the common case: one file shared by a serving process that reads it and tuner
processes that write it, sometimes several at once. So every SQLite connection gets a busy
timeout (wait for a lock instead of failing), foreign keys, and WAL journaling (readers never
block the writer, and a killed writer leaves a valid file). Write transactions start with
``BEGIN IMMEDIATE``: taking the write lock up front means two writers queue on the busy timeout
instead of one of them failing when it upgrades a read lock. That requires managing BEGIN
ourselves (the ``sqlite3`` driver's legacy mode would otherwise emit its own), which also makes
DDL and savepoints transactional, as the SQLAlchemy SQLite dialect docs describe.

The runtime's read of winners only ever reads (:func:`make_engine` with ``read_only=True``, see
:func:`sqlite_read_uri`): it opens files with SQLite's ``mode=ro``, and a WAL file that nobody
has open with ``immutable=1``, so it creates no file, needs no write access to the file or its
folder (a container image, a read-only mount), and waits for a lock no longer than it is told.
A serving process's one write is its miss log (``configs_db/misses.py``, ``TRITUNE_MISS_LOG``):
it creates the DB file where its folder exists, and no folder but that of the default DB.

``-wal`` and ``-shm`` files beside a DB belong to the tuners: a tuner that closes cleanly folds
the WAL back into the DB and removes both; one that was killed, or ran out of disk while
folding, leaves them behind. The WAL then holds committed results: the runtime reads through it
and never removes it, and the next tuner to open and close the DB cleans up. Never delete them
by hand while the DB is in use.

The schema is versioned with Alembic. :func:`upgrade` runs the migrations in ``migrations/``
inside one transaction, so concurrent openers do not race to create tables; a database stamped
with a revision this code does not know (written by a newer tritune) is refused, never touched.
"""

from __future__ import annotations

import math
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool, StaticPool

from .errors import StoreError
from .urls import blocking_ancestor, not_a_db_file, sqlite_file
from .values import printable

#: The Alembic revision this code writes and reads; older known revisions can be upgraded.
SCHEMA_HEAD = "0005"
#: Every revision this code knows, oldest first (a test checks them against ``migrations/``).
SCHEMA_REVISIONS = ("0001", "0002", "0003", "0004", "0005")
MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
#: How long a tuner's connection waits for another process's write lock before giving up.
BUSY_TIMEOUT_MS = 30_000
#: How long a tuner waits for a database server to accept its connection (the drivers' own
#: default is minutes, or forever).
CONNECT_TIMEOUT_S = 30
#: The two bytes at offset 18 of a SQLite file's header say 2 for a WAL database.
_WAL_HEADER = b"\x02\x02"
#: PostgreSQL advisory lock taken while upgrading (an arbitrary constant: "tritune" in base 36).
SCHEMA_LOCK_KEY = 64790900330
#: Tables of a tritune DB, used to tell an empty database from somebody else's.
TRITUNE_TABLES = frozenset({"alembic_version", "environments", "misses", "trials", "winners"})


def _enable_wal(cursor: sqlite3.Cursor) -> None:
    """Switch the file to WAL, retrying while another process holds it.

    Changing the journal mode needs an exclusive lock, and SQLite reports a conflict there as
    "database is locked" at once instead of calling the busy handler; two tuners opening a new
    file together hit that. So retry until the busy timeout, and stop as soon as either process
    has made the switch (it is persistent in the file).
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
                return
            if str(cursor.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower() == "wal":
                return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise sqlite3.OperationalError("could not switch the database to WAL journaling")
        time.sleep(0.01)


def _configure_sqlite(engine: Engine, *, wal: bool, read_only: bool, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Turn off the driver's own BEGIN handling; the "begin" hook below emits ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if read_only:
                cursor.execute("PRAGMA query_only = ON")
            elif wal:
                _enable_wal(cursor)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        # Readers take a snapshot; writers take the write lock before their first read.
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def is_quiet_wal_file(path: Path) -> bool:
    """Whether ``path`` is a WAL-mode SQLite file that no connection has open right now.

    While any connection has a WAL database open, its ``-wal`` file exists; with none beside it,
    everything committed is in the file itself.
    """
    try:
        # Non-blocking: opening a FIFO for reading would wait for a writer.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return False
        header = file.read(20)
    return header[18:20] == _WAL_HEADER and not path.with_name(path.name + "-wal").exists()


def sqlite_read_uri(path: Path, *, immutable: bool = False) -> str:
    """The URI the runtime opens the SQLite file ``path`` with: read-only, never created.

    ``mode=ro`` writes nothing, but on a WAL database it creates ``-wal`` and ``-shm`` files
    when they are missing (and cannot open it at all in a folder it may not write); they then
    stay, as only a writer removes them. So a WAL file that nobody has open
    (:func:`is_quiet_wal_file`) is opened ``immutable=1``: no locks, no side files. The reader
    must check that nothing changed the file meanwhile (a tuner opening it) and read again
    without ``immutable`` if it did. Every other file (rollback journal, or WAL with a writer or
    a killed writer's WAL beside it) is opened ``mode=ro`` with locks, reading through the WAL.
    """
    return path.resolve().as_uri() + ("?mode=ro&immutable=1" if immutable else "?mode=ro")


def _server_connect_args(parsed: Any, timeout_s: float) -> dict[str, Any]:
    """Driver options bounding how long a connection to a database server may take to open.

    libpq (psycopg, psycopg2) counts whole seconds and treats less than 2 as 2; 0 would mean
    forever. A timeout given in the URL wins.
    """
    if "connect_timeout" in parsed.query or "timeout" in parsed.query:
        return {}
    driver = parsed.get_driver_name()
    if driver in ("psycopg", "psycopg2"):
        return {"connect_timeout": max(2, math.ceil(timeout_s))}
    if driver == "pg8000":
        return {"timeout": timeout_s}
    return {}


def make_engine(
    url: str,
    *,
    read_only: bool = False,
    timeout_s: float | None = None,
    immutable: bool = False,
    create_folder: bool = True,
) -> Engine:
    """An engine for ``url`` with the SQLite settings above.

    A SQLite path that exists but is no regular file (a FIFO, a folder, ``/dev/null``) is refused
    with :class:`StoreError` before SQLite opens it. For a SQLite file the parent directory is
    created when ``create_folder`` (the tuner), never when ``read_only``: then nothing is
    ever created and nothing written, the file is opened with :func:`sqlite_read_uri`
    (``immutable`` as the caller decided) and ``query_only``, and each connection is its own
    (no pool). ``timeout_s`` bounds how long a connection waits for a lock (SQLite) or for a
    server to accept it (PostgreSQL drivers that take a connect timeout); by default a tuner's
    patience (:data:`BUSY_TIMEOUT_MS`, :data:`CONNECT_TIMEOUT_S`). In-memory SQLite shares one
    connection (``StaticPool``), otherwise each connection would see its own empty database.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        connect_args = _server_connect_args(parsed, CONNECT_TIMEOUT_S if timeout_s is None else timeout_s)
        if read_only:
            return create_engine(url, poolclass=NullPool, connect_args=connect_args)
        return create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    busy_timeout_ms = BUSY_TIMEOUT_MS if timeout_s is None else max(1, round(timeout_s * 1000))
    path = sqlite_file(url)
    refusal = None if path is None else not_a_db_file(path)
    if refusal is not None:
        raise StoreError(refusal)
    if path is None:
        if parsed.database and parsed.database.startswith("file:"):
            raise StoreError(f"{url}: SQLite URI filenames are not supported; give a plain file path")
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
        _configure_sqlite(engine, wal=False, read_only=read_only, busy_timeout_ms=busy_timeout_ms)
        return engine
    if read_only:
        uri = sqlite_read_uri(path, immutable=immutable)

        def connect() -> sqlite3.Connection:
            return sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=busy_timeout_ms / 1000)

        engine = create_engine("sqlite://", creator=connect, poolclass=NullPool)
    else:
        blocked = blocking_ancestor(path)
        if blocked is not None:
            raise StoreError(f"{printable(str(blocked[0]))} is {blocked[1]}, so the DB's folder cannot be created")
        if create_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url)
    _configure_sqlite(engine, wal=True, read_only=read_only, busy_timeout_ms=busy_timeout_ms)
    return engine


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that commits when the block ends and rolls back if it raises.

    Every store operation is one short scope, so whatever a tune measured is committed before
    the next measurement starts.
    """
    session = Session(engine, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def schema_revision(connection: Connection) -> str | None:
    """The database's Alembic revision, ``None`` for an empty database.

    Raises :class:`StoreError` for a database that has tables but is not a tritune DB, and for
    one stamped with a revision this code does not know.
    """
    tables = set(inspect(connection).get_table_names())
    if not tables:
        return None
    if "alembic_version" not in tables:
        foreign = ", ".join(sorted(tables - TRITUNE_TABLES)[:5]) or ", ".join(sorted(tables))
        raise StoreError(f"not a tritune config DB (no alembic_version table; it holds {foreign})")
    versions = [row[0] for row in connection.execute(text("SELECT version_num FROM alembic_version"))]
    if len(versions) != 1:
        raise StoreError(f"not a tritune config DB (alembic_version holds {versions!r}, expected one revision)")
    revision = str(versions[0])
    if revision not in SCHEMA_REVISIONS:
        raise StoreError(
            f"unknown schema revision {revision!r} (this tritune knows {', '.join(SCHEMA_REVISIONS)}): "
            "it was written by a newer tritune, or is not a tritune config DB; upgrade tritune to use it"
        )
    return revision


def alembic_config() -> Any:
    """An Alembic ``Config`` built in code: no ``alembic.ini`` needed, independent of the CWD."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def upgrade(engine_or_url: Engine | str, revision: str = "head") -> str:
    """Migrate the database to ``revision`` (default: head) and return the revision now in force.

    Runs in one write transaction, so a second process opening the same new file waits and
    then finds the schema already there. A revision this code does not know is refused with
    :class:`StoreError` before anything is changed.
    """
    from alembic import command
    from alembic.util.exc import CommandError

    engine = make_engine(engine_or_url) if isinstance(engine_or_url, str) else engine_or_url
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                # Serialise concurrent upgraders, as BEGIN IMMEDIATE does on SQLite.
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            current = schema_revision(connection)
            target = SCHEMA_HEAD if revision == "head" else revision
            if target not in SCHEMA_REVISIONS:
                raise StoreError(f"unknown target revision {revision!r}")
            if current is not None and SCHEMA_REVISIONS.index(current) > SCHEMA_REVISIONS.index(target):
                raise StoreError(f"database is at revision {current}, newer than the requested {target}")
            if current != target:
                config = alembic_config()
                config.attributes["connection"] = connection
                try:
                    command.upgrade(config, target)
                except CommandError as exc:
                    raise StoreError(f"schema upgrade to {target} failed: {exc}") from exc
            return target
    finally:
        if isinstance(engine_or_url, str):
            engine.dispose()

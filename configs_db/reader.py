"""The runtime's read of a config DB: :func:`read_winners`, bounded in time and read-only.

A serving process reads the user's DB once per device, on the first dispatch. Whatever it finds
there must not take it down or hold it up: the read never creates or changes a file (no schema
upgrade, no WAL side files; a read-only file or folder is fine), gives up after ``timeout_s``
however the database misbehaves (a server that accepts the connection and never answers, a
file another process holds locked), and refuses a database it cannot trust with
:class:`StoreError`. ``tune show`` and ``tune export`` read through it too, so they never write.
(A serving process does write one thing, its miss log: see :mod:`.misses`.) A SQLite file that
does not exist, other than the default DB, is said once per process at INFO: a typo in
``TRITUNE_DB`` otherwise looks like an empty DB.

SQLAlchemy is imported only once there is a database to read, so a serving process without
one never pays for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import StoreError
from .records import EagerAlternative, WinnerRecord
from .urls import is_default_db, is_sqlite, not_a_db_file, sqlite_file
from .values import parse_canonical_json, printable, strict_loads
from .winner_fields import eager_alternative, portable_config_problem

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from .models import Environment, Winner

__all__ = ["READ_TIMEOUT_S", "StoreError", "display_url", "read_winners"]

log = logging.getLogger("tritune.configs_db")

#: Seconds :func:`read_winners` may take in all unless told otherwise.
READ_TIMEOUT_S = 3.0
#: Characters of a driver's error kept in a message.
REASON_CHARS = 1000
#: How much longer than its own timeouts a read may run before it is abandoned: the drivers'
#: timeouts then report first, with their reason; this bound catches those that ignore them.
ABANDON_GRACE_S = 0.5
#: Pause between attempts at a SQLite file that reports a lock conflict at once.
RETRY_PAUSE_S = 0.05

T = TypeVar("T")


def display_url(url: str) -> str:
    """``url`` fit for messages and record sources: a password masked, control characters escaped,
    a SQLite file's name as written (not percent-encoded)."""
    path = sqlite_file(url)
    if path is not None:
        url = f"{url.split('://', 1)[0]}:///{path}"
    elif not is_sqlite(url):
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(url).render_as_string(hide_password=True)
        except ArgumentError:
            url = url.split("://", 1)[0] + "://(unparsable URL)"
    return printable(url, limit=REASON_CHARS)


def database_error_types() -> tuple[type[BaseException], ...]:
    """What a driver raises for a database it cannot use (imports SQLAlchemy)."""
    import sqlite3

    from sqlalchemy.exc import SQLAlchemyError

    return (SQLAlchemyError, sqlite3.Error)


def reason_of(exc: BaseException) -> str:
    """The driver's own words for ``exc``, escaped for a log line."""
    return printable(str(getattr(exc, "orig", None) or exc), limit=REASON_CHARS)


#: Older schema revisions the runtime still reads (without the columns they lack); reading never
#: upgrades a DB, and a tuner opening it for writing does.
READABLE_REVISIONS = ("0002", "0003", "0004")
#: The revision that added each optional winners column group: a DB before it reads them as ``None``.
PEER_REVISION = "0003"
EAGER_REVISION = "0004"
PORTABLE_CONFIG_REVISION = "0005"


def _eager_from_row(winner: Winner, source: str) -> EagerAlternative | None:
    """The row's eager alternative, or ``None``; a malformed ``eager_json`` is ignored with one warning.

    The winner stays served without it: the alternative only ever serves eager calls faster, and
    the winner serves every call correctly on its own.
    """
    if winner.eager_json is None:
        return None
    try:
        return eager_alternative(strict_loads(winner.eager_json))
    except ValueError as exc:
        log.warning(
            "%s: winners row %d (%s %s): ignoring its eager alternative, the winner serves every call: %s",
            source,
            winner.id,
            printable(winner.gpu),
            printable(winner.kernel),
            printable(str(exc)),
        )
        return None


def _portable_config_from_row(winner: Winner) -> dict[str, Any] | None:
    """The row's portable default, or ``None`` where it has none; ``ValueError`` where it is malformed
    (the row is skipped: its speedup cannot be checked against the running default)."""
    if winner.portable_config_json is None:
        return None
    config = parse_canonical_json(winner.portable_config_json)
    problem = portable_config_problem(config)
    if problem is not None:
        raise ValueError(problem)
    return config


def _record_from_row(
    winner: Winner,
    environment: Environment,
    source: str,
    *,
    with_peer: bool,
    with_eager: bool,
    with_portable_config: bool,
) -> WinnerRecord:
    """A :class:`WinnerRecord` from one winners row; ``ValueError`` if its key, config or portable
    default JSON is malformed."""
    return WinnerRecord(
        kernel=winner.kernel,
        kernel_version=winner.kernel_version,
        gpu=winner.gpu,
        key=parse_canonical_json(winner.key_json),
        config=parse_canonical_json(winner.config_json),
        time_ms=float(winner.time_ms),
        portable_ms=float(winner.portable_ms),
        speedup=float(winner.speedup),
        trials=int(winner.trial_count),
        triton_version=environment.triton_version,
        torch_version=environment.torch_version,
        tritune_version=environment.tritune_version,
        source=source,
        peer_ms=(None if winner.peer_ms is None else float(winner.peer_ms)) if with_peer else None,
        peer_name=winner.peer_name if with_peer else None,
        eager=_eager_from_row(winner, source) if with_eager else None,
        portable_config=_portable_config_from_row(winner) if with_portable_config else None,
        extra={
            "gpu_name": environment.gpu_name,
            "capability": environment.capability,
            "sm_count": environment.sm_count,
            "driver": environment.driver,
            "cuda": environment.cuda,
        },
    )


def winner_records(
    session: Session,
    gpu: str | None,
    kernel: str | None,
    source: str,
    *,
    with_peer: bool = True,
    with_eager: bool = True,
    with_portable_config: bool = True,
) -> list[WinnerRecord]:
    """Winner records from the database; a row with a malformed key or config is skipped with one
    warning, and a malformed eager alternative is left out of its record with one warning.

    ``with_peer=False``, ``with_eager=False`` and ``with_portable_config=False`` read a DB at a
    revision before those columns existed.
    """
    from sqlalchemy import select
    from sqlalchemy.orm import defer

    from .models import Environment, Winner

    query = select(Winner, Environment).join(Environment, Winner.environment_id == Environment.id)
    # Timestamps are never read here: a garbled one must not fail the fetch of every row.
    query = query.options(defer(Winner.created_at), defer(Winner.updated_at))
    if not with_peer:
        query = query.options(defer(Winner.peer_ms, raiseload=True), defer(Winner.peer_name, raiseload=True))
    if not with_eager:
        query = query.options(defer(Winner.eager_json, raiseload=True))
    if not with_portable_config:
        query = query.options(defer(Winner.portable_config_json, raiseload=True))
    if gpu is not None:
        query = query.where(Winner.gpu == gpu)
    if kernel is not None:
        query = query.where(Winner.kernel == kernel)
    query = query.order_by(Winner.gpu, Winner.kernel, Winner.kernel_version, Winner.key_json)
    records = []
    for winner, environment in session.execute(query):
        try:
            records.append(
                _record_from_row(
                    winner,
                    environment,
                    source,
                    with_peer=with_peer,
                    with_eager=with_eager,
                    with_portable_config=with_portable_config,
                )
            )
        except (TypeError, ValueError) as exc:  # TypeError: a NULL where a number belongs
            log.warning(
                "%s: skipping winners row %d (%s %s): %s",
                source,
                winner.id,
                printable(winner.gpu),
                printable(winner.kernel),
                printable(str(exc)),
            )
    return records


def read_winners(
    url: str, gpu: str | None = None, *, kernel: str | None = None, timeout_s: float = READ_TIMEOUT_S
) -> list[WinnerRecord]:
    """The winners stored in the database at ``url`` (of one GPU and/or kernel when given).

    A SQLite file that does not exist (said once at INFO unless it is the default DB), and a
    database with no tables at all, hold no winners: ``[]``, and nothing is created. Nothing is
    ever written: a database at one of :data:`READABLE_REVISIONS` is read as it is (the columns
    it lacks read as ``None``), and one at an older revision is refused, not upgraded. Anything
    that cannot be read as a tritune DB at this code's schema (corrupt file, somebody else's
    database, an unknown or too old schema revision, no answer or a lock still held after
    ``timeout_s`` seconds) raises :class:`StoreError` saying why; so does a path that is no
    regular file (a FIFO, a socket, a device such as ``/dev/null``, a folder), at once.
    """
    path = sqlite_file(url)
    if path is not None:
        # Before SQLite opens it: opening a FIFO blocks, and a folder reads as "disk I/O error".
        refusal = not_a_db_file(path)
        if refusal is not None:
            raise StoreError(refusal)
        if not path.exists():
            _tell_missing(url, path)
            return []
        # SQLite keeps its side files beside the file a link points to (a ConfigMap's ..data/).
        path = path.resolve()
    # Import here, in the caller's thread: the time bound is for waiting on the database.
    from . import models, storage  # noqa: F401

    source = f"db:{display_url(url)}"
    deadline = time.monotonic() + timeout_s

    def read() -> list[WinnerRecord]:
        return _read_until(deadline, url, path, gpu, kernel, source)

    late = f"no answer from {display_url(url)} within {timeout_s:g} s"
    return _within(timeout_s + ABANDON_GRACE_S, read, late)


#: SQLite URLs whose missing file was said (:func:`_tell_missing`): once per process is enough.
_told_missing: set[str] = set()


def _tell_missing(url: str, path: Path) -> None:
    """Say at INFO, once per URL, that the DB file a user named is not there, and whether its folder
    is; the default DB is simply not there until something is stored."""
    if url in _told_missing or is_default_db(path):
        return
    _told_missing.add(url)
    shown = printable(str(path), limit=REASON_CHARS)
    if path.parent.is_dir():
        log.info(
            "no config DB at %s: serving without it; tune creates it there, and so does a serving "
            "process's miss log (TRITUNE_MISS_LOG=0 turns that off)",
            shown,
        )
    else:
        log.info(
            "no config DB at %s, nor its folder: serving without it (check TRITUNE_DB); tune creates "
            "both, a serving process's miss log neither",
            shown,
        )


def _within(timeout_s: float, call: Callable[[], T], late: str) -> T:
    """``call()``, or :class:`StoreError` (``late``) once ``timeout_s`` seconds have passed.

    The call runs on a daemon thread: a driver that ignores its timeouts (a DNS lookup, a server
    that never answers) is left to finish on its own, and never keeps the process from exiting.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # re-raised in the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="tritune-config-db-read", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StoreError(late)
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value


def _read_until(
    deadline: float, url: str, path: Path | None, gpu: str | None, kernel: str | None, source: str
) -> list[WinnerRecord]:
    """Read, retrying SQLite lock conflicts reported at once (WAL recovery) until ``deadline``."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    while True:
        remaining = deadline - time.monotonic()
        try:
            return _read_once(url, path, gpu, kernel, source, max(remaining, 0.001))
        except (OperationalError, sqlite3.OperationalError) as exc:
            transient = "locked" in str(exc) or "busy" in str(exc)
            if not transient or time.monotonic() + RETRY_PAUSE_S >= deadline:
                raise StoreError(f"cannot read {display_url(url)} as a config DB: {reason_of(exc)}") from exc
            time.sleep(RETRY_PAUSE_S)
        except database_error_types() as exc:
            raise StoreError(f"cannot read {display_url(url)} as a config DB: {reason_of(exc)}") from exc


def _read_once(
    url: str, path: Path | None, gpu: str | None, kernel: str | None, source: str, timeout_s: float
) -> list[WinnerRecord]:
    from . import storage

    def read(immutable: bool = False) -> list[WinnerRecord]:
        engine = storage.make_engine(url, read_only=True, timeout_s=timeout_s, immutable=immutable)
        return _read_engine(engine, gpu, kernel, source, timeout_s)

    if path is None or not storage.is_quiet_wal_file(path):
        return read()
    # Nobody has this WAL file open: read it immutable (no side files). A tuner that opens it
    # meanwhile may change it under the read, so then read it again with locks.
    before = _file_state(path)
    try:
        records = read(immutable=True)
    except database_error_types():
        if _file_state(path) == before:
            raise
    else:
        if _file_state(path) == before:
            return records
    return read()


def _file_state(path: Path) -> tuple[int, int, int, bool]:
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, path.with_name(path.name + "-wal").exists()


def _read_engine(
    engine: Engine, gpu: str | None, kernel: str | None, source: str, timeout_s: float
) -> list[WinnerRecord]:
    """Check the schema and read the winners through ``engine`` (disposed here) in one transaction."""
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from . import storage

    try:
        with Session(engine) as session, session.begin():
            connection = session.connection()
            if connection.dialect.name == "postgresql":
                # A table locked by a schema upgrade must not hold the read past its bound either.
                connection.execute(text(f"SET LOCAL statement_timeout = {max(1, round(timeout_s * 1000))}"))
            revision = storage.schema_revision(connection)
            if revision is None:
                return []
            if revision != storage.SCHEMA_HEAD and revision not in READABLE_REVISIONS:
                raise StoreError(
                    f"schema revision {revision} is older than this tritune's {storage.SCHEMA_HEAD}, and reading "
                    "never upgrades a DB; a tuner opening it for writing (tune, tune import) upgrades it"
                )
            order = storage.SCHEMA_REVISIONS.index
            return winner_records(
                session,
                gpu,
                kernel,
                source,
                with_peer=order(revision) >= order(PEER_REVISION),
                with_eager=order(revision) >= order(EAGER_REVISION),
                with_portable_config=order(revision) >= order(PORTABLE_CONFIG_REVISION),
            )
    finally:
        engine.dispose()

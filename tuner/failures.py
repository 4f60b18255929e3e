"""What the ``tune`` command prints when a command fails: one or two lines, never a traceback.

A database that cannot be opened, a full disk, a bad ``TRITUNE_*`` value or a missing optional
package is the user's to fix, and a traceback buries what to do. :func:`explain` maps the known
exception families to a line naming what is wrong and, where it helps, a line saying what to do;
anything else becomes one line with its type and message. Every line is escaped (no control
characters, no console markup), since messages quote paths and database errors that came from
files. ``--debug`` (or ``TRITUNE_LOG_LEVEL=DEBUG``) shows the traceback instead.
"""

from __future__ import annotations

import errno
import json
import sqlite3
import sys
from dataclasses import dataclass
from types import TracebackType

from tritune.configs_db.errors import StoreError
from tritune.configs_db.values import printable

#: Printed after the message of an exception nobody anticipated.
DEBUG_HINT = "run with --debug for the traceback"
#: What to do about a module of the user's that does not import.
CHECK_IMPORT = "check the module name and PYTHONPATH"
#: Top-level modules of tritune and of what it installs: a missing one calls for a reinstall.
OWN_IMPORTS = frozenset(
    {"tritune", "torch", "triton", "numpy", "sqlalchemy", "pynvml", "platformdirs"}
    | {"optuna", "alembic", "typer", "rich"}
)
#: Longest message line printed (a database error can quote a whole statement).
MAX_LINE_CHARS = 600


@dataclass(frozen=True)
class Failure:
    """What went wrong, and what to do about it (``None`` when the first line already says)."""

    what: str
    todo: str | None = None

    def lines(self) -> list[str]:
        lines = [self.what] if self.todo is None else [self.what, self.todo]
        return [printable(" ".join(line.split()), limit=MAX_LINE_CHARS) for line in lines]


class CommandError(Exception):
    """Raised by a command that knows exactly what is wrong; printed as is, exit status 1."""

    def __init__(self, what: str, todo: str | None = None) -> None:
        super().__init__(what)
        self.failure = Failure(what, todo)


#: Database error text -> what to do about it (first match wins).
_DATABASE_ADVICE = (
    ("locked", "another process holds the database's write lock; run the command again when it is done"),
    ("busy", "another process holds the database's write lock; run the command again when it is done"),
    ("readonly", "the database file or its folder is read-only: make it writable, or name another --db"),
    ("read-only", "the database file or its folder is read-only: make it writable, or name another --db"),
    ("disk is full", "the disk is full: free some space and run the command again"),
    ("disk i/o error", "the disk failed a read or write: check the file system and free space"),
    ("unable to open", "check that the folder exists and that you may write in it, or name another --db"),
    ("not a database", "it is not a SQLite file: move it away, or name another --db (or TRITUNE_DB)"),
    ("malformed", "the file is damaged: restore it from a copy, or move it away and tune again"),
    ("not a tritune config db", "name a tritune config DB with --db (or TRITUNE_DB)"),
    ("is older than", "a tuning run or tune import with this --db upgrades it; tune show and the runtime only read"),
    ("connection", "check that the server is running and reachable, and the URL's host, port and credentials"),
    ("timeout", "check that the server is running and reachable, and the URL's host, port and credentials"),
    ("password authentication", "check the user name and password in the URL"),
    ("can't load plugin", "name a database SQLAlchemy knows: a file path, sqlite:///path or postgresql+psycopg://..."),
    ("does not exist", "create the database on the server first, or fix its name in the URL"),
)


def database_advice(message: str) -> str | None:
    """What to do about a database error, judged from its text; ``None`` when nothing better than it."""
    lowered = message.lower()
    return next((todo for needle, todo in _DATABASE_ADVICE if needle in lowered), None)


def _first_line(exc: BaseException) -> str:
    """The driver's own message (SQLAlchemy's adds the statement and a link; psycopg a hint line)."""
    original = getattr(exc, "orig", None)
    text = str(original if original is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _raised_in(exc: BaseException, package: str) -> bool:
    """Whether ``exc`` was raised from code of ``package`` (``optuna.storages``, ...)."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        name = str(tb.tb_frame.f_globals.get("__name__", ""))
        if name == package or name.startswith(package + "."):
            return True
        tb = tb.tb_next
    return False


def _os_failure(exc: OSError) -> Failure:
    where = f": {exc.filename}" if exc.filename else ""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Failure(f"no space left on the device{where}", "free some space and run the command again")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return Failure(
            f"permission denied{where}", "check the permissions of the file and its folder, or choose another path"
        )
    if exc.errno == errno.EROFS:
        return Failure(f"read-only file system{where}", "choose a path on a writable file system")
    if exc.errno == errno.ENOENT:
        return Failure(f"no such file or directory{where}")
    return Failure(f"{reason}{where}")


def _import_failure(exc: ImportError) -> Failure:
    root = (exc.name or "").split(".")[0]
    if root in ("optuna", "alembic"):
        return Failure(f"{root} is not installed, and tuning needs it", "pip install 'tritune[tune]'")
    if root == "gguf":
        return Failure("gguf is not installed, and reading GGUF files needs it", "pip install 'tritune[gguf]'")
    if root in ("psycopg", "psycopg2"):
        return Failure(
            "the PostgreSQL driver psycopg is not installed", "pip install 'tritune[postgres]' (or 'psycopg[binary]')"
        )
    if root in OWN_IMPORTS:
        return Failure(f"cannot import {exc.name}: {exc}", "reinstall tritune with its dependencies")
    return Failure(f"cannot import {exc.name or 'a module'}: {exc}", CHECK_IMPORT)


def import_error(exc: BaseException, what: str) -> CommandError:
    """A user's module (``--kernel mykern.softmax:SOFTMAX``, a ``tuning="mod:ATTR"``) that fails to import.

    ``what`` names the module and where the user named it. A missing module of tritune itself or
    of one of its dependencies is tritune's installation, not the user's module: the generic advice
    stands.
    """
    if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] in OWN_IMPORTS:
        failure = _import_failure(exc)
        return CommandError(failure.what, failure.todo)
    if isinstance(exc, ImportError | AttributeError):
        return CommandError(f"cannot import {what}: {exc}", CHECK_IMPORT)
    return CommandError(f"cannot import {what}: {type(exc).__name__}: {exc}", f"the module failed; {DEBUG_HINT}")


def _sqlalchemy_failure(exc: BaseException) -> Failure | None:
    if "sqlalchemy" not in sys.modules:
        return None
    from sqlalchemy import exc as sa

    if isinstance(exc, sa.ArgumentError):
        return Failure(
            f"bad database URL: {exc}",
            "give a file path or a SQLAlchemy URL such as sqlite:///path or postgresql+psycopg://user@host/db",
        )
    if isinstance(exc, sa.DBAPIError | sa.OperationalError | sa.DatabaseError):
        message = _first_line(exc)
        return Failure(f"database error: {message}", database_advice(message))
    return None


def _optuna_failure(exc: BaseException) -> Failure | None:
    """A study storage (``--storage``) that Optuna cannot use: a corrupt journal, a broken RDB."""
    if "optuna" not in sys.modules or not _raised_in(exc, "optuna.storages"):
        return None
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return Failure(
            f"the study journal (--storage) is corrupt: {exc}",
            "move the journal file away and run again (trials already measured are reused from the config DB)",
        )
    message = _first_line(exc)
    return Failure(f"the study storage (--storage) cannot be used: {message}", database_advice(message))


def explain(exc: BaseException) -> Failure:
    """The one or two lines to print for ``exc``."""
    if isinstance(exc, CommandError):
        return exc.failure
    studies = sys.modules.get("tritune.tuner.studies")
    if studies is not None and isinstance(exc, studies.StudyStorageError):
        # Its message names the storage and says what to do.
        return Failure(str(exc))
    optuna_failure = _optuna_failure(exc)
    if optuna_failure is not None:
        return optuna_failure
    if isinstance(exc, StoreError):
        return Failure(str(exc), database_advice(str(exc)))
    if isinstance(exc, ImportError):
        return _import_failure(exc)
    database = _sqlalchemy_failure(exc)
    if database is not None:
        return database
    if isinstance(exc, sqlite3.Error):
        return Failure(f"database error: {exc}", database_advice(str(exc)))
    if isinstance(exc, OSError):
        return _os_failure(exc)
    return Failure(f"{type(exc).__name__}: {exc} ({DEBUG_HINT})")

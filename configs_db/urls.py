"""Database URL and DB file helpers that do not import SQLAlchemy.

The runtime asks "is the config DB a SQLite file, and does it exist?" on the first dispatch of
every process. Answering that without importing SQLAlchemy keeps a process that has no DB from
paying for the import. The parse follows SQLAlchemy's (a test compares them).

:func:`not_a_db_file` and :func:`blocking_ancestor` name what is wrong with a DB path before
SQLite opens it: SQLite reports a folder as "disk I/O error", opening a FIFO for reading blocks
until something writes to it, and creating the DB's folder under a file fails with "File exists".
:func:`is_default_db` tells tritune's own DB file (whose folder tritune may create) from one a user
named.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import unquote

from .values import printable

#: How messages name each kind of path that is not a regular file.
_SPECIAL_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def is_sqlite(url: str) -> bool:
    scheme = url.split("://", 1)[0] if "://" in url else ""
    return scheme.split("+", 1)[0].lower() == "sqlite"


def sqlite_file(url: str) -> Path | None:
    """The file behind a SQLite URL; ``None`` for in-memory SQLite, URI filenames and other databases."""
    if not is_sqlite(url):
        return None
    rest = url.split("://", 1)[1]
    # "sqlite:///name" has an empty host; everything after that slash is the database.
    if not rest.startswith("/"):
        return None
    database = unquote(rest[1:].split("?", 1)[0])
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def special_kind(path: Path) -> str | None:
    """What ``path`` is ("a FIFO", "a directory", ...) when it exists and is not a regular file;
    ``None`` for a regular file and for nothing there. A link is followed; one that leads nowhere,
    or a path that cannot be searched, counts as nothing there (opening it then says why)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    if stat.S_ISREG(mode):
        return None
    return mode_kind(mode)


def mode_kind(mode: int) -> str:
    """How messages name a file mode that is not a regular file's ("a FIFO", "a directory", ...)."""
    return next((kind for test, kind in _SPECIAL_KINDS if test(mode)), "a special file")


def not_a_db_file(path: Path) -> str | None:
    """Why the SQLite DB path ``path`` must not be opened, or ``None``: "<path> is a FIFO, not a
    config DB file" when it exists and is not a regular file (:func:`special_kind`)."""
    kind = special_kind(path)
    if kind is None:
        return None
    return f"{printable(str(path))} is {kind}, not a config DB file"


def blocking_ancestor(path: Path) -> tuple[Path, str] | None:
    """The nearest existing path above ``path`` when it is not a folder, with what it is ("a file",
    "a FIFO", ...): the DB's folder cannot be created under it. ``None`` when it is a folder (the
    missing folders between can be created)."""
    for ancestor in path.parents:
        try:
            mode = os.stat(ancestor).st_mode
        except (FileNotFoundError, NotADirectoryError):  # not there, or a file further up: look higher
            continue
        except (OSError, ValueError):  # cannot be searched: creating the folder says why
            return None
        if stat.S_ISDIR(mode):
            return None
        return ancestor, "a file" if stat.S_ISREG(mode) else (special_kind(ancestor) or "not a folder")
    return None


def is_default_db(path: Path) -> bool:
    """Whether ``path`` is the default config DB file, in tritune's own data folder (created when
    something is first written there); any other DB's folder is the user's to create."""
    from tritune.kernels.settings import default_db_url  # where the default is defined; imports no torch

    default = sqlite_file(default_db_url())
    return default is not None and Path(os.path.abspath(path)) == default

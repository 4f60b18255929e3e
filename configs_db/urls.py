"""Database URL helpers that do not import SQLAlchemy.

The runtime asks "is the config DB a SQLite file, and does it exist?" on the first dispatch of
every process. Answering that without importing SQLAlchemy keeps a process that has no DB from
paying for the import. The parse follows SQLAlchemy's (a test compares them).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote


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

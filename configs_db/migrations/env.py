"""Alembic environment of the config DB.

Normally run by :func:`tritune.configs_db.storage.upgrade`, which passes an open connection in
a write transaction through ``config.attributes["connection"]``; the migrations then join that
transaction. Run from the ``alembic`` command line instead (with ``sqlalchemy.url`` set), it
opens its own engine with the same SQLite settings. There is no offline (``--sql``) mode: the
SQLite migrations use batch operations that need a live database.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from tritune.configs_db.models import Base
from tritune.configs_db.storage import make_engine


def _run(connection: Connection) -> None:
    # render_as_batch lets future migrations alter SQLite tables (copy-and-move under the hood);
    # transactional_ddl keeps a failed upgrade from leaving half a schema behind.
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=True,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("set sqlalchemy.url, or run migrations through tritune.configs_db.storage.upgrade")
    engine = make_engine(url)
    try:
        with engine.begin() as own_connection:
            _run(own_connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("the tritune config DB has no offline (--sql) migrations")
_run_online()

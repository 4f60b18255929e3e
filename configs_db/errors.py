"""The one exception the config DB raises for a database it cannot use.

It lives in its own SQLAlchemy-free module so the runtime can catch it (``store.StoreError``)
without importing the storage layer, and the storage layer can raise it without importing the
store.
"""

from __future__ import annotations


class StoreError(Exception):
    """A config DB that cannot be used: missing tables, corrupt, or at a schema this code does not know."""

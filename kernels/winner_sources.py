"""A device's stored winners, read from their sources: the bundle shipped for its GPU, then the user's DB on top.

The dispatcher (:mod:`.dispatcher`) calls :func:`load_table` once per device, on its first
dispatch there. A source that cannot be read is skipped with one warning (a broken install or a
DB that does not answer within ``TRITUNE_DB_READ_TIMEOUT`` must not take the kernels down), and
what the other sources hold serves; :mod:`.winners` admits the records into the table.
"""

from __future__ import annotations

import logging

from tritune.configs_db.values import printable

from . import settings as settings_module
from .device import DeviceInfo
from .winners import WinnerTable, build_table

log = logging.getLogger("tritune.dispatch")


def load_table(device: DeviceInfo) -> WinnerTable:
    """Bundle, then the user's DB on top; a source that cannot be read is skipped, once."""
    from tritune.configs_db import bundles, store

    current = settings_module.settings()
    record_sets = []
    if not current.disable_bundles:
        try:
            records, rejections = bundles.shipped_records(device.slug)
        except Exception as exc:  # a broken install must not take the kernels down
            log.warning("shipped bundle for %s not used: %s", device.slug, printable(str(exc), limit=1000))
            records, rejections = [], []
        for rejection in rejections:
            log.warning("refused bundle content: %s", printable(rejection.reason, limit=1000))
        record_sets.append(records)
    try:
        record_sets.append(store.read_winners(current.db_url, device.slug, timeout_s=current.db_read_timeout))
    except Exception as exc:  # StoreError, a missing DB driver, ...: serve without the DB
        log.warning(
            "config DB %s not used: %s; serving the shipped bundle and portable defaults "
            "(reload_configs() reads it again)",
            store.display_url(current.db_url),
            printable(str(exc), limit=1000),
        )
    table = build_table(record_sets, device)
    log.info("loaded %d tuned configs for %s", len(table), device.slug)
    return table

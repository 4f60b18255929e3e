"""Provisional winners in the tuner: which keys ``tune`` re-measures first, and the marks ``show`` and ``bench`` print.

A winner tuned under other Triton or torch versions (or, with ``TRITUNE_CROSS_GPU=serve``, on
another GPU) serves provisionally (:mod:`tritune.kernels.winners`). ``tune`` takes the keys such
winners serve first, so that an interrupted or budgeted run replaces them before anything else.
"""

from __future__ import annotations

from typing import Any

from tritune.configs_db import bundles
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo
from tritune.kernels.dispatcher import NEAREST_MAX_LOG2
from tritune.kernels.spec import TuningKey
from tritune.kernels.winners import Entry, WinnerTable, admit, build_table

__all__ = ["provisional_first", "provisional_mark", "tuned_under_here"]


def served_table(store: ConfigStore, device: DeviceInfo) -> WinnerTable:
    """The winners the runtime would load on ``device``: the shipped bundle, then ``store``'s DB on top."""
    record_sets = []
    if not settings.settings().disable_bundles:
        record_sets.append(bundles.shipped_records(device.slug)[0])
    record_sets.append(store.winners(gpu=device.slug))
    return build_table(record_sets, device)


def provisional_first(
    plan: list[tuple[Any, TuningKey]], store: ConfigStore, device: DeviceInfo
) -> list[tuple[Any, TuningKey]]:
    """``plan`` with the keys whose served winner is provisional first, each part in its own order."""
    table = served_table(store, device)

    def provisional(item: tuple[Any, TuningKey]) -> bool:
        entry = table.exact.get((item[0].name, item[1]))
        return entry is not None and entry.provisional

    return [item for item in plan if provisional(item)] + [item for item in plan if not provisional(item)]


def tuned_under_here(record: Any, device: DeviceInfo) -> str:
    """What a stored winner that would serve on ``device`` provisionally was tuned under; ``""`` otherwise."""
    outcome = admit(record, device)
    if isinstance(outcome, tuple) and outcome[2].provisional:
        return str(outcome[2].tuned_under)
    return ""


def provisional_mark(table: WinnerTable, kernel: str, key: TuningKey, served: Any) -> str:
    """``" (provisional)"`` when ``served`` at ``key`` comes from a provisional entry of ``table``, else ``""``."""
    exact = table.exact.get((kernel, key))
    group = table.groups.get((kernel, key.group()), [])
    near = [entry for other, entry in group if other.distance(key) <= NEAREST_MAX_LOG2]
    entries: list[Entry] = [exact] if exact is not None else near
    if any(entry.provisional and entry.config == served for entry in entries):
        return " (provisional)"
    return ""

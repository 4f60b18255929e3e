"""Per call: which config serves this kernel at this key on this GPU.

Lookup order, resolved once per (kernel, key) and then served from a dict:

1. a config pinned with :func:`use_config` (tests and benchmarks);
2. the stored winner at the exact key, if its speedup over the portable default is at least
   ``1 + margin``;
3. with no winner at the exact key, the nearest bucket of the same kernel, GPU, dtype and head dim
   (the same key group) whose winner clears the margin;
4. the portable default, logged once per key.

Stored winners are loaded on the first dispatch for a device (the shipped bundle, then the
user's DB on top), never at import. Nothing here tunes, synchronises the GPU or writes files, so
dispatching is safe inside CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import settings as settings_module
from .device import DeviceInfo, device_info
from .registry import get_spec
from .spec import KernelSpec, TuningKey
from .winners import WinnerTable, build_table

log = logging.getLogger("tritune.dispatch")

_pinned: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "tritune_pinned", default=None
)


class Dispatcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, WinnerTable] = {}
        self._resolved: dict[tuple[str, str, TuningKey], Any] = {}
        self._logged: set[tuple[str, TuningKey]] = set()
        #: (kernel, device type, device index, facts) -> config values: the steady-state hit.
        self.values: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def clear(self) -> None:
        """Forget loaded winners and resolutions (settings changed, DB rewritten)."""
        with self._lock:
            self._tables.clear()
            self._resolved.clear()
            self._logged.clear()
            self.values.clear()

    def select(self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey) -> Any:
        pinned = _pinned.get()
        if pinned is not None and spec.name in pinned:
            return pinned[spec.name]
        config = self._resolved.get((spec.name, device.slug, key))
        if config is None:
            config = self._resolve(spec, device, key)
        return config

    def table(self, device: DeviceInfo) -> WinnerTable:
        table = self._tables.get(device.slug)
        if table is None:
            with self._lock:
                table = self._tables.get(device.slug)
                if table is None:
                    table = self._load(device)
                    self._tables[device.slug] = table
        return table

    def _load(self, device: DeviceInfo) -> WinnerTable:
        from tritune.configs_db import bundles, store

        current = settings_module.settings()
        record_sets = []
        if not current.disable_bundles:
            records, rejections = bundles.shipped_records(device.slug)
            for rejection in rejections:
                log.warning("refused bundle content: %s", rejection.reason)
            record_sets.append(records)
        try:
            record_sets.append(store.read_winners(current.db_url, device.slug))
        except store.StoreError as exc:
            log.warning("config DB %s not used: %s", current.db_url, exc)
        table = build_table(record_sets, device)
        log.info("loaded %d tuned configs for %s", len(table), device.slug)
        return table

    def _resolve(self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey) -> Any:
        current = settings_module.settings()
        threshold = 1.0 + current.margin
        config, reason = None, ""
        if current.disable_tuned:
            reason = "tuned configs disabled (TRITUNE_DISABLE_TUNED)"
        else:
            table = self.table(device)
            exact = table.exact.get((spec.name, key))
            if exact is not None:
                if exact.speedup >= threshold:
                    config = exact.config
                else:
                    reason = f"stored winner is only {exact.speedup:.3f}x the portable default"
            else:
                candidates = [
                    (k.distance(key), -e.speedup, e)
                    for k, e in table.groups.get((spec.name, key.group()), [])
                    if e.speedup >= threshold
                ]
                if candidates:
                    config = min(candidates, key=lambda c: (c[0], c[1]))[2].config
                else:
                    reason = "no tuned config for this key or its bucket group"
        if config is None:
            config = spec.default_config(key)
            if (spec.name, key) not in self._logged:
                self._logged.add((spec.name, key))
                log.info("%s: portable default serves %s: %s", spec.name, key, reason)
        self._resolved[(spec.name, device.slug, key)] = config
        return config


DISPATCHER = Dispatcher()
settings_module.on_change(DISPATCHER.clear)


@torch.compiler.assume_constant_result
def dispatch(kernel: str, device_type: str, device_index: int, facts: tuple[Any, ...]) -> tuple[Any, ...]:
    """The config values serving one call, from plain scalars only.

    Public wrappers call this with their spec's facts as a plain ``tuple`` (Dynamo hands a
    NamedTuple to an ``assume_constant_result`` function as an empty tuple). Its arguments and
    result are plain Python values, so under ``torch.compile`` the choice is made once at trace
    time and baked in as a constant instead of breaking the graph on the dispatcher's dicts.
    In eager mode a call whose facts were seen before costs one dict lookup.
    """
    pinned = _pinned.get()
    unpinned = pinned is None or kernel not in pinned
    memo = (kernel, device_type, device_index, facts)
    if unpinned:
        values = DISPATCHER.values.get(memo)
        if values is not None:
            return values
    spec = get_spec(kernel)
    device = device_info(torch.device(device_type, device_index) if device_type != "cpu" else "cpu")
    key = spec.key_for(device, facts)
    config = spec.serveable(DISPATCHER.select(spec, device, key), device, facts)
    values = tuple(getattr(config, name) for name in spec.space.dimensions)
    if unpinned:
        DISPATCHER.values[memo] = values
    return values


def config_from_values(spec: KernelSpec[Any, Any], values: tuple[Any, ...]) -> Any:
    """Rebuild the config dataclass from :func:`dispatch`'s tuple (field order)."""
    return spec.space.config_type(*values)


@contextlib.contextmanager
def use_config(kernel: str, config: Mapping[str, Any]) -> Iterator[Any]:
    """Pin ``kernel`` to ``config`` (a plain dict of its space's fields) inside the block.

    Fields left out take the kernel's defaults (for the chosen path, where a kernel has several);
    a config outside the space is refused here, before anything launches.
    """
    spec = get_spec(kernel)
    parsed = spec.pinned_config(config)
    current = dict(_pinned.get() or {})
    current[kernel] = parsed
    token = _pinned.set(current)
    try:
        yield parsed
    finally:
        _pinned.reset(token)

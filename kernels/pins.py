"""Pins: :func:`use_config` holds a kernel to a given config inside a block (tests and benchmarks).

The pins in force live in a context variable, so a pin covers exactly the calls of its block (and
of the tasks and threads started with a copy of its context). A pin is parsed once per distinct
config, not per ``use_config`` entry. On a GPU, a pin the space's rule finds infeasible at a call's
key gives way to the kernel's stand-in, and that replacement is logged once per pair; the
dispatcher (:mod:`.dispatcher`) decides what serves a pinned call.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from tritune.configs_db.values import printable

from .device import DeviceInfo
from .registry import get_spec
from .spec import TuningKey

log = logging.getLogger("tritune.dispatch")

#: Kernel name -> its pinned config, for the calls of the current context (None: no pin).
PINNED: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("tritune_pinned", default=None)

#: Bound on remembered parsed pins, as on the dispatcher's memo: past it the cache starts over.
PARSED_PINS_LIMIT = 4096


def infeasible_pin(spec: Any, device: DeviceInfo, key: TuningKey, pin: Any) -> str | None:
    """Why the space's rule says a pin cannot run at ``key`` on a GPU (it gives way to the portable
    default), or None. On the interpreter a pin runs as given: the rules there bound only the sweep."""
    if device.is_interpreter:
        return None
    reason: str | None = spec.space.infeasible_reason(pin, key, spec.limits(device))
    return reason


_rewritten_pins: set[tuple[str, Any, Any]] = set()


def log_pin_rewrite(kernel: str, pin: Any, served: Any, reason: str | None) -> None:
    """A pinned config that cannot serve this call is replaced; say so, with the kernel's reason
    where its ``serve`` hook gave one, in one line once per pair."""
    if (kernel, pin, served) not in _rewritten_pins:
        _rewritten_pins.add((kernel, pin, served))
        why = f" ({printable(reason, limit=1000)})" if reason else ""
        log.warning("%s: pinned config %s cannot serve this call%s; serving %s instead", kernel, pin, why, served)


#: (kernel, the pin's items) -> the parsed config: entering ``use_config`` around every call of a
#: loop would otherwise parse the same dict each time, several times the host cost of the call's
#: own dispatch (``scripts/measure_overhead.py`` measures both).
_parsed_pins: dict[tuple[str, tuple[tuple[str, type, Any], ...]], Any] = {}


def _parsed_pin(kernel: str, config: Mapping[str, Any]) -> Any:
    """``get_spec(kernel).pinned_config(config)``, remembered for configs of hashable values."""
    try:
        # The type is part of the key: 64.0 and True hash like 64 and 1, and the strict parse refuses them.
        cache_key = (kernel, tuple(sorted((name, type(value), value) for name, value in config.items())))
        parsed = _parsed_pins.get(cache_key)
    except (AttributeError, TypeError):  # not a mapping, or unhashable values: the parse says what is wrong
        return get_spec(kernel).pinned_config(config)
    if parsed is None:
        parsed = get_spec(kernel).pinned_config(config)
        if len(_parsed_pins) >= PARSED_PINS_LIMIT:
            _parsed_pins.clear()
        _parsed_pins[cache_key] = parsed
    return parsed


@contextlib.contextmanager
def use_config(kernel: str, config: Mapping[str, Any]) -> Iterator[Any]:
    """Pin ``kernel`` to ``config`` (a plain dict of its space's fields) inside the block.

    Fields left out take the kernel's defaults (for the chosen path, where a kernel has several);
    a config outside the space is refused here, before anything launches. A pinned config that
    cannot serve a call (say, the TMA path on a GPU without TMA) is replaced by what can, with
    one warning. Graphs compiled inside the block keep the pinned config after it ends.
    """
    parsed = _parsed_pin(kernel, config)
    current = dict(PINNED.get() or {})
    current[kernel] = parsed
    token = PINNED.set(current)
    try:
        yield parsed
    finally:
        PINNED.reset(token)

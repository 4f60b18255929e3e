"""Every tritune setting, in one typed place, read from the environment lazily.

Nothing is read at import: :func:`settings` reads the environment the first time it is called
and caches the result, so a serving process may set variables after ``import tritune.kernels``.
:func:`override` changes settings for a block of code (tests, benchmarks) without touching the
environment. The README's settings table documents each variable below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TmaMode = Literal["auto", "on", "off"]

#: Environment variable -> (settings field, one-line meaning). The README table mirrors this.
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "TRITUNE_DB": (
        "db_url",
        "SQLAlchemy URL or file path of the user config DB (default: platformdirs user data dir)",
    ),
    "TRITUNE_MARGIN": (
        "margin",
        "minimum stored speedup over the portable default before a tuned config is served",
    ),
    "TRITUNE_DISABLE_TUNED": ("disable_tuned", "1 serves the portable defaults only (no DB, no bundle)"),
    "TRITUNE_DISABLE_BUNDLES": ("disable_bundles", "1 ignores the bundles shipped in configs_db/bundles"),
    "TRITUNE_LOG_LEVEL": ("log_level", "level of the 'tritune' logger (DEBUG, INFO, WARNING, ...)"),
    "TRITUNE_ENABLE_TMA_CAUSAL_PREFILL": (
        "enable_tma_causal_prefill",
        "auto | on | off for the TMA prefill path",
    ),
}


@dataclass(frozen=True)
class Settings:
    db_url: str
    margin: float = 0.03
    disable_tuned: bool = False
    disable_bundles: bool = False
    log_level: str = "WARNING"
    enable_tma_causal_prefill: TmaMode = "auto"


def default_db_url() -> str:
    """SQLite file in the user's data directory (created only when something is written)."""
    import platformdirs

    path = Path(platformdirs.user_data_dir("tritune", appauthor=False)) / "configs.sqlite"
    return f"sqlite:///{path}"


def db_url_from(value: str) -> str:
    """Accept a SQLAlchemy URL or a plain file path."""
    if "://" in value:
        return value
    return f"sqlite:///{Path(value).expanduser().resolve()}"


def _parse_bool(name: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0/1, true/false, yes/no or on/off")


def _read_environment() -> Settings:
    env = os.environ
    raw_margin = env.get("TRITUNE_MARGIN", "0.03")
    try:
        margin = float(raw_margin)
    except ValueError:
        raise ValueError(f"TRITUNE_MARGIN={raw_margin!r}: expected a number such as 0.03") from None
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"TRITUNE_MARGIN={raw_margin!r}: expected a fraction in [0, 1)")
    tma = env.get("TRITUNE_ENABLE_TMA_CAUSAL_PREFILL", "auto").strip().lower()
    if tma not in ("auto", "on", "off"):
        raise ValueError(f"TRITUNE_ENABLE_TMA_CAUSAL_PREFILL={tma!r}: expected auto, on or off")
    level = env.get("TRITUNE_LOG_LEVEL", "WARNING").strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"TRITUNE_LOG_LEVEL={level!r}: expected a logging level name such as INFO")
    db = env.get("TRITUNE_DB")
    return Settings(
        db_url=db_url_from(db) if db else default_db_url(),
        margin=margin,
        disable_tuned=_parse_bool("TRITUNE_DISABLE_TUNED", env.get("TRITUNE_DISABLE_TUNED", "0")),
        disable_bundles=_parse_bool("TRITUNE_DISABLE_BUNDLES", env.get("TRITUNE_DISABLE_BUNDLES", "0")),
        log_level=level,
        enable_tma_causal_prefill=tma,  # type: ignore[arg-type]
    )


_lock = threading.Lock()
_current: Settings | None = None
_listeners: list[Any] = []


def settings() -> Settings:
    """The settings in force (environment read once, on first use)."""
    global _current
    current = _current
    if current is None:
        with _lock:
            if _current is None:
                _current = _read_environment()
                logging.getLogger("tritune").setLevel(_current.log_level)
            current = _current
    return current


def on_change(callback: Any) -> None:
    """Register a callable run whenever settings change (the dispatcher drops its caches)."""
    _listeners.append(callback)


def reload() -> Settings:
    """Forget the cached settings and read the environment again."""
    global _current
    with _lock:
        _current = None
    for callback in _listeners:
        callback()
    return settings()


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """Temporarily replace some settings (for tests and benchmarks).

    Settings are process-wide: an override is seen by every thread until the block ends (unlike
    ``use_config``, which is context-local).
    """
    global _current
    previous = settings()
    if "db_url" in changes and changes["db_url"] is not None:
        changes["db_url"] = db_url_from(str(changes["db_url"]))
    updated = dataclasses.replace(previous, **changes)
    with _lock:
        _current = updated
    logging.getLogger("tritune").setLevel(updated.log_level)
    for callback in _listeners:
        callback()
    try:
        yield updated
    finally:
        with _lock:
            _current = previous
        logging.getLogger("tritune").setLevel(previous.log_level)
        for callback in _listeners:
            callback()

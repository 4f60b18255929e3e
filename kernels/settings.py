"""Every tritune setting, in one typed place, read from the environment lazily.

Nothing is read at import: :func:`settings` reads the environment the first time it is called
and caches the result, so a serving process may set variables after ``import tritune.kernels``.
:func:`override` changes settings for a block of code (tests, benchmarks) without touching the
environment. The README's settings table documents each variable in :data:`ENVIRONMENT`.

A bad value never takes a serving process down: :func:`settings` warns once (naming the
variable, the value escaped, and the default used) and serves with the default. An empty value
is the same as an unset one. Tools that would rather refuse a typo (the ``tune`` CLI) ask for
:func:`validate_environment` or ``settings(strict=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tritune.configs_db.values import printable

TmaMode = Literal["auto", "on", "off"]
JitMode = Literal["off", "sync", "background"]
CrossGpuMode = Literal["off", "seed", "serve"]

log = logging.getLogger("tritune.settings")


@dataclass(frozen=True)
class Settings:
    db_url: str
    margin: float = 0.03
    disable_tuned: bool = False
    disable_bundles: bool = False
    log_level: str = "WARNING"
    enable_tma_causal_prefill: TmaMode = "auto"
    #: Seconds the serving process's read of the user DB may take in all before it is skipped.
    db_read_timeout: float = 3.0
    #: Let Q4_K's fp8 and staged paths serve (faster at large M, below ggml's accuracy bound).
    q4k_fp8: bool = False
    #: Online tuning of a key that has no exact winner: off, in the calling thread, or in a worker.
    jit: JitMode = "off"
    #: Trials and seconds one online tune of a key may spend, and seconds per process in all.
    jit_trials: int = 16
    jit_key_seconds: float = 4.0
    jit_total_seconds: float = 120.0
    #: Keys resolved without an exact winner are logged to the user DB (``tune missed``).
    miss_log: bool = True
    #: Bundles of other GPUs at keys this GPU's bundle lacks: ignored, seeds for tuning here, or also
    #: served provisionally.
    cross_gpu: CrossGpuMode = "seed"
    #: Launch compiled Triton kernels directly after their first launch (``kernels/_fastlaunch.py``).
    fast_launch: bool = True
    #: Replay a plain eager call's recorded launches per argument layout (``kernels/_replay.py``).
    eager_replay: bool = True


def default_db_url() -> str:
    """SQLite file in the user's data directory (created only when something is written)."""
    import platformdirs

    path = Path(platformdirs.user_data_dir("tritune", appauthor=False)) / "configs.sqlite"
    return _sqlite_url(path)


def db_url_from(value: str) -> str:
    """Accept a SQLAlchemy URL or a plain file path."""
    if "://" in value:
        return value
    return _sqlite_url(Path(value).expanduser().resolve())


def _sqlite_url(path: Path) -> str:
    """The SQLite URL of a file path, quoted: a path is not a URL, and its "%" or "?" must stay
    part of the file name (SQLAlchemy would decode the one and take the other for a query)."""
    from urllib.parse import quote

    return f"sqlite:///{quote(str(path), safe='/:~')}"


def _fraction(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise ValueError("a fraction in [0, 1) such as 0.03")
    return value


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 3600.0:
        raise ValueError("a number of seconds in (0, 3600] such as 3")
    return value


def _flag(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("0/1, true/false, yes/no or on/off")


def _count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 10_000:
        raise ValueError("a whole number in [1, 10000] such as 16")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        lowered = raw.lower()
        if lowered not in choices:
            raise ValueError(", ".join(choices[:-1]) + " or " + choices[-1])
        return lowered

    return parse


def _log_level(raw: str) -> str:
    level = raw.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError("a logging level name such as INFO")
    return level


def _tma_mode(raw: str) -> str:
    mode = raw.lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError("auto, on or off")
    return mode


@dataclass(frozen=True)
class Variable:
    """One environment variable: the field it sets, its default as text, its meaning and its parse.

    ``parse`` gets the stripped, non-empty value and raises ``ValueError`` saying what it expected.
    """

    field: str
    default: str
    meaning: str
    parse: Callable[[str], Any]


#: Environment variable -> what it sets. The README's settings table mirrors this.
ENVIRONMENT: dict[str, Variable] = {
    "TRITUNE_DB": Variable(
        "db_url",
        "sqlite:///<user data dir>/tritune/configs.sqlite",
        "SQLAlchemy URL or file path of the user config DB",
        db_url_from,
    ),
    "TRITUNE_DB_READ_TIMEOUT": Variable(
        "db_read_timeout",
        "3",
        "seconds a serving process's read of the user DB may take before it is skipped (with one warning)",
        _seconds,
    ),
    "TRITUNE_MARGIN": Variable(
        "margin",
        "0.03",
        "minimum stored speedup over the portable default before a tuned config is served",
        _fraction,
    ),
    "TRITUNE_DISABLE_TUNED": Variable(
        "disable_tuned", "0", "1 serves the portable defaults only (no DB, no bundle)", _flag
    ),
    "TRITUNE_DISABLE_BUNDLES": Variable(
        "disable_bundles", "0", "1 ignores the bundles shipped in configs_db/bundles", _flag
    ),
    "TRITUNE_LOG_LEVEL": Variable(
        "log_level", "WARNING", "level of the 'tritune' logger (DEBUG, INFO, WARNING, ...)", _log_level
    ),
    "TRITUNE_ENABLE_TMA_CAUSAL_PREFILL": Variable(
        "enable_tma_causal_prefill", "auto", "auto | on | off for the TMA prefill path", _tma_mode
    ),
    "TRITUNE_Q4K_FP8": Variable(
        "q4k_fp8",
        "0",
        "1 lets Q4_K's fp8 and staged paths serve (faster at large M; below ggml's NMSE 5e-4 bound)",
        _flag,
    ),
    "TRITUNE_JIT": Variable(
        "jit",
        "off",
        "off | sync | background: tune a key with no exact winner on its first eager call",
        _choice("off", "sync", "background"),
    ),
    "TRITUNE_JIT_TRIALS": Variable("jit_trials", "16", "configs one online tune of a key may measure", _count),
    "TRITUNE_JIT_KEY_SECONDS": Variable("jit_key_seconds", "4", "seconds one online tune of a key may take", _seconds),
    "TRITUNE_JIT_TOTAL_SECONDS": Variable(
        "jit_total_seconds", "120", "seconds of online tuning per process in all", _seconds
    ),
    "TRITUNE_MISS_LOG": Variable(
        "miss_log", "1", "0 stops logging keys served without an exact winner to the user DB", _flag
    ),
    "TRITUNE_CROSS_GPU": Variable(
        "cross_gpu",
        "seed",
        "off | seed | serve: other GPUs' bundles seed tuning here where this GPU's bundle lacks a key (seed), "
        "or also serve there provisionally (serve)",
        _choice("off", "seed", "serve"),
    ),
    "TRITUNE_FAST_LAUNCH": Variable(
        "fast_launch",
        "1",
        "0 launches every Triton kernel through JITFunction.run (1: directly once compiled, less host time)",
        _flag,
    ),
    "TRITUNE_EAGER_REPLAY": Variable(
        "eager_replay",
        "1",
        "0 runs every eager call's launch function (1: replays its launches recorded per argument layout)",
        _flag,
    ),
}


#: Settings of a fixed set of values: an override outside them would fall through to a wrong
#: branch (an unknown ``jit`` mode ran a blocking sync tune), so it is refused like the variable.
_CHOICES: dict[str, tuple[str, ...]] = {
    "jit": ("off", "sync", "background"),
    "cross_gpu": ("off", "seed", "serve"),
    "enable_tma_causal_prefill": ("auto", "on", "off"),
}


def _read_environment(environ: Mapping[str, str]) -> tuple[Settings, list[tuple[str, str]]]:
    """The settings ``environ`` asks for, and per value refused for its default: what is wrong, and that default.

    The default is said only where it is used (the runtime's warning): a strict reader refuses instead.
    """
    values: dict[str, Any] = {}
    problems = []
    for name, variable in ENVIRONMENT.items():
        raw = environ.get(name, "")
        if not raw.strip():  # empty is unset
            continue
        try:
            values[variable.field] = variable.parse(raw.strip())
        except ValueError as exc:
            problems.append((f"{name}='{printable(raw)}': expected {exc}", variable.default))
    if "db_url" not in values:
        values["db_url"] = default_db_url()
    return Settings(**values), problems


def validate_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """One message per ``TRITUNE_*`` value that :func:`settings` would replace by its default.

    For tools that refuse a typo instead of serving on (the tuner CLI); ``[]`` when all is well.
    The messages say what is wrong and what was expected, not the default: nothing falls back.
    """
    return [what for what, _ in _read_environment(os.environ if environ is None else environ)[1]]


_lock = threading.Lock()
_current: Settings | None = None
_listeners: list[Any] = []
#: Problems already warned about: a bad value is reported once per process, not per reload.
_warned: set[str] = set()


def settings(*, strict: bool = False) -> Settings:
    """The settings in force (environment read once, on first use).

    A bad value is replaced by its default with one warning. ``strict=True`` raises
    ``ValueError`` naming every bad value instead (and caches nothing).
    """
    global _current
    if strict:
        problems = validate_environment()
        if problems:
            raise ValueError("; ".join(problems))
    current = _current
    if current is None:
        fresh: list[str] = []
        with _lock:
            if _current is None:
                _current, refused = _read_environment(os.environ)
                logging.getLogger("tritune").setLevel(_current.log_level)
                said = [f"{what}; the default {default} is used" for what, default in refused]
                fresh = [problem for problem in said if problem not in _warned]
                _warned.update(fresh)
            current = _current
        for problem in fresh:
            log.warning("%s", problem)
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
    for name, value in changes.items():
        allowed = _CHOICES.get(name)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{name}={value!r}: expected {', '.join(allowed[:-1])} or {allowed[-1]}")
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

"""Canonical JSON for keys and configs, and the sanity rules every stored winner must pass.

Keys and configs are flat objects of ``str -> int | str | bool | float``. The database compares
them as text (they are part of unique constraints), so they must be written one way only: sorted
keys, no spaces, ASCII. Bundles and the database share the same parse and the same number
checks, so a record refused in one is refused in the other. Nothing here imports SQLAlchemy: the
runtime's bundle loader uses it too.

Numbers are kept to what a database column holds: an integer outside the signed 64-bit range is
refused as a key or config value, and a trial count must fit a 32-bit ``INTEGER`` column
(PostgreSQL's). While parsing, an integer literal outside the 64-bit range is never converted
(Python refuses to convert one of over 4300 digits, which would fail the whole file instead of
the one field).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

Scalar = int | str | bool | float

#: A winner claiming more than this speedup over the portable default is a measurement error.
MAX_SPEEDUP = 1000.0
#: The integers a database column holds (SQLite INTEGER, PostgreSQL BIGINT).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: Digits of the widest 64-bit integer; a literal with more is never converted.
_INT64_DIGITS = len(str(INT64_MAX))
#: The most trials a winner may claim: what a 32-bit INTEGER column (PostgreSQL's) holds.
MAX_TRIALS = 2**31 - 1
#: Text longer than this is cut by :func:`printable` (a message names a value, it does not dump it).
PRINTABLE_CHARS = 200


class NonFinite:
    """Stands in for a ``NaN``/``Infinity`` literal met while parsing, so a check can name it.

    ``json.loads`` accepts those literals by default; mapping them to this marker (instead of a
    float) guarantees that no validator here lets one through, while the caller can still
    report *which* field held it instead of refusing the whole document.
    """

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def __repr__(self) -> str:
        return self.literal


class OutOfRange:
    """Stands in for an integer literal outside the signed 64-bit range met while parsing.

    Like :class:`NonFinite`, it lets a check name the field instead of failing the document.
    """

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def __repr__(self) -> str:
        digits = len(self.literal.lstrip("-"))
        return f"an integer of {digits} digits" if digits > _INT64_DIGITS else f"the integer {self.literal}"


def _int_text(value: int) -> str:
    """Name an int in a message without ``str`` of a huge one (over 4300 digits it raises)."""
    if value.bit_length() <= 64:
        return str(value)
    return f"an integer of about {round(value.bit_length() * math.log10(2))} digits"


def _parse_int(literal: str) -> int | OutOfRange:
    """``parse_int`` hook: an ``int`` inside the 64-bit range, else :class:`OutOfRange` (never converted)."""
    if len(literal.lstrip("-")) > _INT64_DIGITS:
        return OutOfRange(literal)
    value = int(literal)
    return value if INT64_MIN <= value <= INT64_MAX else OutOfRange(literal)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a reviewed file must not say one thing twice (json keeps the last)."""
    result: dict[str, Any] = {}
    for name, value in pairs:
        if name in result:
            raise ValueError(f"duplicate key {name!r} in one object")
        result[name] = value
    return result


def strict_loads(text: str) -> Any:
    """``json.loads`` with duplicate keys refused, ``NaN``/``Infinity`` mapped to :class:`NonFinite`
    and integers outside the 64-bit range to :class:`OutOfRange`.

    Raises ``ValueError`` (``json.JSONDecodeError`` is one) for text that is not JSON, and
    ``RecursionError`` is turned into ``ValueError`` too: deeply nested input is hostile, not a bug.
    """
    try:
        return json.loads(
            text, parse_constant=NonFinite, parse_int=_parse_int, object_pairs_hook=_reject_duplicate_keys
        )
    except RecursionError:
        raise ValueError("nested too deeply") from None


def describe(value: object) -> str:
    """Name a JSON value's type the way a reader of the file thinks of it."""
    if isinstance(value, NonFinite):
        return f"{value.literal} (not a finite number)"
    if isinstance(value, OutOfRange):
        return f"{value!r} (outside the 64-bit range)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def check_flat(value: object, what: str) -> dict[str, Scalar]:
    """Return ``value`` as a flat ``str -> int | str | bool | float`` dict, or raise ``ValueError``.

    Keys and configs are compared and hashed as text, so nested values, nulls and non-finite
    floats are refused rather than coerced.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} is {describe(value)}, expected an object")
    result: dict[str, Scalar] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what} has a field name {name!r} that is not a non-empty string")
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{what}.{name} is {item!r}, not a finite number")
        if isinstance(item, int) and not INT64_MIN <= item <= INT64_MAX:
            raise ValueError(f"{what}.{name} is {_int_text(item)}, outside the 64-bit range")
        if not isinstance(item, int | str | float):
            raise ValueError(f"{what}.{name} is {describe(item)}, expected a number, string or boolean")
        result[name] = item
    return result


def canonical_json(obj: Mapping[str, Scalar]) -> str:
    """The one text form of a key or config: sorted keys, no spaces, ASCII, finite numbers only."""
    flat = check_flat(obj, "value")
    return json.dumps(flat, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def parse_canonical_json(text: str) -> dict[str, Scalar]:
    """Inverse of :func:`canonical_json` with a strict parse: a flat object of scalars, or ``ValueError``."""
    if not isinstance(text, str):
        raise ValueError(f"expected JSON text, got {type(text).__name__}")
    return check_flat(strict_loads(text), "value")


def number_problem(value: object, name: str, *, positive: bool = True) -> str | None:
    """Why ``value`` is not a usable finite (positive) number, or ``None`` when it is."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name} is {describe(value)}, expected a number"
    # math.isfinite raises OverflowError for an int too wide for a float: check ints by range.
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return f"{name} is {_int_text(value)}, outside the 64-bit range"
    elif not math.isfinite(value):
        return f"{name} is {value!r}, not a finite number"
    if positive and value <= 0:
        return f"{name} is {value!r}, expected a positive number"
    return None


def winner_numbers_problem(time_ms: object, portable_ms: object, speedup: object, trials: object) -> str | None:
    """Why a winner's measurements are absurd, or ``None``.

    Times must be finite and positive, the speedup in ``(0, MAX_SPEEDUP]`` and the trial count a
    whole number of at least one; anything else came from a broken timer or an edited file.
    """
    for value, name in ((time_ms, "time_ms"), (portable_ms, "portable_ms"), (speedup, "speedup")):
        problem = number_problem(value, name)
        if problem is not None:
            return problem
    assert isinstance(speedup, int | float)
    assert isinstance(time_ms, int | float) and isinstance(portable_ms, int | float)
    if speedup > MAX_SPEEDUP:
        return f"speedup is {speedup!r}, more than {MAX_SPEEDUP:g} is a measurement error"
    # The dispatcher's margin rule trusts the speedup: it must be what the two times say.
    implied = portable_ms / time_ms
    # A ratio that overflows (1e300 / 1e-300) is infinite and would compare as agreeing.
    if not math.isfinite(implied) or abs(speedup - implied) > 1e-3 * max(speedup, implied):
        return f"speedup {speedup!r} disagrees with portable_ms / time_ms = {implied:.6g}"
    if isinstance(trials, bool) or not isinstance(trials, int):
        return f"trials is {describe(trials)}, expected a whole number"
    if trials < 1:
        return f"trials is {trials}, expected at least 1"
    if trials > MAX_TRIALS:
        return f"trials is {_int_text(trials)}, expected at most {MAX_TRIALS}"
    return None


def text_problem(value: object, name: str, max_chars: int | None = None) -> str | None:
    """Why the string ``value`` may not travel from a file into a log, a terminal or a database.

    Control characters forge log lines and terminal output (newlines, ANSI escapes), and a lone
    surrogate (``"\\ud800"`` in JSON) cannot be encoded as UTF-8 at all. ``max_chars`` is the
    width of the column it is stored in (PostgreSQL refuses longer text; SQLite stores it).
    """
    if isinstance(value, str) and not value.isprintable():
        return f"{name} is '{printable(value)}', which holds a control character or a lone surrogate"
    if isinstance(value, str) and max_chars is not None and len(value) > max_chars:
        return f"{name} is {len(value)} characters long, expected at most {max_chars}"
    return None


def printable(text: str, limit: int = PRINTABLE_CHARS) -> str:
    """``text`` fit for one line of a log or terminal: every non-printable character escaped.

    Newlines, ANSI escapes, bidirectional overrides and lone surrogates become ``\\n``,
    ``\\x1b``, ``\\u202e``, ``\\ud800``; text longer than ``limit`` is cut with a count.
    """
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)

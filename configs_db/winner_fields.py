"""Rules for a stored winner's optional fields, shared by the DB, bundles, the tuner and online tuning.

The peer's time and name (the PyTorch call a user would make instead, timed beside the winner)
and the eager alternative (:class:`~.records.EagerAlternative`) travel as plain JSON values in
bundles, DB columns and the online-tuning worker's reports: each reader and writer checks them
with the functions here, so a value one refuses is refused by all.
"""

from __future__ import annotations

import re
from typing import Any

from .records import EagerAlternative
from .values import check_flat, describe, number_problem, printable, text_problem

__all__ = [
    "EAGER_FIELDS",
    "MAX_PEER_NAME_CHARS",
    "PEER_NAME",
    "eager_alternative",
    "eager_fields",
    "eager_problem",
    "flat_config_problem",
    "peer_problem",
    "portable_config_problem",
]

#: The fields of an entry's ``eager`` object (and of the DB's ``winners.eager_json``).
EAGER_FIELDS = ("config", "ms", "winner_ms")
#: Its optional fields: ``replayed`` (true where the host times were taken with eager replay).
EAGER_OPTIONAL = ("replayed",)
#: The longest peer name: what the DB's ``winners.peer_name`` column holds.
MAX_PEER_NAME_CHARS = 64
#: A peer name ("SDPA flash, KV heads expanded", "F.linear, dequantized weight"): plain words and
#: punctuation, none of which console markup (``[bold]``) or a control character is made of.
PEER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._,:;+()/'-]*")


def peer_problem(peer_ms: object, peer_name: object) -> str | None:
    """Why a winner's peer time and name are unusable, or ``None`` (both ``None``: no peer, which is fine).

    The time is checked as ``time_ms`` is (a finite positive number in range); the name is 1 to
    :data:`MAX_PEER_NAME_CHARS` characters of :data:`PEER_NAME`, as it reaches logs, terminals and
    the DB's column. The database's writes and the tuner apply the same rule.
    """
    if peer_ms is None and peer_name is None:
        return None
    if peer_ms is None or peer_name is None:
        return f"peer_ms is {describe(peer_ms)} and peer_name {describe(peer_name)}: both or neither"
    problem = number_problem(peer_ms, "peer_ms")
    if problem is not None:
        return problem
    if not isinstance(peer_name, str) or not peer_name:
        return f"peer_name is {describe(peer_name)}, expected a non-empty string"
    if len(peer_name) > MAX_PEER_NAME_CHARS:
        return f"peer_name is {len(peer_name)} characters long, expected at most {MAX_PEER_NAME_CHARS}"
    problem = text_problem(peer_name, "peer_name")
    if problem is None and not PEER_NAME.fullmatch(peer_name):
        problem = f"peer_name is '{printable(peer_name)}', expected letters, digits, spaces and . _ , : ; + ( ) / ' -"
    return problem


def eager_problem(value: object) -> str | None:
    """Why an eager alternative in its JSON form (:func:`eager_fields`) is unusable, or ``None``
    (``None`` itself: no alternative, which is fine).

    Only its shape is checked here: whether its config is in the kernel's space is decided where
    the winner's is. The database's writes and reads and the bundle export apply the same rule.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"eager is {describe(value)}, expected an object with the fields {', '.join(EAGER_FIELDS)}"
    missing = [name for name in EAGER_FIELDS if name not in value]
    if missing:
        return f"eager is missing field(s) {', '.join(missing)}"
    unknown = sorted(str(name) for name in set(value) - set(EAGER_FIELDS) - set(EAGER_OPTIONAL))
    if unknown:
        expected = ", ".join((*EAGER_FIELDS, *EAGER_OPTIONAL))
        return f"eager has unknown field(s) {', '.join(unknown)}, expected only {expected}"
    if "replayed" in value and value["replayed"] is not True:
        got = "false" if value["replayed"] is False else describe(value["replayed"])
        return f"eager.replayed is {got}, expected true (or no such field)"
    try:
        config = check_flat(value["config"], "eager.config")
    except ValueError as exc:
        return str(exc)
    if not config:
        return "eager.config is an empty object, expected a config's fields"
    for field, item in config.items():
        problem = text_problem(field, "an eager.config field name") or text_problem(item, f"eager.config.{field}")
        if problem is not None:
            return problem
    for name in ("ms", "winner_ms"):
        problem = number_problem(value[name], f"eager.{name}")
        if problem is not None:
            return problem
    if not value["ms"] < value["winner_ms"]:
        return (
            f"eager.ms {value['ms']!r} is not below eager.winner_ms {value['winner_ms']!r}: an eager alternative "
            "is kept only where it beats the winner"
        )
    return None


def eager_fields(eager: EagerAlternative) -> dict[str, Any]:
    """``eager`` in its JSON form, unchecked: what a bundle entry's ``eager`` and ``winners.eager_json`` hold."""
    fields: dict[str, Any] = {"config": eager.config, "ms": eager.ms, "winner_ms": eager.winner_ms}
    if eager.replayed:
        fields["replayed"] = True
    return fields


def eager_alternative(value: object) -> EagerAlternative | None:
    """The alternative that a JSON form holds (``None`` for ``None``); ``ValueError`` with
    :func:`eager_problem`'s reason for a malformed one."""
    problem = eager_problem(value)
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(value, dict):
        return None
    return EagerAlternative(
        config=check_flat(value["config"], "eager.config"),
        ms=float(value["ms"]),
        winner_ms=float(value["winner_ms"]),
        replayed="replayed" in value,
    )


def flat_config_problem(value: object, what: str) -> str | None:
    """Why ``value`` is not a config in its stored form (a flat object of scalars whose names and
    strings are printable), or ``None``. The same rule as a winner's own config."""
    try:
        flat = check_flat(value, what)
    except ValueError as exc:
        return str(exc)
    for name, item in flat.items():
        problem = text_problem(name, f"a {what} field name") or text_problem(item, f"{what}.{name}")
        if problem is not None:
            return problem
    return None


def portable_config_problem(value: object) -> str | None:
    """Why a winner's ``portable_config`` (the default its ``portable_ms`` timed) is unusable, or
    ``None`` (``None`` itself: not recorded, which older records are)."""
    if value is None:
        return None
    if isinstance(value, dict) and not value:
        return "portable_config is an empty object, expected the default config's fields"
    return flat_config_problem(value, "portable_config")

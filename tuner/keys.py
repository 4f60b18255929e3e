"""The keys ``tune`` sweeps: each kernel's default keys, with fields replaced by ``--key FIELD=VALUES``.

``--key head_dim=64,128`` replaces the field ``head_dim`` of every default key with each value in
turn (several ``--key`` options: every combination); the keys that come out twice are kept once,
and those the kernel's tuning half does not accept (``valid_key``) are dropped. A name may also be
an alias the tuning half declares (``key_aliases``: ``"lq": ("lq_bucket", pow2_bucket)`` makes
``--key lq=4000`` mean ``lq_bucket=4096``). The older options ``--head-dim``, ``--lq``, ``--lkv``,
``--batch`` and ``--m`` are ``--key`` with that name. A kernel with a new key field needs no change
here: the field's type (int, str or bool) says how its values are read.

With ``--bundled`` or ``--missed`` the overrides filter instead: of the keys those name, only the
ones whose fields hold one of the given values are tuned (``--bundled --key t_bucket=2048,4096``
re-tunes those bundle keys and no others), as :meth:`KeyPlan.matches` tells.

A name that a kernel has neither as a field nor as an alias leaves that kernel's keys alone; a name
that none of the kernels tuned knows, or a value its field cannot take, is a usage error naming it
and listing the key's fields. Overrides that leave a kernel no valid key (``--lq 4096`` sets the
decode key's ``lq`` field, its new tokens per step) leave that kernel out when others are tuned,
and are a usage error when it is the only one.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import typer

from tritune.kernels.declare import Kernel
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .failures import import_error

__all__ = ["KeyOverride", "KeyPlan", "NoValidKey", "alias_table", "key_fields", "parse_overrides"]

#: Key fields that describe the device: they come from ``--device``, never from ``--key``.
DEVICE_FIELDS = ("arch", "sm_count")
_TYPES: dict[str, type] = {"int": int, "str": str, "bool": bool}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class NoValidKey(typer.BadParameter):
    """The overrides leave a kernel no key its tuning half accepts."""


@dataclass(frozen=True)
class KeyOverride:
    """One ``--key NAME=VALUES`` (or an older option such as ``--lq``): a name and its values as given."""

    name: str
    values: tuple[str, ...]
    #: How the user wrote it, for messages: ``--key lq=4096`` or ``--lq 4096``.
    option: str


def parse_overrides(entries: Sequence[str], options: dict[str, Sequence[int]]) -> list[KeyOverride]:
    """``--key NAME=V1,V2`` entries and the older options (``{"lq": [4096]}``) as overrides."""
    found = []
    for entry in entries:
        name, sep, raw = entry.partition("=")
        name = name.strip().replace("-", "_")
        values = tuple(v.strip() for v in raw.split(",") if v.strip())
        if not sep or not name.isidentifier() or not values:
            raise typer.BadParameter(
                f"{entry!r}: expected FIELD=VALUE[,VALUE...], e.g. head_dim=64,128", param_hint="--key"
            )
        found.append(KeyOverride(name, values, f"--key {entry}"))
    for name, numbers in options.items():
        if numbers:
            option = f"--{name.replace('_', '-')}"
            found.append(KeyOverride(name, tuple(map(str, numbers)), f"{option} {' '.join(map(str, numbers))}"))
    return found


def tuning_of(spec: KernelSpec[Any, Any]) -> Any:
    """The object holding a kernel's tuning half: a declaration's ``tuning``, or an older spec itself.

    A declaration's ``tuning="module:ATTRIBUTE"`` is imported here, on first use: its failure is
    the user's module's, named as such (:func:`.failures.import_error`).
    """
    if not isinstance(spec, Kernel):
        return spec
    try:
        return spec.tuning
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise import_error(
            exc, f'the tuning half of kernel {spec.name} (named by its tuning="module:ATTRIBUTE")'
        ) from exc


def can_tune(spec: KernelSpec[Any, Any]) -> bool:
    """Whether the kernel has a tuning half (a declaration without ``tuning=`` cannot be tuned)."""
    try:
        tuning_of(spec)
    except TypeError:
        return False
    return True


def key_fields(spec: KernelSpec[Any, Any]) -> dict[str, type]:
    """The key fields ``--key`` may set, with their types (the device's fields left out)."""
    fields: dict[str, type] = {}
    for f in dataclasses.fields(spec.key_type):
        if f.name not in DEVICE_FIELDS:
            kind = f.type if isinstance(f.type, type) else _TYPES.get(str(f.type))
            fields[f.name] = kind if kind is not None else str
    return fields


def alias_table(spec: KernelSpec[Any, Any]) -> dict[str, tuple[str, Callable[[int], int]]]:
    """The tuning half's ``key_aliases``: name -> (key field, transform of each int value)."""
    aliases: dict[str, tuple[str, Callable[[int], int]]] = dict(getattr(tuning_of(spec), "key_aliases", None) or {})
    return aliases


def describe_key(spec: KernelSpec[Any, Any]) -> str:
    """``dtype (str), head_dim (int); aliases: lq -> lq_bucket``: what ``--key`` takes for this kernel."""
    text = ", ".join(f"{name} ({kind.__name__})" for name, kind in key_fields(spec).items())
    aliases = alias_table(spec) if can_tune(spec) else {}
    if aliases:
        text += "; aliases: " + ", ".join(f"{name} -> {field}" for name, (field, _) in aliases.items())
    return text


def _value(text: str, kind: type, override: KeyOverride, field: str, spec: KernelSpec[Any, Any]) -> Any:
    try:
        if kind is bool:
            return _BOOLS[text.lower()]
        if kind is int:
            return int(text)
        return kind(text)
    except (KeyError, ValueError):
        expected = {int: "an int", bool: "true or false"}.get(kind, f"a {kind.__name__}")
        raise typer.BadParameter(
            f"{override.option}: {text!r} is not {expected} ({field} of {spec.name}'s key; its fields: "
            f"{describe_key(spec)})"
        ) from None


class KeyPlan:
    """The keys of each kernel tuned, from its default keys and the overrides (see the module docstring)."""

    def __init__(self, specs: Sequence[KernelSpec[Any, Any]], overrides: Sequence[KeyOverride]) -> None:
        self.specs = list(specs)
        self.overrides = list(overrides)
        for override in self.overrides:
            if not any(self._knows(spec, override.name) for spec in self.specs):
                raise typer.BadParameter(self._unknown(override))

    @staticmethod
    def _knows(spec: KernelSpec[Any, Any], name: str) -> bool:
        return name in key_fields(spec) or (can_tune(spec) and name in alias_table(spec))

    def _unknown(self, override: KeyOverride) -> str:
        if override.name in DEVICE_FIELDS:
            return f"{override.option}: {override.name} comes from --device, not from --key"
        if len(self.specs) == 1 and not override.option.startswith("--key"):
            return f"{override.option.split()[0]} does not apply to kernel {self.specs[0].name}"
        fields = "; ".join(f"{spec.name}: {describe_key(spec)}" for spec in self.specs)
        return f"{override.option}: no kernel tuned has a key field or alias {override.name!r} ({fields})"

    def fields_for(self, spec: KernelSpec[Any, Any]) -> dict[str, list[Any]]:
        """Key field -> the values the overrides give it for ``spec`` (names it lacks left out)."""
        kinds = key_fields(spec)
        aliases = alias_table(spec) if can_tune(spec) else {}
        given: dict[str, list[Any]] = {}
        for override in self.overrides:
            if override.name in kinds:
                field, transform, kind = override.name, None, kinds[override.name]
            elif override.name in aliases:
                field, transform = aliases[override.name]
                kind = int
            else:
                continue
            for text in override.values:
                value = _value(text, kind, override, field, spec)
                if transform is not None:
                    value = transform(value)
                values = given.setdefault(field, [])
                if value not in values:
                    values.append(value)
        return given

    def matches(self, spec: KernelSpec[Any, Any], key: TuningKey) -> bool:
        """Whether each field the overrides name for ``spec`` holds one of their values in ``key``:
        the overrides as a filter on keys from elsewhere (``--bundled``, ``--missed``)."""
        return all(getattr(key, name) in values for name, values in self.fields_for(spec).items())

    def keys(self, spec: KernelSpec[Any, Any], device: DeviceInfo) -> list[TuningKey]:
        """``spec``'s default keys on ``device`` with the overrides applied, each once, the invalid dropped."""
        tuning = tuning_of(spec)
        defaults: list[TuningKey] = list(tuning.default_keys(device))
        given = self.fields_for(spec)
        if not given:
            return defaults
        valid: Callable[[TuningKey], bool] = getattr(tuning, "valid_key", lambda key: True)
        names = list(given)
        keys: dict[TuningKey, None] = {}
        for key in defaults:
            for combo in itertools.product(*(given[name] for name in names)):
                changed = dataclasses.replace(key, **dict(zip(names, combo, strict=True)))
                if changed not in keys and valid(changed):
                    keys[changed] = None
        if not keys:
            shown = " ".join(override.option for override in self.overrides)
            hints = "; ".join(_accepted(spec, defaults, valid, name, given[name]) for name in names)
            raise NoValidKey(
                f"{shown}: no key of {spec.name} remains valid with these values" + (f" ({hints})" if hints else "")
            )
        return list(keys)


#: Values tried for an int key field when telling what it accepts: the powers of two up to 2**20.
_POW2_PROBES = tuple(1 << bit for bit in range(21))


def _accepted(
    spec: KernelSpec[Any, Any],
    defaults: Sequence[TuningKey],
    valid: Callable[[TuningKey], bool],
    field: str,
    values: Sequence[Any],
) -> str:
    """What ``field`` accepts at ``spec``'s default keys, when one of ``values`` alone makes every key invalid;
    ``""`` when each value is valid alone (the combination is what fails) or nothing can be told.

    A bucket field (``BUCKETS``) holds powers of two; otherwise the tuning half's ``valid_key`` is
    asked about other values: the powers of two for an int field, both for a bool, the default
    keys' own values for a string.
    """
    if all(any(valid(dataclasses.replace(key, **{field: value})) for key in defaults) for value in values):
        return ""
    if field in getattr(spec.key_type, "BUCKETS", ()) and any(
        not (isinstance(value, int) and value > 0 and value & (value - 1) == 0) for value in values
    ):
        return f"{field}: a power of two"
    kind = key_fields(spec).get(field, str)
    probes: Sequence[Any] = (
        _POW2_PROBES if kind is int else (False, True) if kind is bool else [getattr(key, field) for key in defaults]
    )
    accepted = [value for value in dict.fromkeys(probes) if any(
        valid(dataclasses.replace(key, **{field: value})) for key in defaults)]  # fmt: skip
    if not accepted:
        return f"{field}: no value tried is accepted at the default keys"
    bucket = field in getattr(spec.key_type, "BUCKETS", ())
    if kind is int and len(accepted) > 6 and accepted == [v for v in _POW2_PROBES if accepted[0] <= v <= accepted[-1]]:
        if bucket:
            return f"{field}: a power of two from {accepted[0]} to {accepted[-1]} at the default keys"
        return f"{field}: of the powers of two, {accepted[0]} to {accepted[-1]} are accepted at the default keys"
    if kind is str:
        return f"{field}: the default keys hold {', '.join(map(str, accepted))}"
    among = "" if kind is bool else " of the powers of two"
    return f"{field}: one of {', '.join(map(str, accepted))}{among} at the default keys"

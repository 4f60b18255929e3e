"""Which (kernel, key) pairs one ``tune`` run measures on one device.

Three sources, one per run: each kernel's default keys with the ``--key`` overrides applied
(:mod:`.keys`); the keys the runtime logged without a winner (``--missed``, :mod:`.missed`); or
the keys of the bundle shipped for this GPU (``--bundled``), either of the last two narrowed by
the ``--key`` values (:meth:`.keys.KeyPlan.matches`): a re-tune after a Triton or torch
upgrade or a kernel edit, each key seeded from its shipped winner where that winner's kernel
version is current (:mod:`.strategy`), so a few trials a key suffice. On a GPU without a bundle of
its own, ``--bundled`` takes the keys of the nearest GPU's bundle (:mod:`tritune.kernels.prior`,
unless ``TRITUNE_CROSS_GPU=off``), whose winners seed each key: the way to a first bundle that
covers the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import typer

from tritune.configs_db.records import WinnerRecord
from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .app import console, plain
from .failures import CommandError
from .keys import DEVICE_FIELDS, KeyOverride, KeyPlan, NoValidKey, tuning_of
from .missed import plan_missed

__all__ = ["KeySource", "plan_bundled", "plan_keys"]

Plan = list[tuple[Any, TuningKey]]


@dataclass(frozen=True)
class KeySource:
    """Where a run's keys come from: the default keys with ``overrides``, the miss log of the DB
    ``missed_in`` (``--missed``), or the shipped bundle (``--bundled``)."""

    overrides: list[KeyOverride] = field(default_factory=list)
    missed_in: str | None = None
    bundled: bool = False


def plan_keys(specs: list[Any], source: KeySource, device: DeviceInfo, trials: int = 0) -> Plan:
    """(kernel, key) pairs to tune on ``device`` from ``source``.

    With overrides, a kernel they leave no valid key is left out, with a note, when others are tuned.
    """
    keys = KeyPlan(specs, source.overrides)
    if source.missed_in is not None or source.bundled:
        if source.missed_in is not None:
            found, option = plan_missed(specs, device, source.missed_in, trials), "--missed"
        else:
            found, option = plan_bundled(specs, device), "--bundled"
        return _filtered(found, keys, option) if keys.overrides else found
    plan: Plan = []
    for spec in specs:
        try:
            plan.extend((spec, key) for key in keys.keys(spec, device))
        except NoValidKey as exc:
            if len(specs) == 1:
                raise
            console.print(f"[yellow]{plain(exc.message)}: {plain(spec.name)} is left out[/yellow]")
    if not plan:
        raise typer.BadParameter("no kernel has a valid key with these --key values")
    return plan


def _filtered(found: Plan, keys: KeyPlan, option: str) -> Plan:
    """The pairs of ``found`` whose keys the overrides match; :class:`CommandError` naming the
    overrides and the keys there were when none does."""
    kept = [(spec, key) for spec, key in found if keys.matches(spec, key)]
    if not kept:
        shown = " ".join(override.option for override in keys.overrides)
        there = "; ".join(
            ",".join(f"{name}={value}" for name, value in key.to_dict().items() if name not in DEVICE_FIELDS)
            for _spec, key in found[:4]
        )
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise CommandError(
            f"{shown}: none of the {len(found)} keys {option} takes matches", f"give values they hold: {there}{more}"
        )
    return kept


def plan_bundled(specs: list[KernelSpec[Any, Any]], device: DeviceInfo) -> Plan:
    """The keys of ``specs``' entries in the bundle shipped for ``device``, in the bundle's order,
    each once (whatever kernel version its entry was tuned under); :class:`CommandError` when the
    bundle is disabled, missing, unreadable or holds none of them."""
    from tritune.configs_db import bundles

    if settings.settings().disable_bundles:
        raise CommandError(
            "--bundled tunes the keys of the shipped bundle, and bundles are disabled here",
            "unset TRITUNE_DISABLE_BUNDLES (or set it to 0) for this run",
        )
    records, rejections = bundles.shipped_records(device.slug)
    for rejection in rejections:
        console.print(f"[yellow]{plain(rejection.source)}: {plain(rejection.reason)}[/yellow]", soft_wrap=True)
    if not records:
        records = _nearest_bundle_records(device)
    if not records:
        raise CommandError(
            f"no bundle with winners is shipped for {device.slug} (looked for {bundles.bundle_path(device.slug)})",
            "tune the default keys (leave out --bundled), then tune export writes a bundle",
        )
    plan: Plan = []
    for spec in specs:
        valid = getattr(tuning_of(spec), "valid_key", lambda key: True)
        for record in records:
            if record.kernel != spec.name:
                continue
            why = None
            try:
                key = spec.key_type.from_dict(record.key)
            except (TypeError, ValueError) as exc:
                why = str(exc)
            else:
                if (key.arch, key.sm_count) != (device.arch, device.sm_count):
                    why = f"a key of {key.arch} with {key.sm_count} SMs, not {device.slug}"
                elif not valid(key):
                    why = "not a key the kernel's tuning half accepts"
            if why is not None:
                console.print(
                    f"[yellow]{spec.name}: bundled key {plain(str(record.key))} left out ({plain(why)})[/yellow]"
                )
            elif (spec, key) not in plan:
                plan.append((spec, key))
    if not plan:
        names = ", ".join(spec.name for spec in specs)
        raise CommandError(f"the bundle shipped for {device.slug} holds no key of {names}", None)
    return plan


def _nearest_bundle_records(device: DeviceInfo) -> list[WinnerRecord]:
    """The records of the nearest GPU's shipped bundle, keys translated to ``device``; ``[]`` where
    the prior does not apply or no other GPU ships one. Says which bundle's keys are taken."""
    from tritune.kernels import prior

    if not prior.active(device):
        return []
    nearest: list[tuple[str, list[WinnerRecord]]] = prior.prior_records(device)
    for slug, records in nearest:
        if records:
            console.print(
                f"no bundle is shipped for {plain(device.slug)}: tuning the keys of {plain(slug)}'s bundle, "
                "each seeded from its winner there"
            )
            return records
    return []

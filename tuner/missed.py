"""The keys a serving process logged without a winner: ``tune missed`` lists them, ``tune --missed`` tunes them.

A user runs their model once with the default settings (the runtime logs every key it resolves
without an exact winner: :mod:`tritune.kernels.misses`), then runs ``tune --missed``: every shape
the model called on this GPU is tuned, most frequent first. The plan takes, for each kernel tuned
(``--kernel``, or every tunable kernel), the logged keys of this GPU at the kernel's running
version. A logged key is parsed strictly with the kernel's key type; a row that does not parse,
names another GPU in its key, or is a key the kernel's tuning half refuses is left out with its
reason. Keys that already hold a winner measured under the running Triton and torch are left out
too (``--key`` re-tunes a key on purpose), unless that winner came of fewer trials than the run's
``--trials`` (an online tune's short budget: ``TRITUNE_JIT_TRIALS``, ``TRITUNE_JIT_KEY_SECONDS``),
which are planned again, with a count; so are rows of other kernel versions left out (the key may
no longer mean the same), with a count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from rich.table import Table

from tritune.configs_db.misses import MissRecord, read_misses
from tritune.configs_db.records import WinnerRecord, key_text
from tritune.configs_db.values import canonical_json
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey
from tritune.kernels.winners import against_other_default, is_current

from .app import app, check_database_path, console, db_url, load_kernels, plain
from .failures import CommandError
from .keys import tuning_of

__all__ = ["MissedPlan", "missed", "missed_plan"]

#: What declares a user's kernel to ``tune --missed``.
DECLARE_HINT = "add --kernel package.module:NAME (or path/to/file.py:NAME)"
#: Seconds ``tune missed`` and ``tune --missed`` may spend reading the DB (a person waits at a terminal).
READ_TIMEOUT_S = 60.0


@dataclass
class MissedPlan:
    """The (kernel, key) pairs to tune, most frequent first, and one note per row or group left out."""

    plan: list[tuple[KernelSpec[Any, Any], TuningKey]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Logged rows of this GPU considered (of the kernels tuned).
    logged: int = 0
    #: Kernel name -> logged rows of this GPU of a kernel not declared in this process (``--kernel`` declares it).
    undeclared: dict[str, int] = field(default_factory=dict)


def _key_of(spec: KernelSpec[Any, Any], row: MissRecord, device: DeviceInfo) -> TuningKey | str:
    """The row's key parsed strictly for ``spec`` on ``device``, or why it cannot be tuned here."""
    try:
        key = spec.key_type.from_dict(row.key())
    except (TypeError, ValueError) as exc:
        return f"malformed key ({exc})"
    if key.arch != device.arch or key.sm_count != device.sm_count:
        return f"key is for {key.arch}/{key.sm_count} SMs, not {device.slug}"
    valid: Callable[[TuningKey], bool] = getattr(tuning_of(spec), "valid_key", lambda key: True)
    if not valid(key):
        return "not a key the kernel's tuning half accepts"
    return key


def missed_plan(
    specs: Sequence[KernelSpec[Any, Any]],
    device: DeviceInfo,
    rows: Sequence[MissRecord],
    winners: Sequence[WinnerRecord],
    declared: Callable[[str], bool] | None = None,
    trials: int | None = None,
) -> MissedPlan:
    """What ``tune --missed`` tunes on ``device`` from the logged ``rows`` and the stored ``winners`` (see the
    module docstring).

    ``trials``: the run's trial budget; a current winner that came of fewer trials is tuned again
    (``None``: any current winner counts as complete).

    ``declared``: whether a kernel name is known in this process (built in, installed or declared);
    the rows of the others are counted by name, since only ``--kernel`` can tell where they are.
    """
    if declared is None:
        from tritune.kernels import registry

        declared = set(registry.kernel_names()).__contains__
    by_name = {spec.name: spec for spec in specs}
    tuned = {
        (w.kernel, w.kernel_version, canonical_json(w.key)): w.trials
        for w in winners
        if w.gpu == device.slug and is_current(w) and not against_other_default(w)
    }
    result = MissedPlan()
    older: dict[str, int] = {}
    already = short = 0
    seen: set[tuple[str, TuningKey]] = set()
    for row in rows:
        spec = by_name.get(row.kernel)
        if row.gpu != device.slug:
            continue
        if spec is None:
            if not declared(row.kernel):
                result.undeclared[row.kernel] = result.undeclared.get(row.kernel, 0) + 1
            continue
        result.logged += 1
        if row.kernel_version != spec.version:
            older[spec.name] = older.get(spec.name, 0) + 1
            continue
        key = _key_of(spec, row, device)
        if isinstance(key, str):
            result.notes.append(f"{spec.name} {row.key_json}: left out: {key}")
            continue
        stored = tuned.get((spec.name, spec.version, canonical_json(key.to_dict())))
        if stored is not None and (trials is None or stored >= trials):
            already += 1
            continue
        if (spec.name, key) not in seen:
            short += stored is not None
            seen.add((spec.name, key))
            result.plan.append((spec, key))
    for name, count in sorted(older.items()):
        result.notes.append(f"{name}: {count} logged key(s) of other kernel versions left out (call the model again)")
    if already:
        result.notes.append(f"{already} logged key(s) already tuned under this Triton and torch left out")
    if short:
        result.notes.append(f"{short} logged key(s) whose winner came of fewer than {trials} trials (an online "
                            "tune's) tuned again")  # fmt: skip
    for name, count in sorted(result.undeclared.items()):
        result.notes.append(f"{count} logged key(s) of {name}, a kernel not declared here: {DECLARE_HINT}")
    return result


def plan_missed(
    specs: Sequence[KernelSpec[Any, Any]], device: DeviceInfo, url: str, trials: int | None = None
) -> list[tuple[KernelSpec[Any, Any], TuningKey]]:
    """``tune --missed``'s plan on ``device``, its notes printed; :class:`CommandError` when nothing was logged.

    ``trials``: the run's ``--trials`` (winners of fewer trials are tuned again)."""
    from tritune.configs_db.store import display_url, read_winners

    check_database_path(url, must_exist=True)
    rows = read_misses(url, gpu=device.slug, timeout_s=READ_TIMEOUT_S)
    winners = read_winners(url, device.slug, timeout_s=READ_TIMEOUT_S)
    found = missed_plan(specs, device, rows, winners, trials=trials)
    for note in found.notes:
        console.print(f"[yellow]{plain(note)}[/yellow]", soft_wrap=True)
    if found.logged == 0 and found.undeclared:
        raise CommandError(
            f"no missed keys of {', '.join(spec.name for spec in specs)} on {device.slug} are logged in "
            f"{display_url(url)}, only of kernels not declared here ({', '.join(sorted(found.undeclared))})",
            DECLARE_HINT,
        )
    if found.logged == 0:
        raise CommandError(
            f"no missed keys of {', '.join(spec.name for spec in specs)} on {device.slug} are logged in "
            f"{display_url(url)}",
            "run your model once with TRITUNE_MISS_LOG=1 (the default) and the same TRITUNE_DB, then tune --missed",
        )
    return found.plan


def _winner_now(row: MissRecord, winners: dict[str, set[tuple[str, str, str]]]) -> str:
    """Whether ``row``'s key holds a winner now: in the DB, in the bundle shipped for its GPU, or not."""
    from tritune.configs_db import bundles

    if row.gpu not in winners:
        winners[row.gpu] = {
            (r.kernel, r.kernel_version, canonical_json(r.key)) for r in bundles.shipped_records(row.gpu)[0]
        }
    ident = (row.kernel, row.kernel_version, row.key_json)
    if ident in winners["db"]:
        return "yes (db)"
    if ident in winners[row.gpu]:
        return "yes (bundle)"
    return "no"


@app.command("missed")
def missed(
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    kernel: Annotated[
        str | None,
        typer.Option(help="only this kernel: a name, or a declaration (package.module:NAME or path/to/file.py:NAME)"),
    ] = None,
    gpu: Annotated[str | None, typer.Option(help="only this GPU slug")] = None,
    device: Annotated[
        str | None, typer.Option(help="only the misses of this device's GPU: cpu or a CUDA index")
    ] = None,
) -> None:
    """Keys served without a tuned winner (logged by the runtime), most frequent first: tune --missed tunes them.

    Read-only: nothing is created, upgraded or written.
    """
    from tritune.configs_db.store import display_url, read_winners

    from .commands import runtime_device

    url = db_url(db)
    check_database_path(url, must_exist=True)
    if device is not None:
        here = runtime_device(device).slug
        if gpu is not None and gpu != here:
            raise typer.BadParameter(f"--gpu {gpu!r} and --device {device!r} ({here}) name two GPUs")
        gpu = here
    if kernel is not None and ":" in kernel:
        kernel = load_kernels([kernel])[0].name
    rows = read_misses(url, gpu=gpu, kernel=kernel, timeout_s=READ_TIMEOUT_S)
    if not rows:
        console.print(f"no missed keys logged in {plain(display_url(url))}")
        return
    stored = read_winners(url, gpu, kernel=kernel, timeout_s=READ_TIMEOUT_S)
    winners = {"db": {(r.kernel, r.kernel_version, canonical_json(r.key)) for r in stored}}
    table = Table(title=f"missed keys in {plain(display_url(url))}")
    for column in ("gpu", "kernel", "key", "count", "first seen", "last seen", "winner now"):
        table.add_column(column)
    for row in rows:
        try:
            key = key_text(row.key())
        except ValueError:
            key = f"(malformed) {row.key_json}"
        table.add_row(
            plain(row.gpu),
            plain(row.kernel),
            plain(key),
            str(row.count),
            row.first_seen.strftime("%Y-%m-%d %H:%M UTC"),
            row.last_seen.strftime("%Y-%m-%d %H:%M UTC"),
            _winner_now(row, winners),
        )
    console.print(table)

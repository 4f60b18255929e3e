"""The ``tune`` subcommands that inspect and move stored results: list, show, status, export,
import and bench. They register on the app of :mod:`tritune.tuner.app`."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from tritune.configs_db.records import key_text
from tritune.configs_db.values import printable
from tritune.search_spaces.base import TargetLimits

from .app import (
    app,
    check_database_path,
    check_kernel_names,
    choose_device,
    console,
    db_url,
    load_kernels,
    plain,
)
from .failures import CommandError
from .keys import tuning_of
from .provisional import tuned_under_here
from .tables import BENCH_COLUMNS, SHOW_COLUMNS, bench_cells, bench_key, eager_text, serving_verdict, show_row

if TYPE_CHECKING:
    from .studies import StudyStorage, StudySummary

#: Seconds ``show`` and ``export`` may spend reading the DB: a person at a terminal waits longer
#: than a serving process (whose bound is TRITUNE_DB_READ_TIMEOUT), but not forever.
READ_TIMEOUT_S = 60.0


@app.command("list")
def list_kernels(
    kernel: Annotated[
        list[str] | None,
        typer.Option(
            help="only these kernels: names, or declarations of your own (package.module:NAME or "
            "path/to/file.py:NAME) [default: every built-in and installed kernel]"
        ),
    ] = None,
) -> None:
    """Kernels: version, protocol, where each is declared, its key's fields (for --key) and its search space."""
    from tritune.kernels import registry

    if kernel:
        check_kernel_names(kernel)
        for spec in load_kernels(kernel):
            _list_kernel(spec)
        return
    for name in registry.kernel_names():
        # A kernel of an installed package that fails to import (its declaration, or the tuning
        # half it names) must not hide the other kernels.
        try:
            spec = registry.find(name)
        except Exception as exc:
            if name in registry.builtin_names():
                raise
            console.print(f"[yellow]{plain(name)}: its declaration cannot be imported ({plain(exc)})[/yellow]")
            continue
        try:
            _list_kernel(spec)
        except Exception as exc:
            if name in registry.builtin_names():
                raise
            console.print(f"[yellow]{plain(name)}: {plain(exc)}[/yellow]")


def _list_kernel(spec: Any) -> None:
    """One kernel of ``tune list``: its title line, its space's table, its key's fields and where it is declared."""
    from tritune.kernels import registry

    from .keys import describe_key

    key = describe_key(spec)  # first: it imports the tuning half a declaration names, which may fail
    space = spec.space
    title = f"{spec.name} (version {spec.version}, protocol {spec.protocol}, {space.size()} configs before pruning)"
    # Its own line: a table title wraps at the table's width.
    console.print(f"[bold]{plain(title)}[/bold]", soft_wrap=True)
    table = Table()
    members = getattr(space, "members", None)
    table.add_column("dimension")
    table.add_column("choices")
    table.add_column("portable default")
    if members is not None:
        table.add_column("paths")
    default = space.to_dict(space.default())
    for field, choices in space.dimensions.items():
        row = [field, ", ".join(map(str, choices)), str(default.get(field, ""))]
        if members is not None:
            row.append(", ".join(path for path, member in members.items() if field in member.dimensions))
        table.add_row(*map(plain, row))
    console.print(table)
    console.print(f"  key: {plain(key)}", soft_wrap=True)
    console.print(f"  declared at {plain(registry.target_of(spec) or 'an unknown module')}", soft_wrap=True)


@app.command()
def show(
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    kernel: Annotated[
        str | None,
        typer.Option(help="only this kernel: a name, or a declaration (package.module:NAME or path/to/file.py:NAME)"),
    ] = None,
    gpu: Annotated[str | None, typer.Option(help="only this GPU slug")] = None,
    device: Annotated[
        str, typer.Option(help="judge what the runtime would serve on this device: auto, cpu or a CUDA index")
    ] = "auto",
) -> None:
    """The stored winners, each marked with whether the runtime would serve it on this machine, or why not.

    Read-only: the DB is opened the way the runtime opens it, so nothing is created, upgraded or
    written (an older-schema DB is reported, not migrated).
    """
    from tritune.configs_db.store import display_url, read_winners

    url = db_url(db)
    check_database_path(url, must_exist=True)
    here = runtime_device(device)
    if kernel is not None and _is_declaration(kernel):
        kernel = load_kernels([kernel])[0].name
    records = read_winners(url, gpu, kernel=kernel, timeout_s=READ_TIMEOUT_S)
    _declare_installed({record.kernel for record in records})
    table = Table(title=f"winners in {plain(display_url(url))}")
    for column in SHOW_COLUMNS:
        table.add_column(column)
    notes = []
    for w in records:
        verdict = serving_verdict(w, here)
        key = key_text(w.key)
        if verdict is not None:
            notes.append(f"not served on {here.slug}: {w.gpu} {w.kernel} {key}: {verdict}")
        under = tuned_under_here(w, here) if verdict is None else ""
        if under:
            notes.append(f"provisional on {here.slug}: {w.gpu} {w.kernel} {key}: tuned under {under}; tune re-tunes it")
        if w.eager is not None:
            notes.append(f"eager calls outside CUDA graphs: {w.gpu} {w.kernel} {key}: {eager_text(w.eager)}")
        table.add_row(*show_row(w, verdict, provisional=bool(under)))
    console.print(table)
    for note in notes:
        console.print(f"[yellow]{plain(note)}[/yellow]", soft_wrap=True)


def _is_declaration(name: str) -> bool:
    from tritune.kernels import registry

    return bool(registry.is_target(name))


def _declare_installed(names: set[str]) -> None:
    """Import the installed packages' kernels among ``names`` (their entries would read as unknown)."""
    from tritune.kernels import registry

    installed = registry.entry_points()
    for name in sorted(names):
        if not registry.known(name) and name in installed:
            try:
                registry.find(name)
            except Exception as exc:
                console.print(f"[yellow]{plain(name)}: its declaration cannot be imported ({plain(exc)})[/yellow]")


def runtime_device(device: str) -> Any:
    """The :class:`DeviceInfo` the runtime would serve on for ``--device`` (without touching Triton's mode)."""
    import torch

    from tritune.kernels.device import device_info, interpreter_device

    wanted = device.strip().lower().removeprefix("cuda:")
    if wanted == "auto":
        wanted = "0" if torch.cuda.is_available() else "cpu"
    if wanted == "cpu":
        return interpreter_device()
    if not wanted.isdigit():
        raise typer.BadParameter(f"{device!r}: expected auto, cpu, or a CUDA index such as 0", param_hint="--device")
    if not torch.cuda.is_available() or int(wanted) >= torch.cuda.device_count():
        raise typer.BadParameter(f"{device!r}: no such CUDA GPU is visible", param_hint="--device")
    return device_info(int(wanted))


@app.command()
def status(
    storage: Annotated[str, typer.Option(help="the shared Optuna storage: RDB URL or journal file path")],
    kernel: Annotated[
        str | None,
        typer.Option(help="only this kernel: a name, or a declaration (package.module:NAME or path/to/file.py:NAME)"),
    ] = None,
    gpu: Annotated[str | None, typer.Option(help="only this GPU slug")] = None,
) -> None:
    """Shared studies: trials measured, failed, running and waiting, and each key's best so far."""
    from .studies import StudyStorage

    where = StudyStorage(storage if "://" in storage else str(Path(storage).expanduser().resolve()))
    problem = where.problem()
    if problem is not None:
        raise typer.BadParameter(f"--storage: {problem}")
    if not where.is_rdb and not Path(where.location).exists():
        raise typer.BadParameter(f"--storage {storage!r}: no such journal file")
    if kernel is not None and _is_declaration(kernel):
        # The studies are named by kernel name: a declaration's is read from its module.
        check_kernel_names([kernel])
        kernel = load_kernels([kernel])[0].name
    rows = status_rows(where, kernel=kernel, gpu=gpu)
    if not rows:
        console.print(f"no tritune studies in {plain(where.display())}")
        return
    print_status(rows, title=f"studies in {plain(where.display())}")


def status_rows(
    where: StudyStorage, *, names: set[str] | None = None, kernel: str | None = None, gpu: str | None = None
) -> list[StudySummary]:
    from .studies import summaries

    return [row for row in summaries(where, gpu=gpu, kernel=kernel) if names is None or row.name in names]


def print_status(rows: list[StudySummary], *, title: str) -> None:
    table = Table(title=title)
    counts = ("measured", "failed", "reused", "running", "waiting", "lost", "retried")
    for column in ("gpu", "kernel", "key", *counts, "best ms", "best config", "finalized"):
        table.add_column(column)
    for row in rows:
        if row.finalized is None:
            finalized = "-"
        elif "error" in row.finalized:
            finalized = f"error: {plain(row.finalized['error'])}"
        else:
            finalized = "yes"
        table.add_row(
            plain(row.gpu),
            plain(row.kernel),
            plain(key_text(row.key)),
            *(str(row.counts.get(name, 0)) for name in counts),
            "-" if row.best_ms is None else f"{row.best_ms:.4g}",
            plain(" ".join(f"{k}={v}" for k, v in row.best_params.items())),
            finalized,
        )
    console.print(table)


@app.command("export")
def export_bundle(
    gpu: Annotated[str, typer.Option(help="GPU slug, e.g. nvidia-h200-sm90-132sm")],
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    out: Annotated[
        str | None,
        typer.Option(
            help="bundle file (name ending in .json), or a folder for <gpu>.json: an existing one, or one to create "
            "written with a trailing / [default: ./<gpu>.json]"
        ),
    ] = None,
) -> None:
    """Write the DB's winners for one GPU as a reviewed, diffable JSON bundle (the DB is only read).

    To ship the bundle, copy it into ``configs_db/bundles/`` of a source checkout and commit it.
    """
    from tritune.configs_db import bundles
    from tritune.configs_db.store import read_winners

    try:
        default = bundles.bundle_path(gpu, Path.cwd())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gpu") from None
    url = db_url(db)
    check_database_path(url, must_exist=True)
    records = read_winners(url, gpu, timeout_s=READ_TIMEOUT_S)
    if not records:
        raise typer.BadParameter(f"{gpu!r}: the DB holds no winners for that GPU", param_hint="--gpu")
    records, stale = _current_kernel_versions(records)
    if stale:
        console.print(f"[yellow]left out {stale} winner(s) of kernel versions this code does not run[/yellow]")
    if not records:
        raise typer.BadParameter(
            f"{gpu!r}: every winner for that GPU is of another kernel version than this code runs", param_hint="--gpu"
        )
    # A bundle states one provenance: the largest group of records sharing one, under the running
    # Triton and torch where any group was tuned under them.
    import torch
    import triton

    groups: dict[tuple[str, str, str, str, str], list[Any]] = {}
    for record in records:
        stamp = (
            str(record.extra.get("cuda", "")),
            str(record.extra.get("driver", "")),
            record.torch_version,
            record.triton_version,
            record.tritune_version,
        )
        groups.setdefault(stamp, []).append(record)
    running = [item for item in groups.items() if item[0][2:4] == (torch.__version__, triton.__version__)]
    stamp, chosen = max(running or groups.items(), key=lambda item: len(item[1]))
    for other, left in groups.items():
        if other != stamp:
            console.print(f"[yellow]left out {len(left)} winner(s) tuned under other versions {plain(other)}[/yellow]")
    path = default if out is None else _bundle_file(out, default.name)
    provenance = dict(zip(("cuda", "driver", "torch", "triton", "tritune"), stamp, strict=True))
    gpu_name = str(chosen[0].extra.get("gpu_name") or gpu)
    bundles.write_bundle(chosen, path, gpu=gpu, gpu_name=gpu_name, provenance=provenance)
    console.print(f"wrote {len(chosen)} winner(s) to {plain(path)}")


def _bundle_file(out: str, name: str) -> Path:
    """Where ``--out`` writes the bundle ``name``: into a folder (an existing one, or one to create when
    ``out`` ends in ``/``), else the file ``out`` itself, whose name must end in ``.json``."""
    folder = Path(out).expanduser()
    if out.endswith(("/", os.sep)):
        folder.mkdir(parents=True, exist_ok=True)
    if folder.is_dir():
        return folder / name
    if not folder.name.endswith(".json"):
        raise typer.BadParameter(
            f"{out!r}: no such folder, and a bundle file's name ends in .json (end a folder to create with /)",
            param_hint="--out",
        )
    return folder


def _current_kernel_versions(records: list[Any]) -> tuple[list[Any], int]:
    """``records`` less those of a known kernel at another kernel version (no tritune running this
    code would serve them), and how many were left out; a kernel not declared here is kept."""
    from tritune.kernels.registry import get_spec, known

    kept = [r for r in records if not known(r.kernel) or r.kernel_version == get_spec(r.kernel).version]
    return kept, len(records) - len(kept)


@app.command("import")
def import_bundle(
    path: Annotated[Path, typer.Argument(help="bundle JSON file")],
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    kernel: Annotated[
        list[str] | None,
        typer.Option(
            help="declare these kernels first (package.module:NAME or path/to/file.py:NAME): entries of a kernel "
            "neither built in, installed nor declared are refused"
        ),
    ] = None,
) -> None:
    """Load a bundle's winners into the DB (entries this tritune could never serve are refused).

    Refused, each with its reason: malformed entries, unknown kernels, kernel versions other than
    the running source, other Triton versions, keys no call resolves to (the tuning half's
    ``valid_key``), and keys or configs outside the kernel's types and space. A kernel is known
    when it is built in, declared by an installed package (entry point ``tritune.kernels``) or
    named with ``--kernel``. A bundle of another GPU is loaded (a DB may
    hold several GPUs; each is only served on its own). Every entry is checked before anything is
    written, and the accepted ones are written in one transaction: an import that fails leaves the
    DB as it was. Exit status 1 when the file cannot be used or every entry was refused.
    """
    from tritune.configs_db import bundles
    from tritune.configs_db.store import ConfigStore

    if kernel:
        check_kernel_names(kernel)
        load_kernels(kernel)
    try:
        records, rejections = bundles.load_bundle(path)
    except bundles.BundleError as exc:
        raise CommandError(str(exc), "nothing was imported") from None
    _declare_installed({record.kernel for record in records})
    accepted = []
    for rejection in rejections:
        console.print(f"[yellow]refused {plain(rejection.reason)}[/yellow]", soft_wrap=True)
    for record in records:
        refusal = _import_refusal(record)
        if refusal is not None:
            at = plain(" ".join(f"{k}={v}" for k, v in record.key.items()))
            reason = f"{plain(record.kernel)}: {plain(refusal)} (at {at})"
            console.print(f"[yellow]refused {reason}[/yellow]", soft_wrap=True)
            continue
        accepted.append(record)
    refused = len(rejections) + len(records) - len(accepted)
    if not accepted:
        raise CommandError(
            f"{printable(str(path))}: every entry was refused ({refused}), nothing was imported"
            if refused
            else f"{printable(str(path))}: the bundle holds no winners, nothing was imported"
        )
    url = db_url(db)
    check_database_path(url, must_exist=False)
    import torch
    import triton

    with ConfigStore(url) as store:
        imported, skipped = store.import_records(accepted, current=(triton.__version__, torch.__version__))
    console.print(
        f"imported {imported} winner(s), kept {skipped} existing better one(s), refused {refused} entr"
        f"{'y' if refused == 1 else 'ies'}"
    )


def _import_refusal(record: Any) -> str | None:
    """Why a bundle record can never be served by this tritune, in the dispatcher's words; ``None`` if it can."""
    import triton

    from tritune.kernels.registry import get_spec, known

    if not known(record.kernel):
        return "unknown kernel (declare it: tune import --kernel package.module:NAME or path/to/file.py:NAME)"
    spec = get_spec(record.kernel)
    if record.kernel_version != spec.version:
        return f"stale kernel version {record.kernel_version} (running {spec.version})"
    if record.triton_version != triton.__version__:
        return f"tuned with Triton {record.triton_version}, running {triton.__version__}"
    try:
        key = spec.key_type.from_dict(record.key)
    except (TypeError, ValueError) as exc:
        return f"malformed key ({exc})"
    if not getattr(tuning_of(spec), "valid_key", lambda key: True)(key):
        return "a key this kernel never resolves a call to (its tuning half's valid_key refuses it)"
    try:
        config = spec.space.parse(record.config)
    except ValueError as exc:
        return f"config outside the search space ({exc})"
    try:  # whether it fits a GPU is that GPU's question; a rule that cannot even run here is not
        spec.space.infeasible_reason(config, key, TargetLimits())
    except Exception as exc:
        return f"the kernel's checks failed on this entry ({type(exc).__name__}: {exc})"
    if record.eager is not None:
        try:
            spec.space.parse(record.eager.config)
        except ValueError as exc:
            return f"eager config outside the search space ({exc})"
    return None


@app.command()
def bench(
    device: Annotated[str, typer.Option(help="auto, cpu, or a CUDA index")] = "auto",
    kernel: Annotated[
        list[str] | None, typer.Option(help="kernel(s): names, or package.module:NAME or path/to/file.py:NAME")
    ] = None,
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """At each default key: the portable default, the config the dispatcher serves ("ours") and the
    kernel's peer (the PyTorch call a user would make instead), timed in this run with one timer.

    "vs peer" is the peer's time over ours: above 1x, ours is faster. On a GPU, "host us" (ours / peer) is what
    one eager call costs the host when calls follow each other (ours: the public call, dispatched as
    a user's is), and "eager vs peer" compares what an eager caller pays per call, about the larger
    of GPU and host time, for each.
    """
    check_kernel_names(kernel or [])
    torch_device = choose_device(device, stores=False)
    from tritune.kernels import settings
    from tritune.kernels.device import device_info

    from .timing import host_ms_per_call, timer_for

    info = device_info(torch_device)
    timer = timer_for(torch_device)
    host = functools.partial(host_ms_per_call, device=torch_device)
    table = Table(title=f"portable, ours and the peer on {info.slug}")
    for column in BENCH_COLUMNS:
        table.add_column(column)
    # Why cells are empty, once per reason (the opt-in Q4_K keys share one, say) with the keys it holds for.
    notes: dict[str, list[str]] = {}
    # A benchmark serves what is stored: it never tunes online or logs its keys as missed.
    with settings.override(db_url=db_url(db), jit="off", miss_log=False):
        for spec in load_kernels(kernel, tunable=True):
            for key in spec.default_keys(info):
                row = bench_key(spec, key, info, torch_device, timer, seed, host)
                table.add_row(*bench_cells(row))
                if row.note is not None:
                    notes.setdefault(row.note, []).append(f"{row.kernel} {key_text(row.key)}")
    console.print(table)
    for note, keys in notes.items():
        where = keys[0] if len(keys) == 1 else f"{len(keys)} keys ({keys[0]}, ...)"
        console.print(f"[yellow]{plain(where)}: {plain(note)}[/yellow]", soft_wrap=True)

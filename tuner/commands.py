"""The ``tune`` subcommands that inspect and move stored results: list, show, status, export,
import and bench. They register on the app of :mod:`tritune.tuner.app`."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from .app import app, choose_device, console, db_url, short_key

if TYPE_CHECKING:
    from .studies import StudyStorage, StudySummary


@app.command("list")
def list_kernels() -> None:
    """Kernels and their search spaces."""
    from tritune.kernels.registry import all_specs

    for spec in all_specs():
        table = Table(title=f"{spec.name} (version {spec.version}, {spec.space.size()} configs before pruning)")
        table.add_column("dimension")
        table.add_column("choices")
        table.add_column("portable default")
        default = spec.space.to_dict(spec.space.default())
        for name, choices in spec.space.dimensions.items():
            table.add_row(name, ", ".join(map(str, choices)), str(default[name]))
        console.print(table)


@app.command()
def show(
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    kernel: Annotated[str | None, typer.Option(help="only this kernel")] = None,
    gpu: Annotated[str | None, typer.Option(help="only this GPU slug")] = None,
) -> None:
    """The stored winners."""
    from tritune.configs_db.store import ConfigStore

    table = Table(title="winners")
    for column in ("gpu", "kernel", "key", "config", "time ms", "portable ms", "speedup", "trials"):
        table.add_column(column)
    for w in ConfigStore(db_url(db)).winners(gpu=gpu, kernel=kernel):
        table.add_row(
            w.gpu,
            w.kernel,
            " ".join(f"{k}={v}" for k, v in w.key.items() if k not in ("arch", "sm_count")),
            " ".join(f"{k}={v}" for k, v in w.config.items()),
            f"{w.time_ms:.4g}",
            f"{w.portable_ms:.4g}",
            f"{w.speedup:.3f}x",
            str(w.trials),
        )
    console.print(table)


@app.command()
def status(
    storage: Annotated[str, typer.Option(help="the shared Optuna storage: RDB URL or journal file path")],
    kernel: Annotated[str | None, typer.Option(help="only this kernel")] = None,
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
    rows = status_rows(where, kernel=kernel, gpu=gpu)
    if not rows:
        console.print(f"no tritune studies in {where.display()}")
        return
    print_status(rows, title=f"studies in {where.display()}")


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
            finalized = f"error: {row.finalized['error']}"
        else:
            finalized = "yes"
        table.add_row(
            row.gpu,
            row.kernel,
            " ".join(f"{k}={v}" for k, v in row.key.items() if k not in ("arch", "sm_count")),
            *(str(row.counts.get(name, 0)) for name in counts),
            "-" if row.best_ms is None else f"{row.best_ms:.4g}",
            " ".join(f"{k}={v}" for k, v in row.best_params.items()),
            finalized,
        )
    console.print(table)


@app.command("export")
def export_bundle(
    gpu: Annotated[str, typer.Option(help="GPU slug, e.g. nvidia-h200-sm90-132sm")],
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    out: Annotated[Path | None, typer.Option(help="bundle path (default: the shipped bundles folder)")] = None,
) -> None:
    """Write the DB's winners for one GPU as a reviewed, diffable JSON bundle."""
    from tritune.configs_db import bundles
    from tritune.configs_db.store import ConfigStore

    store = ConfigStore(db_url(db))
    records = store.winners(gpu=gpu)
    if not records:
        raise typer.BadParameter(f"--gpu {gpu!r}: the DB holds no winners for that GPU")
    # A bundle states one provenance: export the largest group of records sharing one.
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
    stamp, chosen = max(groups.items(), key=lambda item: len(item[1]))
    for other, left in groups.items():
        if other != stamp:
            console.print(f"[yellow]left out {len(left)} winner(s) tuned under other versions {other}[/yellow]")
    path = out or bundles.shipped_bundle_dir() / f"{gpu}.json"
    provenance = dict(zip(("cuda", "driver", "torch", "triton", "tritune"), stamp, strict=True))
    gpu_name = str(chosen[0].extra.get("gpu_name") or gpu)
    bundles.write_bundle(chosen, path, gpu=gpu, gpu_name=gpu_name, provenance=provenance)
    console.print(f"wrote {len(chosen)} winner(s) to {path}")


@app.command("import")
def import_bundle(
    path: Annotated[Path, typer.Argument(help="bundle JSON file")],
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
) -> None:
    """Load a bundle's winners into the DB (entries this tritune could never serve are refused).

    Refused, each with its reason: unknown kernels, kernel versions other than the running
    source, other Triton versions, and keys or configs outside the kernel's types and space. A
    bundle of another GPU is loaded (a DB may hold several GPUs; each is only served on its own).
    """
    from tritune.configs_db import bundles
    from tritune.configs_db.store import ConfigStore

    records, rejections = bundles.read_bundle(path)
    accepted = []
    for record in records:
        refusal = _import_refusal(record)
        if refusal is not None:
            console.print(f"[yellow]refused {record.kernel}: {refusal}[/yellow]")
            continue
        accepted.append(record)
    for rejection in rejections:
        console.print(f"[yellow]refused: {rejection.reason}[/yellow]")
    imported, skipped = ConfigStore(db_url(db)).import_records(accepted)
    console.print(f"imported {imported} winner(s), kept {skipped} existing better one(s)")


def _import_refusal(record: Any) -> str | None:
    """Why a bundle record can never be served by this tritune, in the dispatcher's words; ``None`` if it can."""
    import triton

    from tritune.kernels.registry import get_spec

    try:
        spec = get_spec(record.kernel)
    except KeyError:
        return "unknown kernel"
    if record.kernel_version != spec.version:
        return f"stale kernel version {record.kernel_version} (running {spec.version})"
    if record.triton_version != triton.__version__:
        return f"tuned with Triton {record.triton_version}, running {triton.__version__}"
    try:
        spec.key_type.from_dict(record.key)
    except (TypeError, ValueError) as exc:
        return f"malformed key ({exc})"
    try:
        spec.space.parse(record.config)
    except ValueError as exc:
        return f"config outside the search space ({exc})"
    return None


@app.command()
def bench(
    device: Annotated[str, typer.Option(help="auto, cpu, or a CUDA index")] = "auto",
    kernel: Annotated[list[str] | None, typer.Option(help="kernel(s); default: all")] = None,
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Portable vs tuned (as the dispatcher would serve it) at each default key, side by side."""
    torch_device = choose_device(device)
    from tritune.kernels import settings
    from tritune.kernels.device import device_info
    from tritune.kernels.dispatcher import DISPATCHER
    from tritune.kernels.registry import get_spec, kernel_names

    from .timing import timer_for

    info = device_info(torch_device)
    timer = timer_for(torch_device)
    table = Table(title=f"portable vs tuned on {info.slug}")
    for column in ("kernel", "key", "served config", "portable ms", "tuned ms", "speedup"):
        table.add_column(column)
    with settings.override(db_url=db_url(db)):
        for name in kernel or kernel_names():
            spec = get_spec(name)
            for key in spec.default_keys(info):
                problem = spec.make_problem(key, torch_device, seed)
                default = spec.default_config(key)
                served = DISPATCHER.select(spec, info, key)
                times = []
                for config in (default, served):
                    times.append(
                        timer(
                            functools.partial(spec.launch, config, *problem.args, **problem.kwargs),
                            config=config,
                            flush_l2=problem.flush_l2,
                            launch_bound=problem.launch_bound,
                        )
                    )
                table.add_row(
                    name,
                    short_key(key),
                    " ".join(f"{k}={v}" for k, v in spec.space.to_dict(served).items()),
                    f"{times[0]:.4g}",
                    f"{times[1]:.4g}",
                    f"{times[0] / times[1]:.3f}x",
                )
    console.print(table)

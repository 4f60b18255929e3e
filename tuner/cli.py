"""The ``tune`` (alias ``tritune``) command line.

``tune --device 0 --kernel tma_prefill`` tunes the kernel's default keys on GPU 0 into the config
DB; ``tune list|show|export|import|bench`` inspect and move what was stored. Without a GPU,
``--device cpu`` (what ``auto`` picks there) runs the same loop on the Triton interpreter at tiny
shapes and stores under the pseudo-device ``cpu-interpreter``.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Without a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    no_args_is_help=False,
    help="Tune tritune's Triton kernels into a persistent config DB, and inspect or ship the results.",
)

#: CLI option -> parameter name of ``KernelSpec.default_keys``.
_KEY_OPTIONS = {"head_dim": "head_dims", "lq": "lq", "lkv": "lkv", "batch": "batches", "m": "m"}


def _choose_device(device: str) -> Any:
    """Resolve --device, switching Triton to its interpreter before any kernel is defined."""
    import torch

    wanted = device.strip().lower()
    if wanted == "auto":
        wanted = "0" if torch.cuda.is_available() else "cpu"
    if wanted == "cpu":
        from tritune.kernels._interpreter import fix_interpreter_index

        os.environ["TRITON_INTERPRET"] = "1"
        fix_interpreter_index()
        console.print(
            "[yellow]No GPU selected: running on the Triton interpreter at tiny shapes. Times are CPU "
            "wall-clock and results are stored under the pseudo-device 'cpu-interpreter'.[/yellow]"
        )
        return torch.device("cpu")
    index = wanted.removeprefix("cuda:")
    if not index.isdigit():
        raise typer.BadParameter(f"--device {device!r}: expected auto, cpu, an index such as 0, or cuda:N")
    if not torch.cuda.is_available():
        raise typer.BadParameter(f"--device {device!r}: no CUDA GPU is visible (use --device cpu)")
    if int(index) >= torch.cuda.device_count():
        raise typer.BadParameter(f"--device {device!r}: only {torch.cuda.device_count()} GPU(s) visible")
    torch.cuda.set_device(int(index))
    return torch.device("cuda", int(index))


def _db_url(db: str | None) -> str:
    from tritune.kernels import settings

    return settings.db_url_from(db) if db else settings.settings().db_url


def _keys_for(spec: Any, device_info: Any, given: dict[str, list[int]]) -> list[Any]:
    accepted = inspect.signature(spec.default_keys).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs: dict[str, Any] = {}
    for option, values in given.items():
        name = _KEY_OPTIONS[option]
        if not values:
            continue
        if name not in accepted and not open_ended:
            raise typer.BadParameter(f"--{option.replace('_', '-')} does not apply to kernel {spec.name}")
        kwargs[name] = values
    keys: list[Any] = spec.default_keys(device_info, **kwargs)
    return keys


@app.callback()
def tune(
    ctx: typer.Context,
    device: Annotated[str, typer.Option(help="auto, cpu (Triton interpreter), or a CUDA index such as 0")] = "auto",
    kernel: Annotated[list[str] | None, typer.Option(help="kernel(s) to tune; default: all")] = None,
    head_dim: Annotated[list[int] | None, typer.Option(help="head dims to tune (attention kernels)")] = None,
    lq: Annotated[list[int] | None, typer.Option(help="query lengths to tune (prefill)")] = None,
    lkv: Annotated[list[int] | None, typer.Option(help="KV lengths to tune")] = None,
    batch: Annotated[list[int] | None, typer.Option(help="batch sizes to tune (decode)")] = None,
    m: Annotated[list[int] | None, typer.Option(help="M (rows) to tune (GEMM)")] = None,
    trials: Annotated[int | None, typer.Option(min=1, help="measured trials per key [default: 40; 12 on cpu]")] = None,
    time_budget: Annotated[float | None, typer.Option(help="seconds per key")] = None,
    db: Annotated[str | None, typer.Option(help="config DB (SQLAlchemy URL or file path)")] = None,
    seed: Annotated[int, typer.Option(help="seed of the sampler and the random problems")] = 0,
    isolate: Annotated[
        bool,
        typer.Option(
            "--isolate/--no-isolate",
            help="run candidates in a worker process, so one that crashes or hangs costs only its trial",
        ),
    ] = True,
    trial_timeout: Annotated[
        float, typer.Option(min=1, help="seconds one candidate may take (isolated) before it is killed")
    ] = 120.0,
) -> None:
    """Tune kernels at their default keys (or the ones narrowed by the options) into the DB."""
    if ctx.invoked_subcommand is not None:
        return
    torch_device = _choose_device(device)
    from tritune.configs_db.store import ConfigStore
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec, kernel_names

    from .study import KeyResult, KeyTuner, TuneOptions, TuningError, environment_id
    from .timing import timer_for
    from .worker import Worker, worker_device

    names = kernel or kernel_names()
    for name in names:
        if name not in kernel_names():
            raise typer.BadParameter(f"--kernel {name!r}: known kernels are {', '.join(kernel_names())}")
    info = device_info(torch_device)
    url = _db_url(db)
    store = ConfigStore(url)
    env_id = environment_id(store, info)
    if trials is None:
        trials = 12 if torch_device.type == "cpu" else 40
    options = TuneOptions(
        trials=trials, time_budget_s=time_budget, seed=seed, isolate=isolate, trial_timeout_s=trial_timeout
    )
    timer = timer_for(torch_device)
    given = {"head_dim": head_dim or [], "lq": lq or [], "lkv": lkv or [], "batch": batch or [], "m": m or []}
    plan = [(get_spec(n), k) for n in names for k in _keys_for(get_spec(n), info, given)]
    console.print(f"tuning {len(plan)} key(s) on {info.slug} into {url}")

    results: list[KeyResult] = []
    started = time.monotonic()
    # One worker for the whole run: its start-up (importing torch, CUDA init) is paid once.
    worker = (
        Worker(
            worker_device(torch_device),
            timer,
            trial_timeout_s=options.trial_timeout_s,
            noise=options.noise,
            compile_workers=options.compile_workers,
        )
        if isolate
        else None
    )
    try:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        ) as progress:
            for spec, key in plan:
                task = progress.add_task(f"{spec.name} {_short_key(key)}", total=trials)
                tuner = KeyTuner(
                    spec,
                    key,
                    info,
                    torch_device,
                    store,
                    env_id,
                    timer,
                    options,
                    on_trial=lambda *_args, task=task: progress.advance(task),
                    bench=worker,
                )
                try:
                    results.append(tuner.run())
                except TuningError as exc:
                    console.print(f"[red]{exc}[/red]")
                progress.update(task, completed=trials)
    finally:
        if worker is not None:
            worker.close()
    _print_results(results)
    console.print(f"done in {time.monotonic() - started:.1f} s; winners stored in {url}")


def _short_key(key: Any) -> str:
    values = key.to_dict()
    return " ".join(f"{k}={v}" for k, v in values.items() if k not in ("arch", "sm_count"))


def _print_results(results: list[Any]) -> None:
    table = Table(title="tuning summary")
    for column in ("kernel", "key", "winner", "time ms", "portable ms", "speedup", "trials"):
        table.add_column(column)
    for r in results:
        table.add_row(
            r.kernel,
            _short_key(r.key),
            " ".join(f"{k}={v}" for k, v in r.config.items()),
            f"{r.best_ms:.4g}",
            f"{r.portable_ms:.4g}",
            f"{r.speedup:.3f}x",
            f"{r.measured}+{r.reused} ok/reused, {r.failed} failed, {r.pruned} pruned",
        )
    console.print(table)


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
    for w in ConfigStore(_db_url(db)).winners(gpu=gpu, kernel=kernel):
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


@app.command("export")
def export_bundle(
    gpu: Annotated[str, typer.Option(help="GPU slug, e.g. nvidia-h200-sm90-132sm")],
    db: Annotated[str | None, typer.Option(help="config DB")] = None,
    out: Annotated[Path | None, typer.Option(help="bundle path (default: the shipped bundles folder)")] = None,
) -> None:
    """Write the DB's winners for one GPU as a reviewed, diffable JSON bundle."""
    from tritune.configs_db import bundles
    from tritune.configs_db.store import ConfigStore

    store = ConfigStore(_db_url(db))
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
    imported, skipped = ConfigStore(_db_url(db)).import_records(accepted)
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
    torch_device = _choose_device(device)
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
    with settings.override(db_url=_db_url(db)):
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
                            lambda config=config, spec=spec, problem=problem: spec.launch(
                                config, *problem.args, **problem.kwargs
                            ),
                            config=config,
                            flush_l2=problem.flush_l2,
                            launch_bound=problem.launch_bound,
                        )
                    )
                table.add_row(
                    name,
                    _short_key(key),
                    " ".join(f"{k}={v}" for k, v in spec.space.to_dict(served).items()),
                    f"{times[0]:.4g}",
                    f"{times[1]:.4g}",
                    f"{times[0] / times[1]:.3f}x",
                )
    console.print(table)


def main() -> None:
    from tritune.kernels import settings

    logging.basicConfig(
        level=settings.settings().log_level,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    app()

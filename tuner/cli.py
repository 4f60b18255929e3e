"""The ``tune`` (alias ``tritune``) command line.

``tune --device 0 --kernel tma_prefill`` tunes the kernel's default keys on GPU 0 into the config
DB; ``tune list|show|export|import|bench`` inspect and move what was stored. Without a GPU,
``--device cpu`` (what ``auto`` picks there) runs the same loop on the Triton interpreter at tiny
shapes and stores under the pseudo-device ``cpu-interpreter``.

Several workers share Optuna studies (``docs/distributed.md``): ``--device 0,1,2,3`` (or ``all``,
or ``cpu --workers N``) starts one worker process per entry on one host; ``--worker --storage
postgresql+psycopg://...`` joins shared studies from any host; ``tune status`` shows them.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from .studies import StudyStorage, StudySummary
    from .study import TuneOptions

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


def _parse_devices(device: str, workers: int) -> list[str]:
    """``--device`` and ``--workers`` as one entry per worker: ``cpu`` or a CUDA index (``auto`` resolved)."""
    import torch

    wanted = device.strip().lower()
    if wanted == "all":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise typer.BadParameter("--device all: no CUDA GPU is visible (on the CPU: --device cpu --workers N)")
        items = [str(index) for index in range(count)]
    else:
        items = [part.strip().removeprefix("cuda:") for part in wanted.split(",") if part.strip()]
    if not items:
        raise typer.BadParameter(f"--device {device!r}: expected auto, all, cpu, an index such as 0, or a list")
    if items == ["auto"]:
        items = ["0" if torch.cuda.is_available() else "cpu"]
    if "auto" in items:
        raise typer.BadParameter("--device: auto stands alone; list devices as 0,1,2 or cpu,cpu")
    if len({item == "cpu" for item in items}) > 1:
        raise typer.BadParameter(f"--device {device!r}: the interpreter (cpu) and GPUs cannot share one run")
    gpus = [item for item in items if item != "cpu"]
    if workers > 1 and gpus:
        raise typer.BadParameter(
            "--workers N is for --device cpu: two workers on one GPU disturb each other's timings; "
            "list GPUs instead (--device 0,1,2,3 or all)"
        )
    if len(gpus) != len(set(gpus)):
        raise typer.BadParameter(f"--device {device!r}: a GPU is listed twice (one worker per GPU)")
    if len(items) > 1:
        for item in gpus:
            if not item.isdigit():
                raise typer.BadParameter(f"--device {device!r}: {item!r} is not a CUDA index")
            if int(item) >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
                raise typer.BadParameter(f"--device {device!r}: GPU {item} is not visible")
    return items * workers


@app.callback()
def tune(
    ctx: typer.Context,
    device: Annotated[
        str,
        typer.Option(
            help="auto, cpu (Triton interpreter), a CUDA index such as 0, a list (0,1,2,3 or cpu,cpu) "
            "or all: one worker process per entry"
        ),
    ] = "auto",
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
    workers: Annotated[int, typer.Option(min=1, help="worker processes per --device entry (interpreter only)")] = 1,
    storage: Annotated[
        str | None,
        typer.Option(
            help="Optuna storage shared by the workers: an RDB URL (postgresql+psycopg://..., any host joins) "
            "or a journal file path (one host) [default: in memory for one worker, a temporary journal for several]"
        ),
    ] = None,
    worker: Annotated[
        bool, typer.Option("--worker", help="join the shared studies in --storage (an RDB URL) as one worker")
    ] = False,
    heartbeat_interval: Annotated[
        int, typer.Option(min=1, help="seconds between a worker's heartbeats (RDB storage)")
    ] = 10,
    grace_period: Annotated[
        int, typer.Option(min=2, help="seconds without a heartbeat after which a worker's trials are retried")
    ] = 60,
    max_retry: Annotated[int, typer.Option(min=0, help="times a trial of a dead worker is retried")] = 3,
) -> None:
    """Tune kernels at their default keys (or the ones narrowed by the options) into the DB."""
    if ctx.invoked_subcommand is not None:
        return
    from tritune.kernels.registry import kernel_names

    from .studies import StudyStorage
    from .study import TuneOptions

    devices = _parse_devices(device, workers)
    names = kernel or kernel_names()
    for name in names:
        if name not in kernel_names():
            raise typer.BadParameter(f"--kernel {name!r}: known kernels are {', '.join(kernel_names())}")
    where = None
    if storage is not None:
        where = StudyStorage(
            storage if "://" in storage else str(Path(storage).expanduser().resolve()),
            heartbeat_interval_s=heartbeat_interval,
            grace_period_s=grace_period,
            max_retry=max_retry,
        )
        problem = where.problem()
        if problem is not None:
            raise typer.BadParameter(f"--storage: {problem}")
    if worker:
        if where is None or not where.has_heartbeat:
            raise typer.BadParameter(
                "--worker joins shared studies: give --storage an RDB URL (postgresql+psycopg://...); a journal "
                "file has no heartbeats, so the trials of a dead worker on another host would never be retried"
            )
        if len(devices) > 1:
            raise typer.BadParameter("--worker is one worker: give one --device (or leave --worker out)")
    url = _db_url(db)
    if where is not None and where.is_rdb and _same_database(where.location, url):
        raise typer.BadParameter(
            "--storage and --db name the same database: Optuna's tables (trials, alembic_version) collide with "
            "the config DB's; use two databases (they may live on one server)"
        )
    cpu = devices[0] == "cpu"
    if trials is None:
        trials = 12 if cpu else 40
    options = TuneOptions(
        trials=trials, time_budget_s=time_budget, seed=seed, isolate=isolate, trial_timeout_s=trial_timeout
    )
    given = {"head_dim": head_dim or [], "lq": lq or [], "lkv": lkv or [], "batch": batch or [], "m": m or []}
    if len(devices) > 1:
        _tune_fleet(devices, names, given, url, options, where, heartbeat_interval)
    else:
        _tune_here(devices[0], names, given, url, options, where)


def _same_database(first: str, second: str) -> bool:
    from sqlalchemy.engine import make_url

    a, b = make_url(first), make_url(second)
    return (a.get_backend_name(), a.host, a.port, a.database) == (b.get_backend_name(), b.host, b.port, b.database)


def _tune_here(
    device: str,
    names: list[str],
    given: dict[str, list[int]],
    url: str,
    options: TuneOptions,
    where: StudyStorage | None,
) -> None:
    """One worker in this process: the classic tune (in-memory studies), or one worker of shared studies."""
    torch_device = _choose_device(device)
    from tritune.configs_db.store import ConfigStore, display_url
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec

    from .shared import run_worker, worker_name
    from .study import KeyResult, KeyTuner, TuningError, environment_id
    from .timing import timer_for
    from .worker import Worker, worker_device

    info = device_info(torch_device)
    store = ConfigStore(url)
    env_id = environment_id(store, info)
    timer = timer_for(torch_device)
    plan = [(get_spec(n), k) for n in names for k in _keys_for(get_spec(n), info, given)]
    trials = options.trials
    shared = "" if where is None else f" with the studies in {where.display()}"
    console.print(f"tuning {len(plan)} key(s) on {info.slug} into {display_url(url)}{shared}")

    results: list[KeyResult] = []
    started = time.monotonic()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        tasks = {
            (spec.name, key): progress.add_task(f"{spec.name} {_short_key(key)}", total=trials) for spec, key in plan
        }

        if where is not None:
            # A worker of shared studies: Optuna's storage is the sampler state of every worker.
            report = run_worker(
                plan,
                device=info,
                torch_device=torch_device,
                store=store,
                env_id=env_id,
                timer=timer,
                options=options,
                where=where,
                worker=worker_name(worker_device(torch_device)),
                start=zlib.crc32(worker_name(device).encode()),
                on_trial_for=lambda spec, key: lambda *_args, task=tasks[(spec.name, key)]: progress.advance(task),
                on_done=lambda tuner, visit: progress.update(tasks[(tuner.spec.name, tuner.key)], completed=trials),
            )
            results = report.results
            for error in report.errors:
                console.print(f"[red]{error}[/red]")
            if report.by_others:
                console.print(f"{len(report.by_others)} key(s) were already finalized (tune status shows them)")
        else:
            # One worker for the whole run: its start-up (importing torch, CUDA init) is paid once.
            bench = (
                Worker(
                    worker_device(torch_device),
                    timer,
                    trial_timeout_s=options.trial_timeout_s,
                    noise=options.noise,
                    compile_workers=options.compile_workers,
                )
                if options.isolate
                else None
            )
            try:
                for spec, key in plan:
                    task = tasks[(spec.name, key)]
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
                        bench=bench,
                    )
                    try:
                        results.append(tuner.run())
                    except TuningError as exc:
                        console.print(f"[red]{exc}[/red]")
                    progress.update(task, completed=trials)
            finally:
                if bench is not None:
                    bench.close()
    _print_results(results)
    console.print(f"done in {time.monotonic() - started:.1f} s; winners stored in {display_url(url)}")


def _tune_fleet(
    devices: list[str],
    names: list[str],
    given: dict[str, list[int]],
    url: str,
    options: TuneOptions,
    where: StudyStorage | None,
    heartbeat_interval: int,
) -> None:
    """One worker process per device entry, on one shared storage; this process coordinates."""
    import shutil
    import tempfile

    import torch

    from tritune.configs_db.store import ConfigStore, display_url
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec

    from .candidates import spec_target
    from .fleet import WorkerJob, run_fleet
    from .studies import StudyStorage, study_name
    from .timing import timer_for

    if devices[0] == "cpu":
        # The interpreter before any kernel module is imported (the plan imports the specs).
        _choose_device("cpu")
    # The config DB is created (and upgraded) once, before the workers open it together.
    ConfigStore(url).close()
    scratch = None
    if where is None:
        scratch = tempfile.mkdtemp(prefix="tritune-studies-")
        where = StudyStorage(str(Path(scratch) / "studies.log"))
    specs = [get_spec(n) for n in names]
    targets = {spec.name: spec_target(spec) for spec in specs}
    jobs: list[WorkerJob] = []
    study_names: list[str] = []
    plans: dict[str, list[tuple[Any, Any]]] = {}
    for index, entry in enumerate(devices):
        torch_device = torch.device("cpu") if entry == "cpu" else torch.device("cuda", int(entry))
        info = device_info(torch_device)
        if entry not in plans:
            plans[entry] = [(spec, key) for spec in specs for key in _keys_for(spec, info, given)]
            study_names.extend(
                study_name(spec.name, spec.version, info.slug, _triton_version(), key.to_dict())
                for spec, key in plans[entry]
            )
        jobs.append(
            WorkerJob(
                label=f"cpu#{index}" if entry == "cpu" else f"cuda:{entry}",
                index=index,
                count=len(devices),
                device="cpu" if entry == "cpu" else f"cuda:{entry}",
                targets=targets,
                keys=[(spec.name, key.to_dict()) for spec, key in plans[entry]],
                db_url=url,
                where=where,
                options=options,
                timer=timer_for(torch_device),
                poll_s=min(1.0, float(heartbeat_interval)),
            )
        )
    console.print(
        f"tuning {len(study_names)} key(s) with {len(jobs)} workers ({', '.join(job.label for job in jobs)}) "
        f"into {display_url(url)}, studies in {where.display()}"
    )
    started = time.monotonic()
    try:
        exits = run_fleet(jobs, study_names)
        for ended in exits:
            if ended.exitcode != 0:
                console.print(
                    f"[yellow]worker {ended.job.label} (pid {ended.pid}) exited with code {ended.exitcode}; "
                    f"{ended.released} of its trial(s) were handed to the other workers[/yellow]"
                )
        rows = _status_rows(where, names=set(study_names))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    _print_status(rows, title="shared studies")
    unfinished = [row for row in rows if row.finalized is None]
    console.print(f"done in {time.monotonic() - started:.1f} s; winners stored in {display_url(url)}")
    if unfinished or len(rows) < len(study_names):
        console.print(f"[red]{len(study_names) - len(rows) + len(unfinished)} key(s) were not finalized[/red]")
        raise typer.Exit(1)


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


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
    rows = _status_rows(where, kernel=kernel, gpu=gpu)
    if not rows:
        console.print(f"no tritune studies in {where.display()}")
        return
    _print_status(rows, title=f"studies in {where.display()}")


def _status_rows(
    where: StudyStorage, *, names: set[str] | None = None, kernel: str | None = None, gpu: str | None = None
) -> list[StudySummary]:
    from .studies import summaries

    return [row for row in summaries(where, gpu=gpu, kernel=kernel) if names is None or row.name in names]


def _print_status(rows: list[StudySummary], *, title: str) -> None:
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

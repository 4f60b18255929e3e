"""The ``tune`` (alias ``tritune``) command line.

``tune --device 0 --kernel tma_prefill`` tunes the kernel's default keys on GPU 0 into the config
DB (``--key FIELD=VALUES`` replaces key fields, :mod:`.keys`; ``--kernel`` also takes a user's
declaration, ``package.module:NAME`` or ``path/to/file.py:NAME``); ``tune
list|show|export|import|bench`` inspect and move what was stored. Without a GPU,
``--device cpu`` (what ``auto`` picks there) runs the same loop on the Triton interpreter at tiny
shapes and stores under the pseudo-device ``cpu-interpreter``.

Several workers share Optuna studies (``docs/distributed.md``): ``--device 0,1,2,3`` (or ``all``,
or ``cpu --workers N``) starts one worker process per entry on one host; ``--worker --storage
postgresql+psycopg://...`` joins shared studies from any host; ``tune status`` shows them.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .app import (
    DEBUG_FLAG,
    app,
    check_database_path,
    check_kernel_names,
    choose_device,
    console,
    db_url,
    load_kernels,
    plain,
    short_key,
)
from .commands import print_status, status_rows
from .keys import parse_overrides
from .plan import KeySource, plan_keys
from .run_report import print_results, report_stored, stored_text

if TYPE_CHECKING:
    from .studies import StudyStorage
    from .study import TuneOptions


def _positive_seconds(value: float | None) -> float | None:
    """Option callback: a finite number of seconds above zero (click's ranges let nan through)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value!r}: expected a positive number of seconds")
    return value


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
    kernel: Annotated[
        list[str] | None,
        typer.Option(
            help="kernel(s) to tune: a name (tune list), or a declaration of your own as package.module:NAME "
            "or path/to/file.py:NAME; default: all"
        ),
    ] = None,
    key: Annotated[
        list[str] | None,
        typer.Option(
            help="FIELD=V1,V2: tune each default key with FIELD set to each value (repeatable: every "
            "combination); FIELD is a key field or an alias (tune list shows them); with --bundled or --missed, "
            "only their keys whose FIELD holds one of the values"
        ),
    ] = None,
    head_dim: Annotated[list[int] | None, typer.Option(min=1, help="--key head_dim=...")] = None,
    lq: Annotated[list[int] | None, typer.Option(min=1, help="--key lq=... (query length, prefill)")] = None,
    lkv: Annotated[list[int] | None, typer.Option(min=1, help="--key lkv=... (KV length)")] = None,
    batch: Annotated[list[int] | None, typer.Option(min=1, help="--key batch=... (sequences, decode)")] = None,
    m: Annotated[list[int] | None, typer.Option(min=1, help="--key m=... (rows, GEMM)")] = None,
    missed: Annotated[
        bool,
        typer.Option(
            "--missed",
            help="tune the keys the runtime logged without a winner on this GPU (tune missed lists them) "
            "instead of the default keys",
        ),
    ] = False,
    bundled: Annotated[
        bool,
        typer.Option(
            "--bundled",
            help="tune the keys of the bundle shipped for this GPU, each seeded from its shipped winner "
            "(a re-tune after a Triton or torch upgrade or a kernel edit: a few --trials suffice); "
            "on a GPU without one, the nearest GPU's bundle's keys",
        ),
    ] = False,
    trials: Annotated[int | None, typer.Option(min=1, help="measured trials per key [default: 40; 12 on cpu]")] = None,
    time_budget: Annotated[
        float | None,
        typer.Option(
            callback=_positive_seconds,
            help="seconds per key (above zero); past them the portable default is still measured, and a batch "
            "already compiled in parallel up to three times them",
        ),
    ] = None,
    db: Annotated[str | None, typer.Option(help="config DB (SQLAlchemy URL or file path)")] = None,
    seed: Annotated[int, typer.Option(min=0, max=2**32 - 1, help="seed of the sampler and the random problems")] = 0,
    isolate: Annotated[
        bool,
        typer.Option(
            "--isolate/--no-isolate",
            help="run candidates in a worker process, so one that crashes or hangs costs only its trial",
        ),
    ] = True,
    trial_timeout: Annotated[
        float,
        typer.Option(
            min=1, callback=_positive_seconds, help="seconds one candidate may take (isolated) before it is killed"
        ),
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
    debug: Annotated[
        bool,
        typer.Option(
            DEBUG_FLAG,
            help="show the traceback of an error instead of its one-line reason (also TRITUNE_LOG_LEVEL=DEBUG); "
            "accepted anywhere on the line, after a subcommand too",
        ),
    ] = False,
) -> None:
    """Tune kernels at their default keys (or those --key makes of them) into the DB."""
    # --debug is read by the app's error handler before click parses the line (see app.TuneGroup).
    del debug
    if ctx.invoked_subcommand is not None:
        return
    from .studies import StudyStorage
    from .study import TuneOptions

    devices = _parse_devices(device, workers)
    names = list(kernel or [])
    check_kernel_names(names)
    overrides = parse_overrides(key or [], {"head_dim": head_dim or [], "lq": lq or [], "lkv": lkv or [],
                                            "batch": batch or [], "m": m or []})  # fmt: skip
    if missed and bundled:
        raise typer.BadParameter("--missed and --bundled name two sets of keys: give one")
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
    url = db_url(db)
    check_database_path(url, must_exist=False)
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
    source = KeySource(overrides=overrides, missed_in=url if missed else None, bundled=bundled)
    if len(devices) > 1:
        _tune_fleet(devices, names, source, url, options, where, heartbeat_interval)
    else:
        _tune_here(devices[0], names, source, url, options, where)


def _same_database(first: str, second: str) -> bool:
    from sqlalchemy.engine import make_url

    a, b = make_url(first), make_url(second)
    return (a.get_backend_name(), a.host, a.port, a.database) == (b.get_backend_name(), b.host, b.port, b.database)


def _tune_here(
    device: str,
    names: list[str],
    source: KeySource,
    url: str,
    options: TuneOptions,
    where: StudyStorage | None,
) -> None:
    """One worker in this process: the classic tune (in-memory studies), or one worker of shared studies."""
    torch_device = choose_device(device)
    from tritune.configs_db.store import ConfigStore, display_url
    from tritune.kernels.device import device_info

    from .provisional import provisional_first
    from .shared import run_worker, worker_name
    from .study import KeyResult, KeyTuner, TuningError, environment_id
    from .timing import timer_for
    from .worker import worker_device

    info = device_info(torch_device)
    # The kernels and their keys before the DB: a bad --kernel or --key leaves no DB behind.
    plan = plan_keys(load_kernels(names, tunable=True), source, info, options.trials)
    store = ConfigStore(url)
    plan = provisional_first(plan, store, info)
    env_id = environment_id(store, info)
    timer = timer_for(torch_device)
    trials = options.trials
    shared = "" if where is None else f" with the studies in {where.display()}"
    console.print(f"tuning {len(plan)} key(s) on {info.slug} into {plain(display_url(url))}{plain(shared)}")

    results: list[KeyResult] = []
    failed = 0
    started = time.monotonic()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        tasks = {
            (spec.name, key): progress.add_task(f"{spec.name} {short_key(key)}", total=trials) for spec, key in plan
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
            failed = len(report.errors)
            for error in report.errors:
                console.print(f"[red]{plain(error)}[/red]")
            if report.by_others:
                console.print(f"{len(report.by_others)} key(s) were already finalized (tune status shows them)")
        else:
            # One bench for the whole run: a worker's start-up (importing torch, CUDA init) is paid once.
            bench = options.make_bench(torch_device, timer)
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
                        failed += 1
                        console.print(f"[red]{plain(exc)}[/red]")
                    progress.update(task, completed=trials)
            finally:
                bench.close()
    print_results(results)
    kept = sum(not result.stored for result in results)
    report_stored(len(plan), failed, len(results), time.monotonic() - started, display_url(url), kept)


def _tune_fleet(
    devices: list[str],
    names: list[str],
    source: KeySource,
    url: str,
    options: TuneOptions,
    where: StudyStorage | None,
    heartbeat_interval: int,
) -> None:
    """One worker process per device entry, on one shared storage; this process coordinates."""
    import torch

    from tritune.configs_db.store import ConfigStore, display_url
    from tritune.kernels.device import device_info

    from .candidates import spec_target
    from .fleet import ScratchStudies, WorkerJob, run_fleet
    from .provisional import provisional_first
    from .studies import study_name
    from .timing import timer_for

    if devices[0] == "cpu":
        # The interpreter before any kernel module is imported (the plan imports the specs).
        choose_device("cpu")
    specs = load_kernels(names, tunable=True)
    targets = {spec.name: spec_target(spec) for spec in specs}
    plans: dict[str, list[tuple[Any, Any]]] = {}
    infos: dict[str, Any] = {}
    for entry in dict.fromkeys(devices):
        torch_device = torch.device("cpu") if entry == "cpu" else torch.device("cuda", int(entry))
        infos[entry] = device_info(torch_device)
        plans[entry] = plan_keys(specs, source, infos[entry], options.trials)
    # The config DB is created (and upgraded) once, before the workers open it together.
    with ConfigStore(url) as store:
        plans = {entry: provisional_first(plan, store, infos[entry]) for entry, plan in plans.items()}
    scratch = None
    if where is None:
        scratch = ScratchStudies()
        where = scratch.where
    jobs: list[WorkerJob] = []
    # GPUs of one model plan the same keys and so share each study: a name is counted once.
    study_names: dict[str, None] = {}
    for entry, plan in plans.items():
        for spec, key in plan:
            study_names[study_name(spec.name, spec.version, infos[entry].slug, _triton_version(), key.to_dict())] = None
    for index, entry in enumerate(devices):
        torch_device = torch.device("cpu") if entry == "cpu" else torch.device("cuda", int(entry))
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
        f"into {plain(display_url(url))}, studies in {plain(where.display())}"
    )
    started = time.monotonic()
    try:
        exits = run_fleet(jobs, list(study_names))
        for ended in exits:
            if ended.exitcode != 0:
                console.print(
                    f"[yellow]worker {ended.job.label} (pid {ended.pid}) exited with code {ended.exitcode}; "
                    f"{ended.released} of its trial(s) were handed to the other workers[/yellow]"
                )
        rows = status_rows(where, names=set(study_names))
    finally:
        if scratch is not None:
            scratch.remove()
    print_status(rows, title="shared studies")
    finalized = {row.name for row in rows if row.finalized is not None}
    unfinished = [name for name in study_names if name not in finalized]
    # A key whose finalizing offer lost to a faster winner stored before says so in its mark.
    kept = sum(row.finalized is not None and row.finalized.get("stored") is False for row in rows)
    seconds = time.monotonic() - started
    if kept:
        winners = sum(row.finalized is not None and "error" not in row.finalized for row in rows)
        ended_text = stored_text(winners, kept, display_url(url))
    else:
        ended_text = f"winners stored in {plain(display_url(url))}"
    console.print(f"done in {seconds:.1f} s; {ended_text}", soft_wrap=True)
    died = [ended for ended in exits if ended.exitcode != 0]
    if unfinished:
        console.print(f"[red]{len(unfinished)} key(s) were not finalized[/red]")
    if died:
        console.print(f"[red]{len(died)} worker(s) died (their exit codes are above)[/red]")
    if unfinished or died:
        raise typer.Exit(1)


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def main() -> None:
    from tritune.kernels import settings

    try:
        level = settings.settings(strict=True).log_level
    except ValueError:
        # The command names the bad setting itself (app.TuneGroup), with exit status 1.
        level = "WARNING"
    logging.basicConfig(
        level=level,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    app()

"""The ``workers`` part of ``scripts/bench_tuner.py``: one worker or two on one GPU, sharing the studies.

The same tune (``splitk_decode`` at the ``--workers-lkv`` keys, ``--workers-trials`` per key) twice, each time from
an empty config DB, an empty Optuna journal and an empty Triton cache: once by one worker, once by
two worker processes on the same device. Both go through ``tritune.tuner.fleet.run_fleet``, what
``tune --device 0,1`` runs; the CLI refuses two workers on one GPU (``--device 0,0``, ``--workers``),
which is what this part measures. Reports the wall time of each run, the trials each worker
measured, whether the winners agree (identical configs, or re-timed within ``--tolerance`` in one
process) and how the times of configs measured in both runs compare.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _tuner_common import (
    Context,
    Record,
    check,
    fmt_counts,
    fmt_ms,
    fresh_sqlite,
    keys_of,
    log,
    make_worker,
    ratio_check,
    retime,
    short,
    tune_options,
)

from tritune.configs_db.records import key_text

TITLE = "One worker or two on one GPU, sharing the studies"
#: The kernel this part tunes: on a GPU at B 8, D 128 and the ``--workers-lkv`` cache lengths.
KERNEL = "splitk_decode"
#: Worker counts of the two runs, in order.
COUNTS = (1, 2)


def run(ctx: Context, record: Record) -> None:
    import triton

    from tritune.configs_db.store import ConfigStore
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec
    from tritune.tuner.candidates import spec_target
    from tritune.tuner.fleet import WorkerJob, run_fleet
    from tritune.tuner.studies import StudyStorage, study_name
    from tritune.tuner.study import environment_id
    from tritune.tuner.timing import timer_for

    args = ctx.args
    spec = get_spec(KERNEL)
    info = device_info(ctx.torch_device)
    gpu_keys = {"head_dim": [128], "batch": [8], "lkv": list(args.workers_lkv)}
    keys = spec.default_keys(info) if ctx.smoke else keys_of(spec, info, **gpu_keys)
    names = [study_name(spec.name, spec.version, info.slug, triton.__version__, k.to_dict()) for k in keys]
    data = record.data
    data.update(kernel=spec.name, keys=[k.to_dict() for k in keys], trials=args.workers_trials, runs={})
    for index, count in enumerate(COUNTS):
        run_dir = ctx.work / f"workers-{count}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        url = fresh_sqlite(run_dir / "configs.sqlite")
        where = StudyStorage(str(run_dir / "studies.log"))
        # A safety net, the same for both runs in spirit: what is left, split over the runs and keys to go.
        budget = max(10.0, (ctx.left() - 20.0) / (len(COUNTS) - index) / len(keys))
        options = tune_options(ctx, trials=args.workers_trials, seed=0, time_budget_s=budget)
        data["batch"] = options.batch_size
        # Created (and upgraded) once, before the workers open it together, as `tune` does.
        ConfigStore(url).close()
        jobs = [
            WorkerJob(
                label=f"worker{i}", index=i, count=count, device=ctx.worker_device,
                targets={spec.name: spec_target(spec)}, keys=[(spec.name, k.to_dict()) for k in keys],
                db_url=url, where=where, options=options, timer=timer_for(ctx.torch_device), poll_s=0.5,
            )
            for i in range(count)
        ]  # fmt: skip
        log.info(
            "workers: %d worker(s) on %s, %d key(s) x %d trials (time budget %.0f s per key)",
            count,
            ctx.worker_device,
            len(keys),
            args.workers_trials,
            budget,
        )
        started = time.monotonic()
        with cold_triton_cache(run_dir / "triton-cache", ctx.smoke):
            exits = run_fleet(jobs, names)
        wall = time.monotonic() - started
        labels = {str(e.pid): e.job.label for e in exits}
        result: dict[str, Any] = {"wall_s": wall, "exit_codes": {e.job.label: e.exitcode for e in exits}}
        result.update(study_facts(where, names, labels))
        with ConfigStore(url) as store:
            env = environment_id(store, info)
            result["winners"] = {
                json.dumps(w.key, sort_keys=True): {"config": w.config, "ms": w.time_ms}
                for w in store.winners(gpu=info.slug, kernel=spec.name)
            }
            result["trial_ms"] = {
                json.dumps(row.key, sort_keys=True) + " " + json.dumps(row.config, sort_keys=True): row.time_ms
                for row in store.study_trials(env, spec.name, spec.version)
                if row.status == "ok"
            }
        data["runs"][str(count)] = result
        log.info("workers: %d worker(s) done in %.1f s; measured: %s", count, wall, fmt_counts(result["measured_by"]))
        record.save()
    data["checks"] = compare(ctx, spec, keys, data)
    record.save()


@contextlib.contextmanager
def cold_triton_cache(path: Path, smoke: bool) -> Iterator[None]:
    """A fresh Triton cache for one run (its processes inherit it), so both runs compile from nothing."""
    if smoke:
        yield
        return
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = previous


def study_facts(where: Any, names: list[str], labels: dict[str, str]) -> dict[str, Any]:
    """From the journal: per worker, trials measured (ok or failed) and other outcomes; who finalized each key."""
    from optuna.trial import TrialState

    from tritune.tuner.studies import FINALIZED_ATTR, OUTCOME_ATTR, WORKER_ATTR

    def label(worker: Any) -> str:
        # Workers sign trials host:pid:device.
        parts = str(worker).split(":")
        return labels.get(parts[1], str(worker)) if len(parts) >= 3 else str(worker)

    measured: dict[str, int] = {}
    other: dict[str, dict[str, int]] = {}
    finalized: dict[str, Any] = {}
    running = 0
    for name in names:
        try:
            study = where.load(name)
        except KeyError:
            finalized[name] = None
            continue
        for trial in study.get_trials(deepcopy=False):
            who = label(trial.user_attrs.get(WORKER_ATTR, "not asked"))
            outcome = str(trial.user_attrs.get(OUTCOME_ATTR, trial.state.name.lower()))
            running += trial.state == TrialState.RUNNING
            if outcome == "ok" or outcome.startswith("failed"):
                measured[who] = measured.get(who, 0) + 1
            else:
                mine = other.setdefault(who, {})
                mine[outcome] = mine.get(outcome, 0) + 1
        mark = study.user_attrs.get(FINALIZED_ATTR)
        finalized[name] = (
            {"by": label(mark.get("worker")), "config": mark.get("config"), "time_ms": mark.get("time_ms")}
            if isinstance(mark, dict)
            else None
        )
    return {"measured_by": measured, "other_outcomes": other, "finalized": finalized, "left_running": running}


def compare(ctx: Context, spec: Any, keys: list[Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    from tritune.tuner.timing import timer_for

    one, two = data["runs"].get("1"), data["runs"].get("2")
    if one is None or two is None:
        return [check("both runs completed", False, "a run is missing")]
    checks = [
        check(
            f"{label}: every key finalized, no trial left running",
            all(v is not None for v in run["finalized"].values()) and run["left_running"] == 0,
            f"{sum(v is not None for v in run['finalized'].values())} of {len(keys)} finalized, "
            f"{run['left_running']} running",
        )
        for label, run in (("one worker", one), ("two workers", two))
    ]
    data["compare"] = {}
    # One process re-times every pair of differing winners (started only if there is one).
    with contextlib.ExitStack() as stack:
        worker = None
        for key in keys:
            text, tag = key_text(key.to_dict()), json.dumps(key.to_dict(), sort_keys=True)
            a, b = one["winners"].get(tag), two["winners"].get(tag)
            if a is None or b is None:
                checks.append(check(f"{text}: winners agree", False, "a winner is missing"))
                continue
            if a["config"] == b["config"]:
                data["compare"][tag] = {"same_config": True, "retimed_ms": None}
                checks.append(check(f"{text}: winners agree", True, "identical configs"))
                continue
            log.info("workers: re-timing both winners of %s, %d interleaved rounds", text, ctx.args.rounds)
            if worker is None:
                worker = stack.enter_context(make_worker(ctx, timer_for(ctx.torch_device), tune_options(ctx)))
            times = retime(worker, ctx, spec, key, [a["config"], b["config"]])
            data["compare"][tag] = {"same_config": False, "retimed_ms": times}
            checks.append(ratio_check(ctx, f"{text}: winners within {ctx.args.tolerance:.0%}", times, False))
    common = [c for c in sorted(set(one["trial_ms"]) & set(two["trial_ms"])) if one["trial_ms"][c]]
    ratios = [two["trial_ms"][c] / one["trial_ms"][c] for c in common]
    data["disturbance"] = {
        "common_configs": len(ratios),
        "median": statistics.median(ratios) if ratios else None,
        "min": min(ratios, default=None),
        "max": max(ratios, default=None),
    }
    return checks


def render(data: dict[str, Any]) -> list[str]:
    keys = data.get("keys", [])
    lines = [
        f"Kernel `{data.get('kernel')}`, {len(keys)} key(s) ({'; '.join(key_text(k) for k in keys)}), "
        f"{data.get('trials')} trials per key shared by the workers, batch {data.get('batch')}. Studies in an Optuna "
        "journal file, config DB in SQLite, each run from an empty DB, journal and Triton cache, through "
        "`tritune.tuner.fleet.run_fleet` (what `tune --device 0,1` runs) with every worker on the same device.",
        "",
    ]
    if (data.get("batch") or 0) >= (data.get("trials") or 1):
        lines += [
            "With a batch as large as a key's budget, the first worker to ask a key asks its whole budget at once: "
            "two workers split the keys, not the trials of one key.",
            "",
        ]
    lines += [
        "| workers | wall s | measured per worker | other outcomes | finalized by | exit codes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    runs = data.get("runs", {})
    for count, run in runs.items():
        finals = ", ".join(str(v["by"]) if v else "NOT finalized" for v in run["finalized"].values())
        other = "; ".join(f"{w}: {fmt_counts(c)}" for w, c in sorted(run["other_outcomes"].items())) or "-"
        lines.append(
            f"| {count} | {run['wall_s']:.1f} | {fmt_counts(run['measured_by'])} | {other} | {finals} | "
            f"{fmt_counts(run['exit_codes'])} |"
        )
    lines.append("")
    if "1" in runs and "2" in runs:
        lines += [
            "| key | winner, one worker (ms) | winner, two workers (ms) | same | re-timed together, ms |",
            "| --- | --- | --- | --- | --- |",
        ]
        for key in keys:
            tag = json.dumps(key, sort_keys=True)
            a, b = runs["1"]["winners"].get(tag), runs["2"]["winners"].get(tag)
            found = data.get("compare", {}).get(tag, {})
            times = found.get("retimed_ms")
            winners = [f"{short(w['config'])} ({fmt_ms(w['ms'])})" if w else "-" for w in (a, b)]
            retimed = " / ".join(fmt_ms(t) for t in times) if times else "-"
            lines.append(
                f"| {key_text(key)} | {winners[0]} | {winners[1]} | {found.get('same_config', '-')} | {retimed} |"
            )
        lines.append("")
    d = data.get("disturbance")
    if d and d["common_configs"]:
        lines += [
            f"Configs measured in both runs: {d['common_configs']}. Time with two workers over time with one: median "
            f"{d['median']:.3f}, min {d['min']:.3f}, max {d['max']:.3f} (above 1: slower with two; run-to-run "
            "noise included).",
            "",
        ]
    return lines

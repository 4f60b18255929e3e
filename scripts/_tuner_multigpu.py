"""The ``multigpu`` part of ``scripts/bench_tuner.py``: one GPU against all of them, one worker per GPU.

The same tune twice, each time the real ``tune`` command in a subprocess (what users run, start-up
included), from an empty config DB and an empty Triton cache: first ``tune --device 0``, then
``tune --device all`` (one worker process per visible GPU over one set of shared studies, kept in
an Optuna journal file in the work folder so the trials each worker measured can be read back).
Both runs get the same kernels (``--multigpu-kernels``), keys (``--multigpu-head-dim`` and
``--multigpu-lkv``, which both attention kernels accept, so one command tunes them all) and trials
per key (``--multigpu-trials``). While each runs, a thread of this process samples every visible
GPU's NVML utilization every ``--sample-interval`` seconds: the sign that all GPUs worked, not
just that the wall time fell. Afterwards each key's two winners are re-timed together on GPU 0
in interleaved rounds, and must be the same config or lie within ``--tolerance``.

On two H200s the default (D 128, Lkv 16K: four prefill keys at Lq 512..4096 and four decode keys
at B 1/4/16/64, 28 trials each; about 1 s a prefill trial and 0.6 s a decode trial there) comes to
roughly 180 s of tuning on one GPU, so both runs and the re-timing fit in about eight minutes. Less
work would not do: start-up (Python, CUDA, the worker processes) does not shrink with more GPUs,
and at 150 s of tuning it alone would keep the speed-up under 1.8x.

In smoke mode ``tune --device cpu`` and ``tune --device cpu --workers 2`` (the interpreter's
stand-in for two GPUs) run at tiny keys: that proves the script, not the speed-up, and NVML is
reported as unavailable where there is none.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _tuner_common import (
    Context,
    Record,
    cell,
    check,
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
from _tuner_workers import cold_triton_cache, study_facts

from tritune.configs_db.records import key_text

TITLE = "One GPU or all of them, one worker per GPU over shared studies"
#: The ``tune`` CLI through this interpreter (the console script may not be on PATH after an editable install).
TUNE_PY = 'import sys; from tritune.tuner.cli import main; sys.argv[0] = "tune"; main()'
#: Utilization (percent) above which a sample counts as busy in the report.
BUSY_PERCENT = 50
#: A GPU counts as busy in the multi-GPU run if its mean utilization reaches this share of GPU 0's
#: mean in the one-GPU run: both runs pay the same compile gaps and start-up, so the one-GPU run is the
#: fair yardstick for "as busy as a GPU that tunes alone".
BUSY_SHARE = 0.5
#: Seconds kept back, after both tunes, for re-timing the winners (smoke, GPU).
RETIME_RESERVE_S = {True: 40.0, False: 75.0}
#: Lines of each tune's output kept in the findings.
TAIL_LINES = 40


def run(ctx: Context, record: Record) -> None:
    import torch

    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec

    args = ctx.args
    info = device_info(ctx.torch_device)
    specs = [get_spec(name) for name in args.multigpu_kernels]
    plan = [(spec, key) for spec in specs for key in keys_of(spec, info, **key_options(ctx))]
    gpus = 0 if ctx.smoke else torch.cuda.device_count()
    data = record.data
    data.update(
        kernels=[spec.name for spec in specs],
        keys=[{"kernel": spec.name, "key": key.to_dict()} for spec, key in plan],
        trials=args.multigpu_trials,
        gpus_visible=gpus,
        interval_s=args.sample_interval,
        runs={},
    )
    runs = {"one": ["--device", "cpu"] if ctx.smoke else ["--device", "0"]}
    runs["all"] = ["--device", "cpu", "--workers", "2"] if ctx.smoke else ["--device", "all"]
    for index, (label, device_args) in enumerate(runs.items()):
        run_dir = ctx.work / f"multigpu-{label}"
        run_dir.mkdir(parents=True, exist_ok=True)
        url = fresh_sqlite(run_dir / "configs.sqlite")
        journal = run_dir / "studies.log"
        journal.unlink(missing_ok=True)
        command = [*device_args, *tune_arguments(ctx, data["kernels"]), "--db", url]
        if label == "all":
            # The journal `tune` would keep in a temporary folder, here where the trials per worker can be read.
            command += ["--storage", str(journal)]
        # The one-GPU run gets 2/3 of what is left before the re-timing reserve (it should need 2x the other).
        usable = ctx.left() - RETIME_RESERVE_S[ctx.smoke]
        limit = usable * (2 / 3 if index == 0 else 1.0)
        result = tune_run(ctx, run_dir, command, limit)
        result["workers"] = 1 if label == "one" else (2 if ctx.smoke else gpus)
        result.update(db_facts(ctx, info, specs, url))
        if label == "all" and journal.exists():
            from tritune.tuner.studies import StudyStorage

            result.update(study_facts(StudyStorage(str(journal)), study_names(info, plan), {}))
        data["runs"][label] = result
        record.save()
    data["checks"] = compare(ctx, plan, data)
    record.save()


def key_options(ctx: Context) -> dict[str, Any]:
    """The key fields of both runs: the CLI's ``--head-dim`` and ``--lkv``, valid for either kernel."""
    return {"head_dim": [ctx.args.multigpu_head_dim], "lkv": list(ctx.args.multigpu_lkv)}


def tune_arguments(ctx: Context, kernels: list[str]) -> list[str]:
    """What both runs pass to ``tune`` after ``--device``: kernels, keys, trials, trial timeout."""
    arguments: list[str] = []
    for name in kernels:
        arguments += ["--kernel", name]
    arguments += ["--head-dim", str(ctx.args.multigpu_head_dim)]
    for length in ctx.args.multigpu_lkv:
        arguments += ["--lkv", str(length)]
    return [*arguments, "--trials", str(ctx.args.multigpu_trials), "--trial-timeout", f"{ctx.args.trial_timeout:g}"]


def study_names(info: Any, plan: list[tuple[Any, Any]]) -> list[str]:
    import triton

    from tritune.tuner.studies import study_name

    return [study_name(spec.name, spec.version, info.slug, triton.__version__, key.to_dict()) for spec, key in plan]


def tune_run(ctx: Context, run_dir: Path, command: list[str], limit: float) -> dict[str, Any]:
    """Run ``tune COMMAND`` for at most ``limit`` seconds with NVML sampled; wall time, exit and output tail."""
    shown = "tune " + " ".join(command)
    log.info("multigpu: %s (limit %.0f s)", shown, limit)
    output = run_dir / "tune.log"
    timed_out = False
    # A cold Triton cache per run, as for a new user (set in os.environ: read after entering). Also in
    # smoke mode, where the interpreter hardly uses it, so that the CPU test sees it reach the tune.
    with cold_triton_cache(run_dir / "triton-cache", False), output.open("w") as sink:
        # Wide enough that rich does not wrap the "done in" line.
        env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        sampler = UtilizationSampler(ctx.args.sample_interval)
        with sampler:
            started = time.monotonic()
            # Same process group as this part: if the parent stops the part, the tune goes with it.
            child = subprocess.Popen(
                [sys.executable, "-c", TUNE_PY, *command], stdout=sink, stderr=subprocess.STDOUT, env=env
            )
            try:
                exit_code = child.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                timed_out = True
                stop(child)
                exit_code = child.returncode
            wall = time.monotonic() - started
    lines = output.read_text(errors="replace").splitlines()
    done = [float(m.group(1)) for m in map(re.compile(r"done in ([0-9.]+) s").search, lines) if m]
    log.info("multigpu: exit %s after %.1f s%s", exit_code, wall, " (TIMED OUT)" if timed_out else "")
    return {
        "command": shown,
        "wall_s": wall,
        "tune_done_s": done[-1] if done else None,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "limit_s": limit,
        "triton_cache": env.get("TRITON_CACHE_DIR"),
        "utilization": sampler.summary(),
        "tail": lines[-TAIL_LINES:],
    }


def stop(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; ``tune``'s worker processes exit by themselves when it is gone."""
    child.terminate()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def db_facts(ctx: Context, info: Any, specs: list[Any], url: str) -> dict[str, Any]:
    """Per key of the run's config DB: the winner, and the configs measured (ok and failed)."""
    from tritune.configs_db.store import ConfigStore
    from tritune.tuner.study import environment_id

    winners: dict[str, Any] = {}
    configs: dict[str, dict[str, int]] = {}
    with ConfigStore(url) as store:
        # Every GPU of a model shares one environment (GPU model, driver, versions), as the workers stored it.
        env = environment_id(store, info)
        for spec in specs:
            for w in store.winners(kernel=spec.name):
                winners[tag(spec.name, w.key)] = {"config": w.config, "ms": w.time_ms}
            for row in store.study_trials(env, spec.name, spec.version):
                counts = configs.setdefault(tag(spec.name, row.key), {})
                status = "ok" if row.status == "ok" else "failed"
                counts[status] = counts.get(status, 0) + 1
    return {"winners": winners, "configs": configs}


def tag(kernel: str, key: dict[str, Any]) -> str:
    """One key of one kernel as a JSON-safe dictionary key."""
    return f"{kernel} {json.dumps(key, sort_keys=True)}"


class UtilizationSampler:
    """Every visible GPU's NVML utilization, read every ``interval_s`` by a thread while a tune runs.

    The tune runs in other processes; NVML sees every process's kernels, so the sampler lives here
    and touches no GPU. When NVML cannot be opened (no driver, the CPU smoke run) the summary says
    why and the run goes on without it.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.error: str | None = None
        self.gpus: list[dict[str, Any]] = []
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._values: list[list[int]] = []
        self._failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilizationSampler:
        try:
            self._open()
        except Exception as exc:
            self.error = " ".join(f"{type(exc).__name__}: {exc}".split())
            log.info("multigpu: NVML unavailable (%s): no utilization samples", self.error)
            return self
        self._thread = threading.Thread(target=self._sample, name="nvml-utilization", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()

    def _open(self) -> None:
        import pynvml
        import torch

        from tritune.kernels.device import _nvml_index

        pynvml.nvmlInit()
        self._nvml = pynvml
        # CUDA ordinals through CUDA_VISIBLE_DEVICES, as `tune --device all` numbers its workers.
        if torch.cuda.is_available():
            targets: list[tuple[str, int | str]] = [
                (f"cuda:{i}", _nvml_index(i)) for i in range(torch.cuda.device_count())
            ]
        else:
            targets = [(f"nvml:{i}", i) for i in range(pynvml.nvmlDeviceGetCount())]
        for label, target in targets:
            if isinstance(target, int):
                handle = pynvml.nvmlDeviceGetHandleByIndex(target)
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(target)
            name = pynvml.nvmlDeviceGetName(handle)
            self._handles.append(handle)
            self.gpus.append({"gpu": label, "name": name.decode() if isinstance(name, bytes) else str(name)})
        self._values = [[] for _ in self._handles]

    def _sample(self) -> None:
        while True:
            for handle, values in zip(self._handles, self._values, strict=True):
                try:
                    values.append(int(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                except Exception:
                    self._failures += 1
            if self._stop.wait(self.interval_s):
                return

    def summary(self) -> dict[str, Any]:
        """Per GPU: samples, mean, median, the share above :data:`BUSY_PERCENT`, and the samples themselves."""
        if self.error is not None:
            return {"available": False, "error": self.error}
        gpus = []
        for gpu, values in zip(self.gpus, self._values, strict=True):
            gpus.append(
                {
                    **gpu,
                    "samples": len(values),
                    "mean": statistics.fmean(values) if values else None,
                    "median": statistics.median(values) if values else None,
                    "busy_share": sum(v > BUSY_PERCENT for v in values) / len(values) if values else None,
                    "values": values,
                }
            )
        return {"available": True, "gpus": gpus, "read_failures": self._failures}


# ---- the checks ----------------------------------------------------------------------------------------


def compare(ctx: Context, plan: list[tuple[Any, Any]], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every verdict of the part; the two winners of each differing key re-timed together on GPU 0."""
    from tritune.tuner.timing import timer_for

    runs = data["runs"]
    one, every = runs.get("one"), runs.get("all")
    if ctx.smoke:
        checks = [check("two or more GPUs visible", None, "smoke: two interpreter workers stand in for two GPUs")]
    else:
        gpus = data["gpus_visible"]
        checks = [check("two or more GPUs visible", gpus >= 2, f"{gpus} visible")]
    if one is None or every is None:
        return [*checks, check("both runs completed", False, "a run is missing")]
    tags = [tag(spec.name, key.to_dict()) for spec, key in plan]
    for label, result in (("one GPU", one), ("all GPUs", every)):
        found = sum(t in result["winners"] for t in tags)
        checks.append(
            check(
                f"{label}: tune exited 0 with a winner at every key",
                result["exit_code"] == 0 and found == len(tags),
                f"exit {result['exit_code']}{' (timed out)' if result['timed_out'] else ''}, "
                f"{found} of {len(tags)} winners",
            )
        )
    checks.append(work_check(one, every, tags))
    speedup = one["wall_s"] / every["wall_s"] if every["wall_s"] > 0 else None
    data["speedup"] = speedup
    detail = f"{one['wall_s']:.1f} s / {every['wall_s']:.1f} s = {speedup or 0:.2f}x"
    judged = None if ctx.smoke else (speedup is not None and speedup >= ctx.args.min_speedup)
    checks.append(check(f"wall time with all GPUs at least {ctx.args.min_speedup:g}x faster", judged, detail))
    checks.append(busy_check(one["utilization"], every["utilization"]))
    checks += winner_checks(ctx, plan, data, timer_for(ctx.torch_device))
    return checks


def work_check(one: dict[str, Any], every: dict[str, Any], tags: list[str]) -> dict[str, Any]:
    """The multi-GPU run measured no fewer configs at any key: its speed-up was not bought with less work.

    It may measure a few more: workers read a study's budget and then ask, so two that look at once
    can both take its last slots (up to a batch each).
    """
    counts = {t: (sum(one["configs"].get(t, {}).values()), sum(every["configs"].get(t, {}).values())) for t in tags}
    fewer = [t for t, (a, b) in counts.items() if b < a]
    differ = [
        f"{t.split(' ', 1)[0]} {key_text(json.loads(t.split(' ', 1)[1]))}: {a} vs {b}"
        for t, (a, b) in counts.items()
        if a != b
    ]
    detail = f"{sum(a for a, _ in counts.values())} configs with one GPU, {sum(b for _, b in counts.values())} with all"
    if differ:
        detail += "; differing: " + "; ".join(differ)
    return check("no key measured fewer configs with all GPUs", not fewer, detail)


def busy_check(one: dict[str, Any], every: dict[str, Any]) -> dict[str, Any]:
    """Every GPU at least :data:`BUSY_SHARE` as busy in the multi-GPU run as GPU 0 tuning alone."""
    name = f"every GPU busy in the multi-GPU run (mean utilization >= {BUSY_SHARE:.0%} of GPU 0's alone)"
    if not every.get("available") or not one.get("available"):
        return check(name, None, f"NVML unavailable: {every.get('error') or one.get('error')}")
    alone = one["gpus"][0]["mean"] if one["gpus"] else None
    means = {g["gpu"]: g["mean"] for g in every["gpus"]}
    if alone is None or not means or any(m is None for m in means.values()):
        return check(name, False, "no samples")
    detail = f"GPU 0 alone {alone:.0f}%; all GPUs: " + ", ".join(f"{g} {m:.0f}%" for g, m in means.items())
    return check(name, len(means) >= 2 and all(m >= BUSY_SHARE * alone for m in means.values()), detail)


def winner_checks(ctx: Context, plan: list[tuple[Any, Any]], data: dict[str, Any], timer: Any) -> list[dict[str, Any]]:
    """Per key: the same winner in both runs, or the two within ``--tolerance`` when re-timed together."""
    one, every = data["runs"]["one"], data["runs"]["all"]
    checks = []
    data["compare"] = {}
    # The one-GPU run's Triton cache: its winners need no compiling; one bench process for every key.
    with contextlib.ExitStack() as stack:
        worker = None
        for spec, key in plan:
            t = tag(spec.name, key.to_dict())
            name = f"{spec.name} {key_text(key.to_dict())}: winners agree"
            a, b = one["winners"].get(t), every["winners"].get(t)
            if a is None or b is None:
                checks.append(check(name, False, "a winner is missing"))
                continue
            if a["config"] == b["config"]:
                data["compare"][t] = {"same_config": True, "retimed_ms": None}
                checks.append(check(name, True, "identical configs"))
                continue
            if ctx.left() < 10:
                checks.append(check(name, False, "no time left to re-time them"))
                continue
            log.info("multigpu: re-timing both winners of %s %s", spec.name, key_text(key.to_dict()))
            if worker is None:
                stack.enter_context(cold_triton_cache(ctx.work / "multigpu-one" / "triton-cache", False))
                worker = stack.enter_context(make_worker(ctx, timer, tune_options(ctx)))
            times = retime(worker, ctx, spec, key, [a["config"], b["config"]])
            data["compare"][t] = {"same_config": False, "retimed_ms": times}
            checks.append(ratio_check(ctx, f"{name} within {ctx.args.tolerance:.0%}", times, False))
    return checks


# ---- the report ----------------------------------------------------------------------------------------


def render(data: dict[str, Any]) -> list[str]:
    keys = data.get("keys", [])
    runs = data.get("runs", {})
    lines = [
        f"Kernels {', '.join(f'`{k}`' for k in data.get('kernels', []))}, {len(keys)} key(s), "
        f"{data.get('trials')} trials per key in both runs; {data.get('gpus_visible')} GPU(s) visible. Each run is "
        "the `tune` command in a subprocess from an empty config DB and Triton cache, timed from its start to its "
        "exit (the tune's own `done in` leaves out Python and CUDA start-up).",
        "",
        "| run | command | workers | wall s | tune's own s | exit |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, result in runs.items():
        exit_text = f"{result['exit_code']}" + (" (timed out)" if result["timed_out"] else "")
        lines.append(
            f"| {label} | `{cell(result['command'], 400)}` | {result['workers']} | {result['wall_s']:.1f} | "
            f"{fmt_ms(result['tune_done_s'])} | {exit_text} |"
        )
    lines.append("")
    if data.get("speedup") is not None:
        lines += [f"Speed-up of all GPUs over one: **{data['speedup']:.2f}x**.", ""]
    lines += render_utilization(runs, data.get("interval_s"))
    measured = runs.get("all", {}).get("measured_by")
    if measured:
        other = runs["all"].get("other_outcomes", {})
        lines += [
            "Configs each worker measured in the multi-GPU run (from the shared journal): "
            + "; ".join(f"`{w}` {n}" for w, n in sorted(measured.items()))
            + (". Other outcomes: " + "; ".join(f"`{w}` {c}" for w, c in sorted(other.items())) if other else "")
            + ".",
            "",
        ]
    if "one" in runs and "all" in runs:
        lines += render_winners(keys, runs, data.get("compare", {}))
    for label, result in runs.items():
        if result["exit_code"] != 0 or result["timed_out"]:
            lines += [f"Last lines of the {label} run's output:", "", "```", *result["tail"], "```", ""]
    return lines


def render_utilization(runs: dict[str, Any], interval: float | None) -> list[str]:
    lines = [f"GPU utilization (NVML, sampled every {interval} s while each run lasted):", ""]
    rows = []
    for label, result in runs.items():
        util = result["utilization"]
        if not util.get("available"):
            lines += [f"- {label}: NVML unavailable ({cell(util.get('error'), 240)}); no samples.", ""]
            continue
        for g in util["gpus"]:
            mean, median, share = g["mean"], g["median"], g["busy_share"]
            rows.append(
                f"| {label} | {g['gpu']} | {g['name']} | {g['samples']} | "
                f"{'-' if mean is None else f'{mean:.0f}'} | {'-' if median is None else f'{median:.0f}'} | "
                f"{'-' if share is None else f'{share:.0%}'} |"
            )
    if rows:
        lines += [
            f"| run | GPU | name | samples | mean % | median % | samples above {BUSY_PERCENT}% |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    return lines


def render_winners(keys: list[dict[str, Any]], runs: dict[str, Any], compare: dict[str, Any]) -> list[str]:
    lines = [
        "| kernel | key | configs (one / all) | winner, one GPU (ms) | winner, all GPUs (ms) | same | "
        "re-timed together, ms (one / all) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for item in keys:
        t = tag(item["kernel"], item["key"])
        a, b = runs["one"]["winners"].get(t), runs["all"]["winners"].get(t)
        winners = [f"{short(w['config'])} ({fmt_ms(w['ms'])})" if w else "-" for w in (a, b)]
        counts = " / ".join(str(sum(r["configs"].get(t, {}).values())) for r in (runs["one"], runs["all"]))
        found = compare.get(t, {})
        times = found.get("retimed_ms")
        retimed = " / ".join(fmt_ms(v) for v in times) if times else "-"
        lines.append(
            f"| {item['kernel']} | {key_text(item['key'])} | {counts} | {winners[0]} | {winners[1]} | "
            f"{found.get('same_config', '-')} | {retimed} |"
        )
    return [*lines, ""]

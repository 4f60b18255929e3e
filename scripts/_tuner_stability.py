"""The ``stability`` part of ``scripts/bench_tuner.py``: does a tune pick the same speed twice?

One key per kernel, tuned twice with different seeds into two fresh DBs (the seed drives the
sampler and the random problems), every tune in one worker process as ``tune`` runs them. Then
both picks and the portable default are re-timed in interleaved rounds in that same process, on a
third problem: the requirement is that the two picks lie within ``--tolerance`` of each other.
"""

from __future__ import annotations

import time
from typing import Any

from _tuner_common import (
    Context,
    Record,
    captured_warnings,
    check,
    fmt_ms,
    fresh_sqlite,
    keys_of,
    log,
    make_worker,
    ratio_check,
    render_warnings,
    result_dict,
    retime,
    short,
    tune_options,
    verdict_word,
)

from tritune.configs_db.records import key_text

TITLE = "Stability: two seeds, two DBs, the picks re-timed together"
#: The key of each kernel on a GPU, as ``tune --key`` fields or aliases (q4k: N = K = 4096 of its
#: shapes). Cheapest first: a part stopped by its cap keeps the kernels it finished.
KEYS: dict[str, dict[str, Any]] = {
    "splitk_decode": {"head_dim": [128], "batch": [8], "lkv": [32768]},
    "tma_prefill": {"head_dim": [128], "lq": [1024], "lkv": [16384]},
    "q4k_fp8_gemm": {"m": [64]},
    "varlen_sdpa": {"head_dim": [128]},
}
KERNELS = tuple(KEYS)


def stability_key(spec: Any, info: Any, smoke: bool) -> Any:
    """The kernel's key: the one above on a GPU, its first interpreter key in smoke mode."""
    if smoke:
        return spec.default_keys(info)[0]
    keys = keys_of(spec, info, **KEYS[spec.name])
    if spec.name == "q4k_fp8_gemm":
        keys = [k for k in keys if k.n == 4096 and k.k == 4096]
    return keys[0]


def run(ctx: Context, record: Record) -> None:
    from tritune.configs_db.store import ConfigStore
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec
    from tritune.tuner.study import KeyTuner, environment_id
    from tritune.tuner.timing import timer_for

    args = ctx.args
    info = device_info(ctx.torch_device)
    timer = timer_for(ctx.torch_device)
    seeds = list(args.seeds)
    urls = {seed: fresh_sqlite(ctx.work / f"stability-seed{seed}.sqlite") for seed in seeds}
    kernels = args.kernels or list(KERNELS)
    base = tune_options(ctx, trials=args.trials)
    data = record.data
    data.update(seeds=seeds, trials=args.trials, batch=base.batch_size, rounds=args.rounds, tolerance=args.tolerance)
    data["kernels"] = {}
    data["checks"] = []
    warnings: list[str] = []
    data["warnings"] = warnings
    tunes_left = len(kernels) * len(seeds)
    # One worker process for every tune and re-timing: its start-up is paid once, as in `tune`.
    with captured_warnings(warnings), make_worker(ctx, timer, base) as worker:
        for name in kernels:
            spec = get_spec(name)
            key = stability_key(spec, info, ctx.smoke)
            entry: dict[str, Any] = {"key": key.to_dict(), "runs": {}}
            data["kernels"][name] = entry
            for seed in seeds:
                # The time left, shared by the tunes still to run (the last 30 s kept for re-timing).
                # The tuner looks at it between batches, so a tune of a single batch runs to its end.
                budget = max(10.0, (ctx.left() - 30.0) / max(1, tunes_left))
                tunes_left -= 1
                options = tune_options(ctx, trials=args.trials, seed=seed, time_budget_s=budget)
                log.info("stability: %s %s, seed %d (time budget %.0f s)", name, key_text(key.to_dict()), seed, budget)
                started = time.monotonic()
                with ConfigStore(urls[seed]) as store:
                    env = environment_id(store, info)
                    try:
                        result = KeyTuner(
                            spec, key, info, ctx.torch_device, store, env, timer, options, bench=worker
                        ).run()
                    except Exception as exc:
                        entry["runs"][str(seed)] = {"error": f"{type(exc).__name__}: {exc}"}
                        record.save()
                        continue
                entry["runs"][str(seed)] = {**result_dict(result), "wall_s": time.monotonic() - started}
                log.info(
                    "stability: %s seed %d picked %s (%.4g ms) in %.1f s",
                    name,
                    seed,
                    short(result.config),
                    result.best_ms,
                    time.monotonic() - started,
                )
                record.save()
            picks = [entry["runs"][str(s)].get("config") for s in seeds]
            if any(p is None for p in picks):
                entry["check"] = check(f"{name}: both seeds picked a winner", False, "a tune failed")
                data["checks"].append(entry["check"])
                record.save()
                continue
            log.info("stability: %s: both picks and the portable default, %d interleaved rounds", name, args.rounds)
            portable = spec.space.to_dict(spec.default_config(key))
            times = retime(worker, ctx, spec, key, [*picks, portable])
            same = picks[0] == picks[1]
            entry.update(same_config=same, retimed_ms=times)
            name_text = f"{name}: the two picks within {args.tolerance:.0%}"
            entry["check"] = ratio_check(ctx, name_text, None if times is None else times[:2], same)
            data["checks"].append(entry["check"])
            record.save()


def render(data: dict[str, Any]) -> list[str]:
    seeds = data.get("seeds", [])
    lines = [
        f"Each kernel's key tuned twice, seeds {seeds}, into two fresh DBs: {data.get('trials')} trials per tune, "
        f"batch {data.get('batch')}, candidates in one worker process. Then both picks and the portable default "
        f"re-timed in {data.get('rounds')} interleaved rounds in that process (median of the rounds, on a third "
        f"problem). Requirement: the picks within {data.get('tolerance', 0.02):.0%} of each other.",
        "",
    ]
    if (data.get("batch") or 0) >= (data.get("trials") or 1):
        lines += [
            "With a batch as large as the budget, every trial is asked before any is measured: no proposal sees a "
            "result, so each tune is the portable default plus a seeded random sample of the feasible space.",
            "",
        ]
    lines += [
        "| kernel | key | pick, seed A | tune ms | pick, seed B | tune ms | same | re-timed A / B / portable ms "
        "| apart | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, entry in data.get("kernels", {}).items():
        cells = []
        for seed in seeds:
            run = entry["runs"].get(str(seed), {})
            cells += [run.get("error", short(run.get("config"))), fmt_ms(run.get("best_ms"))]
        times = entry.get("retimed_ms")
        retimed = " / ".join(fmt_ms(t) for t in times) if times else "-"
        apart = f"{(max(times[:2]) / min(times[:2]) - 1) * 100:.2f}%" if times else "-"
        verdict = verdict_word(entry.get("check"))
        lines.append(
            f"| {name} | {key_text(entry['key'])} | {' | '.join(cells)} | {entry.get('same_config', '-')} "
            f"| {retimed} | {apart} | {verdict} |"
        )
    lines.append("")
    tunes = [
        f"{name} seed {seed} {run['wall_s']:.0f} s ({run['measured']} measured, {run['failed']} failed, "
        f"{run['pruned']} pruned)"
        for name, entry in data.get("kernels", {}).items()
        for seed, run in entry["runs"].items()
        if "wall_s" in run
    ]
    if tunes:
        lines += ["Tunes: " + "; ".join(tunes) + ".", ""]
    return lines + render_warnings(data.get("warnings", []))

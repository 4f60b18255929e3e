"""The ``fault`` part of ``scripts/bench_tuner.py``: real faults in the crash-isolated worker process.

A tune of ``scripts/_fault_kernel.py`` (six feasible configs, so the sweep is exhaustive) with its
candidates in a worker process, as ``tune`` runs them. One candidate stores to page zero (an
illegal memory access on a GPU, which loses the CUDA context; a SIGSEGV under the interpreter), one
spins until the trial timeout, one writes a wrong result. The tune must record each with its
reason, replace the worker, finish with a well-behaved winner that reproduces the reference outside
the worker, and leave a sound DB that the runtime reads.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _tuner_common import (
    Context,
    Record,
    captured_warnings,
    cell,
    check,
    fmt_ms,
    fresh_sqlite,
    integrity,
    log,
    make_worker,
    on_trial,
    render_warnings,
    result_dict,
    short,
    tune_options,
)

from tritune.configs_db.records import key_text

TITLE = "Fault isolation: real faults in the worker process"


def run(ctx: Context, record: Record) -> None:
    import _fault_kernel

    from tritune.configs_db.store import ConfigStore, read_winners
    from tritune.kernels.device import device_info
    from tritune.tuner.study import KeyTuner, environment_id
    from tritune.tuner.timing import timer_for

    spec = _fault_kernel.SPEC
    info = device_info(ctx.torch_device)
    key = spec.default_keys(info)[0]
    db_path = ctx.work / "fault.sqlite"
    url = fresh_sqlite(db_path)
    timer = timer_for(ctx.torch_device)
    options = tune_options(ctx, trials=12, seed=0)
    feasible = spec.space.feasible(key, spec.limits(info))
    data = record.data
    data.update(
        kernel=spec.name,
        key=key.to_dict(),
        db=str(db_path),
        trial_timeout_s=options.trial_timeout_s,
        batch=options.batch_size,
        feasible=len(feasible),
    )
    record.save()
    log.info(
        "fault: tuning %s %s, %d feasible configs, in a worker process",
        spec.name,
        key_text(key.to_dict()),
        len(feasible),
    )
    warnings: list[str] = []
    started = time.monotonic()
    result = None
    with ConfigStore(url) as store:
        env = environment_id(store, info)
        with captured_warnings(warnings), make_worker(ctx, timer, options) as worker:
            tuner = KeyTuner(
                spec, key, info, ctx.torch_device, store, env, timer, options, on_trial=on_trial, bench=worker
            )
            try:
                result = tuner.run()
            except Exception as exc:
                data["error"] = f"{type(exc).__name__}: {exc}"
            data.update(wall_s=time.monotonic() - started, worker_starts=worker.starts, warnings=warnings)
        rows = store.measured_trials(env, spec.name, spec.version, key.to_dict())
        data["trials"] = [{"config": r.config, "status": r.status, "ms": r.time_ms, "error": r.error} for r in rows]
        data["stored_winners"] = [w.config for w in store.winners(gpu=info.slug, kernel=spec.name)]
    if result is not None:
        data["result"] = result_dict(result)
    record.save()

    data["db_check"] = {
        "integrity_check": integrity(db_path),
        "runtime_winners": len(read_winners(url, info.slug)),
    }
    stored = data["stored_winners"]
    data["replay"] = replay(spec, key, stored[0] if stored else None, ctx.torch_device)
    data["checks"] = checks(ctx, data)
    record.save()


def replay(spec: Any, key: Any, config: dict[str, Any] | None, device: torch.device) -> str | None:
    """Launch the stored winner in this process, on a problem it was never timed on: ``None`` if it is right."""
    if config is None:
        return "no winner stored"
    parsed = spec.space.parse(config)
    problem = spec.make_problem(key, device, seed=1234)
    out = spec.launch(parsed, *problem.args, **problem.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    problem_text: str | None = spec.check(out, spec.reference(*problem.args, **problem.kwargs), problem, parsed)
    return problem_text


def checks(ctx: Context, data: dict[str, Any]) -> list[dict[str, Any]]:
    by_action: dict[str, list[dict[str, Any]]] = {}
    for row in data["trials"]:
        by_action.setdefault(row["config"]["ACTION"], []).append(row)

    def one(action: str) -> dict[str, Any]:
        rows = by_action.get(action, [])
        return rows[0] if len(rows) == 1 else {"status": f"{len(rows)} trials", "error": None}

    oob, hang, wrong = one("oob"), one("hang"), one("wrong")
    oob_error, hang_error = oob["error"] or "", hang["error"] or ""
    if ctx.smoke:
        oob_name = "store to page zero: failed-runtime, the worker died of SIGSEGV (the interpreter writes the host)"
        oob_ok = oob["status"] == "failed-runtime" and "SIGSEGV" in oob_error
    else:
        oob_name = "store to page zero: failed-runtime with CUDA's illegal memory access"
        oob_ok = oob["status"] == "failed-runtime" and "illegal memory access" in oob_error
    good = [r for r in by_action.get("none", []) if r["status"] == "ok"]
    fastest = min(good, key=lambda r: r["ms"])["config"] if good else None
    winner = data.get("result", {}).get("config")
    stored = data["stored_winners"]
    db = data["db_check"]
    return [
        check(oob_name, oob_ok, f"{oob['status']}: {oob_error}"),
        check(
            "spinning kernel: failed-runtime, killed at the trial timeout",
            hang["status"] == "failed-runtime" and "timed out" in hang_error,
            f"{hang['status']}: {hang_error}",
        ),
        check(
            "wrong output: failed-correctness",
            wrong["status"] == "failed-correctness",
            f"{wrong['status']}: {wrong['error']}",
        ),
        check("every well-behaved config measured", len(good) == 3, f"{len(good)} of 3 ok"),
        check(
            "a fresh worker after each fault (at least 3 worker processes)",
            data["worker_starts"] >= 3,
            f"{data['worker_starts']} worker processes started",
        ),
        check("the study completed", winner is not None, data.get("error", "the tuner returned its result")),
        check(
            "the stored winner is the study's pick, and well-behaved",
            winner is not None and stored == [winner] and winner["ACTION"] == "none",
            f"stored {[short(c) for c in stored]}; fastest ok trial {short(fastest)}",
        ),
        check(
            "the winner, replayed outside the worker on a new problem, matches the reference",
            data["replay"] is None,
            data["replay"] or "matches",
        ),
        check("SQLite integrity_check", db["integrity_check"] == ["ok"], ", ".join(db["integrity_check"])),
        check("the runtime reader loads the winner", db["runtime_winners"] == 1, f"{db['runtime_winners']} winner(s)"),
    ]


def render(data: dict[str, Any]) -> list[str]:
    lines = [
        f"Kernel `{data.get('kernel')}` (`scripts/_fault_kernel.py`), key {key_text(data.get('key', {}))}, "
        f"{data.get('feasible')} feasible configs swept; candidates in a worker process, trial timeout "
        f"{data.get('trial_timeout_s')} s, batch {data.get('batch')}; DB `{data.get('db')}`.",
        "",
    ]
    if "trials" in data:
        lines += ["| config | status | time ms | error |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {short(row['config'])} | {row['status']} | {fmt_ms(row['ms'])} | {cell(row['error'] or '')} |"
            for row in data["trials"]
        ]
        starts = data.get("worker_starts", 1)
        lines += [
            "",
            f"Worker processes started: {starts} (1 + {starts - 1} restarts); the tune took "
            f"{data.get('wall_s', 0):.1f} s.",
            "",
        ]
    lines += render_warnings(data.get("warnings", []))
    if "result" in data:
        r = data["result"]
        lines += [
            f"Winner: {short(r['config'])} ({fmt_ms(r['best_ms'])} ms; portable {fmt_ms(r['portable_ms'])} ms); "
            f"{r['measured']} measured, {r['failed']} failed, {r['pruned']} pruned. "
            f"Notes: {'; '.join(r['notes']) or 'none'}.",
            "",
        ]
    if "db_check" in data:
        d = data["db_check"]
        lines += [
            f"DB after the tune: integrity_check {d['integrity_check']}; the runtime reader (`read_winners`) "
            f"loads {d['runtime_winners']} winner(s).",
            "",
        ]
    return lines

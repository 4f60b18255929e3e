"""Online tuning measured on one model-like workload: what a user gets from the first run on.

    python scripts/bench_jit.py --device 0 [--out docs/perf/<record>.md] [--work DIR] [--phases ...]
    python scripts/bench_jit.py --smoke          # the CPU dry run (Triton interpreter, tiny shapes)

The workload (``_jit_workload.py``: prefill chunks over long KV caches, decode batches, a varlen
serving step, Q4_K linears at several M) runs in a fresh process per phase, with the shipped
bundles disabled so that nothing tuned elsewhere helps:

- ``online``: ``TRITUNE_JIT=sync`` and an empty DB. Each key's first call tunes it; reported per
  key: the seconds its first call took over its second (the tuning), the trials it measured, and
  its stored speedup over the portable default.
- ``offline``: ``tune`` at each of those keys with its default budget into another empty DB, the
  bundles disabled as online; the online speedup as a fraction of the offline one, and online
  seconds over offline seconds.
- ``provisional``: the workload with the shipped bundle on, under a faked newer Triton version
  string: the dispatcher's log must show provisional winners serving, and how many keys fell back
  to the portable default.
- ``missed``: the workload with default settings and an empty DB, then ``tune --missed``: the keys
  it tunes against the keys the workload called.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _benchlib as bl

from tritune.configs_db.records import key_text

HERE = Path(__file__).resolve().parent
#: The ``tune`` command as this interpreter runs it (the console script's own entry).
TUNE = [sys.executable, "-c", "from tritune.tuner.entry import main; main()"]
PHASES = ("online", "offline", "provisional", "missed")
#: What the faked newer Triton calls itself in the provisional phase.
FAKE_TRITON = "99.0.0"


def _key_id(kernel: str, key: dict[str, Any]) -> str:
    return kernel + " " + " ".join(f"{k}={v}" for k, v in sorted(key.items()) if k not in ("arch", "sm_count"))


def _run_workload(
    work: Path, name: str, env: dict[str, str], device: str, smoke: bool, extra: tuple[str, ...] = ()
) -> tuple[list[dict], str]:
    """One fresh process running the workload under ``env``; its call rows and its log."""
    out = work / f"{name}-calls.json"
    command = [sys.executable, str(HERE / "_jit_workload.py"), "--device", device, "--json", str(out), *extra]
    if smoke:
        command.append("--smoke")
    full_env = {**os.environ, "TRITUNE_LOG_LEVEL": "INFO", **env}
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, cwd=HERE)
    log = done.stdout + done.stderr
    (work / f"{name}.log").write_text(log)
    if done.returncode != 0:
        raise SystemExit(f"{name}: the workload failed (log in {work / (name + '.log')}):\n{log[-3000:]}")
    return json.loads(out.read_text()), log


def _winners(db: Path) -> dict[str, Any]:
    from tritune.configs_db.store import read_winners

    if not db.exists():
        return {}
    return {_key_id(w.kernel, w.key): w for w in read_winners(f"sqlite:///{db}")}


def _tune(device: str, kernel: str, key: dict[str, Any], db: Path, extra: list[str]) -> float:
    """``tune`` at exactly ``key`` (every key field given); its wall seconds."""
    command = [*TUNE, "--device", device, "--kernel", kernel, "--db", str(db)]
    for field, value in key.items():
        if field not in ("arch", "sm_count"):
            command += ["--key", f"{field}={value}"]
    start = time.perf_counter()
    # From nothing, as the online phase tunes: no shipped winner seeds it.
    env = {**os.environ, "TRITUNE_DISABLE_BUNDLES": "1"}
    done = subprocess.run([*command, *extra], capture_output=True, text=True, cwd=HERE, env=env)
    if done.returncode != 0:
        bl.log.warning("tune %s %s failed: %s", kernel, key, (done.stdout + done.stderr)[-600:])
    return time.perf_counter() - start


def online_phase(work: Path, device: str, smoke: bool) -> list[dict[str, Any]]:
    db = work / "online.sqlite"
    db.unlink(missing_ok=True)
    env = {"TRITUNE_JIT": "sync", "TRITUNE_DISABLE_BUNDLES": "1", "TRITUNE_DB": str(db)}
    calls, _ = _run_workload(work, "online", env, device, smoke)
    winners = _winners(db)
    rows = []
    for call in calls:
        winner = winners.get(_key_id(call["kernel"], call["key"]))
        rows.append(
            {
                **call,
                "tune_s": max(0.0, call["first_s"] - call["second_s"]),
                "online_speedup": winner.speedup if winner else None,
                "online_trials": winner.trials if winner else None,
            }
        )
    return rows


def offline_phase(
    work: Path, device: str, rows: list[dict[str, Any]], smoke: bool, extra: list[str], done: Callable[[], Any]
) -> None:
    """``tune`` at each key the online phase met, into an empty DB: ``tune``'s defaults unless ``extra``
    (``--offline-args``) narrows them, four trials in a smoke run. ``done()`` after each key, so a run
    stopped part-way still reports the keys tuned so far."""
    db = work / "offline.sqlite"
    db.unlink(missing_ok=True)
    extra = ["--trials", "4"] if smoke else extra
    for row in rows:
        row["offline_s"] = _tune(device, row["kernel"], row["key"], db, extra)
        winner = _winners(db).get(_key_id(row["kernel"], row["key"]))
        row["offline_speedup"] = winner.speedup if winner else None
        done()


def borrow_offline(rows: list[dict[str, Any]], earlier: Path) -> None:
    """The offline columns of an earlier run's ``rows.json`` at the keys both runs met: an online
    phase re-run after a change to online tuning is compared with the same offline tune."""
    before = {(r["kernel"], json.dumps(r["key"], sort_keys=True)): r for r in json.loads(earlier.read_text())["rows"]}
    for row in rows:
        match = before.get((row["kernel"], json.dumps(row["key"], sort_keys=True)))
        if match is not None:
            row["offline_s"], row["offline_speedup"] = match.get("offline_s"), match.get("offline_speedup")


def provisional_phase(work: Path, device: str, smoke: bool) -> dict[str, Any]:
    env = {"TRITUNE_JIT": "off", "TRITUNE_DB": str(work / "none.sqlite")}
    calls, log = _run_workload(work, "provisional", env, device, smoke, ("--fake-triton-version", FAKE_TRITON))
    lines = log.splitlines()
    return {
        "calls": len(calls),
        "portable_lines": [line for line in lines if "portable default serves" in line],
        "provisional_lines": [line for line in lines if "provisional" in line],
    }


def missed_phase(work: Path, device: str, smoke: bool) -> dict[str, Any]:
    db = work / "missed.sqlite"
    db.unlink(missing_ok=True)
    env = {"TRITUNE_JIT": "off", "TRITUNE_DISABLE_BUNDLES": "1", "TRITUNE_DB": str(db), "TRITUNE_MISS_LOG": "1"}
    calls, _ = _run_workload(work, "missed", env, device, smoke)
    command = [*TUNE, "--device", device, "--missed", "--db", str(db)]
    command += ["--trials", "4"] if smoke else ["--trials", "8"]
    start = time.perf_counter()
    env = {**os.environ, "TRITUNE_DISABLE_BUNDLES": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE, env=env)
    (work / "missed-tune.log").write_text(done.stdout + done.stderr)
    called = {_key_id(c["kernel"], c["key"]) for c in calls}
    tuned = set(_winners(db))
    return {
        "rc": done.returncode,
        "seconds": time.perf_counter() - start,
        "called": sorted(called),
        "tuned": sorted(tuned),
        "equal": called == tuned,
    }


def report(env: dict[str, Any], rows: list[dict[str, Any]], provisional: dict | None, missed: dict | None) -> str:
    lines = [
        "| kernel | call | key | online tune s | trials | online speedup | offline tune s | offline speedup "
        "| online / offline speedup | online / offline s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fractions, time_shares = [], []
    for r in rows:
        online, offline = r.get("online_speedup"), r.get("offline_speedup")
        fraction = online / offline if online and offline else None
        share = r["tune_s"] / r["offline_s"] if r.get("offline_s") else None
        if fraction is not None:
            fractions.append(fraction)
        if share is not None:
            time_shares.append(share)
        key = key_text(r["key"])
        lines.append(
            f"| {r['kernel']} | {r['label']} | {key} | {r['tune_s']:.1f} | {r.get('online_trials') or '-'} "
            f"| {bl.fmt(online, 3)} | {bl.fmt(r.get('offline_s'), 1)} | {bl.fmt(offline, 3)} "
            f"| {bl.fmt(fraction, 3)} | {bl.fmt(share, 3)} |"
        )
    median = statistics.median(fractions) if fractions else None
    share_median = statistics.median(time_shares) if time_shares else None
    notes = [
        f"Online tuning in all: {sum(r['tune_s'] for r in rows):.1f} s over {len(rows)} calls; "
        f"median online/offline speedup {bl.fmt(median, 3)}, median online/offline tuning time "
        f"{bl.fmt(share_median, 3)}.",
    ]
    if provisional is not None:
        notes.append(
            f"Under a faked Triton {FAKE_TRITON}: {len(provisional['provisional_lines'])} provisional log lines, "
            f"{len(provisional['portable_lines'])} keys served by the portable default:"
        )
        notes += [f"    {line}" for line in provisional["provisional_lines"] + provisional["portable_lines"]]
    if missed is not None:
        notes.append(
            f"tune --missed after a default-settings run: rc {missed['rc']}, {missed['seconds']:.0f} s, "
            f"{len(missed['tuned'])} keys tuned, {len(missed['called'])} keys called, equal: {missed['equal']}."
        )
    header = bl.header_markdown(env, "Online tuning on one workload", [])
    return header + "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="0")
    parser.add_argument("--out", default=None, help="markdown file to write the report to")
    parser.add_argument("--work", default="/tmp/tritune-jit", help="folder for the DBs, call rows and logs")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--smoke", action="store_true", help="CPU dry run on the Triton interpreter at tiny shapes")
    parser.add_argument(
        "--offline-args",
        default="",
        help="tune options of the offline phase, e.g. '--time-budget 30' (default: tune's own defaults)",
    )
    parser.add_argument(
        "--offline-from",
        default=None,
        help="an earlier run's rows.json whose offline columns (same GPU, same keys) stand in for the offline phase",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        bl.use_interpreter()
        args.device = "cpu"
    bl.setup_logging()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.device("cpu") if args.smoke else torch.device("cuda", int(args.device))
    env = bl.environment(device, args.smoke)
    rows: list[dict[str, Any]] = []
    provisional: dict[str, Any] | None = None
    missed: dict[str, Any] | None = None

    def save() -> str:
        # After every phase: a run stopped in a later phase still leaves the earlier ones' report.
        state = {"rows": rows, "provisional": provisional, "missed": missed}
        (work / "rows.json").write_text(json.dumps(state, indent=1))
        markdown = report(env, rows, provisional, missed)
        if args.out:
            Path(args.out).write_text(markdown)
        return markdown

    if "online" in args.phases:
        rows = online_phase(work, args.device, args.smoke)
        save()
    if "offline" in args.phases and rows:
        offline_phase(work, args.device, rows, args.smoke, args.offline_args.split(), save)
    elif args.offline_from and rows:
        borrow_offline(rows, Path(args.offline_from))
        save()
    if "provisional" in args.phases:
        provisional = provisional_phase(work, args.device, args.smoke)
        save()
    if "missed" in args.phases:
        missed = missed_phase(work, args.device, args.smoke)
    bl.print_report(save())
    return 0


if __name__ == "__main__":
    sys.exit(main())

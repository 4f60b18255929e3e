"""Measure the tuner itself on a GPU: fault isolation, pick stability, shared-study workers, several GPUs.

From the repository root on a GPU host:

    python scripts/bench_tuner.py --out tuner.md --json tuner.json

Parts (the first three by default, in this order; name some to run only those, ``multigpu`` only when named):

- ``fault``: a tune of a tiny kernel (``scripts/_fault_kernel.py``) in the crash-isolated worker
  process, where one candidate stores to page zero (a real illegal memory access on a GPU: the
  CUDA context is lost; under the interpreter the worker dies of SIGSEGV), one spins forever
  (killed at ``--fault-timeout``) and one computes a wrong result. Reports each trial's status and
  error, the worker restarts, the winner (replayed against the reference here) and the DB's
  ``integrity_check``.
- ``stability``: one key of each kernel (``--kernels``) tuned twice with different seeds into two
  fresh DBs, then both picks and the portable default re-timed in interleaved rounds in one
  process. Check: the picks within ``--tolerance`` (2%) of each other.
- ``workers``: the same tune of ``splitk_decode`` (the ``--workers-lkv`` keys, a fixed trial count
  per key) run by one worker, then by two worker processes on the same GPU sharing the studies in
  an Optuna journal file (``tritune.tuner.fleet.run_fleet``; the CLI refuses two workers on one
  GPU). Reports wall times, the trials each worker measured, whether the winners agree (identical,
  or re-timed within 2%), and how much slower configs timed with two workers ran than with one.
- ``multigpu`` (needs a host with two or more GPUs): ``tune --device 0`` against
  ``tune --device all`` (one worker per GPU, one shared study per key), each the real CLI in a
  subprocess at the same keys and trials (``--multigpu-*``), with every GPU's NVML utilization
  sampled meanwhile. Reports wall times and the speed-up (``--min-speedup``, 1.8x), how busy each
  GPU was, and whether each key's two winners agree (identical, or re-timed within 2%).

Each part runs in a child process under a hard cap (``--fault-cap`` etc., all within ``--budget``,
by default the caps' sum plus 15 s), writes its findings as it goes, and is rendered into one
markdown report (``--out``) and one JSON file (``--json``), rewritten after every part. The exit
status is 1 when a part crashed, timed out or was skipped, else 2 when a check failed, else 0.

``--smoke`` runs the same flow on the CPU (Triton interpreter, tiny keys, few trials): it proves the
script, not the tuner; its times mean nothing and the 2% checks are not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _benchlib as bl
import _tuner_fault
import _tuner_multigpu
import _tuner_stability
import _tuner_workers
from _tuner_common import Context, Record, render_checks

log = logging.getLogger("tritune.bench")

#: Part name -> its module (``TITLE``, ``run(ctx, record)``, ``render(data)``), in the order they run.
PARTS = {
    "fault": _tuner_fault,
    "stability": _tuner_stability,
    "workers": _tuner_workers,
    "multigpu": _tuner_multigpu,
}
#: Parts run when none is named: multigpu needs two GPUs and eight minutes, so it runs only when asked for.
DEFAULT_PARTS = ["fault", "stability", "workers"]

#: Seconds a part's process gets beyond its cap to write its findings before it is killed.
GRACE_S = 15
#: A part with less time than this left is skipped rather than started.
MIN_PART_S = 20
#: Default caps (seconds) on a GPU and in smoke mode.
CAPS = {"fault": (45, 300), "stability": (115, 600), "workers": (65, 300), "multigpu": (450, 240)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "parts", nargs="*", help=f"parts to run, in order: {', '.join(PARTS)} (default: {', '.join(DEFAULT_PARTS)})"
    )
    p.add_argument("--smoke", action="store_true", help="CPU dry run on the Triton interpreter at tiny keys")
    p.add_argument("--out", default=None, help="markdown report to write")
    p.add_argument("--json", default=None, help="JSON findings to write")
    p.add_argument("--work", default=None, help="folder for the DBs and journals (default: a new temporary one)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: the caps' sum + 15)")
    for name, (gpu, smoke) in CAPS.items():
        p.add_argument(
            f"--{name}-cap", type=float, default=None, help=f"seconds for {name} (default {gpu}; {smoke} smoke)"
        )
    p.add_argument(
        "--kernels", action="append", choices=_tuner_stability.KERNELS, help="stability: kernels (default: all)"
    )
    p.add_argument("--trials", type=int, default=None, help="stability: trials per tune (default 16; 3 smoke)")
    p.add_argument("--seeds", type=int, nargs=2, default=(1, 2), help="stability: the two seeds")
    p.add_argument("--rounds", type=int, default=None, help="interleaved re-timing rounds (default 5; 1 smoke)")
    p.add_argument("--retime-seed", type=int, default=100, help="seed of the re-timing problems")
    p.add_argument(
        "--batch", type=int, default=None, help="candidates per batch (default: the tuner's, a quarter of the trials)"
    )
    p.add_argument("--trial-timeout", type=float, default=120.0, help="stability, workers: seconds per trial")
    p.add_argument("--fault-timeout", type=float, default=6.0, help="fault: seconds per trial (ends the spinner)")
    p.add_argument("--workers-lkv", type=int, nargs="+", default=[4096, 32768], help="workers: decode cache lengths")
    p.add_argument("--workers-trials", type=int, default=None, help="workers: trials per key (default 12; 3 smoke)")
    p.add_argument(
        "--multigpu-kernels",
        nargs="+",
        default=["tma_prefill", "splitk_decode"],
        # Both take --head-dim and --lkv, so one tune command narrows the keys of each.
        choices=["tma_prefill", "splitk_decode"],
        help="multigpu: kernels tuned in both runs (default: both)",
    )
    p.add_argument("--multigpu-head-dim", type=int, default=None, help="multigpu: head dim (default 128; 64 smoke)")
    p.add_argument(
        "--multigpu-lkv", type=int, nargs="+", default=None, help="multigpu: KV lengths (default 16384; 64 smoke)"
    )
    p.add_argument("--multigpu-trials", type=int, default=None, help="multigpu: trials per key (default 28; 2 smoke)")
    p.add_argument("--min-speedup", type=float, default=1.8, help="multigpu: required speed-up of all GPUs over one")
    p.add_argument("--sample-interval", type=float, default=0.5, help="multigpu: seconds between NVML samples")
    p.add_argument("--tolerance", type=float, default=0.02, help="how far apart two picks may be (default 0.02)")
    # A part's own process (started by this script).
    p.add_argument("--run-part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-cap", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [name for name in args.parts if name not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    args.parts = args.parts or list(DEFAULT_PARTS)
    args.trials = args.trials or (3 if args.smoke else 16)
    args.rounds = args.rounds or (1 if args.smoke else 5)
    args.workers_trials = args.workers_trials or (3 if args.smoke else 12)
    args.multigpu_head_dim = args.multigpu_head_dim or (64 if args.smoke else 128)
    args.multigpu_lkv = args.multigpu_lkv or ([64] if args.smoke else [16384])
    args.multigpu_trials = args.multigpu_trials or (2 if args.smoke else 28)
    for name, (gpu, smoke) in CAPS.items():
        attr = f"{name}_cap"
        if getattr(args, attr) is None:
            setattr(args, attr, float(smoke if args.smoke else gpu))
    return args


# ---- one part, in its own process --------------------------------------------------------------------


def run_part(args: argparse.Namespace) -> int:
    """The child's side: run one part until done or its cap, recording as it goes."""
    name = args.run_part
    record = Record(Path(args.part_json))
    ctx = Context(smoke=args.smoke, work=Path(args.work), deadline=time.monotonic() + float(args.part_cap), args=args)
    if name == "fault":
        # The fault part's worker kills the spinning candidate at this timeout.
        args.trial_timeout = args.fault_timeout
    try:
        PARTS[name].run(ctx, record)
    except Exception as exc:
        log.exception("%s failed", name)
        record.data["error"] = bl.error_text(exc, limit=2000)
        record.save()
        return 1
    return 0


# ---- the parent: every part under its cap, then the report -------------------------------------------


def spawn_part(args: argparse.Namespace, name: str, cap: float, part_json: Path) -> str:
    """Run part ``name`` in a child process for at most ``cap`` + grace seconds; how it ended."""
    command = [
        sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
        "--work", args.work, "--run-part", name, "--part-json", str(part_json), "--part-cap", f"{cap:.0f}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Its own process group: on timeout the part and every process it started go together.
    child = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        rc = child.wait(timeout=cap + GRACE_S)
    except subprocess.TimeoutExpired:
        log.warning("%s: past its cap of %.0f s (+%d s grace): stopping it", name, cap, GRACE_S)
        stop_group(child)
        return f"timed out after {cap:.0f} s (partial findings below)"
    except BaseException:
        # Ctrl-C does not reach a process group of its own: take it down with us.
        stop_group(child)
        raise
    return "completed" if rc == 0 else f"crashed with exit status {rc} (partial findings below)"


def stop_group(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the part's process group, SIGKILL 10 s later if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def read_part(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data


def verdict(status: str, data: dict[str, Any]) -> str:
    if status != "completed":
        return "incomplete"
    checks = data.get("checks", [])
    if not checks:
        return "incomplete"
    if any(c["passed"] is False for c in checks):
        return "FAIL"
    return "pass" if any(c["passed"] for c in checks) else "not judged"


def report(env: dict[str, Any], args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    if args.smoke:
        mode = "Smoke mode: the Triton interpreter on the CPU, tiny keys; times mean nothing, 2% checks not judged."
    else:
        mode = f"Picks and winners must lie within {args.tolerance:.0%} of each other."
    summary = "; ".join(f"{name} {r['verdict']} ({r['status']}, {r['wall_s']:.0f} s)" for name, r in results.items())
    notes = [f"{env['cpus']} usable CPUs; work folder (DBs, journals): `{args.work}`.", mode, f"Summary: {summary}."]
    text = bl.header_markdown(env, f"Tuner checks: {', '.join(args.parts)}", notes)
    for name, result in results.items():
        data = result["data"]
        lines = [
            f"## {PARTS[name].TITLE}",
            "",
            f"Status: {result['status']}; verdict: **{result['verdict']}**; "
            f"{result['wall_s']:.0f} s of a {result['cap']:.0f} s cap.",
            "",
        ]
        if data.get("error"):
            lines += [f"Error: `{data['error']}`", ""]
        if data:
            lines += PARTS[name].render(data) + render_checks(data.get("checks", []))
        text += "\n".join(lines) + "\n"
    return text


def main() -> int:
    args = parse_args(sys.argv[1:])
    bl.setup_logging()
    if args.smoke:
        # Before any kernel module is imported; the parts' processes inherit the switch.
        bl.use_interpreter()
    # Alembic narrates every schema upgrade at INFO: one per fresh DB here.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if args.run_part is not None:
        return run_part(args)
    args.work = args.work or tempfile.mkdtemp(prefix="tritune-tuner-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    device = bl.bench_device(args.smoke)
    env = bl.environment(device, args.smoke)
    env["cpus"] = len(os.sched_getaffinity(0))
    caps = {name: getattr(args, f"{name}_cap") for name in args.parts}
    budget = args.budget if args.budget is not None else sum(caps.values()) + GRACE_S
    deadline = time.monotonic() + budget
    log.info("tuner checks: parts %s, budget %.0f s, work folder %s", ", ".join(args.parts), budget, args.work)
    results: dict[str, dict[str, Any]] = {}
    for name in args.parts:
        cap = min(caps[name], deadline - time.monotonic() - GRACE_S)
        part_json = Path(args.work) / f"part-{name}.json"
        part_json.unlink(missing_ok=True)
        started = time.monotonic()
        if cap < MIN_PART_S:
            status = f"skipped: {max(0.0, cap):.0f} s left of the budget"
            log.warning("%s %s", name, status)
        else:
            log.info("== %s (cap %.0f s)", name, cap)
            status = spawn_part(args, name, cap, part_json)
        data = read_part(part_json)
        results[name] = {
            "status": status,
            "verdict": verdict(status, data),
            "cap": max(0.0, cap),
            "wall_s": time.monotonic() - started,
            "data": data,
        }
        log.info("== %s: %s, %s in %.0f s", name, status, results[name]["verdict"], results[name]["wall_s"])
        # The findings first: a report that fails to render must not lose them.
        if args.json:
            Path(args.json).write_text(json.dumps({"environment": env, "parts": results}, indent=1, default=str) + "\n")
        markdown = report(env, args, results)
        bl.write_report(markdown, env, [], args.out, None)
    bl.print_report(markdown)
    if any(r["verdict"] == "incomplete" for r in results.values()):
        return 1
    return 2 if any(r["verdict"] == "FAIL" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure many configs of one tuning key the way the tuner does, to see what its sampling missed.

On the GPU machine:

    python scripts/sweep_configs.py --kernel q4k_fp8_gemm \
        --key '{"dtype": "bfloat16", "m_bucket": 16, "n": 14336, "k": 4096}' \
        --where path=portable --limit 120 --out sweep.md --json sweep.json

The key's GPU fields (arch, SM count) come from ``--device``. Every feasible config of the space that
matches the ``--where`` filters is a candidate; beyond ``--limit`` a seeded random sample of them (the
portable default always included). Candidates compile in parallel threads, then each goes through the
tuner's own bench (``tritune.tuner.candidates.CandidateBench``): the correctness check against the
reference, the cross-check against the portable output, and the tuner's timer (graph replays for
launch-bound keys, L2 flushed where the spec says so). Nothing is written to a DB: this is a probe
of the space, not a tune. The table lists every candidate, fastest first, with its speedup over the
portable default.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import _benchlib as bl
import torch

log = logging.getLogger("tritune.sweep")
#: Stands for a field a config's path does not have.
_ABSENT = object()


def _parse_where(items: list[str], space) -> dict[str, Any]:
    """``name=value`` filters, values read against the field's declared choices (never evaluated)."""
    wanted: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in space.dimensions:
            raise SystemExit(f"--where {item!r}: expected name=value with a field of {sorted(space.dimensions)}")
        matches = [v for v in space.dimensions[name] if str(v) == text]
        if not matches:
            raise SystemExit(f"--where {item!r}: {name} takes one of {space.dimensions[name]}")
        wanted[name] = matches[0]
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--key", required=True, help="the key's non-device fields as JSON")
    parser.add_argument("--where", action="append", default=[], help="name=value filter (repeatable)")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="0")
    parser.add_argument("--compile-workers", type=int, default=12)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    from tritune.kernels import registry
    from tritune.kernels.device import device_info
    from tritune.tuner.candidates import OK, CandidateBench
    from tritune.tuner.timing import timer_for

    spec = registry.get_spec(args.kernel)
    device = torch.device(f"cuda:{args.device}" if args.device.isdigit() else args.device)
    info = device_info(device)
    key = spec.key_type.from_dict({"arch": info.arch, "sm_count": info.sm_count, **json.loads(args.key)})
    limits = spec.limits(info)
    wanted = _parse_where(args.where, spec.space)
    default = spec.default_config(key)
    # A config of a path without a filtered field (spaces of paths) does not match it.
    feasible = [
        c
        for c in spec.space.feasible(key, limits)
        if all(getattr(c, name, _ABSENT) == value for name, value in wanted.items())
    ]
    sample = feasible if len(feasible) <= args.limit else random.Random(args.seed).sample(feasible, args.limit)
    candidates = [default, *(c for c in sample if c != default)]
    log.info("%s %s: %d feasible match, %d candidates", spec.name, key, len(feasible), len(candidates))

    started = time.monotonic()
    bench = CandidateBench(
        spec, key, device, args.seed, default, timer_for(device), compile_workers=args.compile_workers
    )
    plain = [spec.space.to_dict(c) for c in candidates]
    compiled = bench.precompile(plain)
    log.info("compiled %d in %.0f s", len(plain), time.monotonic() - started)
    rows: list[dict[str, Any]] = []
    for values, failure in zip(plain, compiled, strict=True):
        result = failure if failure is not None else bench.trial(values, compiled=True)
        rows.append({"config": values, "status": result["status"], "ms": result["ms"], "error": result["error"]})
        log.info("%s %s %s", result["status"], bl.fmt(result["ms"], 4), values)
    base_ms = rows[0]["ms"]
    ok = sorted((r for r in rows if r["status"] == OK), key=lambda r: r["ms"])
    failed = [r for r in rows if r["status"] != OK]
    env = bl.environment(device, smoke=device.type != "cuda")
    lines = [
        bl.header_markdown(env, f"Config sweep: {spec.name}", []).rstrip("\n"),
        "",
        f"Key: `{json.dumps(key.to_dict(), sort_keys=True)}`; filters {wanted or 'none'}; {len(feasible)} feasible "
        f"configs match, {len(candidates)} measured (portable default first, then a seeded sample). Times: the "
        "tuner's timer (median, ms). Speedup: portable default / config.",
        "",
        "| rank | ms | speedup | config |",
        "| --- | --- | --- | --- |",
    ]
    for rank, row in enumerate(ok, 1):
        ratio = f"{base_ms / row['ms']:.2f}x" if base_ms else "-"
        text = " ".join(f"{k}={v}" for k, v in row["config"].items())
        marker = " (portable default)" if row is rows[0] else ""
        lines.append(f"| {rank} | {row['ms']:.4f} | {ratio} | {text}{marker} |")
    if failed:
        lines += ["", f"{len(failed)} failed:", ""]
        lines += [f"- {r['status']}: {r['config']}: {(r['error'] or '')[:160]}" for r in failed]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "key": key.to_dict(), "rows": rows}, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

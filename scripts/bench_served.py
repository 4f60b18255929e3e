"""The served config against the portable default at every default key, as JSON, and two runs compared.

    python scripts/bench_served.py --device 0 --json served.json [--kernel K ...] [--db URL]
    python scripts/bench_served.py --compare before.json after.json [--out docs/perf/<record>.md]

The first form times, for each default key of each kernel, the portable default, the config the
dispatcher serves there (the shipped bundle, then the DB) and the kernel's peer (the PyTorch call a
user would make instead), with the tuner's own timer (medians, L2 flushed; graph replays where the
kernel's problem says so), and writes one JSON row per key.
The second joins two such files by (kernel, key) and prints a markdown table with each key's
served time before and after and their ratio, flagging every key whose served time moved by more
than ``--tolerance`` (3% by default): how a refactor or a re-tune is shown to keep what was served.
It uses only the kernels' spec interface, so it runs against older checkouts as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import platform
import sys
from pathlib import Path
from typing import Any

from tritune.configs_db.records import key_text

log = logging.getLogger("bench_served")


def measure(device_name: str, kernels: list[str], db: str | None, seed: int) -> dict[str, Any]:
    import torch
    import triton

    from tritune.kernels import settings
    from tritune.kernels.device import device_info
    from tritune.kernels.dispatcher import DISPATCHER
    from tritune.kernels.registry import get_spec, kernel_names
    from tritune.tuner.timing import timer_for

    device = torch.device("cuda", int(device_name)) if device_name != "cpu" else torch.device("cpu")
    info = device_info(device)
    timer = timer_for(device)
    rows = []
    overrides = {"db_url": db} if db else {}
    with settings.override(**overrides):
        for name in kernels or kernel_names():
            spec = get_spec(name)
            for key in spec.default_keys(info):
                problem = spec.make_problem(key, device, seed)
                default = spec.default_config(key)
                served = DISPATCHER.select(spec, info, key)
                times = {}
                for label, config in (("portable", default), ("served", served)):
                    # ``prepare`` checks once where a spec has it; older specs time ``launch`` itself.
                    prepare = getattr(spec, "prepare", None)
                    run = (
                        prepare(config, *problem.args, **problem.kwargs)
                        if prepare is not None
                        else functools.partial(spec.launch, config, *problem.args, **problem.kwargs)
                    )
                    times[label] = timer(
                        run, config=config, flush_l2=problem.flush_l2, launch_bound=problem.launch_bound
                    )
                peer_name, peer_ms = _time_peer(spec, key, problem, timer)
                rows.append(
                    {
                        "kernel": name,
                        "version": spec.version,
                        "key": dataclasses.asdict(key),
                        "served": spec.space.to_dict(served),
                        "portable_ms": times["portable"],
                        "served_ms": times["served"],
                        "peer_name": peer_name,
                        "peer_ms": peer_ms,
                    }
                )
                log.info(
                    "%s %s: %.4g ms served, %.4g ms portable, %s ms %s",
                    name,
                    key_text(rows[-1]["key"]),
                    times["served"],
                    times["portable"],
                    "-" if peer_ms is None else f"{peer_ms:.4g}",
                    peer_name or "(no peer)",
                )
    return {
        "device": info.slug,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "rows": rows,
    }


def _time_peer(spec: Any, key: Any, problem: Any, timer: Any) -> tuple[str | None, float | None]:
    """The kernel's peer (the PyTorch call a user would make instead) timed like the configs; ``(None, None)``
    where it names none (or predates peers), and with the name alone where it failed (logged)."""
    make = getattr(spec, "peer", None)
    peer = None
    try:
        peer = make(key, problem) if make is not None else None
        if peer is None:
            return None, None
        ms = timer(peer.fn, config=peer, flush_l2=problem.flush_l2, launch_bound=problem.launch_bound)
    except Exception as exc:
        name = None if peer is None else peer.name
        log.warning("%s %s: the peer %s failed: %s", spec.name, key_text(key), name, exc)
        return name, None
    return peer.name, float(ms)


def compare(before: dict[str, Any], after: dict[str, Any], tolerance: float) -> str:
    def index(run: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(r["kernel"], json.dumps(r["key"], sort_keys=True)): r for r in run["rows"]}

    old, new = index(before), index(after)
    lines = [
        f"Served config per default key, before and after ({after['device']}, torch {after['torch']}, "
        f"Triton {after['triton']}). Ratio: before / after served time (above 1: faster after). "
        "Vs peer: the peer's time after / the served time after (above 1: faster than the peer).",
        "",
        "| kernel | key | before ms | after ms | ratio | served after | peer after | peer ms | vs peer | |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    moved = 0
    for ident in sorted(set(old) | set(new)):
        a, b = old.get(ident), new.get(ident)
        if a is None or b is None:
            row = b or a
            assert row is not None
            lines.append(
                f"| {row['kernel']} | {key_text(row['key'])} | | | | | | | | only in {'after' if b else 'before'} |"
            )
            continue
        ratio = a["served_ms"] / b["served_ms"]
        flag = "moved" if abs(ratio - 1) > tolerance else ""
        moved += bool(flag)
        served = " ".join(f"{k}={v}" for k, v in b["served"].items())
        # Rows written before peers were timed have no peer fields.
        peer_ms = b.get("peer_ms")
        peer = f"{b.get('peer_name') or ''} | {'' if peer_ms is None else f'{peer_ms:.4g}'} | " + (
            "" if peer_ms is None else f"{peer_ms / b['served_ms']:.2f}x"
        )
        lines.append(
            f"| {b['kernel']} | {key_text(b['key'])} | {a['served_ms']:.4g} | {b['served_ms']:.4g} | {ratio:.3f} "
            f"| {served} | {peer} | {flag} |"
        )
    lines += ["", f"{moved} of {len(set(old) & set(new))} keys moved by more than {tolerance:.0%}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="0")
    parser.add_argument("--kernel", action="append", default=[])
    parser.add_argument("--db", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="where to write the measured rows")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--out", type=Path, help="write the comparison table here as well")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        table = compare(before, after, args.tolerance)
        if args.out:
            args.out.write_text(table)
        sys.stdout.write(table)
        return
    result = measure(args.device, args.kernel, args.db, args.seed)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()

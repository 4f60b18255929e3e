"""Benchmark varlen attention over a column store: tritune varlen vs our own kernels and PyTorch peers.

On the GPU machine, after tuning ``varlen_sdpa`` into a DB:

    python scripts/bench_varlen.py --db /tmp/tune.sqlite --out varlen.md --json varlen.json

Hq=32, Hkv=8, D=128, bf16, causal. K and V live in a ``[rows, cols, Hkv, D]`` column store (one
column per sequence, as ``BatchedSequenceCache`` keeps them) sized for the mix's longest context;
the step's queries are packed ``[T, Hq, D]``, decode tokens first, then the prefill chunks. Mixes:

- ``mixed``: 32 sequences with KV lengths drawn from U[1K, 32K]: 28 decode one token, 4 prefill a
  512-token chunk (store of 32K rows);
- ``decode``: 64 sequences decoding one token each, KV lengths drawn from U[4K, 16K] (16K rows).

Implementations, each checked against the fp32 varlen reference before it is timed (a mismatch is
FAILED and never timed): tritune ``varlen_attention`` as the dispatcher serves it (``--db``), its
portable default and the fastest stored trial at the mix's key; a loop calling ``attention`` per
sequence on views of the store; "dedicated": one ``decode_attention`` over all decode sequences in a
padded contiguous batch cache plus one ``prefill_attention`` per chunk over contiguous K/V (the
summary says whether varlen stays within 1.2x of its time); FlexAttention with a document mask over packed KV;
``torch.nn.attention.varlen.varlen_attn`` over the same packed KV. Both peers' packed KV is built
outside the timed region; the gather row times that gather from the store alone. Each is timed
eagerly (the larger of the ``do_bench`` median, L2 flushed, and the host time per call) and as one
captured CUDA graph (``do_bench`` median of its replay).

``--smoke`` runs the same code on the CPU under ``TRITON_INTERPRET=1`` at tiny shapes (no CUDA
graphs; ``varlen_attn`` replaced by an SDPA stand-in over the same packed KV): a dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import _bench_timing as bt
import _benchlib as bl
import torch
from _varlen_workload import (
    ALTERNATIVES,
    DEDICATED,
    DTYPE,
    MIXES,
    SERVED,
    SMOKE_MIXES,
    Impl,
    MixSpec,
    Workload,
    build_workload,
    implementations,
)

log = logging.getLogger("tritune.bench")


@dataclass
class Row(bt.TimedRow):
    mix: str
    kind: str
    kv_bytes: int
    max_err: float | None = None

    def tbps(self, us: float | None) -> float | None:
        return bl.tera_per_s(self.kv_bytes, us)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_arguments(parser)
    parser.add_argument("--mix", choices=sorted(MIXES), action="append", help="mixes to run (default: all)")
    args = parser.parse_args()
    run = bl.start(args)
    mixes = SMOKE_MIXES if args.smoke else MIXES
    names = list(dict.fromkeys(args.mix or ["mixed", "decode"]))
    flex = None if args.skip_flex else bl.compiled_flex()

    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec

    spec = get_spec("varlen_sdpa")
    slug = device_info(run.device).slug
    best_trials = bl.best_trials_by_path(run.db, spec.name, spec.version, slug) if run.db else {}
    rows: list[Row] = []
    with bl.tuned_db(run.db):
        for name in names:
            started = time.perf_counter()
            workload = build_workload(mixes[name], run.device, args.seed)
            log.info("%s: inputs and reference ready in %.1f s", name, time.perf_counter() - started)
            rows.extend(bench_mix(workload, best_trials, flex, run, args.smoke))
            del workload
            log.info("%s: done in %.0f s", name, time.perf_counter() - started)
            bl.write_report(_report(rows, run), run.env, [_json_row(r, rows) for r in rows], args.out, args.json)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
    bl.print_report(_report(rows, run))
    return 0


# ---- checking and timing -------------------------------------------------------------------------


def bench_mix(w: Workload, best_trials: dict, flex: Any, run: bl.BenchRun, smoke: bool) -> list[Row]:
    """Build, check, then time (eager and CUDA graph) every implementation on one mix."""
    rows = []
    for impl in implementations(w, best_trials, flex, smoke):
        row = Row(mix=w.mix.name, impl=impl.name, kind=impl.kind, kv_bytes=w.kv_bytes, note=impl.note)
        # A peer may be missing here; our own kernels raising is a failure.
        raised = "unavailable" if impl.kind in ("peer", "standin") else "FAILED"

        def check(out: torch.Tensor, impl: Impl = impl, row: Row = row) -> str | None:
            return _check(impl, out, w, row)

        def recheck(out: torch.Tensor, impl: Impl = impl) -> str | None:
            return _check(impl, out, w)

        bt.measure(row, impl.fn, check, run.device, run.graphs, error=impl.error, raised=raised, recheck=recheck)
        rows.append(row)
        _log_row(row)
    return rows


def _check(impl: Impl, out: torch.Tensor, w: Workload, row: Row | None = None) -> str | None:
    from tritune.kernels.varlen.reference import compare

    if impl.check is not None:
        return impl.check(out)
    packed = impl.to_packed(out)
    if row is not None and packed.shape == w.expected.shape:
        row.max_err = float((packed.float() - w.expected).abs().max())
    return compare(packed, w.expected, DTYPE)


# ---- the report ----------------------------------------------------------------------------------


def _log_row(r: Row) -> None:
    bl.log_row(f"{r.mix:<6s} {r.impl:<48s}", r, r.tbps, "TB/s", f"err={bl.fmt(r.max_err, 4)}")


@dataclass
class MixTimes:
    """One mix's reference times in one mode (eager or graph)."""

    varlen: float | None
    dedicated: float | None
    fastest_alt: float | None
    fastest_alt_name: str


def _mix_times(rows: list[Row], mix: str, mode: str) -> MixTimes:
    """tritune varlen (served), dedicated and the fastest passing alternative of ``mix`` in ``mode``."""
    attr = f"{mode}_us"
    group = [r for r in rows if r.mix == mix]
    served = next((getattr(r, attr) for r in group if r.impl == SERVED), None)
    dedicated = next((getattr(r, attr) for r in group if r.impl == DEDICATED), None)
    alts = sorted((getattr(r, attr), r.impl) for r in group if r.kind in ALTERNATIVES and getattr(r, attr))
    fastest, name = alts[0] if alts else (None, "")
    return MixTimes(served, dedicated, fastest, name)


def _vs_varlen(r: Row, rows: list[Row], mode: str) -> float | None:
    """tritune varlen's time / this row's, the reference over this as every ratio of the reports (above 1:
    this row is faster than tritune varlen); none for the gather row."""
    us, varlen = getattr(r, f"{mode}_us"), _mix_times(rows, r.mix, mode).varlen
    return varlen / us if us and varlen and r.kind != "info" else None


def _json_row(r: Row, rows: list[Row]) -> dict[str, Any]:
    return {
        **dataclasses.asdict(r),
        "eager_tbps": r.tbps(r.eager_us),
        "graph_tbps": r.tbps(r.graph_us),
        "eager_vs_varlen": _vs_varlen(r, rows, "eager"),
        "graph_vs_varlen": _vs_varlen(r, rows, "graph"),
    }


def _mix_text(mix: MixSpec) -> str:
    text = f"{mix.decodes} decode tokens"
    if mix.chunks:
        text += f" + {mix.chunks} prefill chunks of {mix.chunk}"
    return (
        f"{text}, KV lengths U[{mix.kv_min}, {mix.kv_max}] (one at {mix.kv_max}), store [{mix.kv_max}, "
        f"{mix.sequences + 1}, {mix.kv_heads}, {mix.head_dim}], Hq={mix.q_heads}"
    )


def _summary(rows: list[Row], mix: str) -> list[str]:
    lines = []
    for mode in ("eager", "graph"):
        t = _mix_times(rows, mix, mode)
        if not t.varlen:
            lines.append(f"- {mode}: no passing tritune varlen time")
            continue
        if t.fastest_alt:
            lines.append(
                f"- {mode}: fastest alternative: {t.fastest_alt_name}, {t.fastest_alt:.1f} us; its time / tritune "
                f"varlen's ({t.varlen:.1f} us) = {t.fastest_alt / t.varlen:.2f}x (above 1: tritune varlen is faster)"
            )
        if t.dedicated:
            share = t.varlen / t.dedicated
            verdict = "met" if share <= 1.2 else "missed"
            lines.append(f"- {mode}: tritune varlen time / dedicated time = {share:.2f} (<= 1.20: {verdict})")
    return lines


def _ratio_cell(r: Row, rows: list[Row], mode: str) -> str:
    value = _vs_varlen(r, rows, mode)
    return "-" if value is None else f"{value:.2f}x"


def _report(rows: list[Row], run: bl.BenchRun) -> str:
    env, db = run.env, run.db
    peak = bl.HBM_TBPS.get(env["gpu"])
    mixes = SMOKE_MIXES if env["smoke"] else MIXES
    notes = [
        "bf16, causal (each query sees its sequence's keys up to its own position); queries packed [T, Hq, D], "
        "decode tokens first; K/V in a [rows, cols, Hkv, D] column store (one column per sequence plus scratch).",
        *(f"Mix {m.name}: {_mix_text(m)}." for m in mixes.values() if any(r.mix == m.name for r in rows)),
        "Times: median of triton.testing.do_bench (warm-up, L2 flushed before every repetition), in us. "
        "Graph: one call captured in a CUDA graph, replay() timed the same way (its output NaN-poisoned and "
        "re-checked after a replay first).",
        "TB/s: effective K+V bandwidth, 2 x sum(kv_end) x Hkv x D x 2 bytes (the keys the step needs) / time, "
        "the same bytes for every row" + (f" (HBM peak of this GPU: about {peak} TB/s)." if peak else "."),
        "vs varlen: tritune varlen (dispatcher)'s time / this row's time (reference / this, as every ratio of "
        "these reports), eager and graph separately; above 1.00x this row is faster than tritune varlen, below "
        "1.00x tritune varlen is faster.",
        "Checked against the fp32 varlen reference (tritune.kernels.varlen.reference.compare, bf16 tolerance) "
        "before timing; FAILED rows are never timed.",
        "Loop and dedicated rows run whatever the dispatcher serves for decode and prefill. The loop works on "
        "views of the store; dedicated gets contiguous caches prepared outside the timed region.",
        "FlexAttention and varlen_attn, alike, read packed KV built from the store outside the timed region; "
        "the gather row times that gather alone (index_select of K and V), for whoever adds it to either.",
        bt.EAGER_NOTE,
        f"Tuned configs: {'DB ' + db if db else 'default settings (user DB and shipped bundles)'}; portable "
        "default pinned with use_config; the best stored trial (fastest ok trial at the mix's exact key) is "
        "listed when it differs from both.",
    ]
    notes.append(bt.HOST_NOTE)
    if not run.graphs:
        notes.append("CUDA graphs: not measured (" + ("CPU smoke run" if env["smoke"] else "--no-graph") + ").")
    text = bl.header_markdown(env, "Varlen attention (varlen_sdpa) side by side", notes)
    for mix in dict.fromkeys(r.mix for r in rows):
        lines = [
            f"## {mix}",
            "",
            "| implementation | check | max err | eager us | eager TB/s | eager vs varlen | host us | graph us "
            "| graph TB/s | graph vs varlen | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in (r for r in rows if r.mix == mix):
            graph_cell, note = bl.graph_cells(r)
            lines.append(
                f"| {r.impl} | {r.status} | {bl.fmt(r.max_err, 4)} | {bl.fmt(r.eager_us, 1)} "
                f"| {bl.fmt(r.tbps(r.eager_us), 2)} | {_ratio_cell(r, rows, 'eager')} | {bl.fmt(r.host_us, 1)} "
                f"| {graph_cell} "
                f"| {bl.fmt(r.tbps(r.graph_us), 2)} | {_ratio_cell(r, rows, 'graph')} "
                f"| {note} |"
            )
        text += "\n".join([*lines, "", *_summary(rows, mix)]) + "\n\n"
    return text


if __name__ == "__main__":
    raise SystemExit(main())

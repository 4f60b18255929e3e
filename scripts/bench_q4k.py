"""Benchmark the Q4_K linear layer: tritune ``q4k_linear`` vs bf16 cuBLAS and an FP8 ``torch._scaled_mm`` ceiling.

On the GPU machine, after tuning ``q4k_fp8_gemm`` into a DB:

    python scripts/bench_q4k.py --db /tmp/tune.sqlite --out q4k.md --json q4k.json

Llama-3-8B shapes (K, N) in {(4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144), (4096, 28672)} (the last
two: Q, K and V fused, gate and up fused), every power of two M from
1 (decode) to 8192 (prefill), bf16 activations. The weight is Gaussian (std 0.02), quantized once
per shape with ``Q4KWeight.quantize``; the reference is the float64 product with the exactly
dequantized weight, and each row reports its SQNR (dB) and NMSE against it (ggml's Q4_K bound is
NMSE <= 5e-4, 33 dB).

Implementations (every one checked against the reference before it is timed; one below its floor
is reported as FAILED, a peer that cannot run as unavailable with its error):

- bf16 cuBLAS: ``x @ W.T`` with W dequantized to bf16 once, outside timing (floor: the portable 40 dB);
- FP8 ``torch._scaled_mm``: W quantized once to e4m3 with one scale per output row, x quantized to e4m3
  with one scale per row outside timing (mat2 passed column-major, as cuBLASLt wants): the fp8 GEMM
  alone, a ceiling for a kernel that also dequantizes (floor: the fp8 path's 25 dB);
- tritune untuned: the key's default (the one-launch GEMV up to M=4 on NVIDIA GPUs, then portable,
  or tma on SM90 from M=32 to 512, or dequant from M=256, on SM90 where the tma path does not
  serve), pinned with ``use_config``;
- tritune per path, pinned: the accurate paths (portable; GEMV up to ``GEMV_MAX_BENCH_M`` rows;
  dequant, the exact weights in bf16 chunk by chunk into cuBLAS, at every M: it is tuned from M=128
  up, the rows below show why; on SM90 the tma path, the Gluon K loop, at every M) and, with
  ``TRITUNE_Q4K_FP8`` on, the opt-in ones (int8, fp8, staged): the fastest tuned trial of that path
  in ``--db`` at the key it is tuned at (``fp8=False`` for the accurate paths, ``fp8=True`` for the
  opt-in ones), or without one the untuned tiles on that path, else the tuner's first starting
  config of it (the dequant path's largest chunk), else its defaults; the accurate paths must also
  meet ggml's bound. A path that cannot serve the call (an 8-bit path below its row floor; the
  dispatcher would run its stand-in under the pin) gets no row, and the log says so;
- tritune tuned: whatever the dispatcher serves (``--db`` on top of the shipped bundles), by default
  and with ``TRITUNE_Q4K_FP8`` on.

Each implementation is timed eagerly (the larger of the ``do_bench`` median and the host time per
call, which the L2 flush ahead of each ``do_bench`` call would hide) and as one call captured in a
CUDA graph whose ``replay()`` is timed with ``do_bench``; before that, the graph's output is
poisoned with NaN, replayed and checked again against the same floor. Times are medians of
``triton.testing.do_bench`` (L2 flushed before every repetition); TFLOP/s count 2 x M x N x K. At
small M an eager call costs its host launch work (Python dispatch and a few Triton launches for our
rows, one C++ launch for cuBLAS), far more than the kernels take: the graph columns are the kernel
comparison there. ``--no-graph`` leaves them out.

``--smoke`` runs the same code on the CPU under ``TRITON_INTERPRET=1`` at tiny shapes (no CUDA graphs):
a dry run that proves the script works before GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _bench_timing as bt
import _benchlib as bl
import torch

log = logging.getLogger("tritune.bench")

SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144), (4096, 28672))  # (K, N)
MS = tuple(2**i for i in range(14))
SMOKE_SHAPES = ((256, 64), (512, 96))
SMOKE_MS = (1, 16, 33)
#: Most rows the GEMV path is timed at: it is tuned at one row and spills registers beyond a few.
GEMV_MAX_BENCH_M = 8
#: The paths the fp8 opt-in admits (pinned with ``TRITUNE_Q4K_FP8`` on).
OPT_IN_PATHS = ("int8", "fp8", "staged")
#: The accurate paths timed at every M (the GEMV only up to ``GEMV_MAX_BENCH_M``).
ACCURATE_BENCH_PATHS = ("portable", "dequant")
DTYPE = torch.bfloat16
WEIGHT_STD = 0.02
E4M3_MAX = 448.0
CUBLAS = "bf16 cuBLAS (x @ W.T)"
SCALED_MM = "FP8 torch._scaled_mm (ceiling)"
KERNEL = "q4k_fp8_gemm"
#: The peers every row's ratios divide, in the table's column order.
PEERS = (CUBLAS, SCALED_MM)


@dataclass
class Row(bt.TimedRow):
    k: int
    n: int
    m: int
    sqnr_db: float | None = None
    nmse: float | None = None

    def tflops(self, us: float | None) -> float | None:
        return bl.tera_per_s(2.0 * self.m * self.n * self.k, us)


@dataclass
class Impl:
    name: str
    fn: Callable[[], torch.Tensor] | None
    #: SQNR floor (dB) the output must reach against the reference.
    floor: float
    note: str = ""
    error: str = ""
    #: Whether ggml's NMSE bound applies too (the accurate paths and the bf16 peer).
    accurate: bool = False
    #: Checked and timed with ``TRITUNE_Q4K_FP8`` on.
    opt_in: bool = False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_arguments(parser, flex=False)
    parser.add_argument("--shape", action="append", help="KxN, e.g. 4096x14336 (default: the five Llama-3-8B linears)")
    parser.add_argument("--m", type=int, action="append", help="rows of x (default every power of two 1 .. 8192)")
    args = parser.parse_args()
    run = bl.start(args)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape] if args.shape else None
    shapes = shapes or list(SMOKE_SHAPES if args.smoke else SHAPES)
    ms = args.m or list(SMOKE_MS if args.smoke else MS)
    # The reference must be a true fp32 product, not TF32.
    torch.set_float32_matmul_precision("highest")

    from tritune.kernels.device import device_info
    from tritune.kernels.q4k.kernel import KERNEL as Q4K

    info = device_info(run.device)
    best = bl.best_trials_by_path(run.db, KERNEL, Q4K.version, info.slug) if run.db else {}
    rows: list[Row] = []
    with bl.tuned_db(run.db):
        for k, n in shapes:
            rows.extend(bench_shape(k, n, ms, args.seed, run, best))
            bl.write_report(_report(rows, run), run.env, [_json_row(r) for r in rows], args.out, args.json)
    bl.print_report(_report(rows, run))
    return 0


def _json_row(r: Row) -> dict[str, Any]:
    return {**dataclasses.asdict(r), "eager_tflops": r.tflops(r.eager_us), "graph_tflops": r.tflops(r.graph_us)}


def fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales ``[rows, 1]`` with one scale per row (its max maps to 448)."""
    t32 = t.float()
    scale = t32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (t32 / scale).to(torch.float8_e4m3fn), scale


def bench_shape(k: int, n: int, ms: list[int], seed: int, run: bl.BenchRun, best: dict) -> list[Row]:
    """Quantize one weight, then check and time (eager and CUDA graph) every implementation at each M."""
    from tritune.kernels import Q4KWeight

    device = run.device
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = Q4KWeight.quantize(torch.randn(n, k, generator=gen, device=device) * WEIGHT_STD)
    w32 = weight.dequantize()  # [N, K] fp32, exactly gguf's values
    w64 = w32.double()
    w_bf16 = w32.to(DTYPE)
    w_fp8, w_scale = fp8_rows(w32)
    w_scale_row = w_scale.reshape(1, n).contiguous()  # [1, N]: scale_b of _scaled_mm
    log.info("K=%d N=%d: weight quantized (%.1f MB as Q4_K)", k, n, weight.nbytes / 1e6)
    rows: list[Row] = []
    for m in ms:
        x = torch.randn(m, k, generator=gen, device=device).to(DTYPE)
        expected = x.double() @ w64.t()
        impls = [
            Impl(CUBLAS, lambda x=x: x @ w_bf16.t(), _floor("portable"), "W dequantized to bf16 once", accurate=True),
            _scaled_mm_impl(x, w_fp8, w_scale_row),
            *_tritune_impls(x, weight, best),
        ]
        rows.extend(_measure(Row(k=k, n=n, m=m, impl=impl.name, note=impl.note), impl, expected, run) for impl in impls)
        del x, expected
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _measure(row: Row, impl: Impl, expected: torch.Tensor, run: bl.BenchRun) -> Row:
    """Check ``impl`` against its SQNR floor (recording the SQNR), then time it (``bt.measure``)."""

    from tritune.kernels import settings

    def check(out: torch.Tensor) -> str | None:
        row.sqnr_db, row.nmse, problem = _check(out, expected, impl)
        return problem

    def recheck(out: torch.Tensor) -> str | None:
        return _check(out, expected, impl)[2]

    # The opt-in is a process-wide setting: entered once around the row's check and timing.
    with settings.override(q4k_fp8=impl.opt_in):
        bt.measure(row, impl.fn, check, run.device, run.graphs, error=impl.error, recheck=recheck)
    _log_row(row)
    return row


def _floor(path: str) -> float:
    from tritune.kernels.q4k.reference import MIN_SQNR_DB

    return MIN_SQNR_DB[path]


def _check(out: torch.Tensor, expected: torch.Tensor, impl: Impl) -> tuple[float, float, str | None]:
    """SQNR (dB) and NMSE of ``out``, and what is wrong when it is below ``impl``'s floor or, for an
    accurate implementation, above ggml's NMSE bound (None when it passes)."""
    from tritune.kernels.q4k.reference import GGML_MAX_NMSE, nmse, sqnr_db

    sqnr, error = sqnr_db(out, expected), nmse(out, expected)
    if math.isnan(sqnr):
        return sqnr, error, "output holds NaN or inf"
    if sqnr < impl.floor:
        return sqnr, error, f"SQNR {sqnr:.1f} dB is below the {impl.floor:.0f} dB floor"
    if impl.accurate and error > GGML_MAX_NMSE:
        return sqnr, error, f"NMSE {error:.2e} exceeds ggml's Q4_K bound {GGML_MAX_NMSE:g}"
    return sqnr, error, None


def _scaled_mm_impl(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_row: torch.Tensor) -> Impl:
    """Row-wise scaled FP8 GEMM; per-tensor scales where the build refuses row-wise ones."""
    x_fp8, x_scale = fp8_rows(x)
    mat2 = w_fp8.t()  # [K, N], column-major: the layout _scaled_mm requires of its second operand

    def rowwise() -> torch.Tensor:
        return torch._scaled_mm(x_fp8, mat2, scale_a=x_scale, scale_b=w_scale_row, out_dtype=DTYPE)

    try:
        rowwise()
        return Impl(SCALED_MM, rowwise, floor=_floor("fp8"), note="e4m3, row-wise scales (x per row, W per column)")
    except Exception as exc:
        refused = bl.error_text(exc, 120)
    # Per-tensor fallback: requantize both operands against one scale each.
    x_t_scale = x.float().abs().amax().clamp(min=1e-12) / E4M3_MAX
    w32 = w_fp8.float() * w_scale_row.t()
    w_t_scale = w32.abs().amax().clamp(min=1e-12) / E4M3_MAX
    x_t = (x.float() / x_t_scale).to(torch.float8_e4m3fn)
    w_t = (w32 / w_t_scale).to(torch.float8_e4m3fn).t()

    def tensorwise() -> torch.Tensor:
        return torch._scaled_mm(x_t, w_t, scale_a=x_t_scale, scale_b=w_t_scale, out_dtype=DTYPE)

    try:
        tensorwise()
    except Exception as exc:
        return Impl(
            SCALED_MM, None, floor=_floor("fp8"), error=f"row-wise: {refused}; per-tensor: {bl.error_text(exc, 120)}"
        )
    return Impl(
        SCALED_MM, tensorwise, floor=_floor("fp8"), note=f"e4m3, per-tensor scales (row-wise refused: {refused})"
    )


def _tritune_impls(x: torch.Tensor, weight, best: dict) -> list[Impl]:
    from tritune.kernels import q4k_linear, settings
    from tritune.kernels._launch import device_index
    from tritune.kernels.device import device_info
    from tritune.kernels.dispatcher import dispatch_config
    from tritune.kernels.q4k.kernel import KERNEL as Q4K
    from tritune.kernels.q4k.kernel import portable_default
    from tritune.kernels.q4k.reference import ACCURATE_PATHS

    info = device_info(x.device)
    facts = Q4K.facts(x, weight, None)
    keys = {}
    served = {}
    eager = {}
    for opt_in in (False, True):
        with settings.override(q4k_fp8=opt_in):
            keys[opt_in] = Q4K.key_for(info, facts)
            config = dispatch_config(KERNEL, x.device.type, device_index(x.device), tuple(facts))
            served[opt_in] = Q4K.space.to_dict(config)
            eager[opt_in] = bl.eager_note(Q4K, facts, x.device)
    untuned = Q4K.space.to_dict(Q4K.default_config(keys[False]))
    # The portable rules' tiles: the other paths' rows start from them (the default may be the
    # dequant path, whose fields say nothing of an MMA tile, or the tma path's own tiles).
    tiles = Q4K.space.to_dict(portable_default(keys[False]))

    def pinned(config: dict[str, Any]) -> Callable[[], torch.Tensor]:
        return bl.pinned_call(KERNEL, config, q4k_linear, x, weight)

    impls = [
        Impl(
            "tritune untuned (default)",
            pinned(untuned),
            _floor(untuned["path"]),
            bl.config_text(untuned),
            accurate=True,
        )
    ]
    gemv = ("gemv",) if x.shape[0] <= GEMV_MAX_BENCH_M else ()
    tma = ("tma",) if info.capability == (9, 0) and not info.is_interpreter else ()
    paths = (*ACCURATE_BENCH_PATHS, *tma, *gemv, *OPT_IN_PATHS)
    for path in paths:
        opt_in = path in OPT_IN_PATHS
        key = keys[opt_in]
        key_json = json.dumps(key.to_dict(), sort_keys=True)
        config, origin = best.get((key_json, path)), "fastest tuned trial"
        if config is None:
            config, origin = _path_default(tiles, path, key, info), "default tiles, no tuned trial"
            if path == "staged" and Q4K.space.infeasible_reason(Q4K.space.parse(config), key, Q4K.limits(info)):
                continue  # small M, fp16 or odd N: the staged path is not a candidate there
        if config == untuned:
            continue  # the untuned row already times it
        with settings.override(q4k_fp8=opt_in):
            served_pin = bl.served_under_pin(Q4K, config, x.device, facts)
        if served_pin != config:
            # The path cannot serve this call (say, an 8-bit path below its row floor): the pin
            # would time the stand-in under the path's name.
            stand_in = bl.config_text(served_pin)
            print(f"M={x.shape[0]}: the {path} path does not serve this call; no row ({stand_in} would run)")
            continue
        name = f"tritune {path} path (pinned{', TRITUNE_Q4K_FP8=1' if opt_in else ''})"
        note = f"{origin}: {bl.config_text(config)}"
        impls.append(Impl(name, pinned(config), _floor(path), note, accurate=path in ACCURATE_PATHS, opt_in=opt_in))
    for opt_in in (False, True):
        tag = "same as untuned" if served[opt_in] == untuned else "tuned"
        path = str(served[opt_in]["path"])
        impls.append(
            Impl(
                "tritune tuned (dispatcher" + (", TRITUNE_Q4K_FP8=1)" if opt_in else ")"),
                lambda: q4k_linear(x, weight),
                _floor(path),
                f"{tag}: {bl.config_text(served[opt_in])}{eager[opt_in]}",
                accurate=path in ACCURATE_PATHS,
                opt_in=opt_in,
            )
        )
    return impls


def _path_default(tiles: dict[str, Any], path: str, key, info) -> dict[str, Any]:
    """The portable rules' ``tiles`` on ``path`` where they are feasible there, else the tuner's
    first starting config of that path at the key, else that path's own defaults."""
    from tritune.kernels.q4k.kernel import KERNEL as Q4K
    from tritune.kernels.q4k.kernel import tma_default

    if path == "tma" and tma_default(key) is not None:
        # The tma path's own default tiles (the portable rules' are chosen for another loop).
        return Q4K.space.to_dict(tma_default(key))
    # The tiles the path has; its own defaults for the rest.
    fields = Q4K.space.members[path].dimensions
    config = Q4K.space.to_dict(Q4K.space.parse({**{k: v for k, v in tiles.items() if k in fields}, "path": path}))
    if Q4K.space.infeasible_reason(Q4K.space.parse(config), key, Q4K.limits(info)) is None:
        return config
    starts = [c for c in Q4K.starting_configs(key, info) if c.path == path]
    if starts:
        return Q4K.space.to_dict(starts[0])
    return Q4K.space.to_dict(Q4K.pinned_config({"path": path}))


def _log_row(r: Row) -> None:
    label = f"K={r.k:<5d} N={r.n:<5d} M={r.m:<5d} {r.impl:<36s}"
    nmse = "-" if r.nmse is None else f"{r.nmse:.2e}"
    bl.log_row(label, r, r.tflops, "TFLOP/s", f"SQNR={bl.fmt(r.sqnr_db, 1)} NMSE={nmse}")


def _report(rows: list[Row], run: bl.BenchRun) -> str:
    env, db = run.env, run.db
    notes = [
        f"bf16 x [M, K] (std 1) times a Q4_K weight [N, K] (Gaussian, std {WEIGHT_STD}, quantized with "
        "Q4KWeight.quantize); out [M, N] bf16.",
        "Times: median of triton.testing.do_bench (warm-up, L2 flushed before every repetition), in us. "
        "Graph: one call captured in a CUDA graph, replay() timed the same way (output NaN-poisoned, replayed "
        "and re-checked against the same SQNR floor first). TFLOP/s: 2 x M x N x K / time.",
        "Small M (decode, M up to about 64): the eager times are host-bound, the Python dispatch and Triton "
        "launches of each call (cuBLAS and _scaled_mm launch from C++ and pay far less), not kernel time; "
        "the graph columns, which replay the launches without the host, are the kernel comparison.",
        bt.EAGER_NOTE,
        "vs cuBLAS / vs _scaled_mm: that peer's time / this time, eager and graph separately (above 1.00x is faster).",
        "SQNR (dB) and NMSE: against the float64 product with the exactly dequantized weight; checked before "
        "timing against the floor of the path that ran: 40 dB (portable, dequant and tma paths, bf16 cuBLAS), "
        "33 dB (GEMV path) or 25 dB (int8, fp8 and staged paths, the TRITUNE_Q4K_FP8 opt-in, and _scaled_mm), "
        "and for the accurate paths and bf16 cuBLAS ggml's Q4_K bound, NMSE <= 5e-4; FAILED rows are never timed.",
        "The _scaled_mm row times the fp8 GEMM alone (weight and activation quantized outside timing): a ceiling, "
        "not a like-for-like peer.",
        f"Tuned configs and trials: {'DB ' + db if db else 'default settings (user DB and shipped bundles)'}; "
        "untuned = the key's default (the one-launch GEMV up to M=4 on NVIDIA GPUs, then portable; tma on SM90 "
        "from M=32 to 512; dequant from M=256, on SM90 where the tma path does not serve) pinned with use_config.",
    ]
    notes.append(bt.HOST_NOTE)
    if not run.graphs:
        notes.append("CUDA graphs: not measured (" + ("CPU smoke run" if env["smoke"] else "--no-graph") + ").")
    text = bl.header_markdown(env, "Q4_K linear (q4k_fp8_gemm)", notes)
    lines = [
        "| K x N | M | implementation | check | SQNR dB | NMSE | eager us | eager TFLOP/s | eager vs cuBLAS "
        "| eager vs _scaled_mm | host us | graph us | graph TFLOP/s | graph vs cuBLAS | graph vs _scaled_mm | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape in dict.fromkeys((r.k, r.n, r.m) for r in rows):
        group = [r for r in rows if (r.k, r.n, r.m) == shape]
        peers = {
            mode: [next((getattr(r, f"{mode}_us") for r in group if r.impl == peer), None) for peer in PEERS]
            for mode in ("eager", "graph")
        }
        for r in group:
            graph_cell, note = bl.graph_cells(r)
            eager_vs = " | ".join(bl.ratio(peer, r.eager_us) for peer in peers["eager"])
            graph_vs = " | ".join(bl.ratio(peer, r.graph_us) for peer in peers["graph"])
            nmse = "-" if r.nmse is None else f"{r.nmse:.2e}"
            lines.append(
                f"| {r.k} x {r.n} | {r.m} | {r.impl} | {r.status} | {bl.fmt(r.sqnr_db, 1)} | {nmse} "
                f"| {bl.fmt(r.eager_us, 1)} | {bl.fmt(r.tflops(r.eager_us), 1)} | {eager_vs} "
                f"| {bl.fmt(r.host_us, 1)} | {graph_cell} | {bl.fmt(r.tflops(r.graph_us), 1)} | {graph_vs} | {note} |"
            )
    return text + "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

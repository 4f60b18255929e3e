"""Benchmark causal GQA prefill: tritune (untuned, tuned, the best of each path) vs PyTorch peers.

Run on a GPU after tuning into a DB:

    python scripts/bench_prefill.py --db /tmp/tune.sqlite --out docs/perf/DATE-tma_prefill-GPU.md

Each path of the kernel (portable, TMA, warp-specialized) gets a row with its fastest trial in the
DB, or on a GPU, where the DB has none, with its default tiles. Every implementation is checked
against an fp32 reference on a sample of query rows (the first and
last 64 rows of every head) before it is timed; one that fails is reported as FAILED, never as a
speedup; a peer that cannot run is reported as unavailable, one of our rows raising as FAILED.
Times are medians of ``triton.testing.do_bench`` (warm-up, L2 flushed between repetitions); an
eager time is the larger of that and the host time per call. The SDPA peers read the K/V heads
ours reads (``enable_gqa``); cuDNN at Lq != Lkv has no bottom-right causal kernel in torch and is
labelled "SDPA cuDNN (dense mask)", outside the fastest-peer reference. TFLOP/s count only unmasked
query-key pairs (4 * D flops each). On a GPU every row is also timed as a CUDA-graph replay (its
output poisoned with NaN, replayed and checked first): where an eager call's host path outlasts
the kernel, the eager time measures the host, the graph time the kernel. The
report is rewritten after every shape, so a run cut short keeps what it measured. ``--smoke``
runs the same code on the CPU under ``TRITON_INTERPRET=1`` at tiny shapes: a dry run of the
script, with meaningless times (and no graph column).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _bench_timing as bt
import _benchlib as bl
import torch

# B=1, Hq=16, Hkv=2, bf16; (D, Lq, Lkv)
SHAPES = [
    (64, 512, 16384),
    (64, 4096, 131072),
    (128, 512, 16384),
    (128, 1024, 131072),
    (128, 4096, 131072),
    (64, 16384, 16384),
    (128, 16384, 16384),
]
SMOKE_SHAPES = [(64, 16, 64), (64, 32, 96), (64, 32, 32)]
HQ, HKV, B = 16, 2, 1
SMOKE_HQ = 4
FLASH, CUDNN, CUDNN_DENSE = "SDPA flash", "SDPA cuDNN", "SDPA cuDNN (dense mask)"
#: The peers whose fastest time the ratios divide. cuDNN with a dense mask (Lq != Lkv) is not one:
#: PyTorch's own dispatch of causal_lower_right never picks it (flash, then mem-efficient, serve it).
PEERS = (FLASH, CUDNN, "FlexAttention")
DENSE_MASK_NOTE = (
    "torch has no bottom-right causal cuDNN path for Lq != Lkv: under sdpa_kernel(CUDNN_ATTENTION) "
    "causal_lower_right builds a dense Lq x Lkv mask in every call (timed, as a torch user pays it) and "
    "cuDNN runs its dense-bias kernel; not counted as a fastest peer"
)
#: Max |error| on the sampled rows against the fp32 reference for bf16 outputs.
TOLERANCE = 3e-2


@dataclass
class Row(bt.TimedRow):
    shape: str
    flops: float
    max_err: float | None = None

    def tflops(self, us: float | None) -> float | None:
        return bl.tera_per_s(self.flops, us)


def causal_pairs(lq: int, lkv: int) -> int:
    """Unmasked (query, key) pairs of bottom-right causal attention with Lq <= Lkv."""
    return lq * (lkv - lq) + lq * (lq + 1) // 2


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 bottom-right causal attention for the selected query rows only."""
    group = q.shape[1] // k.shape[1]
    lq, lkv = q.shape[2], k.shape[2]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].float(), kf) * scale
    position = (lkv - lq + rows)[:, None]
    scores = scores.masked_fill(torch.arange(lkv, device=q.device)[None, :] > position, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), vf)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.add_common_arguments(parser)
    parser.add_argument("--shapes", default=None, help="subset, e.g. 128x4096x131072,64x512x16384 (D x Lq x Lkv)")
    args = parser.parse_args()
    run = bl.start(args)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    from tritune.kernels.device import device_info
    from tritune.kernels.prefill.kernel import KERNEL as SPEC

    slug = device_info(run.device).slug
    best_by_path = bl.best_trials_by_path(run.db, SPEC.name, SPEC.version, slug) if run.db else {}
    # FlexAttention has no interpreter path: the smoke run leaves it out.
    flex = None if args.skip_flex or args.smoke else bl.compiled_flex()
    rows: list[Row] = []
    # The DB is served for the whole run: every tritune row of every shape reads it.
    with bl.tuned_db(run.db):
        for d, lq, lkv in shapes:
            rows.extend(bench_shape(run, d, lq, lkv, best_by_path, flex, seed=args.seed, smoke=args.smoke))
            json_rows = [dataclasses.asdict(r) for r in rows]
            bl.write_report(report(run.env, rows), run.env, json_rows, args.out, args.json)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
    bl.print_report(report(run.env, rows))
    return 0


def bench_shape(
    run: bl.BenchRun, d: int, lq: int, lkv: int, best_by_path: dict, flex: Any, *, seed: int, smoke: bool
) -> list[Row]:
    """Check, then time, every implementation at one shape (eagerly, and as a graph replay on a GPU)."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    from tritune.kernels import prefill_attention
    from tritune.kernels.device import device_info
    from tritune.kernels.prefill.kernel import KERNEL as SPEC

    device = run.device
    q_heads = SMOKE_HQ if smoke else HQ
    torch.manual_seed(seed)
    q = torch.randn(B, q_heads, lq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, lkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, lkv, d, device=device, dtype=torch.bfloat16)
    kv_len = torch.tensor(lkv, device=device, dtype=torch.int32)
    sample = torch.unique(torch.cat([torch.arange(0, min(64, lq)), torch.arange(max(0, lq - 64), lq)])).to(device)
    expected = reference_rows(q, k, v, sample, d**-0.5)
    flops = 4.0 * d * causal_pairs(lq, lkv) * B * q_heads
    shape = f"D={d} Lq={lq} Lkv={lkv}"
    mask = causal_lower_right(lq, lkv)

    facts = SPEC.facts(q, k, v, causal=True, kv_len=kv_len, softmax_scale=None, out=None)
    key = SPEC.key_for(device_info(device), tuple(facts))
    impls: list[tuple[str, Callable[[], torch.Tensor] | None]] = [
        ("tritune portable (untuned)", pinned(SPEC.space.to_dict(SPEC.default_config(key)), q, k, v, kv_len)),
        ("tritune tuned (dispatcher)", lambda: prefill_attention(q, k, v, kv_len=kv_len)),
    ]
    for path, member in SPEC.space.members.items():
        best = best_by_path.get((json.dumps(key.to_dict(), sort_keys=True), path))
        if best is not None:
            impls.append((f"tritune best {path} (tuned)", pinned(best, q, k, v, kv_len)))
        elif path != "portable" and not smoke:
            # A path no trial of the DB measured still gets a row, at its default tiles: its serve
            # hook replaces it where it cannot run, and the row's note names what served.
            untried = SPEC.space.to_dict(member.default())
            impls.append((f"tritune {path} (default tiles, no tuned trial)", pinned(untried, q, k, v, kv_len)))
    peers = [(FLASH, SDPBackend.FLASH_ATTENTION, {"attn_mask": mask})]
    if lq == lkv:
        # causal_lower_right is plain causal here: cuDNN's own causal kernel.
        peers.append((CUDNN, SDPBackend.CUDNN_ATTENTION, {"is_causal": True}))
    else:
        peers.append((CUDNN_DENSE, SDPBackend.CUDNN_ATTENTION, {"attn_mask": mask}))
    if smoke:
        peers.append(("SDPA math (smoke stand-in)", SDPBackend.MATH, {"attn_mask": mask}))
    sdpa_rows = {}
    for name, backend, sdpa_args in peers:
        peer = bl.sdpa_peer(backend, q, k, v, **sdpa_args)
        if peer.fn is not None:
            peer.note = bl.join_notes(peer.note, bl.backend_ran(peer.fn, device))
        if name == CUDNN_DENSE:
            peer.note = bl.join_notes(DENSE_MASK_NOTE, peer.note)
        sdpa_rows[name] = peer
        impls.append((name, peer.fn))
    if flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        offset = lkv - lq

        def causal_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(causal_mod, B=None, H=None, Q_LEN=lq, KV_LEN=lkv, device=device)
        impls.append(("FlexAttention", lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)))

    def check(out: torch.Tensor) -> str | None:
        err = float((out[:, :, sample].float() - expected).abs().max())
        return None if err <= TOLERANCE else f"max err {err:.2e}"

    rows = []
    for name, fn in impls:
        peer = sdpa_rows.get(name)
        note = served_config_text(fn, facts, device) if name.startswith("tritune") else peer.note if peer else ""
        row = Row(shape=shape, flops=flops, impl=name, note=note)

        def record(out: torch.Tensor, row: Row = row) -> str | None:
            row.max_err = float((out[:, :, sample].float() - expected).abs().max())
            return check(out)

        raised = "FAILED" if name.startswith("tritune") else "unavailable"
        error = bl.join_notes(peer.note, peer.error) if peer else ""
        rows.append(bt.measure(row, fn, record, device, run.graphs, error=error, raised=raised, recheck=check))
        bl.log_row(f"{shape} {name:<30s}", row, row.tflops, "TFLOP/s", f"err={bl.fmt(row.max_err, 4)}")
    return rows


def served_config_text(fn: Callable[[], torch.Tensor], facts: Any, device: torch.device) -> str:
    """The config the dispatcher serves for this row (under the row's pin, if any), as the note says it."""
    from tritune.kernels.prefill.kernel import KERNEL as SPEC

    pin = getattr(fn, "pin", None)
    if pin is not None:
        return "served: " + bl.config_text(bl.served_under_pin(SPEC, pin, device, facts))
    return "served: " + bl.config_text(bl.served_config(SPEC, facts, device)) + bl.eager_note(SPEC, facts, device)


def pinned(config: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor):
    from tritune.kernels import prefill_attention

    run = bl.pinned_call("tma_prefill", config, prefill_attention, q, k, v, kv_len=kv_len)
    run.pin = config  # type: ignore[attr-defined]
    return run


def report(env: dict[str, Any], rows: list[Row]) -> str:
    notes = [
        f"B={B}, Hq={HQ}, Hkv={HKV}, bf16, bottom-right causal, kv_len as a device tensor.",
        "Median of triton.testing.do_bench (L2 flushed), in ms. TFLOP/s count unmasked pairs only.",
        "'vs fastest peer' = fastest passing PyTorch peer's time (SDPA flash, SDPA cuDNN with its causal kernel"
        " at Lq = Lkv, FlexAttention) / this time (>1: faster than every peer), eager and graph separately.",
        "SDPA cuDNN (dense mask), the cuDNN row at Lq != Lkv: torch has no bottom-right causal cuDNN kernel"
        " there, so causal_lower_right materialises a dense Lq x Lkv mask in every timed call and cuDNN runs"
        " its dense-bias kernel. It is shown, with its own ratio, but is not a 'fastest peer': PyTorch's own"
        " dispatch of causal_lower_right never picks it.",
        "graph: one call captured in a CUDA graph, its replay timed the same way (no host time; '-' where not run).",
        "SDPA peers read the same Hkv K/V heads as ours, with enable_gqa=True; a backend refusing it gets K/V"
        " heads repeated outside the timed region (its note says so). Each SDPA row's note names the backend"
        " that ran ('ran: ...', torch.profiler over one call at warm-up).",
        bt.EAGER_NOTE,
        bt.HOST_NOTE,
    ]
    lines = [
        "| shape | implementation | check | time (ms) | TFLOP/s | vs fastest peer | host (ms) | graph (ms) "
        "| graph vs fastest peer | max err (sampled rows) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape in dict.fromkeys(r.shape for r in rows):
        group = [r for r in rows if r.shape == shape]
        eager_peer, graph_peer = bl.fastest(group, PEERS, "eager_us"), bl.fastest(group, PEERS, "graph_us")
        for r in group:
            err = "-" if r.max_err is None else f"{r.max_err:.2e}"
            eager_ms = None if r.eager_us is None else r.eager_us / 1e3
            graph_cell, note = bl.graph_cells(r, scale=1e-3, digits=3)
            lines.append(
                f"| {shape} | {r.impl} | {r.status} | {bl.fmt(eager_ms, 3)} | {bl.fmt(r.tflops(r.eager_us), 0)} | "
                f"{bl.ratio(eager_peer, r.eager_us)} | {bl.fmt(None if r.host_us is None else r.host_us / 1e3, 3)} | "
                f"{graph_cell} | {bl.ratio(graph_peer, r.graph_us)} | "
                f"{err} | {note} |"
            )
    return bl.header_markdown(env, "tma_prefill vs PyTorch peers", notes) + "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

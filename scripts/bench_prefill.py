"""Benchmark causal GQA prefill: tritune (untuned, tuned, best TMA / best portable) vs PyTorch peers.

Run on a GPU after tuning into a DB:

    python scripts/bench_prefill.py --db /tmp/tune.sqlite --out docs/perf/prefill-h200.md

Every implementation is checked against an fp32 reference on a sample of query rows (first and last
64 rows of every head) before it is timed; one that fails is reported as FAILED, never as a speedup.
Times are medians of ``triton.testing.do_bench`` (warm-up, L2 flushed between repetitions). TFLOP/s
count only unmasked query-key pairs (4 * D flops each).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.testing

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
HQ, HKV, B = 16, 2, 1


@dataclass
class Row:
    shape: str
    impl: str
    ms: float | None
    tflops: float | None
    max_err: float | None
    note: str = ""


def causal_pairs(lq: int, lkv: int) -> int:
    """Unmasked (query, key) pairs of bottom-right causal attention."""
    return lq * (lkv - lq) + lq * (lq + 1) // 2


def reference_rows(q, k, v, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 bottom-right causal attention for the selected query rows only."""
    group = q.shape[1] // k.shape[1]
    lq, lkv = q.shape[2], k.shape[2]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    qs = q[:, :, rows].float()
    scores = torch.einsum("bhqd,bhkd->bhqk", qs, kf) * scale
    pos = (lkv - lq + rows)[:, None]
    mask = torch.arange(lkv, device=q.device)[None, :] <= pos
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), vf)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", default=None, help="config DB holding the tuned winners and trials")
    parser.add_argument("--out", default=None, help="markdown file to write the table to")
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default=None, help="subset, e.g. 128x4096x131072,64x512x16384")
    parser.add_argument("--skip-flex", action="store_true")
    args = parser.parse_args()

    from tritune.kernels import settings

    if args.db:
        settings.override(db_url=args.db).__enter__()

    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    best_by_path = _best_trials_by_path(args.db) if args.db else {}

    flex = None
    if not args.skip_flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

    rows: list[Row] = []
    for d, lq, lkv in shapes:
        rows.extend(bench_shape(d, lq, lkv, best_by_path, flex))
        torch.cuda.empty_cache()

    table = _table(rows)
    header = (
        f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"CUDA {torch.version.cuda} | Python {platform.python_version()}\n\n"
        f"Command: `python {' '.join(sys.argv)}`\n\nB={B}, Hq={HQ}, Hkv={HKV}, bf16, bottom-right causal, "
        "kv_len as a device tensor. Median of triton.testing.do_bench (L2 flushed). TFLOP/s count unmasked "
        "pairs only. Ratio = fastest peer time / this time (>1 is faster than every PyTorch peer).\n\n"
    )
    print(header + table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(header + table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=1)
    return 0



def bench_shape(d: int, lq: int, lkv: int, best_by_path: dict, flex) -> list[Row]:
    """Check, then time, every implementation at one shape."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    from tritune.kernels import prefill_attention, use_config
    from tritune.kernels.device import device_info
    from tritune.kernels.prefill.spec import SPEC

    rows: list[Row] = []
    torch.manual_seed(0)
    q = torch.randn(B, HQ, lq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, lkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HKV, lkv, d, device="cuda", dtype=torch.bfloat16)
    kv_len = torch.tensor(lkv, device="cuda", dtype=torch.int32)
    scale = d**-0.5
    sample = torch.cat([torch.arange(0, 64), torch.arange(lq - 64, lq)]).to("cuda")
    expected = reference_rows(q, k, v, sample, scale)
    flops = 4.0 * d * causal_pairs(lq, lkv) * B * HQ
    shape = f"D={d} Lq={lq} Lkv={lkv}"
    k_rep = k.repeat_interleave(HQ // HKV, dim=1)
    v_rep = v.repeat_interleave(HQ // HKV, dim=1)
    mask = causal_lower_right(lq, lkv)

    impls: list[tuple[str, Callable[[], torch.Tensor]]] = []

    facts = SPEC.facts(q, k, v, causal=True, kv_len=kv_len, softmax_scale=None, out=None)
    key = SPEC.key_for(device_info(q.device), facts)
    portable = SPEC.space.to_dict(SPEC.default_config(key))
    impls.append(("tritune portable (untuned)", _pinned(use_config, portable, q, k, v, kv_len)))
    impls.append(("tritune tuned (dispatcher)", lambda: prefill_attention(q, k, v, kv_len=kv_len)))
    for path in ("portable", "tma"):
        best = best_by_path.get((json.dumps(key.to_dict(), sort_keys=True), path))
        if best is not None:
            impls.append((f"tritune best {path} (tuned)", _pinned(use_config, best, q, k, v, kv_len)))
    impls.append(("SDPA flash", lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k_rep, v_rep, mask)))
    impls.append(("SDPA cuDNN", lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k_rep, v_rep, mask)))
    if flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        offset = lkv - lq

        def causal_mod(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(causal_mod, B=None, H=None, Q_LEN=lq, KV_LEN=lkv, device="cuda")
        impls.append(("FlexAttention", lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)))

    for name, fn in impls:
        try:
            out = fn()
            torch.cuda.synchronize()
            err = float((out[:, :, sample].float() - expected).abs().max())
            if not (err <= 3e-2):
                rows.append(Row(shape, name, None, None, err, "FAILED correctness check"))
                continue
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            rows.append(Row(shape, name, ms, flops / ms / 1e9, err))
        except Exception as exc:  # report the peer as unavailable, keep benchmarking
            rows.append(Row(shape, name, None, None, None, f"unavailable: {type(exc).__name__}: {exc}"[:160]))
        print(_fmt(rows[-1]), flush=True)
    return rows

def _pinned(use_config, config: dict, q, k, v, kv_len) -> Callable[[], torch.Tensor]:
    from tritune.kernels import prefill_attention

    def run() -> torch.Tensor:
        with use_config("tma_prefill", config):
            return prefill_attention(q, k, v, kv_len=kv_len)

    return run


def _sdpa(backend, q, k, v, mask) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _best_trials_by_path(db: str) -> dict[tuple[str, str], dict]:
    """Best ok trial per (key, path) from the DB, for 'tuned TMA vs tuned portable'."""
    from sqlalchemy import create_engine, text

    from tritune.kernels import settings

    engine = create_engine(settings.db_url_from(db))
    best: dict[tuple[str, str], tuple[float, dict]] = {}
    with engine.connect() as conn:
        for key_json, config_json, time_ms in conn.execute(
            text("SELECT key_json, config_json, time_ms FROM trials WHERE kernel='tma_prefill' AND status='ok'")
        ):
            config = json.loads(config_json)
            key = json.dumps(json.loads(key_json), sort_keys=True)
            slot = (key, config.get("path", "portable"))
            if slot not in best or time_ms < best[slot][0]:
                best[slot] = (time_ms, config)
    return {slot: cfg for slot, (_, cfg) in best.items()}


def _fmt(r: Row) -> str:
    t = f"{r.ms:.3f} ms" if r.ms is not None else "-"
    f = f"{r.tflops:.0f} TFLOP/s" if r.tflops is not None else ""
    return f"{r.shape:28s} {r.impl:30s} {t:>12s} {f:>14s} err={r.max_err} {r.note}"


def _table(rows: list[Row]) -> str:
    lines = ["| shape | implementation | time (ms) | TFLOP/s | vs fastest peer | max err (sampled rows) | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    peers = ("SDPA flash", "SDPA cuDNN", "FlexAttention")
    for shape in dict.fromkeys(r.shape for r in rows):
        group = [r for r in rows if r.shape == shape]
        peer_times = [r.ms for r in group if r.impl in peers and r.ms is not None]
        fastest = min(peer_times) if peer_times else None
        for r in group:
            ratio = f"{fastest / r.ms:.2f}x" if (fastest and r.ms) else "-"
            lines.append(
                f"| {shape} | {r.impl} | {r.ms:.3f} | {r.tflops:.0f} | {ratio} | {r.max_err:.2e} | {r.note} |"
                if r.ms is not None
                else f"| {shape} | {r.impl} | - | - | - | {r.max_err if r.max_err is not None else '-'} | {r.note} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

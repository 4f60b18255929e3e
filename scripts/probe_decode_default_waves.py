"""Time the decode kernel's wave targets at large batches: the unsplit default against splits.

On the GPU machine:

    python scripts/probe_decode_default_waves.py --json F.json

Hq=32, Hkv=8, bf16, one new token, D in {128, 64}, B in {32, 48, 64, 128}, caches of 1K to 128K
(K+V up to 64 x 128K x 8 heads). Each cell runs the space's default tiles at wave targets 2, 8,
16 and 32 and at target 2 with 4 stages, each one call captured in a CUDA graph and its replay
timed with ``triton.testing.do_bench`` (L2 flushed). Caches of 16K or more also run with
per-sequence lengths drawn from [L/2, L] (no peer there); equal lengths also time SDPA's cuDNN
backend and check each config's output against it. A probe of the default's rule, not a
benchmark record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from tritune.kernels.decode.launch import launch
from tritune.search_spaces.splitk_decode import DecodeConfig

HQ, HKV = 32, 8
VARIANTS = {
    "W2": {},
    "W2s4": {"num_stages": 4},
    "W8": {"TARGET_WAVES": 8},
    "W16": {"TARGET_WAVES": 16},
    "W32": {"TARGET_WAVES": 32},
}


def replay_us(fn: Callable[[], object]) -> float:
    """Median replay time of one ``fn()`` captured in a CUDA graph (warmed on a side stream first)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=10, rep=60)


def probe_cell(d: int, b: int, lkv: int, ragged: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[dict]:
    """Every variant (and cuDNN at equal lengths) at one cell."""
    if ragged:
        gen = torch.Generator(device="cpu").manual_seed(1)
        lens = torch.randint(lkv // 2, lkv + 1, (b,), generator=gen, dtype=torch.int32).to(q.device)
    else:
        lens = torch.full((b,), lkv, device=q.device, dtype=torch.int32)
    kv_bytes = 2 * int(lens.sum()) * HKV * d * 2
    cell = {"D": d, "B": b, "Lkv": lkv, "ragged": ragged}
    rows, ref = [], None
    if not ragged:

        def cudnn() -> torch.Tensor:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        ref = cudnn().float()
        us = replay_us(cudnn)
        rows.append({**cell, "impl": "cudnn", "us": us, "tbs": kv_bytes / us / 1e6})
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(d)
    for name, changes in VARIANTS.items():
        config = dataclasses.replace(DecodeConfig(), **changes)

        def call(config: DecodeConfig = config) -> None:
            launch(config, q, k, v, lens, scale, out)

        out.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        err = float((out.float() - ref).abs().max()) if ref is not None else float("nan")
        finite = bool(torch.isfinite(out).all())
        us = replay_us(call)
        rows.append({**cell, "impl": name, "us": us, "tbs": kv_bytes / us / 1e6, "err": err, "finite": finite})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="file to write the rows to")
    args = parser.parse_args()
    rows: list[dict] = []
    for d in (128, 64):
        for b in (32, 48, 64, 128):
            for lkv in (1024, 4096, 16384, 32768, 131072):
                if b * lkv > 64 * 131072:
                    continue
                torch.manual_seed(0)
                q = torch.randn(b, HQ, 1, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, HKV, lkv, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, HKV, lkv, d, device="cuda", dtype=torch.bfloat16)
                for ragged in (False, True) if lkv >= 16384 else (False,):
                    cell = probe_cell(d, b, lkv, ragged, q, k, v)
                    rows += cell
                    print(" | ".join([f"D={d} B={b} Lkv={lkv} ragged={int(ragged)}"] +
                                     [f"{r['impl']} {r['us']:.1f}" for r in cell]), flush=True)  # fmt: skip
                del q, k, v
                torch.cuda.empty_cache()
    with open(args.json, "w") as fh:
        meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
        json.dump({**meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Probe: the Q4_K GEMV path (dp4a on the CUDA cores) at decode sizes, and where its time goes.

For each shape (K x N) and M, CUDA-graph replays with the L2 flushed before each (the tuner's
timer for launch-bound keys) of: the GEMV pre-pass alone (x to int8 words, scales, sums); whole
GEMV calls at a few configs; the portable default; bf16 cuBLAS on the dequantized weight; and the
weight-read floor (Q4_K bytes at 4.27 TB/s). On the GPU machine:
``python scripts/probe_q4k_dp4a.py --out dp4a.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch

SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096))  # (K, N)
CONFIGS = (
    {"path": "gemv", "BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 1},
    {"path": "gemv", "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 1},
    {"path": "gemv", "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 8, "SPLIT_K": 1},
    {"path": "gemv", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 1},
    {"path": "gemv", "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 2},
    {"path": "gemv", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 4},
)
#: Device-to-device copy rate of the H200 (../shared/gpu/README.md), bytes read plus written.
PEAK_BYTES_PER_S = 4.27e12


def _rows_for(k: int, n: int, m: int, weight, dense: torch.Tensor, x: torch.Tensor) -> list[str]:
    from tritune.kernels import q4k_linear, use_config
    from tritune.kernels.q4k import launch
    from tritune.kernels.q4k.reference import q4k_linear_reference, sqnr_db

    expected = q4k_linear_reference(x, weight)
    cublas_us, _ = bl.graph_replay_us(lambda: x @ dense.t())
    portable_us, out = bl.graph_replay_us(lambda: q4k_linear(x, weight))
    results = [("bf16 cuBLAS", cublas_us, None), ("portable default", portable_us, sqnr_db(out.float(), expected))]
    prepass_us, _ = bl.graph_replay_us(lambda: launch.quantize_rows_gemv(x)[0])
    results.append(("GEMV pre-pass alone", prepass_us, None))
    results.append(("weight-read floor", weight.nbytes / PEAK_BYTES_PER_S * 1e6, None))
    for config in CONFIGS:
        with use_config("q4k_fp8_gemm", config):
            us, out = bl.graph_replay_us(lambda: q4k_linear(x, weight))
        label = " ".join(f"{key}={value}" for key, value in config.items())
        results.append((label, us, sqnr_db(out.float(), expected)))
    rows = []
    for label, us, sqnr in results:
        quality = f"{sqnr:.1f}" if sqnr is not None else ""
        rows.append(
            f"| {k} x {n} | {m} | {label} | {us:.1f} | {bl.ratio(portable_us, us)} | {bl.ratio(cublas_us, us)} | "
            f"{quality} |"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=int, action="append")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from tritune.kernels import Q4KWeight

    device = torch.device("cuda")
    rows = [
        "| K x N | M | what | us | speed vs portable | speed vs cuBLAS | SQNR dB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, n in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        weight = Q4KWeight.quantize(torch.randn(n, k, generator=gen, device=device) * 0.02)
        dense = weight.dequantize().to(torch.bfloat16)
        for m in args.m or [1, 4, 8]:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            rows += _rows_for(k, n, m, weight, dense, x)
    notes = ["CUDA-graph replays, L2 flushed before each (median). Speed ratios: the other's time / this one's."]
    return bl.finish_probe(device, "Q4_K GEMV (dp4a) probe", notes, rows, args.out)


if __name__ == "__main__":
    sys.exit(main())

"""Time each step of the Q4_K staged path on its own, to see where a staged call's time goes.

On the GPU machine: ``python scripts/probe_q4k_staged.py --out staged.md``.

Steps, each a median of ``triton.testing.do_bench`` (L2 flushed) at M in ``--m``, K=4096, N=14336:
the pre-pass (e4m3 rows and the column folds, one launch), one chunk's dequantization, one chunk's
``torch._scaled_mm`` written into a column slice of ``out`` and into a contiguous buffer, the
``_scaled_mm`` of the whole N (the ceiling), and the whole staged call through ``q4k_linear``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch
from torch._library.triton import set_wrap_triton_enabled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=int, action="append")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from tritune.kernels import Q4KWeight, q4k_linear
    from tritune.kernels.q4k import launch

    device = torch.device("cuda")
    k, n, chunk = 4096, 14336, args.chunk
    weight = Q4KWeight.quantize(torch.randn(n, k, device=device) * 0.02)
    qs, scales, mins, ss = weight.tensors()
    scratch = torch.empty((chunk, k), dtype=torch.float8_e4m3fn, device=device)

    def prepass(x: torch.Tensor):
        # As inside the op body: wrap_triton off, so the launch reaches the bare kernel.
        with set_wrap_triton_enabled(False):
            return launch.staged_prepass(x, ss, interpreted=False)

    inv_fold = prepass(torch.randn(1, k, device=device).bfloat16())[2]

    def dequant(block_n: int, block_k: int, warps: int):
        def run() -> None:
            with set_wrap_triton_enabled(False):
                launch.dequantize_chunk(qs, scales, mins, ss, inv_fold, scratch, 0, chunk, block_n=block_n,
                                        block_k=block_k, num_warps=warps, interpreted=False)  # fmt: skip

        return run

    rows = ["| step | M | us | note |", "| --- | --- | --- | --- |"]

    def add(step: str, m: int | str, fn, note: str = "") -> None:
        fn()
        torch.cuda.synchronize()
        us = bl.time_ms(fn, device) * 1e3
        rows.append(f"| {step} | {m} | {us:.1f} | {note} |")
        print(rows[-1], flush=True)

    for bn, bk, w in ((32, 256, 4), (64, 128, 4), (128, 128, 8), (128, 256, 8)):
        moved = chunk * k * 1.0 + chunk * k / 2
        add(f"dequant {chunk} rows BLOCK_N={bn} BLOCK_K={bk} warps={w}", "-", dequant(bn, bk, w),
            f"{moved / 1e6:.1f} MB moved")  # fmt: skip
    for m in args.m or [256, 4096]:
        x = torch.randn(m, k, device=device).bfloat16()
        xq, row_scale, _ = prepass(x)

        def quantize(x=x) -> None:
            prepass(x)

        add("pre-pass: quantize rows and column folds", m, quantize)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
        tmp = torch.empty((m, chunk), dtype=torch.bfloat16, device=device)
        sa = row_scale.view(m, 1)

        def mm_slice(sa=sa, xq=xq, out=out) -> None:
            torch._scaled_mm(xq, scratch.t(), scale_a=sa, scale_b=inv_fold[:, :chunk], out_dtype=torch.bfloat16,
                             out=out[:, :chunk])  # fmt: skip

        def mm_contig(sa=sa, xq=xq, tmp=tmp) -> None:
            torch._scaled_mm(xq, scratch.t(), scale_a=sa, scale_b=inv_fold[:, :chunk], out_dtype=torch.bfloat16,
                             out=tmp)  # fmt: skip

        add(f"_scaled_mm {m}x{chunk}x{k} into a column slice of out", m, mm_slice)
        add(f"_scaled_mm {m}x{chunk}x{k} into a contiguous buffer", m, mm_contig)
        full = torch.randn((n, k), device=device).to(torch.float8_e4m3fn)
        add(f"_scaled_mm {m}x{n}x{k} (whole N, ceiling)", m,
            lambda sa=sa, xq=xq, full=full: torch._scaled_mm(xq, full.t(), scale_a=sa, scale_b=inv_fold,
                                                             out_dtype=torch.bfloat16))  # fmt: skip
        del full
        for c in (2048, 4096, 8192):
            config = {"path": "staged", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "CHUNK_N": c}
            call = bl.pinned_call("q4k_fp8_gemm", config, q4k_linear, x, weight)
            add(f"whole staged call CHUNK_N={c}", m, call)
            graph, _ = bl.capture_graph(call)
            us = bl.graph_replay_ms(graph) * 1e3
            rows.append(f"| whole staged call CHUNK_N={c}, graph replay | {m} | {us:.1f} | |")
            print(rows[-1], flush=True)
        del x, xq, out, tmp
        torch.cuda.empty_cache()
    return bl.finish_probe(device, "Q4_K staged path, step by step", [f"K={k}, N={n}, chunk {chunk} rows"], rows,
                           args.out)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

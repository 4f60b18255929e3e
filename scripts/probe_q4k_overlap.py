"""Probe: does the staged Q4_K path gain from dequantizing the next chunk on a side stream?

The staged path alternates, per chunk of ``CHUNK_N`` weight rows, a memory-bound dequantization
into one scratch buffer and cuBLASLt's fp8 GEMM on it, all on one stream. At M=4096, K=14336,
N=4096 it runs in 485 us against 391 us for ``_scaled_mm`` alone; about 25 us of that is the
dequantization. Here, two scratch buffers and a side stream let chunk ``i + 1``'s dequantization
run while chunk ``i``'s GEMM does (events order each buffer's reuse). Both variants are timed as
CUDA-graph replays (the capture records the fork and join) and eagerly, L2 flushed, checked
against each other first.

On the GPU machine: ``python scripts/probe_q4k_overlap.py --out overlap.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch

#: (K, N, M, staged config as the shipped bundle has it at that key).
CASES = (
    (14336, 4096, 4096, {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "CHUNK_N": 2048, "FAST_ACCUM": False}),
    (4096, 14336, 4096, {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "CHUNK_N": 4096, "FAST_ACCUM": True}),
    (4096, 4096, 4096, {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "CHUNK_N": 2048, "FAST_ACCUM": False}),
    (14336, 4096, 1024, {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "CHUNK_N": 2048, "FAST_ACCUM": False}),
)


class Overlapped:
    """The staged path with two scratch buffers and the dequantization on a side stream."""

    def __init__(self, weight, m: int, config: dict, chunk: int) -> None:
        self.weight, self.config, self.chunk = weight, config, chunk
        n, k = weight.shape
        device = weight.qs.device
        self.buffers = [torch.empty((chunk, k), dtype=torch.float8_e4m3fn, device=device) for _ in range(2)]
        self.side = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range((n + chunk - 1) // chunk)]
        self.free = [torch.cuda.Event() for _ in range((n + chunk - 1) // chunk)]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from tritune.kernels.q4k.launch import dequantize_chunk, staged_prepass

        w = self.weight
        n = w.shape[0]
        m = x.shape[0]
        main = torch.cuda.current_stream()
        xq, row_scale, inv_fold = staged_prepass(x, w.super_scales, interpreted=False)
        self.side.wait_stream(main)
        starts = list(range(0, n, self.chunk))
        for i, row0 in enumerate(starts):
            rows = min(self.chunk, n - row0)
            buffer = self.buffers[i % 2]
            with torch.cuda.stream(self.side):
                if i >= 2:
                    self.side.wait_event(self.free[i - 2])
                dequantize_chunk(
                    w.qs, w.scales, w.mins, w.super_scales, inv_fold, buffer, row0, rows,
                    block_n=self.config["BLOCK_N"], block_k=self.config["BLOCK_K"],
                    num_warps=self.config["num_warps"], interpreted=False,
                )  # fmt: skip
                self.ready[i].record(self.side)
            main.wait_event(self.ready[i])
            torch._scaled_mm(
                xq, buffer[:rows].t(), scale_a=row_scale.view(m, 1), scale_b=inv_fold[:, row0 : row0 + rows],
                out_dtype=out.dtype, use_fast_accum=self.config["FAST_ACCUM"], out=out[:, row0 : row0 + rows],
            )  # fmt: skip
            self.free[i].record(main)
        main.wait_stream(self.side)
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from tritune.kernels import Q4KWeight, q4k_linear
    from tritune.tuner.timing import GpuTimer

    device = torch.device("cuda")
    timer = GpuTimer()
    lines = [
        "| K x N | M | variant | CHUNK_N | graph us | eager us | vs _scaled_mm (graph) | max abs diff vs shipped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    torch.manual_seed(0)
    for k, n, m, config in CASES:
        weight = Q4KWeight.quantize(torch.randn(n, k, device=device) * 0.02)
        x = torch.randn(m, k, device=device).bfloat16()
        out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
        ref = torch.empty_like(out)
        pinned = {"path": "staged", **config}
        shipped = bl.pinned_call("q4k_fp8_gemm", pinned, q4k_linear, x, weight, out=ref)
        shipped()
        w8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        x8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        sa = torch.ones((m, 1), device=device)
        sb = torch.ones((1, n), device=device)

        def ceiling(x8=x8, w8=w8, sa=sa, sb=sb) -> torch.Tensor:
            return torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        def both(fn) -> tuple[float, float]:
            graph = timer.measure(fn, config=None, flush_l2=True, launch_bound=True).ms * 1e3
            eager = timer.measure(fn, config=None, flush_l2=True, launch_bound=False).ms * 1e3
            return graph, eager

        ceil_graph, _ = both(ceiling)
        g, e = both(shipped)
        lines.append(f"| {k} x {n} | {m} | shipped staged | {config['CHUNK_N']} | {g:.1f} | {e:.1f} | "
                     f"{ceil_graph / g:.2f}x | 0 |")  # fmt: skip
        for chunk in sorted({config["CHUNK_N"], 1024, 2048}):
            variant = Overlapped(weight, m, config, chunk)
            out.fill_(float("nan"))
            variant(x, out)
            torch.cuda.synchronize()
            diff = float((out.float() - ref.float()).abs().max())
            g, e = both(lambda variant=variant, x=x, out=out: variant(x, out))
            lines.append(f"| {k} x {n} | {m} | side-stream overlap | {chunk} | {g:.1f} | {e:.1f} | "
                         f"{ceil_graph / g:.2f}x | {diff:.3g} |")  # fmt: skip
        lines.append(f"| {k} x {n} | {m} | _scaled_mm alone (ceiling) | | {ceil_graph:.1f} | | 1.00x | |")
        print("\n".join(lines[-5:]), flush=True)
        del weight, x, out, ref, w8, x8
        torch.cuda.empty_cache()
    return bl.finish_probe(device, "Q4_K staged path: side-stream overlap probe", [], lines, args.out)


if __name__ == "__main__":
    sys.exit(main())

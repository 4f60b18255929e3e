"""Time the tma path's shared weight tile (two warpgroups over one 64-row weight tile, each with
its own rows of x) against the 128 x 256 tiles it sits beside, bf16 cuBLAS and the call's default.

On the GPU machine:

    python scripts/probe_q4k_shared_tile.py --json F.json

Shapes (K x N) 4096 x 14336, 14336 x 4096 and 4096 x 4096; M 512 to 4096. Each tile is pinned
unsplit with ``launch_tma`` (no feasibility check, so the probe sees what the space would admit
or refuse): 256 rows of x over 128 weight rows (8 warps, 3 stages), 512 rows over 64 (8 warps, 2
or 3 stages), 256 rows over 64 shared by two warpgroups (4 stages; and 128-deep K tiles, 3 stages),
packed (bf16 dequantization, ``-p``) or in float32. Times: the replay of one call captured in a
CUDA graph (``triton.testing.do_bench``, median); NMSE against the float64 product with the
exactly dequantized weight. A probe of the tiles, not a benchmark record.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton

from tritune.kernels.q4k.kernel import q4k_linear
from tritune.kernels.q4k.launch_tma import launch_tma
from tritune.kernels.q4k.weight import Q4KWeight
from tritune.search_spaces.q4k_fp8_gemm import TmaConfig

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, PACKED_DEQUANT) of each pinned tile.
TILES = [
    (256, 128, 64, 8, 3, True),
    (256, 128, 64, 8, 3, False),
    (512, 64, 64, 8, 3, True),
    (512, 64, 64, 8, 3, False),
    (512, 64, 64, 8, 2, True),
    (256, 64, 64, 8, 4, True),
    (256, 64, 128, 8, 3, True),
]


def graph_us(fn: Callable[[], object]) -> float:
    """Median replay time of one call captured in a CUDA graph, in microseconds."""
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
    return 1e3 * float(triton.testing.do_bench(graph.replay, warmup=10, rep=50))


def _cells(x: torch.Tensor, weight: Q4KWeight, out: torch.Tensor) -> list[tuple[str, Callable[[], object]]]:
    """The calls timed at one (shape, M): cuBLAS on the dequantized weight, the served call, each tile."""
    dense = weight.dequantize().to(torch.bfloat16)
    parts = (weight.qs, weight.scales, weight.mins, weight.super_scales)
    cells: list[tuple[str, Callable[[], object]]] = [
        ("cublas", lambda: torch.mm(x, dense.t(), out=out)),
        ("served", lambda: q4k_linear(x, weight, out=out)),
    ]
    for bm, bn, bk, warps, stages, packed in TILES:
        config = TmaConfig(
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SWAP_AB=True, PACKED_DEQUANT=packed
        )
        name = f"tma-{bm}x{bn}x{bk}-w{warps}-s{stages}{'-p' if packed else ''}"
        cells.append((name, lambda config=config: launch_tma(config, x, parts, None, out)))
    return cells


def probe(shapes: list[tuple[int, int]], ms: list[int]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    torch.manual_seed(0)
    for k, n in shapes:
        weight = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            expected = torch.mm(x.double(), weight.dequantize().double().t())
            for name, fn in _cells(x, weight, out):
                try:
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    nmse = float(((out.double() - expected).norm() / expected.norm()) ** 2)
                    us = graph_us(fn)
                except Exception as exc:  # a tile the GPU refuses (shared memory) is reported and skipped
                    print(f"{k}x{n} M={m} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                rows.append({"k": k, "n": n, "m": m, "impl": name, "us": us, "nmse": nmse})
                print(f"{k}x{n} M={m} {name}: {us:.1f} us, NMSE {nmse:.1e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="file to write the rows to")
    parser.add_argument("--shape", action="append", help="K x N, as 4096x14336 (repeatable)")
    parser.add_argument("--m", action="append", type=int, help="rows of x (repeatable)")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shape or ["4096x14336", "14336x4096", "4096x4096"])]
    rows = probe([(k, n) for k, n in shapes], args.m or [512, 1024, 2048, 4096])
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
    with open(args.json, "w") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

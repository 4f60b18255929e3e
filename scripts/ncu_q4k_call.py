"""One pinned Q4_K GEMM for Nsight Compute: the tma kernel with a tile of
``scripts/probe_q4k_tma_tiles.py`` (``--tile``), or bf16 cuBLAS on the dequantized weight
(``--cublas``), launched twice (the first launch compiles; profile the second).

    ncu --clock-control none --launch-skip 1 --launch-count 1 ... \\
        python scripts/ncu_q4k_call.py --shape 4096x14336 --m 2048 --tile 512x64x64-w8-s3-p
"""

from __future__ import annotations

import argparse

import torch

from tritune.kernels.q4k.launch_tma import launch_tma
from tritune.kernels.q4k.weight import Q4KWeight


def main() -> None:
    from probe_q4k_tma_tiles import tile_config  # scripts/ is on sys.path when run as a script

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096x14336", help="K x N")
    parser.add_argument("--m", type=int, default=2048, help="rows of x")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tile", help="a tma tile, as 512x64x64-w8-s3-p")
    which.add_argument("--cublas", action="store_true", help="bf16 cuBLAS on the dequantized weight")
    args = parser.parse_args()
    k, n = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    weight = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
    if args.cublas:
        dense = weight.dequantize().to(torch.bfloat16)
        torch.cuda.synchronize()
        for _ in range(2):
            torch.mm(x, dense.t(), out=out)
    else:
        config = tile_config(args.tile)
        parts = (weight.qs, weight.scales, weight.mins, weight.super_scales)
        for _ in range(2):
            launch_tma(config, x, parts, None, out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

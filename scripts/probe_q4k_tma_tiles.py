"""Time pinned tiles of the Q4_K tma path against bf16 cuBLAS and the call's default.

On the GPU machine:

    python scripts/probe_q4k_tma_tiles.py --json F.json [--tile 256x64x64-w8-s4-p ...]

Shapes (K x N) 4096 x 14336, 14336 x 4096 and 4096 x 4096 (``--shape``); M 256 to 4096 (``--m``).
Each tile is pinned, swapped and unsplit, with ``launch_tma`` (no feasibility check, so the probe
sees what the space would admit or refuse). A tile is named ``BMxBNxBK-wW-sS[-p][-l|-lw|-rs|-lwrs]``:
rows of x x weight rows x K depth, warps, ring stages, ``-p`` dequantized in x's dtype
(``PACKED_DEQUANT``, else float32), ``-l`` the scales loaded into registers (else by TMA where the
launch allows it), ``-lw`` the copies issued by a loader warp (``LOADER_WARP``), ``-rs`` the weight
tile in wgmma's A registers (``W_REGISTERS``; packed only), ``-lwrs`` both.
Times: the replay of one call captured in a CUDA graph (``triton.testing.do_bench``, median);
NMSE against the float64 product with the exactly dequantized weight. A probe of the tiles, not a
benchmark record.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable

import torch
import triton

from tritune.kernels.q4k.kernel import q4k_linear
from tritune.kernels.q4k.launch_tma import launch_tma
from tritune.kernels.q4k.weight import Q4KWeight
from tritune.search_spaces.q4k_fp8_gemm import TmaConfig

#: The tiles pinned when no ``--tile`` is given: the M >= 512 defaults, the 128-row weight tile,
#: and tiles small enough for two CTAs an SM.
TILES = [
    "512x64x64-w8-s3-p",
    "256x64x64-w8-s4-p",
    "256x128x64-w8-s3-p",
    "256x64x64-w8-s2-p",
    "256x64x128-w8-s2-p",
    "128x64x64-w4-s4-p",
]
_TILE = re.compile(r"(\d+)x(\d+)x(\d+)-w(\d+)-s(\d+)(-p)?(-l|-lw|-rs|-lwrs)?")


def tile_config(name: str) -> TmaConfig:
    """The swapped, unsplit tma config a tile name stands for (see the module's docstring)."""
    match = _TILE.fullmatch(name)
    if match is None:
        raise SystemExit(f"--tile {name!r}: expected BMxBNxBK-wW-sS[-p][-l|-lw|-rs|-lwrs], as 256x64x64-w8-s4-p")
    bm, bn, bk, warps, stages = (int(v) for v in match.groups()[:5])
    return TmaConfig(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SWAP_AB=True,
        PACKED_DEQUANT=match.group(6) is not None, LOADER_WARP=match.group(7) in ("-lw", "-lwrs"),
        W_REGISTERS=match.group(7) in ("-rs", "-lwrs"),
    )  # fmt: skip


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


def _cells(
    x: torch.Tensor, weight: Q4KWeight, out: torch.Tensor, tiles: list[str]
) -> list[tuple[str, Callable[[], object]]]:
    """The calls timed at one (shape, M): cuBLAS on the dequantized weight, the served call, each tile."""
    dense = weight.dequantize().to(torch.bfloat16)
    parts = (weight.qs, weight.scales, weight.mins, weight.super_scales)
    cells: list[tuple[str, Callable[[], object]]] = [
        ("cublas", lambda: torch.mm(x, dense.t(), out=out)),
        ("served", lambda: q4k_linear(x, weight, out=out)),
    ]
    for name in tiles:
        config, by_tma = tile_config(name), not name.endswith("-l")
        cells.append((name, lambda config=config, by_tma=by_tma: launch_tma(config, x, parts, None, out, by_tma)))
    return cells


def probe(shapes: list[tuple[int, int]], ms: list[int], tiles: list[str]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    torch.manual_seed(0)
    for k, n in shapes:
        weight = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            expected = torch.mm(x.double(), weight.dequantize().double().t())
            for name, fn in _cells(x, weight, out, tiles):
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
    parser.add_argument("--tile", action="append", help="a tile to pin, as 256x64x64-w8-s4-p (repeatable)")
    args = parser.parse_args()
    tiles = args.tile or TILES
    for name in tiles:
        tile_config(name)
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shape or ["4096x14336", "14336x4096", "4096x4096"])]
    rows = probe([(k, n) for k, n in shapes], args.m or [256, 512, 1024, 2048, 4096], tiles)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
    with open(args.json, "w") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

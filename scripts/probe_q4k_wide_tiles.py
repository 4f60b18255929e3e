"""Time tma tiles (BLOCK_M 128/256) against bf16 cuBLAS and the dispatcher at mid and large M."""

import json
import sys

import torch
from triton.testing import do_bench

from tritune.kernels import Q4KWeight, q4k_linear, use_config

SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096)]
MS = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 256, 512, 1024, 2048, 4096]
BASE = dict(path="tma", SWAP_AB=True)
TILES = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2),
]


def graph_time(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return do_bench(g.replay, warmup=10, rep=40), out


def main():
    rows = []
    for k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(k + n)
        w = Q4KWeight.quantize(torch.randn(n, k, generator=gen, device="cuda") * 0.02)
        w32 = w.dequantize()
        wb = w32.to(torch.bfloat16)
        for m in MS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = x.double() @ w32.double().t()

            def sqnr(out):
                e = (out.double() - ref).square().sum() / ref.square().sum()
                return float(-10 * torch.log10(e))

            t_cublas, _ = graph_time(lambda: x @ wb.t())
            t_disp, o = graph_time(lambda: q4k_linear(x, w))
            row = dict(k=k, n=n, m=m, cublas_us=t_cublas * 1e3, dispatcher_us=t_disp * 1e3, dispatcher_db=sqnr(o))
            best = None
            for tile in TILES:
                if tile["BLOCK_M"] > max(m, 16):
                    continue
                tiles_mn = -(-m // tile["BLOCK_M"]) * (n // tile["BLOCK_N"])
                for split in (1, 2, 4):
                    if split > 1 and tiles_mn * split > 3 * 132:
                        continue
                    cfg = {**BASE, **tile, "SPLIT_K": split}
                    name = "tma %dx%dx%d w%d s%d k%d" % (
                        tile["BLOCK_M"],
                        tile["BLOCK_N"],
                        tile["BLOCK_K"],
                        tile["num_warps"],
                        tile["num_stages"],
                        split,
                    )
                    try:
                        with use_config("q4k_fp8_gemm", cfg):
                            t, o = graph_time(lambda: q4k_linear(x, w))
                        db = sqnr(o)
                    except Exception as exc:
                        print(f"  {name}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                        continue
                    row[name] = (t * 1e3, db)
                    if best is None or t * 1e3 < best[1]:
                        best = (name, t * 1e3)
            row["best"] = best
            rows.append(row)
            print(
                json.dumps(
                    {
                        kk: (round(v, 1) if isinstance(v, float) else v)
                        for kk, v in row.items()
                        if kk in ("k", "n", "m", "cublas_us", "dispatcher_us", "dispatcher_db")
                    }
                ),
                "best",
                best and (best[0], round(best[1], 1), round(t_cublas * 1e3 / best[1], 2)),
                flush=True,
            )
            del x, ref
        torch.cuda.empty_cache()
    json.dump(rows, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/probe256.json", "w"), indent=1)


main()

"""Probe: the one-launch Q4_K GEMV with its lanes along K at 2, 4 and 8 rows of x, against the
tiles the shipped bundle serves there.

    python scripts/probe_q4k_gemv_k_lanes_rows.py          # on a GPU host

At the three Llama-3-8B shapes (K x N) and M 2/4/8: ``q4k_linear`` as the dispatcher serves it
(the shipped bundle), and 14 shuffled one-launch ``K_LANES`` GEMV tiles (up to 64 product words a
thread), each a CUDA-graph replay timed by ``triton.testing.do_bench`` (L2 flushed before every
repetition), with the NMSE of the fastest against the fp64 product of the exact dequantized weight.
The GEMV's space admitted one row only when this ran; the tiles launch directly.
"""

import concurrent.futures as cf
import functools
import itertools
import random
import time

import torch
import triton

from tritune.kernels import q4k_linear
from tritune.kernels.q4k.launch import launch
from tritune.kernels.q4k.weight import Q4KWeight
from tritune.search_spaces.q4k_fp8_gemm import SPACE

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
MS = (2, 4, 8)


def candidates(k, n, m):
    out = []
    for bn, bk, nw, split in itertools.product((32, 64, 128), (256, 512, 1024), (4, 8), (1, 2, 4, 8)):
        words = bn * bk // 8
        if bk > 128 * nw or m * words // (32 * nw) > 64 or words < 128 * nw or k % (bk * split):
            continue
        ctas = (n // bn) * split
        if ctas < 128 or ctas > 4000:
            continue
        tile = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "SPLIT_K": split}
        out.append({"path": "gemv", **tile, "FUSE_QUANT": True, "FUSED_REDUCE": split > 1, "K_LANES": True})
    random.Random(k + n + m).shuffle(out)
    return out[:14]


def make(k, n, m):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = Q4KWeight.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    return w, x


def _compile(job):
    k, n, m = job
    w, x = make(k, n, m)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bad = []
    for c in candidates(k, n, m):
        try:
            launch(SPACE.parse(c), x, w, None, out)
        except Exception as e:
            bad.append((c, str(e)[:200]))
    torch.cuda.synchronize()
    return bad


def graph_time(fn):
    """us per CUDA-graph replay of ``fn``."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench(g.replay, warmup=25, rep=120)


def main():
    t0 = time.time()
    jobs = [(k, n, m) for k, n in SHAPES for m in MS]
    ctx = torch.multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(9, mp_context=ctx) as pool:
        for bad in pool.map(_compile, jobs):
            for b in bad:
                print("compile failed", b, flush=True)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    for k, n, m in jobs:
        w, x = make(k, n, m)
        ref = x.double() @ w.dequantize().double().T
        served = graph_time(functools.partial(q4k_linear, x, w))
        rows = []
        for c in candidates(k, n, m):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            cc = SPACE.parse(c)
            try:
                t = graph_time(functools.partial(launch, cc, x, w, None, out))
            except Exception as e:
                print("run failed", c, str(e)[:150], flush=True)
                continue
            err = ((out.double() - ref) ** 2).mean().item() / (ref**2).mean().item()
            rows.append((t, {f: c[f] for f in ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K")}, err))
        rows.sort(key=lambda r: r[0])
        best = rows[0]
        print(
            f"{k}x{n} M={m}: served {served:.2f} us; best K_LANES gemv {best[0]:.2f} us "
            f"({served / best[0]:.2f}x) nmse {best[2]:.1e} {best[1]}; 2nd {rows[1][0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

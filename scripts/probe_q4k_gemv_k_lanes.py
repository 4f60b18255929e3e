"""Probe: the one-launch Q4_K GEMV with its lanes along K (``K_LANES``) against the shipped M=1 winners.

    python scripts/probe_q4k_gemv_k_lanes.py          # on a GPU host; SHAPE_CAP=seconds per shape

At the three Llama-3-8B shapes (K x N) and M=1: each shipped winner, the same tiles with
``K_LANES``, and then every one-launch ``K_LANES`` tile the rules below admit (shuffled, up to
``SHAPE_CAP`` seconds a shape), each timed as a CUDA-graph replay by ``triton.testing.do_bench``
(which flushes the L2 before every repetition) with its NMSE against the fp64 product of the exact
dequantized weight. Tiles compile first in parallel processes. Prints the ten fastest a shape and
writes all rows to ``$OUT/klanes_probe.json``.
"""

import concurrent.futures as cf
import functools
import itertools
import json
import os
import random
import time

import torch
import triton

from tritune.kernels.q4k.launch import launch
from tritune.kernels.q4k.weight import Q4KWeight
from tritune.search_spaces.q4k_fp8_gemm import SPACE

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # K x N
OFFICIAL = {
    (4096, 4096): dict(
        path="gemv", BLOCK_N=128, BLOCK_K=256, num_warps=4, SPLIT_K=8, FUSE_QUANT=True, FUSED_REDUCE=True
    ),
    (4096, 14336): dict(
        path="gemv", BLOCK_N=32, BLOCK_K=512, num_warps=4, SPLIT_K=1, FUSE_QUANT=True, FUSED_REDUCE=False
    ),
    (14336, 4096): dict(
        path="gemv", BLOCK_N=128, BLOCK_K=256, num_warps=4, SPLIT_K=8, FUSE_QUANT=True, FUSED_REDUCE=True
    ),
}
CAP = float(os.environ.get("SHAPE_CAP", "60"))


def candidates(k, n):
    out = []
    for bn, bk, nw, split in itertools.product((32, 64, 128, 256), (128, 256, 512, 1024), (2, 4, 8), (1, 2, 4, 8)):
        words = bn * bk // 8
        if bk > 128 * nw or words // (32 * nw) > 32 or words < 128 * nw:
            continue
        if k % (bk * split):
            continue
        ctas = (n // bn) * split
        if ctas < 64 or ctas > 8000:
            continue
        out.append(
            dict(
                path="gemv",
                BLOCK_N=bn,
                BLOCK_K=bk,
                num_warps=nw,
                SPLIT_K=split,
                FUSE_QUANT=True,
                FUSED_REDUCE=split > 1,
                K_LANES=True,
            )
        )
    return out


def make(k, n):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = Q4KWeight.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
    return w, x


def _compile(job):
    k, n, cands = job
    w, x = make(k, n)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    bad = []
    for c in cands:
        try:
            launch(SPACE.parse(c), x, w, None, out)
        except Exception as e:
            bad.append((c, str(e)[:300]))
    torch.cuda.synchronize()
    return bad


def graph_time(config, x, w, out):
    """us per CUDA-graph replay of one call with ``config`` (L2 flushed before each repetition)."""
    parsed = SPACE.parse(config)
    call = functools.partial(launch, parsed, x, w, None, out)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench(graph.replay, warmup=25, rep=150)


def nmse(out, ref):
    return ((out.double() - ref) ** 2).mean().item() / (ref**2).mean().item()


def poisoned(n):
    return torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)


def main():
    t0 = time.time()
    jobs = []
    for k, n in SHAPES:
        c = [*candidates(k, n), OFFICIAL[k, n], {**OFFICIAL[k, n], "K_LANES": True}]
        for i in range(0, len(c), 8):
            jobs.append((k, n, c[i : i + 8]))
    print("candidates", {f"{k}x{n}": len(candidates(k, n)) for k, n in SHAPES}, flush=True)
    ctx = torch.multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(14, mp_context=ctx) as pool:
        for bad in pool.map(_compile, jobs):
            for b in bad:
                print("compile failed", b, flush=True)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    results = {}
    for k, n in SHAPES:
        w, x = make(k, n)
        ref = x.double() @ w.dequantize().double().T
        mb = w.nbytes
        out0 = poisoned(n)
        t_off = graph_time(OFFICIAL[k, n], x, w, out0)
        print(f"{k}x{n} official {OFFICIAL[k, n]} {t_off:.2f} us nmse {nmse(out0, ref):.2e}", flush=True)
        out1 = poisoned(n)
        t_kl = graph_time({**OFFICIAL[k, n], "K_LANES": True}, x, w, out1)
        d = (out1.float() - out0.float()).abs().max().item()
        print(f"   same tiles K_LANES {t_kl:.2f} us {t_off / t_kl:.2f}x nmse {nmse(out1, ref):.2e} diff {d:.3g}")
        rows = []
        t_shape = time.time()
        cands = candidates(k, n)
        random.Random(0).shuffle(cands)
        for c in cands:
            if time.time() - t_shape > CAP:
                print("   shape time cap", flush=True)
                break
            out = poisoned(n)
            try:
                t = graph_time(c, x, w, out)
            except Exception as e:
                print("run failed", c, str(e)[:200], flush=True)
                continue
            rows.append((t, c, nmse(out, ref)))
        rows.sort(key=lambda r: r[0])
        for t, c, err in rows[:10]:
            cs = {f: c[f] for f in ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K")}
            print(f"   {t:7.2f} us {t_off / t:5.2f}x {mb / t / 1e6:.2f} TB/s nmse {err:.2e} {cs}", flush=True)
        if rows:
            print(f"   worst {rows[-1][0]:.2f} us; {len(rows)} timed; at {time.time() - t0:.0f} s", flush=True)
        results[f"{k}x{n}"] = {"official": t_off, "klanes_same": t_kl, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "klanes_probe.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()

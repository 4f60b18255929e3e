"""tma defaults with a split: the reduce launch against the fused reduce, graph and eager."""

import dataclasses
import json
import sys
import time

import torch
from triton.testing import do_bench

from tritune.kernels import Q4KWeight, q4k_linear, use_config
from tritune.kernels.q4k.kernel import Q4KKey, tma_default

SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144)]


def graph_time(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=40) * 1e3


def eager_time(fn, calls=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / calls * 1e6)
    return min(best)


rows = []
for k, n in SHAPES:
    gen = torch.Generator(device="cuda").manual_seed(k + n)
    w = Q4KWeight.quantize(torch.randn(n, k, generator=gen, device="cuda") * 0.02)
    wb = w.dequantize().to(torch.bfloat16)
    for m in (16, 32, 64, 128, 256):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        key = Q4KKey(arch="sm90", sm_count=132, dtype="bfloat16", m_bucket=m, n=n, k=k, fp8=False)
        cfg = tma_default(key)
        row = dict(
            k=k,
            n=n,
            m=m,
            split=cfg.SPLIT_K,
            cublas_graph=graph_time(lambda: x @ wb.t()),
            cublas_eager=eager_time(lambda: x @ wb.t()),
        )
        for fused in (False, True) if cfg.SPLIT_K > 1 else (False,):
            c = dataclasses.asdict(dataclasses.replace(cfg, FUSED_REDUCE=fused))
            with use_config("q4k_fp8_gemm", c):
                out = q4k_linear(x, w)
                err = (
                    (out.float() - (x.float() @ wb.float().t())).square().sum()
                    / (x.float() @ wb.float().t()).square().sum()
                ).item()
                row[f"fused={fused}"] = dict(
                    graph=graph_time(lambda: q4k_linear(x, w)), eager=eager_time(lambda: q4k_linear(x, w)), nmse=err
                )
        rows.append(row)
        print(json.dumps(row, default=lambda v: round(v, 2)), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)

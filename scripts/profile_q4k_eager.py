"""Where an eager tma-path call's host time goes: cProfile over many calls."""

import cProfile
import io
import pstats
import sys
import time

import torch

from tritune.kernels import Q4KWeight, q4k_linear

out = open(sys.argv[1], "w")
for k, n, m in [(4096, 4096, 32), (4096, 14336, 64)]:
    w = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    for _ in range(50):
        q4k_linear(x, w)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(500):
        q4k_linear(x, w)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 500 * 1e6
    p = cProfile.Profile()
    p.enable()
    for _ in range(500):
        q4k_linear(x, w)
    p.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(35)
    out.write(f"== K={k} N={n} M={m}: {per:.1f} us a call without the profiler\n{s.getvalue()}\n")
    s = io.StringIO()
    pstats.Stats(p, stream=s).sort_stats("cumulative").print_stats(35)
    out.write(s.getvalue())
out.close()

"""Time the Q4_K staged path (the fp8 opt-in) by chunk size: host time, eager GPU time and replay time.

On the GPU machine:

    python scripts/probe_q4k_staged_chunks.py --shape 4096x14336 --shape 4096x28672 --shape 4096x6144

Per shape (K x N), M in 1024/2048/4096 and every chunk the space admits there up to 8192 rows, the
path is pinned with the default's tiles (128 x 64, 8 warps) and timed three ways: host time per
call (20 calls queued back to back, the GPU never waited for), ``triton.testing.do_bench`` of
the eager call (L2 flushed before each), and the replay of one call captured in a CUDA graph.
Each chunk is two launches (its dequantization and cuBLASLt's fp8 GEMM), so the chunk count sets
an eager call's host time. A probe of the chunk rule, not a benchmark record.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from tritune.kernels import settings
from tritune.kernels.pins import use_config
from tritune.kernels.q4k.kernel import q4k_linear
from tritune.kernels.q4k.weight import Q4KWeight

CHUNKS = (2048, 4096, 8192)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", required=True, help="KxN, e.g. 4096x14336")
    parser.add_argument("--m", type=int, action="append", help="rows of x (default 1024 2048 4096)")
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in args.shape:
        k, n = (int(part) for part in shape.split("x"))
        weight = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
        for m in args.m or (1024, 2048, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for chunk in (c for c in CHUNKS if n >= 2 * c):
                config = {"path": "staged", "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "CHUNK_N": chunk}
                with settings.override(q4k_fp8=True), use_config("q4k_fp8_gemm", config):
                    for _ in range(3):
                        q4k_linear(x, weight)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(20):
                        q4k_linear(x, weight)
                    host = (time.perf_counter() - start) / 20 * 1e6
                    torch.cuda.synchronize()
                    eager = 1e3 * triton.testing.do_bench(lambda x=x, w=weight: q4k_linear(x, w), warmup=25, rep=200)
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        q4k_linear(x, weight)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        q4k_linear(x, weight)
                    replay = 1e3 * triton.testing.do_bench(graph.replay, warmup=25, rep=200)
                print(
                    f"K={k} N={n} M={m} CHUNK_N={chunk}: host {host:.0f} us, eager (GPU) {eager:.1f} us, "
                    f"graph {replay:.1f} us",
                    flush=True,
                )


if __name__ == "__main__":
    main()

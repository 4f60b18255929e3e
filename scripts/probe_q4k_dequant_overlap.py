"""Time the Q4_K dequant path with each chunk's dequantization on a side stream, overlapping the
previous chunk's cuBLAS GEMM, against the path as it runs (the whole weight, one chunk) and bf16
cuBLAS on the weight dequantized once.

On the GPU machine:

    python scripts/probe_q4k_dequant_overlap.py --json F.json

Shapes (K x N) 4096 x 4096, 4096 x 14336 and 14336 x 4096; M 256 to 8192. The overlapped call
dequantizes chunk ``i + B - 1`` on a side stream while the GEMM of chunk ``i`` runs, in B = 2 or
3 reused scratch buffers (a chunk's dequantization waits for the GEMM that last read its buffer),
for chunks of 1024 to 8192 rows that split the weight at least twice. Each variant is timed
three ways: host time per call, ``triton.testing.do_bench`` of the eager call (the greater of
the two is the eager figure), and the replay of one call captured in a CUDA graph; its NMSE is
against cuBLAS's output. A probe of the path, not a benchmark record.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import triton

from tritune.kernels._fastlaunch import bound
from tritune.kernels.pins import use_config
from tritune.kernels.q4k._triton_dequant import _q4k_dequant_kernel
from tritune.kernels.q4k.kernel import q4k_linear
from tritune.kernels.q4k.weight import Q4KWeight

_SIDE: list[torch.cuda.Stream] = []


def overlapped(x: torch.Tensor, weight: Q4KWeight, out: torch.Tensor, chunk: int, buffers: int = 2) -> None:
    """``out = x @ dequant(weight)^T``, each chunk's dequantization on a side stream ahead of its GEMM."""
    qs, scales, mins, supers = weight.qs, weight.scales, weight.mins, weight.super_scales
    k = x.shape[1]
    n = qs.shape[0]
    main = torch.cuda.current_stream()
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    side = _SIDE[0]
    chunk = min(chunk, n)
    scratch = [torch.empty((chunk, k), dtype=x.dtype, device=x.device) for _ in range(buffers)]
    starts = list(range(0, n, chunk))
    kernel = bound(_q4k_dequant_kernel)
    side.wait_stream(main)

    def dequantize(i: int) -> torch.cuda.Event:
        rows = min(chunk, n - starts[i])
        with torch.cuda.stream(side):
            kernel[(triton.cdiv(rows, 32), k // 256)](
                qs, scales, mins, supers, scratch[i % buffers], starts[i], rows, k, qs.stride(0), scales.stride(0),
                supers.stride(0), ROUND_BF16_IN_FP32=False, BLOCK_N=32, BLOCK_K=256, num_warps=8,
            )  # fmt: skip
        return side.record_event()

    ready = [dequantize(i) for i in range(min(buffers - 1, len(starts)))]
    for i, row0 in enumerate(starts):
        ahead = i + buffers - 1
        if ahead < len(starts):
            if ahead >= buffers:
                # The GEMM last queued on main (chunk ahead - buffers) read this buffer.
                side.wait_stream(main)
            ready.append(dequantize(ahead))
        main.wait_event(ready[i])
        rows = min(chunk, n - row0)
        torch.mm(x, scratch[i % buffers][:rows].t(), out=out[:, row0 : row0 + rows])


def host_us(fn: Callable[[], None]) -> float:
    """CPU time per call, 10 calls queued back to back (median of 3 rounds)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        rounds.append((time.perf_counter() - start) / 10 * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[1]


def captured(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """One ``fn()`` captured in a CUDA graph (warmed on a side stream first)."""
    fn()
    torch.cuda.synchronize()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        fn()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def nmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref).norm() / ref.norm()) ** 2)


def variants(
    x: torch.Tensor, weight: Q4KWeight, dense: torch.Tensor, out: torch.Tensor
) -> dict[str, Callable[[], None]]:
    """cuBLAS on ``dense``, the dequant path as pinned, and the overlapped chunkings of ``weight``."""
    n = dense.shape[0]
    calls: dict[str, Callable[[], None]] = {
        "cublas": lambda: torch.mm(x, dense.t(), out=out),
        "dequant-seq": lambda: q4k_linear(x, weight, out=out),
    }
    for chunk in (1024, 2048, 4096, 8192):
        if n >= 2 * chunk:
            calls[f"overlap-{chunk}"] = lambda c=chunk: overlapped(x, weight, out, c)
        if n >= 4 * chunk:
            calls[f"overlap3-{chunk}"] = lambda c=chunk: overlapped(x, weight, out, c, buffers=3)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="file to write the rows to")
    args = parser.parse_args()
    rows = []
    torch.manual_seed(0)
    whole = {"path": "dequant", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8, "CHUNK_N": 16384}
    for k, n in ((4096, 4096), (4096, 14336), (14336, 4096)):
        weight = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
        dense = weight.dequantize().to(torch.bfloat16)
        for m in (256, 512, 1024, 2048, 4096, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = torch.mm(x, dense.t()).double()
            for name, fn in variants(x, weight, dense, out).items():
                with use_config("q4k_fp8_gemm", whole):
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    eager_nmse = nmse(out, ref)
                    host = host_us(fn)
                    eager = max(host, 1e3 * triton.testing.do_bench(fn, warmup=10, rep=80))
                    graph = captured(fn)
                    replay = 1e3 * triton.testing.do_bench(graph.replay, warmup=10, rep=80)
                    out.fill_(float("nan"))
                    graph.replay()
                    torch.cuda.synchronize()
                row = {"k": k, "n": n, "m": m, "impl": name, "host": host, "eager": eager, "graph": replay,
                       "nmse": eager_nmse, "graph_nmse": nmse(out, ref)}  # fmt: skip
                rows.append(row)
                print(f"{k}x{n} M={m} {name:14s} host {host:7.1f} eager {eager:8.1f} graph {replay:8.1f}", flush=True)
    with open(args.json, "w") as fh:
        meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
        json.dump({**meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

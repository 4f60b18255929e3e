"""Why can a CUDA-graph replay of ``prefill_attention`` read slower than the eager call?

For three benchmark shapes (B=1, Hq=16, Hkv=2, bf16, bottom-right causal) this lists which kernels
the dispatcher launches eagerly and inside a captured graph (``torch.profiler``), then times both
(``triton.testing.do_bench``, median, L2 flushed): once with ``out`` allocated inside the call (so,
under capture, from the graph's private memory pool) and once with a preallocated ``out``.

    python scripts/probe_prefill_graph_out.py
"""

from __future__ import annotations

from collections.abc import Callable

import _benchlib as bl
import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from tritune.kernels import prefill_attention

SHAPES = ((64, 16384, 16384), (128, 16384, 16384), (64, 4096, 131072))  # (D, Lq, Lkv)


def kernels_run(fn: Callable[[], object]) -> list[str]:
    """Names of the CUDA kernels three calls of ``fn`` launch."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return sorted({event.name[:60] for event in prof.events() if event.device_type.name == "CUDA"})


def median_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    device = torch.device("cuda")
    for d, lq, lkv in SHAPES:
        q = torch.randn(1, 16, lq, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 2, lkv, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_len = torch.tensor(lkv, device=device, dtype=torch.int32)
        given = torch.empty_like(q)

        def allocating(q=q, k=k, v=v, kv_len=kv_len) -> torch.Tensor:
            return prefill_attention(q, k, v, kv_len=kv_len)

        def into_given(q=q, k=k, v=v, kv_len=kv_len, given=given) -> torch.Tensor:
            return prefill_attention(q, k, v, kv_len=kv_len, out=given)

        allocating()
        torch.cuda.synchronize()
        graph, out = bl.capture_graph(allocating)
        graph_given, _ = bl.capture_graph(into_given)
        print(
            f"D={d} Lq={lq} Lkv={lkv}: out allocated: eager {median_ms(allocating):.3f} ms, "
            f"graph {median_ms(graph.replay):.3f} ms | out given: eager {median_ms(into_given):.3f} ms, "
            f"graph {median_ms(graph_given.replay):.3f} ms"
        )
        print(f"  kernels eager {kernels_run(allocating)}, graph {kernels_run(graph.replay)}")
        print(f"  graph-pool out address mod 1024: {out.data_ptr() % 1024}")


if __name__ == "__main__":
    main()

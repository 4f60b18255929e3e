"""Probe: the ws prefill kernel on square causal 16K, eager calls against CUDA-graph replays.

    python scripts/probe_prefill_ws_graph.py

For D=128 and 64 (B=1, Hq=16, Hkv=2, bf16), tritune's served call and SDPA's cuDNN backend, twice
each: do_bench of the eager call, of a graph holding one call and of a graph holding ten (per
call), back-to-back eager and graph launches timed by events, the eager call again, and the SM
and memory clocks, power, temperature and throttle reasons nvidia-smi reads after them; then the
kernel's own time under torch.profiler for three eager calls and three replays.
"""

import functools
import subprocess

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from tritune.kernels import prefill_attention

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def clocks() -> str:
    run = subprocess.run(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"], capture_output=True, text=True
    )
    return run.stdout.strip()


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def back_to_back(fn, calls: int) -> float:
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def compare(name: str, fn, head_dim: int) -> None:
    for _ in range(5):
        fn()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    one, ten = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(one):
        fn()
    with torch.cuda.graph(ten):
        for _ in range(10):
            fn()
    for rep in range(2):
        eager = do_bench(fn, warmup=50, rep=300)
        graph_one = do_bench(one.replay, warmup=50, rep=300)
        graph_ten = do_bench(ten.replay, warmup=20, rep=300) / 10
        eager_b2b = back_to_back(lambda: [fn() for _ in range(20)], 20)
        graph_b2b = back_to_back(lambda: [ten.replay() for _ in range(2)], 20)
        again = do_bench(fn, warmup=50, rep=300)
        print(
            f"D={head_dim} {name} rep{rep}: eager {eager:.3f} | graph(1) {graph_one:.3f} | graph(10)/10 "
            f"{graph_ten:.3f} | eager b2b {eager_b2b:.3f} | graph b2b {graph_b2b:.3f} | eager again {again:.3f} "
            f"| {clocks()}",
            flush=True,
        )


def kernel_times(fn) -> None:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            print(f"  {event.name[:80]} {event.device_time / 1000:.3f} ms")


def main() -> None:
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length = 1, 16, 2, 16384
    for head_dim in (128, 64):
        q = torch.randn(batch, q_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
        ours = functools.partial(prefill_attention, q, k, v)
        for name, fn in (("ours", ours), ("cudnn", functools.partial(cudnn, q, k, v))):
            compare(name, fn, head_dim)
        kernel_times(ours)


if __name__ == "__main__":
    main()

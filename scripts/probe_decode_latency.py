"""Where the microseconds of a short decode step go on a GPU (an exploratory probe, not a benchmark).

At B=1, Lkv=4096 (Hq=32, Hkv=8, D=128, bf16) one graph replay of split-K decode took 16.4 us on the
H200, while its 16.8 MB of K/V take about 3.9 us at the copy rate. This probe times, each as a
captured CUDA graph replayed with ``do_bench`` (L2 flushed before every replay, as the benchmarks
do) and as back-to-back replays with a warm L2:

- an empty one-program Triton kernel (the floor of one launch inside a graph);
- a Triton kernel that only reads K and V (the floor of the bytes);
- split-K decode (split + merge), its split kernel alone (the merge launch stubbed), and the
  single-launch form (``FUSED_MERGE``: the last split program of a row block merges);
- SDPA's cuDNN backend.

Run on the GPU machine: ``python scripts/probe_decode_latency.py --out FILE.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as bl


@triton.jit
def _empty_kernel(X):
    pass


@triton.jit
def _read_kernel(K, V, OUT, n_per_program, BLOCK: tl.constexpr):
    # Each program sums its slice of K and V: the least a kernel reading those bytes can do.
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_per_program, BLOCK):
        idx = pid * n_per_program + i + offs
        acc += tl.load(K + idx).to(tl.float32) + tl.load(V + idx).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, 0))


#: What a captured step without a tensor result hands ``capture_graph``.
_NOTHING = torch.empty(0)


def warm_l2_us(graph: torch.cuda.CUDAGraph, reps: int = 200) -> float:
    """Mean microseconds per replay of ``reps`` back-to-back replays (no flush: the L2 stays warm)."""
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def row(label: str, fn: Callable[[], object]) -> str:
    try:
        graph, _ = bl.capture_graph(lambda: (fn(), _NOTHING)[1])
    except Exception as exc:
        return f"| {label} | cannot capture: {bl.error_text(exc, 100)} | - |"
    cold = bl.graph_replay_ms(graph) * 1e3
    warm = warm_l2_us(graph)
    bl.log.info("%-48s cold %8.1f us  warm %8.1f us", label, cold, warm)
    return f"| {label} | {cold:.1f} | {warm:.1f} |"


def probe(batch: int, lkv: int) -> list[str]:
    from tritune.kernels import decode_attention, use_config
    from tritune.kernels.decode import op as decode_op

    dev = torch.device("cuda")
    hq, hkv, d = 32, 8, 128
    q = torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, lkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv_len = torch.full((batch,), lkv, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    sink = torch.empty(4096, device=dev)
    n = k.numel()
    programs = 1024
    per_program = n // programs
    rows = [f"### B={batch}, Lkv={lkv} ({2 * k.numel() * 2 / 1e6:.1f} MB of K/V)", ""]
    rows += ["| graph of | cold L2 us (do_bench) | warm L2 us (back to back) |", "| --- | --- | --- |"]
    rows.append(row("empty Triton kernel, 1 program", lambda: _empty_kernel[(1,)](sink)))
    rows.append(
        row(
            f"read K and V ({programs} programs)",
            lambda: _read_kernel[(programs,)](k, v, sink, per_program, BLOCK=2048, num_warps=8),
        )
    )
    configs = {
        "default": {},
        "bundle B=1 4K winner": {"TARGET_WAVES": 2, "MIN_CHUNK": 64, "BLOCK_N": 16, "num_warps": 2, "num_stages": 3},
        "waves 4, chunk 128, N 64": {"TARGET_WAVES": 4, "MIN_CHUNK": 128, "BLOCK_N": 64},
        "fused merge (default tiles)": {"FUSED_MERGE": True},
        "fused, waves 4, chunk 128, N 64": {"TARGET_WAVES": 4, "MIN_CHUNK": 128, "BLOCK_N": 64, "FUSED_MERGE": True},
    }
    for name, config in configs.items():
        with use_config("splitk_decode", config):
            rows.append(row(f"decode {name}: split + merge", lambda: decode_attention(q, k, v, kv_len, out=out)))

            class _NoMerge:
                def __getitem__(self, grid: object) -> Callable[..., None]:
                    return lambda *a, **kw: None

            def split_only() -> None:
                original = decode_op._launch

                def patched(split_kernel: object, _merge: object, *args: object) -> None:
                    original(split_kernel, _NoMerge(), *args)

                decode_op._launch = patched
                try:
                    decode_attention(q, k, v, kv_len, out=out)
                finally:
                    decode_op._launch = original

            rows.append(row(f"decode {name}: split only", split_only))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with contextlib.suppress(Exception):
        rows.append(row("SDPA cuDNN", cudnn))
    return [*rows, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bl.setup_logging()
    dev = torch.device("cuda")
    env = bl.environment(dev, smoke=False)
    lines = ["# Probe: where a short decode step's time goes", "", f"`{env['command']}`", ""]
    lines += [f"{key}: {value}" for key, value in env.items() if key != "command"] + [""]
    for batch, lkv in ((1, 4096), (8, 4096), (1, 32768)):
        lines += probe(batch, lkv)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Where an eager Q4_K call's host time goes: per-call host and wall time, then cProfile and the
torch profiler's CPU-side table, for the configs the shipped bundle serves at a few keys.

On the GPU machine: ``python scripts/probe_q4k_host.py --out host.md``. Session 6 measured a staged
call at M=1024, K=4096, N=14336 taking 139.8 us as a CUDA-graph replay but 671.6 us eager; this
finds out which host-side step costs the difference.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import _benchlib as bl
import torch

#: (label, M, K, N, config) probed: staged at the key that showed the gap, the fp8 and portable paths for scale.
CASES = (
    ("staged", 1024, 4096, 14336, {"path": "staged", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "CHUNK_N": 4096}),
    ("staged", 256, 4096, 14336, {"path": "staged", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "CHUNK_N": 4096}),
    ("fp8 fold swap", 1024, 4096, 14336, {"path": "fp8", "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
                                         "SCALE_FOLD": True, "SWAP_AB": True, "num_warps": 8, "num_stages": 3}),
    ("portable", 16, 4096, 14336, {"path": "portable", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4,
                                   "num_stages": 3}),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from tritune.kernels import Q4KWeight, q4k_linear

    device = torch.device("cuda")
    text = [bl.header_markdown(bl.environment(device, smoke=False), "Q4_K eager host cost", [])]
    weights: dict[tuple[int, int], Q4KWeight] = {}
    for label, m, k, n, config in CASES:
        weight = weights.setdefault((k, n), Q4KWeight.quantize(torch.randn(n, k, device=device) * 0.02))
        x = torch.randn(m, k, device=device).bfloat16()
        out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
        call = bl.pinned_call("q4k_fp8_gemm", config, q4k_linear, x, weight, out=out)
        for _ in range(3):
            call()
        host, wall = bl.host_and_wall_us(call)
        bench = bl.time_ms(call, device) * 1e3
        graph, _ = bl.capture_graph(call)
        replay = bl.graph_replay_ms(graph) * 1e3
        text.append(f"## {label}, M={m}, K={k}, N={n}\n\n`{config}`\n")
        text.append(f"- host issue {host:.1f} us/call, wall {wall:.1f} us/call (20 back-to-back calls)")
        text.append(f"- do_bench eager {bench:.1f} us, graph replay {replay:.1f} us\n")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
        text.append("cProfile, 20 calls, by own time:\n\n```\n" + buf.getvalue()[-6000:] + "\n```\n")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:  # fmt: skip
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
        text.append("torch profiler, 5 calls, by self CPU time:\n\n```\n" + table + "\n```\n")
        print("\n".join(text[-5:]), flush=True)
        del graph
    report = "\n".join(text) + "\n"
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe: why the tuner stored about twice the benchmark's time for staged Q4_K configs at M=1024.

Session 7 saw, for the same staged config at K=14336, N=4096, M=1024, 353.8 us in the tuner's
trials against 164.7 us in ``bench_q4k.py``. This times that config in one process, five ways,
each with the tuner's GPU timer (L2 flushed, eager: M=1024 is not launch-bound):

1. ``q4k_linear`` pinned with ``use_config`` (the benchmark's call);
2. ``SPEC.launch`` on the benchmark's inputs (the tuner's call, on the benchmark's tensors);
3. ``SPEC.launch`` on ``SPEC.make_problem``'s inputs (the tuner's call and tensors);
4. a ``CandidateBench`` trial (the tuner's whole path, with its checks and noise policy);
5. ``SPEC.launch`` captured in a CUDA graph (GPU time alone).

Plus host time per eager call for 1 and 3. On the GPU machine:
``python scripts/probe_q4k_timing.py --out timing.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch

CONFIG = {"path": "staged", "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8,
          "num_stages": 3, "CHUNK_N": 2048, "FAST_ACCUM": False}  # fmt: skip
#: (M, K, N): the keys of session 7's gap, and the one where tuner and benchmark agreed.
SHAPES = ((1024, 14336, 4096), (1024, 4096, 14336), (1024, 4096, 4096))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from tritune.kernels import Q4KWeight, q4k_linear, registry
    from tritune.kernels.device import device_info
    from tritune.tuner.candidates import CandidateBench
    from tritune.tuner.timing import GpuTimer

    device = torch.device("cuda")
    info = device_info(device)
    spec = registry.get_spec("q4k_fp8_gemm")
    timer = GpuTimer()
    lines = [f"Config: `{CONFIG}`", "", "| M x K x N | way | us | host us/call |", "| --- | --- | --- | --- |"]
    config = spec.space.parse(CONFIG)

    def eager(fn) -> float:
        return timer.measure(fn, config=None, flush_l2=True, launch_bound=False).ms * 1e3

    for m, k, n in SHAPES:
        shape = f"{m} x {k} x {n}"
        weight = Q4KWeight.quantize(torch.randn(n, k, device=device) * 0.02)
        x = torch.randn(m, k, device=device).bfloat16()
        out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
        pinned = bl.pinned_call("q4k_fp8_gemm", CONFIG, q4k_linear, x, weight, out=out)
        key = spec.key_type.from_dict(
            {"arch": info.arch, "sm_count": info.sm_count, "dtype": "bfloat16", "m_bucket": m, "n": n, "k": k}
        )
        problem = spec.make_problem(key, device, 0)
        target = torch.empty((m, n), dtype=torch.bfloat16, device=device)

        def bench_tensors(x=x, weight=weight, out=out) -> object:
            return spec.launch(config, x, weight, out=out)

        def tuner_tensors(args=problem.args, target=target) -> object:
            return spec.launch(config, *args, out=target)

        for fn in (pinned, bench_tensors, tuner_tensors):
            fn()
        rows = [
            ("1 q4k_linear pinned", eager(pinned), bl.host_and_wall_us(pinned)[0]),
            ("2 SPEC.launch, benchmark tensors", eager(bench_tensors), None),
            ("3 SPEC.launch, make_problem tensors", eager(tuner_tensors), bl.host_and_wall_us(tuner_tensors)[0]),
        ]
        bench = CandidateBench(spec, key, device, 0, spec.default_config(key), timer)
        result = bench.trial(CONFIG)
        rows.append(("4 CandidateBench.trial", (result["ms"] or float("nan")) * 1e3, None))
        graph = timer.measure(tuner_tensors, config=None, flush_l2=True, launch_bound=True).ms * 1e3
        rows.append(("5 graph replay", graph, None))
        rows.append(("1 again (order effects)", eager(pinned), bl.host_and_wall_us(pinned)[0]))
        for way, us, host in rows:
            lines.append(f"| {shape} | {way} | {us:.1f} | {'' if host is None else f'{host:.1f}'} |")
        print("\n".join(lines[-len(rows) :]), flush=True)
        del bench, problem
        torch.cuda.empty_cache()
    return bl.finish_probe(device, "Q4_K tuner-vs-benchmark timing probe", [], lines, args.out)


if __name__ == "__main__":
    sys.exit(main())

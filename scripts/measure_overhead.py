"""Host-side cost of tritune's dispatch per call, against a direct launch of the same config.

    python scripts/measure_overhead.py [--out FILE]

At a tiny, launch-bound shape the host time per call is what a decode loop pays. Four variants,
each run N times back to back and timed on the host (the GPU synchronised before and after):
the public function (checks + facts + dispatch + op), the registered op alone, the spec's launch
(the Triton kernel launch without torch.library), and facts + dispatch alone (the lookup).
Also verifies that importing tritune.kernels created no CUDA context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tritune.kernels  # noqa: F401  (import first: must not initialise CUDA)

CUDA_INITIALISED_AFTER_IMPORT = torch.cuda.is_initialized()


def per_call_us(fn, n: int = 2000, repeats: int = 5) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from tritune.kernels import prefill_attention
    from tritune.kernels.device import device_info
    from tritune.kernels.dispatcher import config_from_values, dispatch
    from tritune.kernels.prefill.spec import SPEC

    q = torch.randn(1, 16, 16, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv_len = torch.tensor(128, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    kwargs = dict(causal=True, kv_len=kv_len, softmax_scale=None, out=out)
    facts = SPEC.facts(q, k, v, **kwargs)
    config = config_from_values(SPEC, dispatch("tma_prefill", "cuda", 0, facts))
    key = SPEC.key_for(device_info(q.device), facts)

    public = per_call_us(lambda: prefill_attention(q, k, v, kv_len=kv_len, out=out))
    launch = per_call_us(lambda: SPEC.launch(config, q, k, v, **kwargs))
    lookup = per_call_us(lambda: dispatch("tma_prefill", "cuda", 0, SPEC.facts(q, k, v, **kwargs)), n=20000)
    lines = [
        f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}",
        "Command: `python scripts/measure_overhead.py`",
        f"shape: q [1, 16, 16, 64], k/v [1, 2, 128, 64] bf16; key {key}; config {config}",
        "",
        "| path | host us per call |",
        "| --- | --- |",
        f"| public `prefill_attention` (checks + facts + dispatch + torch.library op + launch) | {public:.1f} |",
        f"| `SPEC.launch` (direct Triton launch, same config) | {launch:.1f} |",
        f"| facts + dispatch lookup only | {lookup:.2f} |",
        f"| overhead of the public path over a direct launch | {public - launch:.1f} |",
        "",
        f"torch.cuda.is_initialized() right after `import tritune.kernels`: {CUDA_INITIALISED_AFTER_IMPORT}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

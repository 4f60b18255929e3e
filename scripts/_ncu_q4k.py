"""A few pinned Q4_K calls for Nsight Compute to profile (``ncu ... python scripts/_ncu_q4k.py``).

``--m`` rows of bf16 x against a 4096 x 14336 (K x N) weight; ``--config`` is the pinned config as
JSON (parsed by the space, never evaluated). Default: the portable M=16 decode tile.
"""

import argparse
import json

import torch

from tritune.kernels import Q4KWeight, q4k_linear, use_config

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--m", type=int, default=16)
parser.add_argument("--calls", type=int, default=5)
parser.add_argument(
    "--config", default='{"path": "portable", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1}'
)
args = parser.parse_args()
weight = Q4KWeight.quantize(torch.randn(14336, 4096, device="cuda") * 0.02)
x = torch.randn(args.m, 4096, device="cuda").bfloat16()
with use_config("q4k_fp8_gemm", json.loads(args.config)):
    for _ in range(args.calls):
        q4k_linear(x, weight)
torch.cuda.synchronize()

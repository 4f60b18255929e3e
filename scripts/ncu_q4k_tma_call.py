"""One tma-path Q4_K call (pinned) for ncu: argv K N M and the config as JSON."""

import json
import sys

import torch

from tritune.kernels import Q4KWeight, q4k_linear, use_config

k, n, m = (int(v) for v in sys.argv[1:4])
cfg = json.loads(sys.argv[4])
w = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
with use_config("q4k_fp8_gemm", {"path": "tma", **cfg}):
    for _ in range(2):
        q4k_linear(x, w)
torch.cuda.synchronize()
print("ok")

"""Three staged Q4_K calls (M=4096, K=4096, N=14336, chunks of 4096 rows) for Nsight Compute to profile."""

import torch

from tritune.kernels import Q4KWeight, q4k_linear, use_config

weight = Q4KWeight.quantize(torch.randn(14336, 4096, device="cuda") * 0.02)
x = torch.randn(4096, 4096, device="cuda").bfloat16()
with use_config("q4k_fp8_gemm", {"path": "staged", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "CHUNK_N": 4096}):
    for _ in range(3):
        q4k_linear(x, weight)
torch.cuda.synchronize()

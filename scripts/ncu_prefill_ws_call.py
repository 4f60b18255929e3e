"""One square causal 16K prefill call on the ws path (pinned), for ncu."""

import sys

import torch

from tritune.kernels import prefill_attention, use_config

d = int(sys.argv[1])
cfg = dict(path="ws", BLOCK_M=128, BLOCK_N=128 if d == 128 else 128, num_stages=2, CONSUMER_REGS=232, PRODUCER_REGS=40)
q = torch.randn(1, 16, 16384, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 2, 16384, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(1, 2, 16384, d, device="cuda", dtype=torch.bfloat16)
with use_config("tma_prefill", cfg):
    for _ in range(2):
        o = prefill_attention(q, k, v, causal=True)
torch.cuda.synchronize()
print("ok", o.shape)

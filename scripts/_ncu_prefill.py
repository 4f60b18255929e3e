"""A few prefill calls for Nsight Compute to profile (``ncu ... python scripts/_ncu_prefill.py``).

The benchmark's layout (B=1, Hq=16, Hkv=2, bf16, bottom-right causal, kv_len on the device) at
``--d``, ``--lq`` and ``--lkv``, served by the dispatcher (the shipped bundle's winner), or by
``--config`` (JSON, parsed by the space, never evaluated) when given.
"""

import argparse
import contextlib
import json

import torch

from tritune.kernels import prefill_attention, use_config

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--d", type=int, default=128)
parser.add_argument("--lq", type=int, default=16384)
parser.add_argument("--lkv", type=int, default=16384)
parser.add_argument("--calls", type=int, default=3)
parser.add_argument("--config", default="")
args = parser.parse_args()
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, 16, args.lq, args.d, generator=gen, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 2, args.lkv, args.d, generator=gen, device="cuda", dtype=torch.bfloat16)
v = torch.randn(1, 2, args.lkv, args.d, generator=gen, device="cuda", dtype=torch.bfloat16)
kv_len = torch.tensor(args.lkv, device="cuda", dtype=torch.int32)
pin = use_config("tma_prefill", json.loads(args.config)) if args.config else contextlib.nullcontext()
with pin:
    for _ in range(args.calls):
        prefill_attention(q, k, v, kv_len=kv_len)
torch.cuda.synchronize()

"""Where the host time of an eager split-KV prefill call goes (Lq=512, Lkv=16K, the tuned configs).

At Lq=512 the TMA kernel takes about 0.08 ms (D=64) and 0.13 ms (D=128), and eager benchmark rows
have read anywhere from 1.1x to 1.8x of SDPA flash between runs while graph replays stayed put:
the host work of a call (descriptors, workspace allocations, two launches) is close to the
kernel's time. This probe issues 200 back-to-back calls of each piece and reports microseconds of
host time per call (``_benchlib.host_and_wall_us``): the public call, ``prefill_tma`` alone (both
launches), the four ``TensorDescriptor.from_tensor`` calls, the two workspace allocations, and the
public call with ``SPLIT_KV=1`` pinned (one launch, no workspace).

    python scripts/probe_prefill_host.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import _benchlib as bl
import torch
from torch._library.triton import set_wrap_triton_enabled
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels import prefill_attention
from tritune.kernels.prefill._triton_tma import prefill_tma
from tritune.search_spaces.tma_prefill import PrefillConfig

#: The H200 bundle's winners at Lq=512, Lkv=16K (D, config).
CONFIGS = {
    64: PrefillConfig(path="tma", BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, PACK_GQA=False, SPLIT_KV=2),
    128: PrefillConfig(path="tma", BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, PACK_GQA=False, SPLIT_KV=2),
}


def _pieces(d: int, config: PrefillConfig, device: torch.device) -> dict[str, Callable[[], object]]:
    """The calls to time at head dim ``d``: the public call, its parts, and the one-split call."""
    q = torch.randn(1, 16, 512, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 16384, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    kv_len = torch.tensor(16384, device=device, dtype=torch.int32)
    scale = d**-0.5
    one_split = {
        "path": "tma", "BLOCK_M": config.BLOCK_M, "BLOCK_N": config.BLOCK_N, "num_warps": config.num_warps,
        "num_stages": config.num_stages, "PACK_GQA": config.PACK_GQA, "SPLIT_KV": 1,
    }  # fmt: skip

    def bare_launches() -> None:
        # Bare kernels, as the op's body launches them in eager mode (no tracing wrapper).
        with set_wrap_triton_enabled(False):
            prefill_tma(q, k, v, kv_len, out, causal=True, softmax_scale=scale, config=config)

    pinned_one_split = bl.pinned_call("tma_prefill", one_split, prefill_attention, q, k, v, kv_len=kv_len, out=out)
    return {
        "public call (dispatcher)": lambda: prefill_attention(q, k, v, kv_len=kv_len, out=out),
        "prefill_tma (descriptors, workspace, both launches)": bare_launches,
        "4 x TensorDescriptor.from_tensor": lambda: [
            TensorDescriptor.from_tensor(t, [1, 1, 64, d]) for t in (q, k, v, out)
        ],
        "2 x torch.empty (workspace)": lambda: (
            torch.empty((2, 1, 16, 512, d), dtype=torch.float32, device=device),
            torch.empty((2, 2, 1, 16, 512), dtype=torch.float32, device=device),
        ),
        "public call, SPLIT_KV=1 pinned": pinned_one_split,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = ["| D | piece | host us per call | wall us per call |", "| --- | --- | --- | --- |"]
    for d, config in CONFIGS.items():
        for name, piece in _pieces(d, config, device).items():
            piece()
            host, wall = bl.host_and_wall_us(piece, args.calls)
            rows.append(f"| {d} | {name} | {host:.1f} | {wall:.1f} |")
            print(rows[-1], flush=True)
    notes = [
        "B=1, Hq=16, Hkv=2, Lq=512, Lkv=16384, bf16, causal, kv_len on the device, out preallocated.",
        "host us: time to issue the calls back to back, per call; wall us: until the GPU finished them.",
    ]
    return bl.finish_probe(device, "Host time of an eager split-KV prefill call", notes, rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

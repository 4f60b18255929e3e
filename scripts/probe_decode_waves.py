"""Time split-K decode configs by wave target and tile at the large decode cells, as CUDA-graph replays.

On the GPU machine:

    python scripts/probe_decode_waves.py --shape 64x131072 --shape 64x32768 --shape 8x32768 --json F.json

Each config launches through the kernel's own launcher (``tritune.kernels.decode.launch.launch``),
so wave targets outside the space can be measured too. Every cell is timed at equal lengths (the
benchmark's cells) next to SDPA cuDNN, and the first cell also over lengths drawn from
[Lmax/2, Lmax] (the tuner's problem). Outputs are NaN-poisoned before the first launch and checked
finite and against cuDNN (max abs error) at equal lengths. Hq=32, Hkv=8, D=128, bf16, one new token.
This is a probe of where the fast configs lie, not a benchmark record: no dispatcher, no eager column.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from tritune.kernels.decode.launch import launch
from tritune.search_spaces.splitk_decode import DecodeConfig

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
#: Tile changes from the default measured at the default wave target; the first five also at larger targets.
TILES: list[dict[str, int]] = [
    {},
    {"BLOCK_N": 32, "num_warps": 2},
    {"BLOCK_N": 32, "num_warps": 2, "num_stages": 4},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 16, "num_warps": 2, "num_stages": 4},
]
WAVES = (2, 8, 16, 32)


def replay_us(fn: Callable[[], object]) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph (L2 flushed before each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=50, rep=300)


def probe_cell(batch: int, lmax: int, ragged: bool, sm_count: int) -> list[dict[str, object]]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, lmax, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if ragged:
        lengths = torch.randint(lmax // 2, lmax + 1, (batch,), device=dev, dtype=torch.int32)
    else:
        lengths = torch.full((batch,), lmax, device=dev, dtype=torch.int32)
    kv_bytes = 2 * int(lengths.sum()) * KV_HEADS * HEAD_DIM * 2
    rows: list[dict[str, object]] = []
    expected = None
    if not ragged:

        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        expected = cudnn()
        us = replay_us(cudnn)
        peer = {"B": batch, "Lkv": lmax, "ragged": ragged, "impl": "SDPA cuDNN", "us": us, "TBps": kv_bytes / us / 1e6}
        rows.append(peer)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(HEAD_DIM)
    default_target = max(1, sm_count * 2 // (batch * KV_HEADS))
    for waves in WAVES:
        target = max(1, sm_count * waves // (batch * KV_HEADS))
        if waves != 2 and target == default_target:
            continue
        for tile in TILES if waves == 2 else TILES[:5]:
            config = DecodeConfig(**{**tile, "TARGET_WAVES": waves})
            out.fill_(float("nan"))
            launch(config, q, k, v, lengths, scale, out)
            torch.cuda.synchronize()
            error = float((out.float() - expected.float()).abs().max()) if expected is not None else None
            us = replay_us(lambda c=config: launch(c, q, k, v, lengths, scale, out))
            row = {"B": batch, "Lkv": lmax, "ragged": ragged, "impl": "ours", "TARGET_WAVES": waves,
                   "splits_target": target, **tile, "us": us, "TBps": kv_bytes / us / 1e6,
                   "max_err": error, "finite": bool(torch.isfinite(out).all())}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", required=True, help="BATCHxLMAX, e.g. 64x131072")
    parser.add_argument("--json", required=True, help="file to write the rows and the environment to")
    args = parser.parse_args()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, object]] = []
    for index, shape in enumerate(args.shape):
        batch, lmax = (int(part) for part in shape.split("x"))
        for ragged in (False, True) if index == 0 else (False,):
            rows += probe_cell(batch, lmax, ragged, sm_count)
        torch.cuda.empty_cache()
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
    with open(args.json, "w") as fh:
        json.dump({**env, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

"""How the varlen benchmark's mixed step splits between its decode tokens and its prefill chunks,
under several pinned configs: which tile shape each half wants.

On the GPU machine: ``python scripts/probe_varlen_split.py --out split.md``. The same mixed workload
as ``bench_varlen.py`` (28 decodes + 4 chunks of 512, KV 1K-32K), timed three ways per config: the
whole step, the decode segments only (the chunks' q_len set to 0) and the chunks only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch
from _varlen_workload import MIXES, build_workload

_MIXED = {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3, "MAX_SPLITS": 64, "MIN_CHUNK": 256, "TARGET_WAVES": 4}
CONFIGS = (
    {**_MIXED, "BLOCK_N": 64, "SHORT_M": 16},
    {**_MIXED, "BLOCK_N": 64, "SHORT_M": 16, "KV_TMA": True},
    {**_MIXED, "BLOCK_N": 128, "SHORT_M": 16, "KV_TMA": True},
    {**_MIXED, "BLOCK_N": 128, "SHORT_M": 32, "KV_TMA": True},
    {**_MIXED, "BLOCK_N": 128, "SHORT_M": 16, "KV_TMA": True, "MIN_CHUNK": 512, "TARGET_WAVES": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "MAX_SPLITS": 64, "MIN_CHUNK": 256,
     "TARGET_WAVES": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "MAX_SPLITS": 64, "MIN_CHUNK": 256,
     "TARGET_WAVES": 4},
    {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "MAX_SPLITS": 4, "MIN_CHUNK": 128,
     "TARGET_WAVES": 4},
    {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "MAX_SPLITS": 64, "MIN_CHUNK": 256,
     "TARGET_WAVES": 4},
    {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "MAX_SPLITS": 4, "MIN_CHUNK": 128,
     "TARGET_WAVES": 4, "KV_TMA": True},
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--config", action="append", default=[], help="extra config as k=v,k=v")
    args = parser.parse_args(argv)
    from tritune.kernels import varlen_attention

    device = torch.device("cuda")
    w = build_workload(MIXES["mixed"], device, seed=0)
    decode_only = w.seq_info.clone()
    decode_only[w.seq_info[:, 1] > 1, 1] = 0
    chunks_only = w.seq_info.clone()
    chunks_only[w.seq_info[:, 1] == 1, 1] = 0
    variants = {"whole step": w.seq_info, "decodes only": decode_only, "chunks only": chunks_only}
    extra = [{k: int(v) for k, v in (item.split("=") for item in text.split(","))} for text in args.config]
    rows = ["| config | " + " | ".join(variants) + " |", "| --- |" + " --- |" * len(variants)]
    for config in (*CONFIGS, *extra):
        cells = []
        for seq_info in variants.values():
            out = torch.empty_like(w.q)
            call = bl.pinned_call("varlen_sdpa", config, varlen_attention, w.q, w.k_store, w.v_store, seq_info,
                                  causal=True, out=out)  # fmt: skip
            try:
                call()
                cells.append(f"{bl.time_ms(call, device) * 1e3:.1f}")
            except Exception as exc:  # a config the space refuses: say so and go on
                cells.append(bl.error_text(exc, 80))
        rows.append("| " + " ".join(f"{k}={v}" for k, v in config.items()) + " | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    notes = ["Mix: 28 decode tokens + 4 prefill chunks of 512, KV U[1024, 32768], Hq=32, Hkv=8, D=128, bf16",
             "Times: eager do_bench medians in us (L2 flushed)."]  # fmt: skip
    return bl.finish_probe(device, "Varlen mixed step, decode vs chunk halves", notes, rows, args.out)


if __name__ == "__main__":
    sys.exit(main())

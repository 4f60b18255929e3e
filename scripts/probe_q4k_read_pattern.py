"""Probe: how fast the H200 reads a Q4_K weight's codes in the order the decode kernels read them.

Every decode kernel tried so far (portable, fp8, int8 MMA, the dp4a GEMV) reads the packed codes
``qs`` (``[N, K/2]`` bytes, row-major) at about 1 TB/s, a quarter of the copy rate. Each of their
programs walks its ``BLOCK_N`` weight rows along K, one ``BLOCK_N x BYTES`` tile at a time (128
bytes a row for a 256-deep K tile), so the memory sees short pieces of many rows at once. This
probe times a kernel that only reads (and XOR-folds, so that nothing is optimized away) the same
bytes in three orders, each with its next tile loaded one iteration ahead:

* ``rows``: a program per ``ROWS`` weight rows, ``BYTES`` of each row per iteration (the kernels'
  order);
* ``rows, 3 ahead``: the same order with three tiles in flight a program instead of one;
* ``flat``: a program per contiguous slice of the buffer, ``ROWS * BYTES`` contiguous bytes per
  iteration (what a tile-major repack of the weight would give).

CUDA-graph replays, L2 flushed before each (median); GB/s counts the bytes read. On the GPU
machine: ``python scripts/probe_q4k_read_pattern.py --out read.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch
import triton
import triton.language as tl


@triton.jit
def _read_rows(q_ptr, out_ptr, row_words, ROWS: tl.constexpr, WORDS: tl.constexpr, TILES: tl.constexpr):
    """Program p folds rows p*ROWS .. p*ROWS+ROWS-1, WORDS 32-bit words of each per iteration."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ptrs = q_ptr + rows.to(tl.int64)[:, None] * row_words + tl.arange(0, WORDS)[None, :]
    acc = tl.zeros((ROWS, WORDS), dtype=tl.int32)
    cur = tl.load(ptrs)
    for i in range(TILES):
        nxt = tl.load(ptrs + tl.minimum(i + 1, TILES - 1) * WORDS)
        acc ^= cur
        cur = nxt
    tl.store(out_ptr + tl.program_id(0), tl.reduce_or(acc.reshape(ROWS * WORDS), axis=0))


@triton.jit
def _read_rows_deep(q_ptr, out_ptr, row_words, ROWS: tl.constexpr, WORDS: tl.constexpr, TILES: tl.constexpr):
    """As ``_read_rows``, with the tiles two and three iterations ahead in flight (three loads
    outstanding a thread instead of one)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ptrs = q_ptr + rows.to(tl.int64)[:, None] * row_words + tl.arange(0, WORDS)[None, :]
    acc = tl.zeros((ROWS, WORDS), dtype=tl.int32)
    cur = tl.load(ptrs)
    nxt = tl.load(ptrs + tl.minimum(1, TILES - 1) * WORDS)
    far = tl.load(ptrs + tl.minimum(2, TILES - 1) * WORDS)
    for i in range(TILES):
        farther = tl.load(ptrs + tl.minimum(i + 3, TILES - 1) * WORDS)
        acc ^= cur
        cur, nxt, far = nxt, far, farther
    tl.store(out_ptr + tl.program_id(0), tl.reduce_or(acc.reshape(ROWS * WORDS), axis=0))


@triton.jit
def _read_flat(q_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr, TILES: tl.constexpr):
    """Program p folds a contiguous slice: ROWS * WORDS words per iteration, TILES iterations."""
    base = tl.program_id(0).to(tl.int64) * (TILES * ROWS * WORDS)
    ptrs = q_ptr + base + tl.arange(0, ROWS * WORDS)
    acc = tl.zeros((ROWS * WORDS,), dtype=tl.int32)
    cur = tl.load(ptrs)
    for i in range(TILES):
        nxt = tl.load(ptrs + tl.minimum(i + 1, TILES - 1) * (ROWS * WORDS))
        acc ^= cur
        cur = nxt
    tl.store(out_ptr + tl.program_id(0), tl.reduce_or(acc, axis=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows_md = [
        "| N x K | order | rows | bytes a row per iteration | warps | us | GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, k in ((14336, 4096), (4096, 14336)):
        qs = torch.randint(0, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)  # K/2 bytes a row
        nbytes = qs.numel() * 4
        for rows, row_bytes, warps in (
            (32, 128, 4),
            (64, 128, 4),
            (32, 256, 4),
            (32, 512, 4),
            (16, 512, 4),
            (32, 1024, 8),
        ):
            words = row_bytes // 4
            tiles = (k // 2) // row_bytes
            out = torch.empty(n // rows, dtype=torch.int32, device=device)
            for order in ("rows", "rows, 3 ahead", "flat"):
                if order == "rows, 3 ahead":

                    def call(o=out, r=rows, w=words, t=tiles, q=qs, nw=warps):
                        _read_rows_deep[(q.shape[0] // r,)](q, o, q.shape[1], ROWS=r, WORDS=w, TILES=t, num_warps=nw)
                        return o
                elif order == "rows":

                    def call(o=out, r=rows, w=words, t=tiles, q=qs, nw=warps):
                        _read_rows[(q.shape[0] // r,)](q, o, q.shape[1], ROWS=r, WORDS=w, TILES=t, num_warps=nw)
                        return o
                else:

                    def call(o=out, r=rows, w=words, t=tiles, q=qs, nw=warps):
                        _read_flat[(q.shape[0] // r,)](q, o, ROWS=r, WORDS=w, TILES=t, num_warps=nw)
                        return o

                us, _ = bl.graph_replay_us(call)
                rows_md.append(
                    f"| {n} x {k} | {order} | {rows} | {row_bytes} | {warps} | {us:.1f} | {nbytes / us / 1e3:.0f} |"
                )
                print(rows_md[-1], flush=True)
    notes = ["Reads the codes of an N x K Q4_K weight (N*K/2 bytes, random); CUDA-graph replays, L2 flushed (median)."]
    return bl.finish_probe(
        device, "Q4_K code reads: the decode kernels' order against contiguous slices", notes, rows_md, args.out
    )


if __name__ == "__main__":
    sys.exit(main())

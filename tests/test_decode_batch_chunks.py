"""Decode calls with more sequences than a CUDA grid's z extent (65535) launch in batch chunks.

The split kernel's and the merge's grids put sequences on z. CPU tier: the grids of a B=70000
call recorded on meta tensors (nothing runs), and interpreter numerics with the chunk limit
lowered so that a small call runs in chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sm90_build import record_launches
from torch._library.triton import set_wrap_triton_enabled

from tritune.kernels import _launch
from tritune.kernels.decode import launch as decode_launch
from tritune.kernels.decode.kernel import decode_attention
from tritune.kernels.decode.reference import compare, decode_reference
from tritune.kernels.pins import use_config
from tritune.search_spaces.splitk_decode import DecodeConfig

BIG_BATCH = 70000
META = torch.device("meta")
#: CUDA's cap on a grid's y and z extents.
CUDA_GRID_YZ = 65535
#: Where each decode kernel takes ``out`` among its arguments.
OUT_POSITION = {"_decode_split_kernel": 4, "_decode_merge_kernel": 1}
#: Many small splits (on a 64-SM plan), merged by a second launch or by the split kernel itself.
MANY_SPLITS = {"MIN_CHUNK": 64, "BLOCK_N": 16, "TARGET_WAVES": 4}
FUSED = {**MANY_SPLITS, "FUSED_MERGE": True}


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[str, tuple[int, ...], int, int]]]:
    """Record each decode kernel's (name, grid, first sequence, sequences of out), launching nothing."""
    launches: list[tuple[str, tuple[int, ...], int, int]] = []
    with set_wrap_triton_enabled(False), record_launches() as recorder:
        try:
            yield launches
        finally:
            for launch in recorder.launches:
                name = launch.kernel.fn.__name__
                out = launch.args[OUT_POSITION[name]]
                launches.append((name, tuple(launch.grid), out.storage_offset() // out.stride(0), out.shape[0]))


@pytest.mark.parametrize("config", [MANY_SPLITS, FUSED], ids=["merge-launch", "fused-merge"])
def test_big_batches_launch_grids_cuda_accepts_covering_each_sequence_once(config, monkeypatch):
    # As many SMs as sequences x 16: splits even at this batch, so the merge launches too.
    monkeypatch.setitem(_launch.SM_COUNTS, META, 16 * BIG_BATCH)
    # The fused merge's arrival counters on meta: kept out of the process's buffers.
    monkeypatch.setattr(_launch, "COUNTERS", {})
    q = torch.empty(BIG_BATCH, 8, 1, 128, dtype=torch.bfloat16, device=META)
    k = torch.empty(BIG_BATCH, 1, 4096, 128, dtype=torch.bfloat16, device=META)
    kv_len = torch.empty(BIG_BATCH, dtype=torch.int32, device=META)
    with recorded_launches() as launches:
        decode_launch.launch(DecodeConfig(**config), q, k, torch.empty_like(k), kv_len, 0.1, torch.empty_like(q))
    assert launches
    by_kernel: dict[str, list[tuple[int, int]]] = {}
    for name, grid, first, sequences in launches:
        assert max(grid[1:]) <= CUDA_GRID_YZ, (name, grid)
        assert grid[2] == sequences, (name, grid, sequences)
        by_kernel.setdefault(name, []).append((first, sequences))
    expected = {"_decode_split_kernel"} | (set() if config.get("FUSED_MERGE") else {"_decode_merge_kernel"})
    assert set(by_kernel) == expected
    for chunks in by_kernel.values():
        end = 0
        for first, sequences in sorted(chunks):
            assert first == end, chunks  # no sequence skipped, none written twice
            end = first + sequences
        assert end == BIG_BATCH


@pytest.mark.parametrize("config", [MANY_SPLITS, FUSED], ids=["merge-launch", "fused-merge"])
def test_chunked_calls_match_the_reference(config, monkeypatch, device):
    """With the limit lowered to 2 sequences, a B=5 call runs in three chunks through batch views
    (a strided ``kv_len`` view included) and matches the reference."""
    if device == "cpu":
        monkeypatch.setitem(_launch.SM_COUNTS, torch.device("cpu"), 64)
    monkeypatch.setattr(decode_launch, "_GRID_YZ", 2, raising=False)
    launches: list[int] = []
    split_kernel = decode_launch._decode_split_kernel

    class Counting:
        def __getitem__(self, grid: Any) -> Any:
            launches.append(grid[2])
            return split_kernel[grid]

    monkeypatch.setattr(decode_launch, "wrap_triton", lambda kernel: Counting() if kernel is split_kernel else kernel)
    gen = torch.Generator().manual_seed(3)
    lengths = [97, 0, 37, 64, 5]
    q = torch.randn(5, 4, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    k = torch.randn(5, 2, 100, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(5, 2, 100, 64, generator=gen).to(torch.bfloat16)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    k, v = k.to(device), v.to(device)
    kv_len = torch.tensor([x for n in lengths for x in (n, -1)], dtype=torch.int32, device=device)[::2]
    out = torch.full_like(q, float("nan"))
    with use_config("splitk_decode", config):
        decode_attention(q, k, v, kv_len, out=out)
    assert launches == [2, 2, 1]
    problem = compare(out, decode_reference(q, k, v, kv_len), q.dtype)
    assert problem is None, problem

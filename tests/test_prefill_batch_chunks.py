"""Prefill calls with more batches than a CUDA grid's y or z extent (65535) launch in batch chunks.

Every path puts batches on y or z (portable: z, TMA: z as batches x KV splits, the split merge:
z, ws: y), so a bigger batch launches through batch views of every tensor. CPU tier: the grids of
a B=70000 call recorded on meta tensors (nothing runs), and interpreter numerics with the chunk
limit lowered so that a small call runs in chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from sm90_build import record_launches
from torch._library.triton import set_wrap_triton_enabled

from tritune.kernels import prefill_attention, use_config
from tritune.kernels.prefill import launch as prefill_launch
from tritune.kernels.prefill.kernel import KERNEL
from tritune.kernels.prefill.reference import prefill_reference
from tritune.search_spaces.tma_prefill import PortableConfig, TmaConfig, WsConfig

BIG_BATCH = 70000
META = torch.device("meta")
#: CUDA's cap on a grid's y and z extents.
CUDA_GRID_YZ = 65535
#: Where every prefill kernel takes out (or its descriptor) among its arguments.
OUT_POSITION = 3


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, ...]
    #: The first batch and the number of batches of the tensor the launch writes (a view of out).
    first: int
    batches: int


def _batches(t: Any) -> tuple[int, int]:
    """``(first batch, batches)`` of a view of ``out`` (a descriptor's base for the TMA and ws kernels)."""
    t = getattr(t, "base", t)
    return t.storage_offset() // t.stride(0), t.shape[0]


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Record each prefill kernel's grid and the batches of out it writes, launching nothing."""
    launches: list[Launch] = []
    with set_wrap_triton_enabled(False), record_launches() as recorder:
        try:
            yield launches
        finally:
            for launch in recorder.launches:
                first, batches = _batches(launch.args[OUT_POSITION])
                launches.append(Launch(launch.kernel.fn.__name__, tuple(launch.grid), first, batches))


def _meta_call(batch: int, *, kv_len: str | None = None):
    q = torch.empty(batch, 8, 64, 128, dtype=torch.bfloat16, device=META)
    k = torch.empty(batch, 1, 256, 128, dtype=torch.bfloat16, device=META)
    lengths = {None: None, "scalar": torch.empty((), dtype=torch.int32, device=META)}.get(kv_len)
    if kv_len == "per-batch":
        lengths = torch.empty(batch, dtype=torch.int32, device=META)
    return q, k, torch.empty_like(k), lengths, True, 128**-0.5, torch.empty_like(q)


CONFIGS = {
    "portable": PortableConfig(BLOCK_M=64, BLOCK_N=64),
    "tma": TmaConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "tma-split4": TmaConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, SPLIT_KV=4),
    "ws": WsConfig(BLOCK_M=128, BLOCK_N=128, num_stages=2, CONSUMER_REGS=232, PRODUCER_REGS=40),
}
#: The grid axis each kernel puts batches on (the TMA kernel: batches x KV splits).
BATCH_AXIS = {"_prefill_fwd_kernel": 2, "_prefill_tma_kernel": 2, "_merge_splits_kernel": 2, "_prefill_ws_kernel": 1}


@pytest.mark.parametrize("kv_len", [None, "scalar", "per-batch"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_big_batches_launch_grids_cuda_accepts_covering_each_batch_once(config, kv_len):
    call = _meta_call(BIG_BATCH, kv_len=kv_len)
    runner = {
        "portable": prefill_launch.launch_portable,
        "tma": prefill_launch.launch_tma,
        "ws": prefill_launch.launch_ws,
    }[config.path]
    with recorded_launches() as launches:
        runner(config, *call)
    assert launches
    split = getattr(config, "SPLIT_KV", 1)
    by_kernel: dict[str, list[Launch]] = {}
    for launch in launches:
        assert max(launch.grid[1:]) <= CUDA_GRID_YZ, launch
        multiple = split if launch.kernel == "_prefill_tma_kernel" else 1
        assert launch.grid[BATCH_AXIS[launch.kernel]] == launch.batches * multiple, launch
        by_kernel.setdefault(launch.kernel, []).append(launch)
    expected = {"portable": {"_prefill_fwd_kernel"}, "tma": {"_prefill_tma_kernel"}, "ws": {"_prefill_ws_kernel"}}
    kernels = expected[config.path] | ({"_merge_splits_kernel"} if split > 1 else set())
    assert set(by_kernel) == kernels
    for chunks in by_kernel.values():
        covered = sorted((launch.first, launch.batches) for launch in chunks)
        assert sum(batches for _, batches in covered) == BIG_BATCH
        end = 0
        for first, batches in covered:
            assert first == end, covered  # no batch skipped, none written twice
            end = first + batches


def test_a_call_within_the_limit_launches_once():
    with recorded_launches() as launches:
        prefill_launch.launch_portable(CONFIGS["portable"], *_meta_call(3))
    assert [(launch.first, launch.batches) for launch in launches] == [(0, 3)]


@pytest.mark.parametrize("kv_len", [None, "scalar", "per-batch"])
@pytest.mark.parametrize(
    "pinned",
    [{"BLOCK_M": 16, "BLOCK_N": 16}, {"path": "tma", "BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_KV": 2}],
    ids=["portable", "tma-split2"],
)
def test_chunked_calls_match_the_reference(pinned, kv_len, monkeypatch):
    """With the limit lowered to 2 batches (one batch of two KV splits for the TMA kernel), a B=5
    call runs in chunks through batch views and matches the fp64 reference."""
    monkeypatch.setattr(prefill_launch, "_GRID_YZ", 2, raising=False)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(5, 4, 9, 64, generator=gen).to(torch.float16)
    k = torch.randn(5, 2, 40, 64, generator=gen).to(torch.float16)
    v = torch.randn(5, 2, 40, 64, generator=gen).to(torch.float16)
    lengths = {
        None: None,
        "scalar": torch.tensor(33, dtype=torch.int32),
        "per-batch": torch.tensor([40, 9, 0, 25, 13], dtype=torch.int32),
    }[kv_len]
    chunks: list[int] = []
    chunked = prefill_launch._in_batch_chunks

    def counting(*args: Any) -> None:
        chunks.append(args[1])
        chunked(*args)

    monkeypatch.setattr(prefill_launch, "_in_batch_chunks", counting)
    out = torch.full_like(q, float("nan"))
    with use_config("tma_prefill", pinned):
        prefill_attention(q, k, v, kv_len=lengths, out=out)
    ref = prefill_reference(q, k, v, causal=True, kv_len=lengths, dtype=torch.float64)
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).abs().max()) <= 2e-2 * max(1.0, float(ref.abs().max()))
    assert KERNEL.check(out, ref.float(), None) is None
    assert chunks == [1 if "SPLIT_KV" in pinned else 2]  # the chunk sizes that keep z within 2

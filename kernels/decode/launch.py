"""The launch of split-K decode attention: the split plan, the workspace, the grids.

The grid is sized from static facts (batch, heads, the cache length ``Lmax``) and the SM count;
each program decides on the device, from the runtime ``kv_len``, whether its split has work (see
:mod:`._triton_decode`). Everything a launch needs beyond the tensors' own strides follows from
the config and those static facts, so it is planned once per combination (:func:`plan`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from tritune.search_spaces.splitk_decode import (
    DecodeConfig,
    block_m_for,
    max_splits,
    padded_head_dim,
    row_blocks,
    splits_target,
)

from .._launch import (
    LOG2E,
    MERGE_TILE,
    arrival_counters,
    prepare_interpreter,
    runs_on_interpreter,
    sm_count,
    traced,
    unchecked_descriptor,
    workspace,
)
from .._oplib import in_direct_body, wrap_triton
from ._triton_decode import _decode_merge_kernel, _decode_split_kernel

__all__ = ["Plan", "descriptors_allowed", "launch", "plan"]

#: Whether the kernels were decorated for the interpreter, which launches then prepare first.
_INTERPRETED = runs_on_interpreter(_decode_split_kernel)
#: CUDA caps a grid's z extent, where both kernels put batches, at this: more launch in chunks.
_GRID_YZ = 65535


class Plan(NamedTuple):
    """Everything a launch needs that follows from static facts and the config."""

    block_m: int
    d_pad: int
    row_blocks: int
    splits_target: int
    num_splits: int
    workspace: int
    lse_offset: int
    split_block: int
    merge_block_d: int
    #: Arrival counters of a fused merge (one per sequence, KV head and row block); 0: no fused merge.
    counters: int


@functools.lru_cache(maxsize=1024)
def plan(config: DecodeConfig, sm_count: int, batch: int, kv_heads: int, rows: int, lmax: int, head_dim: int) -> Plan:
    """The launch plan of ``config`` for ``rows`` query rows per KV head (query heads of a group x new tokens)."""
    target = splits_target(config, sm_count, batch * kv_heads, rows)
    num_splits = max_splits(config, sm_count, batch * kv_heads, rows, lmax)
    # Workspace: normalised partial outputs [B, Hkv, splits, rows, D], then their log2-sum-exps.
    partials = batch * kv_heads * num_splits * rows
    size = partials * (head_dim + 1) if num_splits > 1 else 1
    d_pad = padded_head_dim(head_dim)
    fused = config.FUSED_MERGE and num_splits > 1
    # The merge holds a [split_block, merge_block_d] fp32 tile: at most MERGE_TILE values (64 a thread at 4
    # warps), split across head-dim blocks when there are many splits, so that one pass covers up to 512 of
    # them. A fused merge runs in the split program with its num_warps: the same values per thread.
    tile = MERGE_TILE * config.num_warps // 4 if fused else MERGE_TILE
    split_block = max(2, min(1 << (num_splits - 1).bit_length(), 512))
    merge_block_d = min(d_pad, max(16, tile // split_block))
    counters = batch * kv_heads * row_blocks(rows) if fused else 0
    return Plan(
        block_m=block_m_for(rows),
        d_pad=d_pad,
        row_blocks=row_blocks(rows),
        splits_target=target,
        num_splits=num_splits,
        workspace=size,
        lse_offset=partials * head_dim,
        split_block=split_block,
        merge_block_d=merge_block_d,
        counters=counters,
    )


def descriptors_allowed(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether ``KV_TMA`` may load these caches through host-side descriptors in this call.

    Not for a head dim that is not a power of two (the box spans the whole head dim, unpadded),
    nor while a tracer runs the launch: torch cannot yet trace a ``triton_op`` whose kernel takes
    host-side descriptors, so ``torch.compile`` keeps pointer loads. A descriptor also needs a
    16-byte aligned base and outer strides of whole 16 bytes (the inner stride of 1 is the op's
    contract, checked again here since the descriptor is built unchecked): a cache view that
    breaks either (an odd offset into a buffer, an odd row pitch) keeps pointer loads.
    """
    if padded_head_dim(head_dim) != head_dim or not in_direct_body():
        return False
    if 0 in k_cache.shape:  # an empty cache (no key at all): a descriptor needs every dimension
        return False
    for cache in (k_cache, v_cache):
        strides = cache.stride()
        if strides[3] != 1 or cache.data_ptr() % 16:
            return False
        if any(stride * cache.element_size() % 16 for stride in strides[:3]):
            return False
    return True


def launch(
    config: DecodeConfig,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """Launch the split kernel, then the merge where some sequence may need more than one split
    (unless the split kernel merges itself: ``FUSED_MERGE``), on checked arguments."""
    if _INTERPRETED:
        prepare_interpreter()
    tracing = traced(q)
    if tracing:
        # Plain ints: under dynamic-shape tracing sizes arrive as SymInts, and the grid, the workspace
        # and the kernels' stride specialisation are all fixed per shape anyway.
        batch, q_heads, lq, head_dim = (int(n) for n in q.shape)
        sq, sk, sv, so = (tuple(int(x) for x in t.stride()[:3]) for t in (q, k_cache, v_cache, out))
    else:  # eager tensors' sizes are ints already (converting them costs an eager call microseconds)
        batch, q_heads, lq, head_dim = q.shape
        sq, sk, sv, so = q.stride()[:3], k_cache.stride()[:3], v_cache.stride()[:3], out.stride()[:3]
    if batch > _GRID_YZ:
        # Batch views of every tensor, one chunk after the other: each plans its own split and
        # workspace, and a fused merge leaves the arrival counters at zero for the next.
        for b0 in range(0, batch, _GRID_YZ):
            b1 = b0 + _GRID_YZ
            launch(config, q[b0:b1], k_cache[b0:b1], v_cache[b0:b1], kv_len[b0:b1], softmax_scale, out[b0:b1])
        return
    kv_heads, lmax = int(k_cache.shape[1]), int(k_cache.shape[2])
    group = q_heads // kv_heads
    p = plan(config, sm_count(q.device), batch, kv_heads, group * lq, lmax, head_dim)
    ws = workspace(p.workspace, q.device)
    fused = p.counters > 0
    counters = arrival_counters(p.counters, q.device, fresh=tracing) if fused else None
    # A view such as lengths[::2] is read through its stride.
    stride_kvl = int(kv_len.stride(0))
    # Only the interpreter runs CPU tensors; its bf16 dot is broken, so its MMAs take fp32 operands.
    dot_in_fp32 = q.device.type == "cpu"
    kv_tma = config.KV_TMA and descriptors_allowed(k_cache, v_cache, head_dim)
    if kv_tma:
        box = [1, 1, config.BLOCK_N, head_dim]
        k_desc, v_desc = unchecked_descriptor(k_cache, box), unchecked_descriptor(v_cache, box)
    else:
        # Unread (the kernel's pointer branch compiles without them): any argument serves.
        k_desc, v_desc = k_cache, v_cache
    try:
        wrap_triton(_decode_split_kernel)[(p.num_splits, p.row_blocks * kv_heads, batch)](
            q, k_cache, v_cache, kv_len, out, ws, counters, *sq, *sk, *sv, *so, stride_kvl,
            kv_heads, lmax, softmax_scale * LOG2E, p.splits_target, config.MIN_CHUNK, p.num_splits, p.lse_offset,
            k_desc, v_desc,
            GROUP=group, LQ=lq, BLOCK_M=p.block_m, HEAD_DIM=head_dim, D_PAD=p.d_pad, BLOCK_N=config.BLOCK_N,
            DOT_IN_FP32=dot_in_fp32, FUSED_MERGE=fused, SPLIT_BLOCK=p.split_block,
            MERGE_BLOCK_D=p.merge_block_d, KV_TMA=kv_tma, num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    except BaseException:
        # The interpreter runs the programs one by one: a launch that raised part-way has left row
        # blocks counted, which would keep their last split from merging in every later launch.
        if counters is not None and not counters.is_cuda:
            counters.zero_()
        raise
    if p.num_splits > 1 and not fused:
        d_blocks = -(-head_dim // p.merge_block_d)
        wrap_triton(_decode_merge_kernel)[(group * lq * d_blocks, kv_heads, batch)](
            kv_len, out, ws, *so, stride_kvl,
            kv_heads, lmax, p.splits_target, config.MIN_CHUNK, p.num_splits, p.lse_offset,
            GROUP=group, LQ=lq, HEAD_DIM=head_dim, BLOCK_N=config.BLOCK_N,
            SPLIT_BLOCK=p.split_block, BLOCK_D=p.merge_block_d, num_warps=4, num_stages=2,
        )  # fmt: skip

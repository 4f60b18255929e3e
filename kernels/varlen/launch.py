"""Launching varlen attention: the plan a config and the static facts fix, the grid, the two kernels.

The grid is sized from static facts only (T, S, the store's shape, the config), never from
``seq_info``, which stays on the device: every program reads the table and works out its own tile
and KV split there (see ``_triton_varlen``), so a call never synchronises and one captured CUDA
graph serves any mix of segments within the static T and S. Launches go through ``wrap_triton``,
so ``torch.compile`` sees the kernels; in plain eager calls it hands back the bare kernels.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch

from tritune.search_spaces.varlen_sdpa import (
    VarlenConfig,
    block_m_for,
    padded_head_dim,
    short_block_m,
    split_budget,
)

from .._launch import (
    LOG2E,
    MERGE_TILE,
    prepare_interpreter,
    runs_on_interpreter,
    sm_count,
    unchecked_descriptor,
    workspace,
)
from .._oplib import in_direct_body, wrap_triton
from ._triton_varlen import _varlen_fwd_kernel, _varlen_merge_kernel

__all__ = ["Plan", "launch", "plan"]

#: Query-row x segment comparisons one zero-fill program makes at once.
_ZERO_TILE = 4096
#: Whether the kernels were decorated for the interpreter, which a launch then prepares first (a
#: direct call of the registered op, opcheck's for one, has no other place that would).
_INTERPRETED = runs_on_interpreter(_varlen_fwd_kernel)


class Plan(NamedTuple):
    """Everything a launch needs that follows from static facts and the config, except T."""

    block_m: int
    #: Rows of the tile for segments whose new tokens fit in it (``block_m``: one tile for all).
    short_m: int
    tokens_per_tile: int
    d_pad: int
    s_pad: int
    budget: int
    split: bool
    zero_tokens: int
    ws_slots: int
    merge_block_d: int


@functools.lru_cache(maxsize=1024)
def plan(
    config: VarlenConfig,
    sm_count: int,
    segments: int,
    rows: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    causal: bool,
    window: int,
) -> Plan:
    """The launch geometry of ``config`` for these static facts (``window`` 0: none)."""
    block_m = block_m_for(config.BLOCK_M, group)
    tq = block_m // group
    budget = split_budget(config, sm_count, kv_heads)
    # No tile can see more keys than the store holds (or than the window spans, causally).
    max_cost = min(rows, tq + window - 1) if causal and window > 0 else rows
    split = config.MAX_SPLITS > 1 and max_cost > config.MIN_CHUNK
    s_pad = max(16, 1 << (segments - 1).bit_length())
    # The zero-fill compares ZERO_TOKENS rows with every segment: keep that tile small in registers.
    zero_tokens = max(2, min(64, _ZERO_TILE // s_pad))
    d_pad = padded_head_dim(head_dim)
    return Plan(
        block_m=block_m,
        short_m=short_block_m(config, group),
        tokens_per_tile=tq,
        d_pad=d_pad,
        s_pad=s_pad,
        budget=budget,
        split=split,
        zero_tokens=zero_tokens,
        # Split tiles hold at most twice the budget of partials (see _triton_varlen's schedule).
        ws_slots=2 * budget if split else 0,
        merge_block_d=min(d_pad, max(16, MERGE_TILE // block_m)),
    )


def _effective_window(window: int | None, rows: int) -> int:
    """The window the kernels get (0: none): ``window``, capped at ``rows + 1``.

    The cap changes nothing, and keeps the kernels' int32 cost bounds ``TQ + window - 1`` and
    ``q_len + window - 1`` from wrapping near ``2**31 - 1`` (a common "no window" sentinel): they
    stay below ``rows + max(TQ, T)``. Exact because, for every segment, the keys a kernel reads lie
    in ``[ring_lo, kv_end)`` with ``kv_end - ring_lo <= rows`` (flat: ``kv_end`` clamped to
    ``rows``, ``ring_lo = 0``; ring: ``ring_lo = max(kv_end - rows, 0)``), and every query sits at
    a position ``p < kv_end``. A window hides the keys ``<= p - window``: none of those once
    ``window >= rows``. From ``window >= rows + 1`` on, both cost bounds (``TQ >= 1``,
    ``q_len >= 0``) are at least ``rows >= kv_end - ring_lo``, so their ``min`` keeps the cost: any
    such window gives the same masks and schedule.
    """
    return 0 if window is None else min(window, rows + 1)


def _descriptors_allowed(k_store: torch.Tensor, v_store: torch.Tensor, ring: bool, head_dim: int) -> bool:
    """Whether ``KV_TMA`` may load these stores through host-side descriptors.

    Not for a ring (a tile may wrap past the last row), nor a head dim that is not a power of two
    (the box would be padded), nor while a tracer runs the launch: torch cannot yet trace a
    ``triton_op`` whose kernel takes host-side descriptors, so ``torch.compile`` keeps pointer
    loads. Descriptors also need 16-byte aligned bases and strides (an inner stride of 1 is checked
    for every call).
    """
    if ring or padded_head_dim(head_dim) != head_dim or not in_direct_body():
        return False
    for store in (k_store, v_store):
        if store.data_ptr() % 16 or any(stride * store.element_size() % 16 for stride in store.stride()[:3]):
            return False
    return True


def launch(
    config: VarlenConfig,
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    causal: bool,
    window: int | None,
    ring: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """Run ``config`` on checked arguments into ``out``: the tile kernel, and the merge where a tile may split."""
    if _INTERPRETED:
        prepare_interpreter()
    # T may stay symbolic under tracing: the grid is plain arithmetic on it. The other sizes fix
    # the kernel's constants (and change only when a store grows), so they specialise.
    tokens = q.shape[0]
    q_heads, head_dim = operator.index(q.shape[1]), operator.index(q.shape[2])
    rows, cols, kv_heads = (operator.index(n) for n in k_store.shape[:3])
    segments = operator.index(seq_info.shape[0])
    group = q_heads // kv_heads
    span = _effective_window(window, rows)
    geometry = plan(config, sm_count(q.device), segments, rows, kv_heads, group, head_dim, causal, span)
    work_slots = tokens // geometry.tokens_per_tile + segments + (geometry.budget if geometry.split else 0)
    zero_programs = (tokens + geometry.zero_tokens - 1) // geometry.zero_tokens
    partials = geometry.ws_slots * kv_heads * geometry.block_m
    ws = workspace(partials * (head_dim + 1) if geometry.split else 1, q.device)
    sk, sv = k_store.stride()[:3], v_store.stride()[:3]
    # Only the interpreter runs CPU tensors; its bf16 dot is broken, so its MMAs take fp32 operands.
    dot_in_fp32 = q.device.type == "cpu"
    qk_scale = softmax_scale * LOG2E
    block_n, min_chunk, max_splits = config.BLOCK_N, config.MIN_CHUNK, config.MAX_SPLITS
    kv_tma = config.KV_TMA and _descriptors_allowed(k_store, v_store, ring, head_dim)
    if kv_tma:
        box = [block_n, 1, 1, head_dim]
        k_desc, v_desc = unchecked_descriptor(k_store, box), unchecked_descriptor(v_store, box)
    else:
        # Unread (the kernel's pointer branch compiles without them): any argument serves.
        k_desc, v_desc = k_store, v_store
    wrap_triton(_varlen_fwd_kernel)[(work_slots + zero_programs, kv_heads)](
        q, k_store, v_store, k_desc, v_desc, out, seq_info, ws,
        q.stride(0), q.stride(1), *sk, *sv, out.stride(0), out.stride(1), seq_info.stride(0), seq_info.stride(1),
        segments, tokens, rows, cols, kv_heads, span, qk_scale,
        geometry.budget, min_chunk, max_splits, work_slots, partials * head_dim,
        GROUP=group, HEAD_DIM=head_dim, D_PAD=geometry.d_pad, BLOCK_M=geometry.block_m, SHORT_M=geometry.short_m,
        BLOCK_N=block_n, S_PAD=geometry.s_pad, ZERO_TOKENS=geometry.zero_tokens, CAUSAL=causal, WINDOWED=span > 0,
        RING=ring, SPLIT=geometry.split, KV_TMA=kv_tma, DOT_IN_FP32=dot_in_fp32, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if geometry.split:
        d_blocks = -(-head_dim // geometry.merge_block_d)
        wrap_triton(_varlen_merge_kernel)[(geometry.budget, kv_heads, d_blocks)](
            out, seq_info, ws,
            out.stride(0), out.stride(1), seq_info.stride(0), seq_info.stride(1),
            segments, tokens, rows, cols, kv_heads, span,
            geometry.budget, min_chunk, max_splits, partials * head_dim,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=geometry.merge_block_d, BLOCK_M=geometry.block_m,
            BLOCK_N=block_n, S_PAD=geometry.s_pad, CAUSAL=causal, WINDOWED=span > 0, RING=ring, num_warps=4,
            num_stages=1,
        )  # fmt: skip

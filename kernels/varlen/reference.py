"""Pure-PyTorch reference of varlen attention: one segment at a time, dense masks, fp64 (or fp32).

Used by the tests, the tuner's correctness gate and the benchmarks. Each segment's keys are
gathered from its store column by position before anything is computed, so whatever lies outside
them (rows past ``kv_end``, ring slots already overwritten) cannot reach the result. The
semantics are the kernel's contract:

- segment ``(q_start, q_len, col, kv_end)`` owns query rows ``q_start .. q_start + q_len - 1``;
  its query ``j`` sits at position ``kv_end - q_len + j``;
- its sequence holds positions ``0 .. kv_end - 1``, position ``p`` at store row ``p`` (flat) or
  ``p % rows`` (ring, where only positions ``>= kv_end - rows`` still exist);
- causal: a query sees the keys at positions up to its own; otherwise every key;
  ``window=W``: also only the keys at positions ``> its own - W``;
- a query row that sees no key, and a row no segment covers, is zero.
"""

from __future__ import annotations

import math

import torch

from .._numerics import TOLERANCES, compare, masked_attention

__all__ = ["TOLERANCES", "compare", "segment_keys", "sequence_reference", "varlen_reference"]

#: Score elements computed at once: bounds the reference's memory at long contexts.
_CHUNK_ELEMENTS = 1 << 26


def sequence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention of one sequence's queries ``q [L, Hq, D]`` over its keys ``k, v [n, Hkv, D]``.

    ``q_positions [L]`` and ``k_positions [n]`` are the absolute positions that causality and
    the window compare. Returns ``[L, Hq, D]`` in ``dtype``.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    length, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(length, q_heads, head_dim, dtype=dtype, device=q.device)
    if length == 0 or k.shape[0] == 0:
        return out
    # Query heads of one GQA group share their K/V head: [Hkv, group, L, D] against [Hkv, 1, D, n].
    qg = q.to(dtype).permute(1, 0, 2).reshape(kv_heads, group, length, head_dim)
    kt = k.to(dtype).permute(1, 2, 0)[:, None]
    vg = v.to(dtype).permute(1, 0, 2)[:, None]
    step = max(1, _CHUNK_ELEMENTS // max(1, q_heads * k.shape[0]))
    for start in range(0, length, step):
        rows = slice(start, min(length, start + step))
        qp = q_positions[rows, None].to(torch.int64)
        kp = k_positions[None, :].to(torch.int64)
        visible = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=q.device)
        if causal:
            visible &= kp <= qp
        if window is not None:
            visible &= kp > qp - window
        scores = (qg[:, :, rows] @ kt) * scale  # [Hkv, group, rows, n]
        part = masked_attention(scores, visible, vg)
        out[rows] = part.reshape(q_heads, -1, head_dim).permute(1, 0, 2)
    return out


def segment_keys(
    k_store: torch.Tensor, v_store: torch.Tensor, col: int, kv_end: int, *, ring: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys, values and positions of one sequence that the store still holds."""
    rows = k_store.shape[0]
    first = max(0, kv_end - rows) if ring else 0
    end = kv_end if ring else min(kv_end, rows)
    positions = torch.arange(first, max(end, first), device=k_store.device)
    index = positions % rows if ring else positions
    return k_store[index, col], v_store[index, col], positions


def varlen_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    ring: bool = False,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``varlen_attention``'s result as a loop of :func:`sequence_reference` over the segments, in ``dtype``."""
    result = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for q_start, q_len, col, kv_end in seq_info.tolist():
        if q_len <= 0:
            continue
        k, v, positions = segment_keys(k_store, v_store, col, kv_end, ring=ring)
        q_positions = torch.arange(kv_end - q_len, kv_end, device=q.device)
        result[q_start : q_start + q_len] = sequence_reference(
            q[q_start : q_start + q_len], k, v, q_positions, positions,
            causal=causal, window=window, softmax_scale=softmax_scale, dtype=dtype,
        )  # fmt: skip
    return result

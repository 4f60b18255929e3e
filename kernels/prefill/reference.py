"""Pure-PyTorch reference of prefill attention: a dense mask, computed in fp32 or fp64.

Used by the tests, the tuner's correctness gate and the benchmarks. The semantics are the
kernels' contract:

- ``kv_len`` (int32, shape ``[]`` or ``[B]``, clamped to ``[0, Lkv]``) bounds the valid keys;
  without it every key is valid;
- causal attention is aligned bottom-right: query ``i`` sits at absolute position
  ``kv_len - Lq + i`` and sees the keys at positions ``<=`` its own (and ``< kv_len``);
- a query row that sees no key returns zeros.
"""

from __future__ import annotations

import math

import torch

from .._numerics import masked_attention

#: Score elements computed at once: bounds the reference's memory at long contexts.
_CHUNK_ELEMENTS = 1 << 27


def visible_keys(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool,
    kv_len: torch.Tensor | None,
    device: torch.device,
    rows: slice | None = None,
) -> torch.Tensor:
    """Boolean mask ``[B, Lq, Lkv]`` (or the rows asked for): which keys each query sees."""
    rows = rows or slice(0, seqlen_q)
    if kv_len is None:
        valid = torch.full((batch,), seqlen_k, dtype=torch.int64, device=device)
    else:
        valid = kv_len.to(device=device, dtype=torch.int64).reshape(-1).expand(batch).clamp(0, seqlen_k)
    q_idx = torch.arange(rows.start, rows.stop, device=device)
    k_idx = torch.arange(seqlen_k, device=device)
    mask = k_idx[None, None, :] < valid[:, None, None]
    if causal:
        position = valid[:, None] - seqlen_q + q_idx[None, :]  # [B, rows]
        mask = mask & (k_idx[None, None, :] <= position[:, :, None])
    return mask.expand(batch, len(q_idx), seqlen_k)


def prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    kv_len: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over ``k, v [B, Hkv, Lkv, D]`` in ``dtype`` (fp32 or fp64)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    batch, q_heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    # Query heads of one GQA group share their K/V head: [B, Hkv, group, Lq, D].
    qg = q.to(dtype).reshape(batch, kv_heads, group, seqlen_q, head_dim)
    kt = k.to(dtype).transpose(-1, -2)[:, :, None]  # [B, Hkv, 1, D, Lkv]
    vg = v.to(dtype)[:, :, None]  # [B, Hkv, 1, Lkv, D]
    # Keys at or past kv_len are never visible and may hold anything (a cache's unused tail): their
    # zero weights must not meet NaN values.
    valid = visible_keys(batch, 1, seqlen_k, causal=False, kv_len=kv_len, device=q.device)  # [B, 1, Lkv]
    vg = vg.masked_fill(~valid[:, :, None, :, None], 0.0)
    out = torch.zeros(batch, kv_heads, group, seqlen_q, head_dim, dtype=dtype, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * q_heads * seqlen_k))
    for start in range(0, seqlen_q, step):
        rows = slice(start, min(seqlen_q, start + step))
        mask = visible_keys(batch, seqlen_q, seqlen_k, causal=causal, kv_len=kv_len, device=q.device, rows=rows)[
            :, None, None
        ]  # [B, 1, 1, rows, Lkv]
        out[:, :, :, rows] = masked_attention((qg[:, :, :, rows] @ kt) * scale, mask, vg)
    return out.reshape(batch, q_heads, seqlen_q, head_dim)


def visible_pairs(seqlen_q: int, kv_len: int, causal: bool) -> int:
    """Query-key pairs the mask leaves visible (bottom-right causal), for flop counts."""
    if not causal:
        return seqlen_q * kv_len
    # Row i sees kv_len - seqlen_q + 1 + i keys (at least 0): sum the positive counts.
    lowest = max(kv_len - seqlen_q + 1, 1)
    return (kv_len - lowest + 1) * (lowest + kv_len) // 2 if kv_len >= lowest else 0

"""Pure-PyTorch reference of decode attention, one sequence at a time, in fp64 (or fp32).

Used by the tests, the tuner's correctness gate and the benchmarks. Each sequence's cache is
sliced to its ``kv_len`` before anything is computed, so whatever lies past it (garbage, NaN)
cannot reach the result. The semantics are the kernel's contract:

- ``kv_len[b]`` (clamped to ``[0, Lmax]``) valid keys per sequence;
- the ``Lq`` new tokens are causal among themselves: token ``i`` sits at position
  ``kv_len - Lq + i`` and sees the keys at positions ``<=`` its own;
- a query row that sees no key returns zeros.
"""

from __future__ import annotations

import math

import torch

from .._numerics import TOLERANCES, compare, masked_attention

__all__ = ["TOLERANCES", "compare", "decode_reference"]


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over the first ``kv_len[b]`` keys of ``[B, Hkv, Lmax, D]`` caches."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    batch, q_heads, lq, head_dim = q.shape
    kv_heads, lmax = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    lengths = [min(max(int(n), 0), lmax) for n in kv_len.tolist()]
    out = torch.zeros(batch, kv_heads, group * lq, head_dim, dtype=dtype, device=q.device)
    # The new tokens of one GQA group share their KV head: rows are (query head, token) pairs.
    qg = q.reshape(batch, kv_heads, group * lq, head_dim)
    token = torch.arange(group * lq, device=q.device) % lq
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k = k_cache[b, :, :n].to(dtype)  # [Hkv, n, D]
        v = v_cache[b, :, :n].to(dtype)  # [Hkv, n, D]
        scores = (qg[b].to(dtype) @ k.transpose(-1, -2)) * scale  # [Hkv, rows, n]
        position = n - lq + token  # [rows]
        visible = torch.arange(n, device=q.device)[None, :] <= position[:, None]  # [rows, n]
        out[b] = masked_attention(scores, visible, v)
    return out.reshape(batch, q_heads, lq, head_dim)

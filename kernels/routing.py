"""One entry point for attention: decode steps go to split-K decode, everything else to prefill.

A call is a decode step when it brings at most ``MAX_QUERY_TOKENS`` new tokens per sequence,
attends causally, and names the valid length of each sequence with a ``[B]`` ``kv_len``: then
``k`` and ``v`` are read as KV caches of which only ``kv_len[b]`` positions count. A decode step
whose layout decode does not serve (a head dim of stride other than 1) goes to prefill, which takes
any strides. Errors name the arguments as this function calls them (``k``, ``v``). Prefill is
imported on first use, so a decode-only process never loads it.
"""

from __future__ import annotations

import torch

from .decode.op import MAX_QUERY_TOKENS, decode_attention_named, serves_layout

__all__ = ["attention"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_len: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over ``k, v [B, Hkv, Lkv, D]``, routed to the kernel that fits.

    Causal attention is aligned bottom-right: query ``i`` sits at position ``kv_len - Lq + i``.
    """
    # Checked here: a decode step is recognised by causal, and decode_attention takes no flag to check.
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    decode_step = (
        causal
        and isinstance(q, torch.Tensor)
        and isinstance(kv_len, torch.Tensor)
        and q.dim() == 4
        and 1 <= q.shape[2] <= MAX_QUERY_TOKENS
        and kv_len.dim() == 1
        and serves_layout(q, k, v, out)
    )
    if decode_step:
        return decode_attention_named(q, k, v, kv_len, softmax_scale, out, ("k", "v"))
    from .prefill.op import prefill_attention

    return prefill_attention(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=softmax_scale, out=out)

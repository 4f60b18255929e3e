"""One entry point for attention: decode steps go to split-K decode, everything else to prefill.

A call is a decode step when it brings at most ``MAX_QUERY_TOKENS`` new tokens per sequence,
attends causally, and names the valid length of each sequence with a ``[B]`` ``kv_len``: then
``k`` and ``v`` are read as KV caches of which only ``kv_len[b]`` positions count. A decode step
whose layout decode does not serve (a head dim of stride other than 1) goes to prefill, which takes
any strides. Errors name the arguments as this function calls them (``k``, ``v``). Prefill is
imported on first use, so a decode-only process never loads it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch

from .decode.op import MAX_QUERY_TOKENS, decode_attention_named

__all__ = ["attention"]

_PREFILL_MODULE = "tritune.kernels.prefill.op"


def _serves_layout(t: object) -> bool:
    """Decode's ``serves_layout`` of one argument (a 0-dim tensor's strides are empty)."""
    if not isinstance(t, torch.Tensor):
        return True
    strides = t.stride()
    return not strides or strides[-1] == 1


def _prefill_attention() -> Callable[..., torch.Tensor]:
    """Prefill, imported on first use; later calls skip the cost of an import statement."""
    module = sys.modules.get(_PREFILL_MODULE)
    if module is None:
        module = importlib.import_module(_PREFILL_MODULE)
    return module.prefill_attention  # type: ignore[no-any-return]


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
    decode_step = False
    if causal and isinstance(q, torch.Tensor) and isinstance(kv_len, torch.Tensor):
        shape = q.shape
        # serves_layout(q, k, v, out) without its generator, whose cost would be paid on every call.
        decode_step = (
            len(shape) == 4
            and 1 <= shape[2] <= MAX_QUERY_TOKENS
            and kv_len.dim() == 1
            and q.stride()[3] == 1
            and _serves_layout(k)
            and _serves_layout(v)
            and (out is None or _serves_layout(out))
        )
    if decode_step:
        return decode_attention_named(q, k, v, kv_len, softmax_scale, out, ("k", "v"))
    return _prefill_attention()(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=softmax_scale, out=out)

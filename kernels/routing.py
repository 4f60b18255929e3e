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

from .decode.kernel import KERNEL as DECODE
from .decode.kernel import MAX_QUERY_TOKENS

__all__ = ["attention"]

_PREFILL_MODULE = "tritune.kernels.prefill.kernel"
#: Decode's argument names -> this function's, for its errors.
_DECODE_NAMES = {"k_cache": "k", "v_cache": "v"}


def _serves_layout(t: object) -> bool:
    """Whether decode's layout rule (a head dim of stride 1) holds for one argument.

    A 0-dim tensor's strides are empty: it has no head dim to break the rule.
    """
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
    # Checked here: a decode step is recognised by causal, and decode takes no flag to check.
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    decode_step = False
    if causal and isinstance(q, torch.Tensor) and isinstance(kv_len, torch.Tensor):
        try:
            shape = q.shape
            # Decode's layout rule, read inline: a generated check's call would cost every call.
            decode_step = (
                len(shape) == 4
                and 1 <= shape[2] <= MAX_QUERY_TOKENS
                and kv_len.dim() == 1
                and q.stride()[3] == 1
                and _serves_layout(k)
                and _serves_layout(v)
                and (out is None or _serves_layout(out))
            )
        except Exception:  # a tensor without sizes or strides (nested, sparse): prefill's checks name it
            decode_step = False
    if decode_step:
        return DECODE.call_named((q, k, v, kv_len, softmax_scale, out), _DECODE_NAMES)  # type: ignore[no-any-return]
    return _prefill_attention()(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=softmax_scale, out=out)

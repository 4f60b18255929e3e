"""The facts of a plain eager decode call, in one pass over its tensors: the per-call fast path.

A decode step is short on the GPU and an eager loop pays its host time once per layer, so the
checks before the launch are what the dispatcher's promise (a dict lookup per call) comes down to.
``check_inputs`` reads some tensor attributes several times and builds tuples for its messages,
and every tensor attribute read costs time. :func:`eager_facts` reads each once and accepts only
what ``check_inputs`` accepts, returning the same facts as a plain tuple (the tests compare the
two). ``None`` (bad input, a tensor subclass, ``torch.compile``, an int scale) sends the call to
``check_inputs``, which raises the error naming the argument. A given ``out`` also pays the memory
checks (``out_is_separate``), which cost more than the rest; a call without one skips them.
"""

from __future__ import annotations

import torch

from tritune.search_spaces.splitk_decode import HEAD_DIMS

from .._launch import DTYPE_NAMES, MAX_SOFTMAX_SCALE, out_is_separate, runs_on_interpreter
from ._triton_decode import _decode_split_kernel

__all__ = ["eager_facts"]

#: Whether CPU tensors may run (the kernels were decorated for the interpreter): what ``check_device`` asks.
_CPU_RUNS = runs_on_interpreter(_decode_split_kernel)
# Module-level names for the per-call checks: each saves an attribute lookup.
_TENSOR = torch.Tensor
_INT32 = torch.int32
_MAX_SCALE = MAX_SOFTMAX_SCALE
_DTYPE_NAME = DTYPE_NAMES.get
_HEAD_DIMS = frozenset(HEAD_DIMS)
_is_compiling = torch.compiler.is_compiling


def eager_facts(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor | None,
    softmax_scale: float | None,
    max_query_tokens: int,
) -> tuple[str, int, int, int, int, int, int] | None:
    """``tuple(check_inputs(...))`` of a valid plain eager call, or None where that must decide.

    ``max_query_tokens``: the op's limit on new tokens per sequence (``op.MAX_QUERY_TOKENS``).
    """
    if (
        _is_compiling()
        or type(q) is not _TENSOR
        or type(k_cache) is not _TENSOR
        or type(v_cache) is not _TENSOR
        or type(kv_len) is not _TENSOR
        or not (softmax_scale is None or (type(softmax_scale) is float and -_MAX_SCALE <= softmax_scale <= _MAX_SCALE))
    ):
        return None
    dtype = q.dtype
    name = _DTYPE_NAME(dtype)
    shape = q.shape
    kv_shape = k_cache.shape
    if (
        name is None
        or k_cache.dtype is not dtype
        or v_cache.dtype is not dtype
        or kv_len.dtype is not _INT32
        or len(shape) != 4
        or len(kv_shape) != 4
        or v_cache.shape != kv_shape
    ):
        return None
    batch, q_heads, lq, head_dim = shape
    kv_batch, kv_heads, lmax, kv_dim = kv_shape
    if (
        kv_batch != batch
        or kv_dim != head_dim
        or head_dim not in _HEAD_DIMS
        or not 1 <= lq <= max_query_tokens
        or kv_heads == 0
        or q_heads % kv_heads
        or kv_len.shape != (batch,)
    ):
        return None
    device = q.device
    if (
        k_cache.device != device
        or v_cache.device != device
        or kv_len.device != device
        or not (q.is_cuda or (_CPU_RUNS and q.is_cpu))
    ):
        return None
    # The layout contract: a head dim of stride 1 (a cache is never copied).
    if q.stride()[3] != 1 or k_cache.stride()[3] != 1 or v_cache.stride()[3] != 1:
        return None
    if out is not None and (
        type(out) is not _TENSOR
        or out.dtype is not dtype
        or out.device != device
        or out.shape != shape
        or out.stride()[3] != 1
        or not out_is_separate(out, (q, k_cache, v_cache, kv_len))
    ):
        return None
    return (name, head_dim, batch, q_heads, kv_heads, lq, lmax)

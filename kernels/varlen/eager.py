"""The facts of a plain eager varlen call, in one pass over its tensors: the per-call fast path.

A serving step calls varlen attention once per layer, so its host time before the launch is what
the dispatcher's promise (a dict lookup per call) comes down to. ``check_inputs`` reads some
tensor attributes several times, builds tuples for its messages and asks ``has_static_value`` of
every length, and every tensor attribute read costs time. :func:`eager_facts` reads each attribute
once and accepts only what ``check_inputs`` accepts, returning the same facts as a plain tuple (the
tests compare the two); in eager mode every length is a plain int, so no length is symbolic.
``None`` (bad input, a tensor subclass, ``torch.compile``, an int scale) sends the call to
``check_inputs``, which raises the error naming the argument. A given ``out`` also pays the memory
checks (``out_is_separate``), which cost more than the rest; a call without one skips them.
"""

from __future__ import annotations

import torch

from tritune.search_spaces.varlen_sdpa import HEAD_DIMS

from .._launch import DTYPE_NAMES, MAX_SOFTMAX_SCALE, out_is_separate, runs_on_interpreter
from ._triton_varlen import _varlen_fwd_kernel

__all__ = ["eager_facts"]

#: Whether CPU tensors may run (the kernels were decorated for the interpreter): what ``check_device`` asks.
_CPU_RUNS = runs_on_interpreter(_varlen_fwd_kernel)
# Module-level names for the per-call checks: each saves an attribute lookup.
_TENSOR = torch.Tensor
_INT32 = torch.int32
_MAX_SCALE = MAX_SOFTMAX_SCALE
_DTYPE_NAME = DTYPE_NAMES.get
_HEAD_DIMS = frozenset(HEAD_DIMS)
_is_compiling = torch.compiler.is_compiling


def eager_facts(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    causal: bool,
    window: int | None,
    ring: bool,
    softmax_scale: float | None,
    out: torch.Tensor | None,
) -> tuple[str, int, int, int, int, int, int, bool, bool, bool] | None:
    """``tuple(check_inputs(...))`` of a valid plain eager call, or None where that must decide."""
    if (
        _is_compiling()
        or type(q) is not _TENSOR
        or type(k_store) is not _TENSOR
        or type(v_store) is not _TENSOR
        or type(seq_info) is not _TENSOR
        or type(causal) is not bool
        or type(ring) is not bool
        or not (window is None or (type(window) is int and window > 0))
        or not (softmax_scale is None or (type(softmax_scale) is float and -_MAX_SCALE <= softmax_scale <= _MAX_SCALE))
    ):
        return None
    dtype = q.dtype
    name = _DTYPE_NAME(dtype)
    shape = q.shape
    store_shape = k_store.shape
    info_shape = seq_info.shape
    if (
        name is None
        or k_store.dtype is not dtype
        or v_store.dtype is not dtype
        or seq_info.dtype is not _INT32
        or len(shape) != 3
        or len(store_shape) != 4
        or len(info_shape) != 2
        or v_store.shape != store_shape
    ):
        return None
    tokens, q_heads, head_dim = shape
    rows, cols, kv_heads, kv_dim = store_shape
    segments, fields = info_shape
    if (
        kv_dim != head_dim
        or head_dim not in _HEAD_DIMS
        or rows < 1
        or cols < 1
        or kv_heads == 0
        or q_heads % kv_heads
        or fields != 4
        or segments < 1
    ):
        return None
    device = q.device
    if (
        k_store.device != device
        or v_store.device != device
        or seq_info.device != device
        or not (q.is_cuda or (_CPU_RUNS and q.is_cpu))
    ):
        return None
    # The layout contract: a head dim of stride 1 (a store is never copied).
    if q.stride()[2] != 1 or k_store.stride()[3] != 1 or v_store.stride()[3] != 1:
        return None
    if out is not None and (
        type(out) is not _TENSOR
        or out.dtype is not dtype
        or out.device != device
        or out.shape != shape
        or out.stride()[2] != 1
        or not out_is_separate(out, (q, k_store, v_store, seq_info))
    ):
        return None
    return (name, head_dim, q_heads, kv_heads, tokens, segments, rows, causal, window is not None, ring)

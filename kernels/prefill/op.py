"""``prefill_attention``: the public op of the ``tma_prefill`` kernel family.

The wrapper checks its inputs (each error names the argument), reduces the call to plain facts,
asks the dispatcher for a config and calls ``torch.ops.tritune.prefill_attention`` with the
config's values as scalars. In plain eager mode the checks and the facts are one pass over the
tensors' attributes (:func:`_eager_facts`); anything unusual takes the detailed path, which explains
an error or serves the call. That op is a ``triton_op`` on a GPU, so ``torch.compile`` sees the
portable kernel; the TMA path runs inside the nested opaque op ``tritune::prefill_attention_tma``
because torch cannot trace host-side tensor descriptors inside a ``triton_op`` body yet.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tritune.search_spaces.tma_prefill import HEAD_DIMS

from .._launch import (
    DTYPE_NAMES,
    MAX_SOFTMAX_SCALE,
    check_device,
    check_out_memory,
    check_softmax_scale,
    device_index,
    out_is_separate,
    prepare_interpreter,
    runs_on_interpreter,
)
from .._oplib import in_direct_body, plain_tensors_call, register_op
from ..device import device_info
from ..dispatcher import dispatch, dispatch_eager
from ._triton_portable import _prefill_fwd_kernel, prefill_portable
from ._triton_tma import _merge_splits_kernel, _prefill_tma_kernel, prefill_tma
from .spec import SPEC, PrefillConfig, _tma_layout_ok, portable_for

__all__ = ["prefill_attention"]

#: Whether the kernels were decorated for the interpreter: CPU tensors may run (what ``check_device``
#: asks), and the bodies prepare the interpreter before their first launch.
_CPU_RUNS = runs_on_interpreter(_prefill_fwd_kernel)
# Module-level names for the per-call checks of _eager_facts: each saves an attribute lookup.
_TENSOR = torch.Tensor
_INT32 = torch.int32
_MAX_SCALE = MAX_SOFTMAX_SCALE
_DTYPE_NAME = DTYPE_NAMES.get
_HEAD_DIMS = frozenset(HEAD_DIMS)
_is_compiling = torch.compiler.is_compiling


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kv_len: torch.Tensor | None,
    softmax_scale: float | None,
    out: torch.Tensor | None,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [batch, heads, seqlen, head_dim], got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
    check_device("q", q, _prefill_fwd_kernel)
    batch, q_heads, _, head_dim = q.shape
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"k, v: head dims differ from q's {head_dim}: k has {k.shape[-1]}, v has {v.shape[-1]}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: head_dim {head_dim} is not supported; expected one of {HEAD_DIMS}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k, v: expected the same [batch, kv_heads, seqlen]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k, v: expected batch {batch} (q's), got {k.shape[0]}")
    if k.shape[1] == 0 or q_heads % k.shape[1] != 0:
        raise ValueError(f"q, k: q's {q_heads} heads must be a multiple of k's {k.shape[1]} heads (GQA)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    check_softmax_scale(softmax_scale)
    if kv_len is not None:
        if not isinstance(kv_len, torch.Tensor):
            raise TypeError(f"kv_len: expected an int32 tensor or None, got {type(kv_len).__name__}")
        if kv_len.dtype != torch.int32:
            raise TypeError(f"kv_len: expected dtype torch.int32, got {kv_len.dtype}")
        if kv_len.device != q.device:
            raise ValueError(f"kv_len: expected q's device {q.device}, got {kv_len.device}")
        if kv_len.dim() > 1 or (kv_len.dim() == 1 and kv_len.shape[0] != batch):
            raise ValueError(f"kv_len: expected shape [] or [{batch}] (batch), got {tuple(kv_len.shape)}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if out.dtype != q.dtype:
            raise TypeError(f"out: expected the dtype of q ({q.dtype}), got {out.dtype}")
        if out.shape != q.shape:
            raise ValueError(f"out: expected q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        if out.device != q.device:
            raise ValueError(f"out: expected q's device {q.device}, got {out.device}")
        check_out_memory(out, {"q": q, "k": k, "v": v, "kv_len": kv_len})


def _eager_facts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kv_len: torch.Tensor | None,
    softmax_scale: float | None,
    out: torch.Tensor | None,
) -> tuple[Any, ...] | None:
    """The facts of a valid plain eager call, in one pass over the tensors' attributes; else None.

    Each call pays its checks and facts on the host before its launch, and every tensor attribute
    read costs time: :func:`_check_inputs` followed by ``SPEC.facts`` read the same ones several
    times over. This reads each once and accepts only what both accept, returning
    ``tuple(SPEC.facts(...))``'s value (the tests compare them). ``None`` (bad input, a tensor
    subclass, ``torch.compile``, an int scale) sends the call down that detailed path, which raises
    the error naming the argument. With ``out=None`` the facts describe q, k and v only: the caller
    folds in the layout of the ``out`` it allocates; a given ``out`` also pays the memory checks.
    """
    if (
        _is_compiling()
        or type(q) is not _TENSOR
        or type(k) is not _TENSOR
        or type(v) is not _TENSOR
        or type(causal) is not bool
        or not (softmax_scale is None or (type(softmax_scale) is float and -_MAX_SCALE <= softmax_scale <= _MAX_SCALE))
    ):
        return None
    dtype = q.dtype
    name = _DTYPE_NAME(dtype)
    shape = q.shape
    kv_shape = k.shape
    if name is None or k.dtype is not dtype or v.dtype is not dtype or len(shape) != 4 or v.shape != kv_shape:
        return None
    batch, q_heads, seqlen_q, head_dim = shape
    if len(kv_shape) != 4:
        return None
    kv_batch, kv_heads, seqlen_k, kv_dim = kv_shape
    if kv_batch != batch or kv_dim != head_dim or head_dim not in _HEAD_DIMS or kv_heads == 0 or q_heads % kv_heads:
        return None
    device = q.device
    if k.device != device or v.device != device or not (q.is_cuda or (_CPU_RUNS and q.is_cpu)):
        return None
    if kv_len is not None and (
        type(kv_len) is not _TENSOR
        or kv_len.dtype is not _INT32
        or kv_len.device != device
        or kv_len.shape not in ((), (batch,))
    ):
        return None
    # Tensor descriptors need unit inner strides, 16-byte outer strides and bases, no empty tensor.
    sq0, sq1, sq2, sq3 = q.stride()
    sk0, sk1, sk2, sk3 = k.stride()
    sv0, sv1, sv2, sv3 = v.stride()
    layout_ok = (
        sq3 == 1
        and sk3 == 1
        and sv3 == 1
        and not (sq0 | sq1 | sq2 | sk0 | sk1 | sk2 | sv0 | sv1 | sv2) & 7
        and 0 not in shape
        and 0 not in kv_shape
        and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
    )
    if out is not None:
        if type(out) is not _TENSOR or out.dtype is not dtype or out.shape != shape or out.device != device:
            return None
        if not out_is_separate(out, (q, k, v, kv_len)):
            return None
        so0, so1, so2, so3 = out.stride()
        layout_ok = layout_ok and so3 == 1 and not (so0 | so1 | so2) & 7 and not out.data_ptr() & 15
    return (name, batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, kv_len is not None, layout_ok)


_CONFIGS: dict[tuple[Any, ...], PrefillConfig] = {}


def _config(*values: Any) -> PrefillConfig:
    """The config of ``values`` (field order), built once: constructing a frozen dataclass per call
    would be a sizeable share of the body's host work."""
    config = _CONFIGS.get(values)
    if config is None:
        config = _CONFIGS[values] = PrefillConfig(*values)
    return config


def _prefill_tma_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    out: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    pack_gqa: bool,
    split_kv: int,
) -> None:
    if _CPU_RUNS:
        prepare_interpreter()
    config = _config("tma", block_m, block_n, num_warps, num_stages, pack_gqa, split_kv)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15:
        # Only a compiled graph gets here with a misaligned base: its facts could not see pointers.
        # The stand-in keeps the TMA tiles only where the portable kernel fits them.
        device = device_info(q.device)
        facts = SPEC.facts(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=softmax_scale, out=out)
        portable = portable_for(config, SPEC.key_for(device, facts), SPEC.limits(device))
        prefill_portable(q, k, v, kv_len, out, causal=causal, softmax_scale=softmax_scale, config=portable)
        return
    prefill_tma(q, k, v, kv_len, out, causal=causal, softmax_scale=softmax_scale, config=config)


_prefill_tma_op = register_op(
    "tritune::prefill_attention_tma",
    _prefill_tma_body,
    mutates_args={"out"},
    kernels=[_prefill_tma_kernel, _merge_splits_kernel],
    opaque=True,
)


def _prefill_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    out: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    path: str,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    pack_gqa: bool,
    split_kv: int,
) -> None:
    if _CPU_RUNS:
        prepare_interpreter()
    if path == "tma":
        tiles = (block_m, block_n, num_warps, num_stages, pack_gqa, split_kv)
        args = (q, k, v, kv_len, out, causal, softmax_scale, *tiles)
        if in_direct_body():
            # Plain tensors already (this body runs directly): the TMA op's own checks would be a second toll.
            _prefill_tma_op.call_body(args)
        else:
            _prefill_tma_op(*args)
        return
    config = _config(path, block_m, block_n, num_warps, num_stages, pack_gqa, split_kv)
    prefill_portable(q, k, v, kv_len, out, causal=causal, softmax_scale=softmax_scale, config=config)


_prefill_op = register_op(
    "tritune::prefill_attention", _prefill_body, mutates_args={"out"}, kernels=[_prefill_fwd_kernel]
)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    kv_len: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over ``k, v [B, Hkv, Lkv, D]`` (bf16/fp16, any strides).

    ``Hq`` must be a multiple of ``Hkv`` (GQA) and ``D`` one of 64, 80, 96, 128, 256.
    ``kv_len`` (int32 on q's device, shape ``[]`` or ``[B]``) bounds the valid keys and is read on
    the device, so a call can be captured in a CUDA graph and replayed with new lengths; it is
    clamped to ``[0, Lkv]``. With ``causal``, query ``i`` sits at position ``kv_len - Lq + i``
    and sees the keys at positions up to its own (bottom-right alignment). Rows that see no key
    are zeros. ``softmax_scale`` defaults to ``1 / sqrt(D)``; any finite scale with
    ``|softmax_scale| <= 1e4`` is served, zero and negative ones included. The result is written to
    ``out`` (default ``torch.empty_like(q)``) through its strides and returned; ``out`` must not
    share memory with q, k, v or kv_len, nor two of its elements one address.
    """
    facts = _eager_facts(q, k, v, causal, kv_len, softmax_scale, out)
    facts_eager = facts is not None
    if facts is None:
        _check_inputs(q, k, v, causal, kv_len, softmax_scale, out)
    if out is None:
        out = torch.empty_like(q)
        if facts is not None and facts[9] and not _tma_layout_ok(out, False):
            facts = (*facts[:9], False)
    if q.numel() == 0:
        return out
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if facts is None:
        # A plain tuple: dynamo rebuilds NamedTuple arguments of constant-result functions wrongly.
        facts = tuple(SPEC.facts(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=scale, out=out))
        values = dispatch(SPEC.name, q.device.type, device_index(q.device), facts)
    else:
        values = dispatch_eager(SPEC.name, q.device, facts)
    # The config's values in field order: path, BLOCK_M, BLOCK_N, num_warps, num_stages, PACK_GQA, SPLIT_KV.
    args = (q, k, v, kv_len, out, causal, scale, *values)
    if facts_eager and plain_tensors_call(q, k, v, kv_len, out):
        # The one-pass facts saw exactly torch.Tensor arguments: only modes and autograd are left to rule out.
        _prefill_op.call_body(args)
    else:
        _prefill_op(*args)
    return out

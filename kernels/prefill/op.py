"""``prefill_attention``: the public op of the ``tma_prefill`` kernel family.

The wrapper checks its inputs (each error names the argument), reduces the call to plain facts,
asks the dispatcher for a config and calls ``torch.ops.tritune.prefill_attention`` with the
config's values as scalars. That op is a ``triton_op`` on a GPU, so ``torch.compile`` sees the
portable kernel; the TMA path runs inside the nested opaque op ``tritune::prefill_attention_tma``
because torch cannot trace host-side tensor descriptors inside a ``triton_op`` body yet.
"""

from __future__ import annotations

import math

import torch

from tritune.search_spaces.tma_prefill import HEAD_DIMS

from .._launch import DTYPE_NAMES, check_device, device_index
from .._oplib import register_op
from ..device import device_info
from ..dispatcher import config_from_values, dispatch
from ._triton_portable import _prefill_fwd_kernel, prefill_portable
from ._triton_tma import _merge_splits_kernel, _prefill_tma_kernel, prefill_tma
from .spec import SPEC, PrefillConfig, portable_for

__all__ = ["prefill_attention"]


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
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, int | float)):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite number, got {softmax_scale}")
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
    config = PrefillConfig("tma", block_m, block_n, num_warps, num_stages, pack_gqa, split_kv)
    if any(t.data_ptr() % 16 for t in (q, k, v, out)):
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
    if path == "tma":
        _prefill_tma_op(
            q, k, v, kv_len, out, causal, softmax_scale, block_m, block_n, num_warps, num_stages, pack_gqa, split_kv
        )
        return
    config = PrefillConfig(path, block_m, block_n, num_warps, num_stages, pack_gqa, split_kv)
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
    are zeros. ``softmax_scale`` defaults to ``1 / sqrt(D)``; the result is written to ``out``
    (default ``torch.empty_like(q)``) through its strides and returned.
    """
    _check_inputs(q, k, v, causal, kv_len, softmax_scale, out)
    if out is None:
        out = torch.empty_like(q)
    if q.numel() == 0:
        return out
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    facts = SPEC.facts(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=scale, out=out)
    # A plain tuple: dynamo rebuilds NamedTuple arguments of constant-result functions wrongly.
    values = dispatch(SPEC.name, q.device.type, device_index(q.device), tuple(facts))
    config = config_from_values(SPEC, values)
    _prefill_op(
        q,
        k,
        v,
        kv_len,
        out,
        causal,
        scale,
        config.path,
        config.BLOCK_M,
        config.BLOCK_N,
        config.num_warps,
        config.num_stages,
        config.PACK_GQA,
        config.SPLIT_KV,
    )
    return out

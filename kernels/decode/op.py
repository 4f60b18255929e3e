"""Decode attention over a KV cache: the public op, its input checks and its launch.

``decode_attention(q, k_cache, v_cache, kv_len)`` attends ``Lq <= 8`` new query tokens per
sequence over the first ``kv_len[b]`` positions of a ``[B, Hkv, Lmax, D]`` cache. ``kv_len`` stays on
the device and is read by the kernels, so a call never synchronises and can be captured in a CUDA
graph once and replayed for any lengths up to ``Lmax``.

Layout contract: every tensor may have any strides as long as its last (head-dim) stride is 1; a
tensor whose last stride is not 1 is refused with a ValueError rather than copied, because a copy
of a cache would cost more than the attention itself. A given ``out`` must give each element its
own memory (no zero stride, no expanded view) and share none with an input: the kernels write it
tile by tile while other programs still read. ``kv_len`` values outside ``[0, Lmax]`` are clamped
on the device.

The launch is registered once as ``tritune::decode_attention`` (a ``triton_op`` on GPUs, so
``torch.compile`` sees the kernels); tracers and dispatch modes always go through it. In eager mode
on plain tensors the wrapper launches the same kernels itself: the op dispatcher adds more host
time per call than a short decode step takes on the GPU. Serving loops should capture decode steps
in CUDA graphs anyway, where neither path costs anything per replay.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from tritune.search_spaces.splitk_decode import (
    HEAD_DIMS,
    DecodeConfig,
    block_m_for,
    max_splits,
    padded_head_dim,
    row_blocks,
    splits_target,
)

from .._launch import (
    DTYPE_NAMES,
    LOG2E,
    MERGE_TILE,
    arrival_counters,
    check_device,
    check_out_memory,
    check_softmax_scale,
    check_tensor,
    device_index,
    prepare_interpreter,
    runs_on_interpreter,
    sm_count,
    traced,
    workspace,
)
from .._oplib import register_op, wrap_triton
from ..dispatcher import dispatch, dispatch_eager
from ._triton_decode import _decode_merge_kernel, _decode_split_kernel
from .eager import eager_facts

__all__ = [
    "DTYPE_NAMES",
    "MAX_QUERY_TOKENS",
    "DecodeFacts",
    "check_inputs",
    "decode_attention",
    "decode_attention_named",
    "serves_layout",
]

KERNEL = "splitk_decode"
#: Most new tokens per sequence one call serves (speculative / multi-token decode steps).
MAX_QUERY_TOKENS = 8
#: What the errors of a direct call name the caches.
CACHE_NAMES = ("k_cache", "v_cache")
#: Whether the kernels were decorated for the interpreter, which launches then prepare first.
_INTERPRETED = runs_on_interpreter(_decode_split_kernel)


class DecodeFacts(NamedTuple):
    """A call reduced to plain scalars: what keys and configs may depend on."""

    dtype: str
    head_dim: int
    batch: int
    q_heads: int
    kv_heads: int
    lq: int
    lmax: int


# ---- input checks ----------------------------------------------------------------------------


def serves_layout(*tensors: object) -> bool:
    """Whether the tensors among ``tensors`` meet the layout contract (a head dim of stride 1)."""
    return all(not isinstance(t, torch.Tensor) or t.dim() == 0 or t.stride(-1) == 1 for t in tensors)


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    *,
    kv_names: Sequence[str] = CACHE_NAMES,
) -> DecodeFacts:
    """Validate a call (TypeError/ValueError naming the argument) and return its facts.

    ``kv_names``: what the errors call ``k_cache`` and ``v_cache`` (the caller's own names).
    """
    k_name, v_name = kv_names
    check_tensor("q", q, 4)
    check_tensor(k_name, k_cache, 4)
    check_tensor(v_name, v_cache, 4)
    check_tensor("kv_len", kv_len, 1)
    if q.dtype not in DTYPE_NAMES:
        raise TypeError(f"q: expected dtype torch.bfloat16 or torch.float16, got {q.dtype}")
    for name, t in ((k_name, k_cache), (v_name, v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
    if kv_len.dtype != torch.int32:
        raise TypeError(f"kv_len: expected dtype torch.int32, got {kv_len.dtype}")
    device = q.device
    for name, t in ((k_name, k_cache), (v_name, v_cache), ("kv_len", kv_len)):
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")
    check_device("q", q, _decode_split_kernel)

    batch, q_heads, lq, head_dim = q.shape
    kv_batch, kv_heads, lmax, kv_dim = k_cache.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: head dim {head_dim} is not supported; expected one of {HEAD_DIMS}")
    if not 1 <= lq <= MAX_QUERY_TOKENS:
        raise ValueError(f"q: expected 1 to {MAX_QUERY_TOKENS} query tokens (dim 2), got {lq}")
    if kv_batch != batch or kv_dim != head_dim:
        raise ValueError(
            f"{k_name}: expected shape [{batch}, Hkv, Lmax, {head_dim}] to match q {tuple(q.shape)}, "
            f"got {tuple(k_cache.shape)}"
        )
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(
            f"{v_name}: expected the shape of {k_name} {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"q: {q_heads} query heads are not a multiple of {k_name}'s {kv_heads} KV heads (GQA)")
    if tuple(kv_len.shape) != (batch,):
        raise ValueError(f"kv_len: expected shape ({batch},), got {tuple(kv_len.shape)}")
    if out is not None:
        check_tensor("out", out, 4)
        if out.dtype != q.dtype:
            raise TypeError(f"out: expected dtype {q.dtype} (the dtype of q), got {out.dtype}")
        if out.device != device:
            raise ValueError(f"out: expected device {device} (the device of q), got {out.device}")
        if tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"out: expected the shape of q {tuple(q.shape)}, got {tuple(out.shape)}")
    check_softmax_scale(softmax_scale)
    for name, t in (("q", q), (k_name, k_cache), (v_name, v_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
    if out is not None:
        check_out_memory(out, {"q": q, k_name: k_cache, v_name: v_cache, "kv_len": kv_len})
    return DecodeFacts(DTYPE_NAMES[q.dtype], head_dim, batch, q_heads, kv_heads, lq, lmax)


# ---- launch ----------------------------------------------------------------------------------


class _Plan(NamedTuple):
    """Everything a launch needs that follows from static facts and the config."""

    block_m: int
    d_pad: int
    row_blocks: int
    splits_target: int
    num_splits: int
    workspace: int
    lse_offset: int
    split_block: int
    merge_block_d: int
    #: Arrival counters of a fused merge (one per sequence, KV head and row block); 0: no fused merge.
    counters: int


@functools.lru_cache(maxsize=1024)
def _plan(
    values: tuple[Any, ...], sm_count: int, batch: int, kv_heads: int, rows: int, lmax: int, head_dim: int
) -> _Plan:
    config = DecodeConfig(*values)
    target = splits_target(config, sm_count, batch * kv_heads, rows)
    num_splits = max_splits(config, sm_count, batch * kv_heads, rows, lmax)
    # Workspace: normalised partial outputs [B, Hkv, splits, rows, D], then their log2-sum-exps.
    partials = batch * kv_heads * num_splits * rows
    workspace = partials * (head_dim + 1) if num_splits > 1 else 1
    d_pad = padded_head_dim(head_dim)
    fused = config.FUSED_MERGE and num_splits > 1
    # The merge holds a [split_block, merge_block_d] fp32 tile: at most MERGE_TILE values (64 a thread at 4
    # warps), split across head-dim blocks when there are many splits, so that one pass covers up to 512 of
    # them. A fused merge runs in the split program with its num_warps: the same values per thread.
    tile = MERGE_TILE * config.num_warps // 4 if fused else MERGE_TILE
    split_block = max(2, min(1 << (num_splits - 1).bit_length(), 512))
    merge_block_d = min(d_pad, max(16, tile // split_block))
    counters = batch * kv_heads * row_blocks(rows) if fused else 0
    return _Plan(
        block_m_for(rows), d_pad, row_blocks(rows), target, num_splits, workspace, partials * head_dim, split_block,
        merge_block_d, counters,
    )  # fmt: skip


def _launch(
    split_kernel: Any,
    merge_kernel: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    values: tuple[Any, ...],
) -> None:
    """Launch the split kernel, then the merge where some sequence may need more than one split
    (unless the split kernel merges itself: ``FUSED_MERGE``)."""
    if _INTERPRETED:
        prepare_interpreter()
    # Plain ints: under dynamic-shape tracing sizes arrive as SymInts, and the grid, the workspace and
    # the kernels' stride specialisation are all fixed per shape anyway.
    batch, q_heads, lq, head_dim = (int(n) for n in q.shape)
    kv_heads, lmax = int(k_cache.shape[1]), int(k_cache.shape[2])
    group = q_heads // kv_heads
    _, MIN_CHUNK, BLOCK_N, num_warps, num_stages, _ = values
    plan = _plan(values, sm_count(q.device), batch, kv_heads, group * lq, lmax, head_dim)
    ws = workspace(plan.workspace, q.device)
    fused = plan.counters > 0
    counters = arrival_counters(plan.counters, q.device, fresh=traced(q)) if fused else None
    sq, sk, sv, so = (tuple(int(x) for x in t.stride()[:3]) for t in (q, k_cache, v_cache, out))
    # A view such as lengths[::2] is read through its stride.
    stride_kvl = int(kv_len.stride(0))
    # Only the interpreter runs CPU tensors; its bf16 dot is broken, so its MMAs take fp32 operands.
    dot_in_fp32 = q.device.type == "cpu"
    try:
        split_kernel[(plan.num_splits, plan.row_blocks * kv_heads, batch)](
            q, k_cache, v_cache, kv_len, out, ws, counters, *sq, *sk, *sv, *so, stride_kvl,
            kv_heads, lmax, softmax_scale * LOG2E, plan.splits_target, MIN_CHUNK, plan.num_splits, plan.lse_offset,
            GROUP=group, LQ=lq, BLOCK_M=plan.block_m, HEAD_DIM=head_dim, D_PAD=plan.d_pad, BLOCK_N=BLOCK_N,
            DOT_IN_FP32=dot_in_fp32, FUSED_MERGE=fused, SPLIT_BLOCK=plan.split_block,
            MERGE_BLOCK_D=plan.merge_block_d, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    except BaseException:
        # The interpreter runs the programs one by one: a launch that raised part-way has left row
        # blocks counted, which would keep their last split from merging in every later launch.
        if counters is not None and not counters.is_cuda:
            counters.zero_()
        raise
    if plan.num_splits > 1 and not fused:
        d_blocks = -(-head_dim // plan.merge_block_d)
        merge_kernel[(group * lq * d_blocks, kv_heads, batch)](
            kv_len, out, ws, *so, stride_kvl,
            kv_heads, lmax, plan.splits_target, MIN_CHUNK, plan.num_splits, plan.lse_offset,
            GROUP=group, LQ=lq, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N,
            SPLIT_BLOCK=plan.split_block, BLOCK_D=plan.merge_block_d, num_warps=4, num_stages=2,
        )  # fmt: skip


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    TARGET_WAVES: int,
    MIN_CHUNK: int,
    BLOCK_N: int,
    num_warps: int,
    num_stages: int,
    FUSED_MERGE: bool = False,
) -> None:
    """The registered op's body: the launch, with its kernels wrapped so that tracers see them."""
    values = (TARGET_WAVES, MIN_CHUNK, BLOCK_N, num_warps, num_stages, FUSED_MERGE)
    _launch(
        wrap_triton(_decode_split_kernel),
        wrap_triton(_decode_merge_kernel),
        q, k_cache, v_cache, kv_len, out, softmax_scale, values,
    )  # fmt: skip


_decode_op = register_op(
    "tritune::decode_attention",
    _decode_attention,
    mutates_args={"out"},
    kernels=[_decode_split_kernel, _decode_merge_kernel],
)


def _run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    values: tuple[Any, ...],
) -> None:
    # Plain eager calls run the body directly (TritonOp); tracers and dispatch modes see the op.
    _decode_op(q, k_cache, v_cache, kv_len, out, softmax_scale, *values)


def launch(
    config: DecodeConfig,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
) -> None:
    """Run ``config`` on already-checked arguments into a preallocated ``out``, as a call would."""
    values = (
        config.TARGET_WAVES, config.MIN_CHUNK, config.BLOCK_N, config.num_warps, config.num_stages, config.FUSED_MERGE,
    )  # fmt: skip
    _run(q, k_cache, v_cache, kv_len, out, softmax_scale, values)


# ---- the public op ---------------------------------------------------------------------------


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` (``Lq <= 8``) over the first ``kv_len[b]`` cache positions.

    ``k_cache, v_cache``: ``[B, Hkv, Lmax, D]`` with ``Hq % Hkv == 0`` (GQA); ``kv_len``: int32 ``[B]``
    on q's device, read there (no host synchronisation). The new tokens are causal among
    themselves: token ``i`` sits at position ``kv_len - Lq + i`` and sees the keys up to it; a row
    that sees no key (``kv_len == 0``) is zero. ``softmax_scale`` defaults to ``1 / sqrt(D)``; any
    finite scale with ``|softmax_scale| <= 1e4`` is served, zero and negative ones included.
    Returns ``out`` (allocated when not given), ``[B, Hq, Lq, D]`` in q's dtype; a given ``out``
    must not share memory with the other arguments, nor two of its elements one address.
    """
    return decode_attention_named(q, k_cache, v_cache, kv_len, softmax_scale, out, CACHE_NAMES)


def decode_attention_named(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    softmax_scale: float | None,
    out: torch.Tensor | None,
    kv_names: Sequence[str],
) -> torch.Tensor:
    """:func:`decode_attention`, with errors that call the caches ``kv_names`` (for wrappers such as ``attention``)."""
    # One pass over the tensors in plain eager mode; anything else gets the detailed checks.
    facts = eager_facts(q, k_cache, v_cache, kv_len, out, softmax_scale, MAX_QUERY_TOKENS)
    eager = facts is not None
    if facts is None:
        # A plain tuple: dynamo hands a NamedTuple to assume_constant_result functions empty (torch 2.13).
        facts = tuple(check_inputs(q, k_cache, v_cache, kv_len, out, softmax_scale, kv_names=kv_names))
    device = q.device
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    if q.numel() == 0:
        return out
    if eager:
        values = dispatch_eager(KERNEL, device, facts)
    else:
        values = dispatch(KERNEL, device.type, device_index(device), facts)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(facts[1])
    _run(q, k_cache, v_cache, kv_len, out, scale, values)
    return out

"""Varlen attention over a batched KV store: the public op, its input checks and its launch.

``varlen_attention(q, k_store, v_store, seq_info)`` attends a step's packed query rows
``q [T, Hq, D]`` over per-sequence columns of ``[rows, cols, Hkv, D]`` stores. ``seq_info``
(int32 ``[S, 4]``: q_start, q_len, col, kv_end per segment) stays on the device and is read by
the kernels, so a call never synchronises and one captured CUDA graph serves any mix of decode
tokens, prefill chunks and draft blocks within the static ``T`` and ``S``.

The launch is registered once as ``tritune::varlen_attention`` (a ``triton_op`` on GPUs, so
``torch.compile`` sees the kernels); tracers and dispatch modes always go through it. In eager mode
on plain tensors the wrapper launches the same kernels itself, as the decode family does: the op
dispatcher costs more host time than a short decode-heavy step takes on the GPU.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Any, NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import has_static_value
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.search_spaces.varlen_sdpa import (
    HEAD_DIMS,
    VarlenConfig,
    block_m_for,
    padded_head_dim,
    short_block_m,
    split_budget,
)

from .._launch import (
    DTYPE_NAMES,
    LOG2E,
    MERGE_TILE,
    check_device,
    check_out_memory,
    check_softmax_scale,
    check_tensor,
    device_index,
    prepare_interpreter,
    runs_on_interpreter,
    sm_count,
    workspace,
)
from .._oplib import in_direct_body, register_op, wrap_triton
from ..dispatcher import dispatch, dispatch_eager
from ._triton_varlen import _varlen_fwd_kernel, _varlen_merge_kernel
from .eager import eager_facts

__all__ = ["DTYPE_NAMES", "DYNAMIC", "VarlenFacts", "check_inputs", "launch", "validate_seq_info", "varlen_attention"]

KERNEL = "varlen_sdpa"
#: A length fact that is symbolic under ``torch.compile``: keys bucket it as 0 rather than guard on it.
DYNAMIC = 0
#: Query-row x segment comparisons one zero-fill program makes at once.
_ZERO_TILE = 4096
#: Whether the kernels were decorated for the interpreter, which launches then prepare first.
_INTERPRETED = runs_on_interpreter(_varlen_fwd_kernel)


class VarlenFacts(NamedTuple):
    """A call reduced to plain scalars: what keys and configs may depend on."""

    dtype: str
    head_dim: int
    q_heads: int
    kv_heads: int
    #: T, the static width of the step (``DYNAMIC`` when symbolic).
    tokens: int
    #: S, the static number of segment slots (``DYNAMIC`` when symbolic).
    segments: int
    #: Store rows (``DYNAMIC`` when symbolic).
    rows: int
    causal: bool
    windowed: bool
    ring: bool


# ---- input checks ----------------------------------------------------------------------------


def _bucketed(n: Any) -> int:
    # A symbolic length must not reach a key: reading its value would pin the compiled graph to it.
    # (has_static_value, unlike isinstance checks, sees through dynamo's symbolic ints without a guard.)
    return int(n) if has_static_value(n) else DYNAMIC


def _static_int(n: Any) -> int:
    # Head counts and the head dim fix the kernel: under dynamo, operator.index specialises on them.
    return operator.index(n)


def check_inputs(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    ring: bool = False,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> VarlenFacts:
    """Validate a call (TypeError/ValueError naming the argument) and return its facts."""
    check_tensor("q", q, 3)
    check_tensor("k_store", k_store, 4)
    check_tensor("v_store", v_store, 4)
    check_tensor("seq_info", seq_info, 2)
    if q.dtype not in DTYPE_NAMES:
        raise TypeError(f"q: expected dtype torch.bfloat16 or torch.float16, got {q.dtype}")
    for name, t in (("k_store", k_store), ("v_store", v_store)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
    if seq_info.dtype != torch.int32:
        raise TypeError(f"seq_info: expected dtype torch.int32, got {seq_info.dtype}")
    device = q.device
    for name, t in (("k_store", k_store), ("v_store", v_store), ("seq_info", seq_info)):
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")
    check_device("q", q, _varlen_fwd_kernel)

    tokens, q_heads, head_dim = q.shape
    rows, cols, kv_heads, kv_dim = k_store.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: head dim {head_dim} is not supported; expected one of {HEAD_DIMS}")
    if kv_dim != head_dim:
        raise ValueError(f"k_store: expected head dim {head_dim} (q's), got shape {tuple(k_store.shape)}")
    if tuple(v_store.shape) != tuple(k_store.shape):
        raise ValueError(f"v_store: expected the shape of k_store {tuple(k_store.shape)}, got {tuple(v_store.shape)}")
    if rows < 1 or cols < 1:
        raise ValueError(f"k_store: expected at least one row and one column, got shape {tuple(k_store.shape)}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"q: {q_heads} query heads are not a multiple of k_store's {kv_heads} KV heads (GQA)")
    if seq_info.shape[1] != 4 or seq_info.shape[0] < 1:
        raise ValueError(
            f"seq_info: expected shape [S, 4] with S >= 1 (q_start, q_len, col, kv_end), got {tuple(seq_info.shape)}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(ring, bool):
        raise TypeError(f"ring: expected a bool, got {type(ring).__name__}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window: expected an int or None, got {type(window).__name__}")
        if window <= 0:
            raise ValueError(f"window: expected a positive number of positions, got {window}")
    check_softmax_scale(softmax_scale)
    if out is not None:
        check_tensor("out", out, 3)
        if out.dtype != q.dtype:
            raise TypeError(f"out: expected dtype {q.dtype} (the dtype of q), got {out.dtype}")
        if out.device != device:
            raise ValueError(f"out: expected device {device} (the device of q), got {out.device}")
        if tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"out: expected the shape of q {tuple(q.shape)}, got {tuple(out.shape)}")
    for name, t in (("q", q), ("k_store", k_store), ("v_store", v_store), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
    if out is not None:
        check_out_memory(out, {"q": q, "k_store": k_store, "v_store": v_store, "seq_info": seq_info})
    return VarlenFacts(
        DTYPE_NAMES[q.dtype], _static_int(head_dim), _static_int(q_heads), _static_int(kv_heads), _bucketed(tokens),
        _bucketed(seq_info.shape[0]), _bucketed(rows), causal, window is not None, ring,
    )  # fmt: skip


def validate_seq_info(seq_info: torch.Tensor, *, T: int, rows: int, cols: int, ring: bool = False) -> None:
    """Check a ``seq_info`` table on the host (for debugging: it synchronises), raising ValueError.

    Checks the dtype and shape, negative entries, query ranges outside ``[0, T)`` or overlapping,
    columns outside ``[0, cols)``, ``q_len > kv_end``, and ``kv_end > rows`` for a flat store (a
    ring holds any length, but one step's new tokens must fit in it: ``q_len <= rows``). Segments
    with ``q_len == 0`` are unused and only checked for negative entries. ``T``, ``rows`` and
    ``cols`` must be ints (else a TypeError), with ``T >= 0`` and ``rows, cols >= 1``.
    """
    for name, value, least in (("T", T, 0), ("rows", rows, 1), ("cols", cols, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{name}: expected at least {least}, got {value}")
    if not isinstance(ring, bool):
        raise TypeError(f"ring: expected a bool, got {type(ring).__name__}")
    if not isinstance(seq_info, torch.Tensor):
        raise ValueError(f"seq_info: expected a torch.Tensor, got {type(seq_info).__name__}")
    if seq_info.dtype != torch.int32:
        raise ValueError(f"seq_info: expected dtype torch.int32, got {seq_info.dtype}")
    if seq_info.dim() != 2 or seq_info.shape[1] != 4 or seq_info.shape[0] < 1:
        raise ValueError(f"seq_info: expected shape [S, 4] with S >= 1, got {tuple(seq_info.shape)}")
    table = seq_info.detach().cpu().tolist()
    names = ("q_start", "q_len", "col", "kv_end")
    used: list[tuple[int, int, int]] = []
    for s, entry in enumerate(table):
        for name, value in zip(names, entry, strict=True):
            if value < 0:
                raise ValueError(f"seq_info[{s}]: {name} is negative ({value})")
        q_start, q_len, col, kv_end = entry
        if q_len == 0:
            continue
        if q_start + q_len > T:
            raise ValueError(f"seq_info[{s}]: query rows [{q_start}, {q_start + q_len}) leave q's {T} rows")
        if col >= cols:
            raise ValueError(f"seq_info[{s}]: column {col} is outside the store's {cols} columns")
        if q_len > kv_end:
            raise ValueError(f"seq_info[{s}]: q_len {q_len} exceeds kv_end {kv_end} (the new tokens are the last ones)")
        if not ring and kv_end > rows:
            raise ValueError(f"seq_info[{s}]: kv_end {kv_end} is beyond the flat store's {rows} rows")
        if ring and q_len > rows:
            raise ValueError(f"seq_info[{s}]: q_len {q_len} new tokens overwrite each other in a ring of {rows} rows")
        used.append((q_start, q_start + q_len, s))
    used.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(used):
        if start < end:
            raise ValueError(f"seq_info[{first}] and seq_info[{second}]: query ranges overlap")


# ---- launch ----------------------------------------------------------------------------------


class _Plan(NamedTuple):
    """Everything a launch needs that follows from static facts and the config, except T."""

    block_m: int
    #: Rows of the tile for segments whose new tokens fit in it (``block_m``: one tile for all).
    short_m: int
    tokens_per_tile: int
    d_pad: int
    s_pad: int
    budget: int
    split: bool
    zero_tokens: int
    ws_slots: int
    merge_block_d: int


@functools.lru_cache(maxsize=1024)
def _plan(
    values: tuple[int, ...],
    sm_count: int,
    segments: int,
    rows: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    causal: bool,
    window: int,
) -> _Plan:
    config = VarlenConfig(*values)
    block_m = block_m_for(config.BLOCK_M, group)
    tq = block_m // group
    budget = split_budget(config, sm_count, kv_heads)
    # No tile can see more keys than the store holds (or than the window spans, causally).
    max_cost = min(rows, tq + window - 1) if causal and window > 0 else rows
    split = config.MAX_SPLITS > 1 and max_cost > config.MIN_CHUNK
    s_pad = max(16, 1 << (segments - 1).bit_length())
    # The zero-fill compares ZERO_TOKENS rows with every segment: keep that tile small in registers.
    zero_tokens = max(2, min(64, _ZERO_TILE // s_pad))
    d_pad = padded_head_dim(head_dim)
    return _Plan(
        block_m=block_m,
        short_m=short_block_m(config, group),
        tokens_per_tile=tq,
        d_pad=d_pad,
        s_pad=s_pad,
        budget=budget,
        split=split,
        zero_tokens=zero_tokens,
        # Split tiles hold at most twice the budget of partials (see _triton_varlen's schedule).
        ws_slots=2 * budget if split else 0,
        merge_block_d=min(d_pad, max(16, MERGE_TILE // block_m)),
    )


def _descriptors_allowed(k_store: torch.Tensor, v_store: torch.Tensor, ring: bool, head_dim: int) -> bool:
    """Whether ``KV_TMA`` may load these stores through host-side descriptors.

    Not for a ring (a tile may wrap past the last row), nor a head dim that is not a power of two
    (the box would be padded), nor while a tracer runs the body: torch cannot yet trace a
    ``triton_op`` whose kernel takes host-side descriptors, so ``torch.compile`` keeps pointer
    loads. Descriptors also need 16-byte aligned bases and strides (an inner stride of 1 is checked
    for every call).
    """
    if ring or padded_head_dim(head_dim) != head_dim or not in_direct_body():
        return False
    for store in (k_store, v_store):
        if store.data_ptr() % 16 or any(stride * store.element_size() % 16 for stride in store.stride()[:3]):
            return False
    return True


def _launch(
    fwd_kernel: Any,
    merge_kernel: Any,
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    window: int,
    ring: bool,
    softmax_scale: float,
    values: tuple[int, ...],
) -> None:
    """Launch the tile kernel, and the merge where some tile may take more than one split."""
    if _INTERPRETED:
        prepare_interpreter()
    # T may stay symbolic under tracing: the grid is plain arithmetic on it. The other sizes fix
    # the kernel's constants (and change only when a store grows).
    tokens = q.shape[0]
    q_heads, head_dim = _static_int(q.shape[1]), _static_int(q.shape[2])
    rows, cols, kv_heads = (_static_int(n) for n in k_store.shape[:3])
    segments = _static_int(seq_info.shape[0])
    group = q_heads // kv_heads
    _, BLOCK_N, num_warps, num_stages, MAX_SPLITS, MIN_CHUNK, _, _, KV_TMA = values
    plan = _plan(values, sm_count(q.device), segments, rows, kv_heads, group, head_dim, causal, window)
    work_slots = tokens // plan.tokens_per_tile + segments + (plan.budget if plan.split else 0)
    zero_programs = (tokens + plan.zero_tokens - 1) // plan.zero_tokens
    partials = plan.ws_slots * kv_heads * plan.block_m
    ws = workspace(partials * (head_dim + 1) if plan.split else 1, q.device)
    sk, sv = k_store.stride()[:3], v_store.stride()[:3]
    # Only the interpreter runs CPU tensors; its bf16 dot is broken, so its MMAs take fp32 operands.
    dot_in_fp32 = q.device.type == "cpu"
    qk_scale = softmax_scale * LOG2E
    kv_tma = bool(KV_TMA) and _descriptors_allowed(k_store, v_store, ring, head_dim)
    if kv_tma:
        box = [BLOCK_N, 1, 1, head_dim]
        k_desc, v_desc = TensorDescriptor.from_tensor(k_store, box), TensorDescriptor.from_tensor(v_store, box)
    else:
        # Unread (the kernel's pointer branch compiles without them): any argument serves.
        k_desc, v_desc = k_store, v_store
    fwd_kernel[(work_slots + zero_programs, kv_heads)](
        q, k_store, v_store, k_desc, v_desc, out, seq_info, ws,
        q.stride(0), q.stride(1), *sk, *sv, out.stride(0), out.stride(1), seq_info.stride(0), seq_info.stride(1),
        segments, tokens, rows, cols, kv_heads, window, qk_scale,
        plan.budget, MIN_CHUNK, MAX_SPLITS, work_slots, partials * head_dim,
        GROUP=group, HEAD_DIM=head_dim, D_PAD=plan.d_pad, BLOCK_M=plan.block_m, SHORT_M=plan.short_m,
        BLOCK_N=BLOCK_N, S_PAD=plan.s_pad, ZERO_TOKENS=plan.zero_tokens, CAUSAL=causal, WINDOWED=window > 0,
        RING=ring, SPLIT=plan.split, KV_TMA=kv_tma, DOT_IN_FP32=dot_in_fp32, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if plan.split:
        d_blocks = -(-head_dim // plan.merge_block_d)
        merge_kernel[(plan.budget, kv_heads, d_blocks)](
            out, seq_info, ws,
            out.stride(0), out.stride(1), seq_info.stride(0), seq_info.stride(1),
            segments, tokens, rows, cols, kv_heads, window,
            plan.budget, MIN_CHUNK, MAX_SPLITS, partials * head_dim,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=plan.merge_block_d, BLOCK_M=plan.block_m, BLOCK_N=BLOCK_N,
            S_PAD=plan.s_pad, CAUSAL=causal, WINDOWED=window > 0, RING=ring, num_warps=4, num_stages=1,
        )  # fmt: skip


def _varlen_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    window: int,
    ring: bool,
    softmax_scale: float,
    BLOCK_M: int,
    BLOCK_N: int,
    num_warps: int,
    num_stages: int,
    MAX_SPLITS: int,
    MIN_CHUNK: int,
    TARGET_WAVES: int,
    SHORT_M: int,
    KV_TMA: bool,
) -> None:
    """The registered op's body: the launch, with its kernels wrapped so that tracers see them."""
    values = (BLOCK_M, BLOCK_N, num_warps, num_stages, MAX_SPLITS, MIN_CHUNK, TARGET_WAVES, SHORT_M, KV_TMA)
    _launch(
        wrap_triton(_varlen_fwd_kernel),
        wrap_triton(_varlen_merge_kernel),
        q, k_store, v_store, seq_info, out, causal, window, ring, softmax_scale, values,
    )  # fmt: skip


_varlen_op = register_op(
    "tritune::varlen_attention",
    _varlen_attention,
    mutates_args={"out"},
    kernels=[_varlen_fwd_kernel, _varlen_merge_kernel],
)


def _run(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    window: int,
    ring: bool,
    softmax_scale: float,
    values: tuple[int, ...],
) -> None:
    # Plain eager calls run the body directly (TritonOp); tracers and dispatch modes see the op.
    _varlen_op(q, k_store, v_store, seq_info, out, causal, window, ring, softmax_scale, *values)


def launch(
    config: VarlenConfig,
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    out: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    ring: bool,
    softmax_scale: float,
) -> None:
    """Run ``config`` on already-checked arguments into a preallocated ``out``, as a call would."""
    values = (
        config.BLOCK_M, config.BLOCK_N, config.num_warps, config.num_stages,
        config.MAX_SPLITS, config.MIN_CHUNK, config.TARGET_WAVES, config.SHORT_M, config.KV_TMA,
    )  # fmt: skip
    _run(q, k_store, v_store, seq_info, out, causal, window or 0, ring, softmax_scale, values)


# ---- the public op ---------------------------------------------------------------------------


def varlen_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    ring: bool = False,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's packed queries ``q [T, Hq, D]`` over per-sequence columns of K/V stores.

    ``k_store, v_store``: ``[rows, cols, Hkv, D]`` (``Hq % Hkv == 0``); column ``c`` holds one
    sequence, position ``p`` at row ``p`` (flat) or ``p % rows`` (``ring``: only the last ``rows``
    positions exist). ``seq_info``: int32 ``[S, 4]`` on q's device, one row per segment
    ``(q_start, q_len, col, kv_end)``: query rows ``q_start .. q_start + q_len - 1`` are the last
    ``q_len`` of the ``kv_end`` positions of column ``col``; ``q_len == 0`` marks an unused slot.

    Query ``j`` of a segment sits at position ``kv_end - q_len + j``. With ``causal`` it sees the
    keys at positions up to its own, otherwise every key of its sequence; ``window=W`` also hides
    the keys at or below its position ``- W``. A row that sees no key, and every row no segment
    covers, is zero. ``softmax_scale`` defaults to ``1 / sqrt(D)``; any finite scale with
    ``|softmax_scale| <= 1e4`` is served, zero and negative ones included. Returns ``out``
    (allocated when not given), ``[T, Hq, D]`` in q's dtype; a given ``out`` must not share memory
    with the other arguments, nor two of its elements one address. Lengths are read on the device
    only; check a table with :func:`validate_seq_info` when debugging (out-of-range entries are
    clamped, not reported).
    """
    # One pass over the tensors in plain eager mode; anything else gets the detailed checks.
    facts = eager_facts(q, k_store, v_store, seq_info, causal, window, ring, softmax_scale, out)
    eager = facts is not None
    if facts is None:
        # A plain tuple: dynamo hands a NamedTuple to assume_constant_result functions empty (torch 2.13).
        checked = check_inputs(
            q, k_store, v_store, seq_info, causal=causal, window=window, ring=ring, softmax_scale=softmax_scale, out=out
        )
        facts = tuple(checked)
    device = q.device
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    if eager:
        if facts[4] == 0:
            return out
        values = dispatch_eager(KERNEL, device, facts)
    else:
        if has_static_value(q.shape[0]) and q.shape[0] == 0:
            return out
        values = dispatch(KERNEL, device.type, device_index(device), facts)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(facts[1])
    _run(q, k_store, v_store, seq_info, out, causal, window or 0, ring, scale, values)
    return out

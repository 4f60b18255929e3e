"""Varlen attention over a batched KV store: its tuning key, its declaration and the public function.

``varlen_attention(q, k_store, v_store, seq_info)`` attends a step's packed query rows
``q [T, Hq, D]`` over per-sequence columns of ``[rows, cols, Hkv, D]`` stores. ``seq_info``
(int32 ``[S, 4]``: q_start, q_len, col, kv_end per segment) stays on the device and is read by
the kernels, so a call never synchronises and one captured CUDA graph serves any mix of decode
tokens, prefill chunks and draft blocks within the static ``T`` and ``S``.

T, S and the store's rows are declared dynamic: where ``torch.compile`` keeps them symbolic their
facts are 0 (the key's buckets too), so choosing the config never guards on them, and T stays
symbolic through the launch's grid, so one compiled step serves any width. The head counts and
the head dim fix the kernels and specialise, as S and the store's shape do in the launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tritune.search_spaces.varlen_sdpa import HEAD_DIMS, SPACE, VarlenConfig, portable_config

from .._launch import SOFTMAX_SCALE, gqa_rule
from ..arguments import DYNAMIC
from ..declare import Kernel, Output, Rule, Scalar, Tensor
from ..device import DeviceInfo, target_supports
from ..fit_default import fit_shared_memory, halve_first
from ..spec import TuningKey, pow2_bucket
from ._triton_varlen import _varlen_fwd_kernel, _varlen_merge_kernel
from .launch import launch
from .reference import varlen_reference

__all__ = ["KERNEL", "VarlenKey", "varlen_attention"]


@dataclass(frozen=True)
class VarlenKey(TuningKey):
    dtype: str
    head_dim: int
    #: Query heads per KV head (not ``group``: that name is TuningKey.group(), the bucket group).
    gqa_group: int
    causal: bool
    windowed: bool
    ring: bool
    #: The step's static width T, rounded up to a power of two (0: symbolic under torch.compile).
    t_bucket: int
    #: The static number of segment slots S, rounded up to a power of two (0: symbolic).
    s_bucket: int
    #: Store rows, rounded up to a power of two (0: symbolic); the true lengths live on the device.
    rows_bucket: int

    BUCKETS: ClassVar[tuple[str, ...]] = ("t_bucket", "s_bucket", "rows_bucket")


def _bucket(n: int, minimum: int) -> int:
    return DYNAMIC if n == DYNAMIC else pow2_bucket(n, minimum=minimum)


def _key(device: DeviceInfo, f: Any) -> VarlenKey:
    return VarlenKey(
        arch=device.arch,
        sm_count=device.sm_count,
        dtype=f.dtype,
        head_dim=f.D,
        gqa_group=f.Hq // f.Hkv,
        causal=f.causal,
        windowed=f.has_window,
        ring=f.ring,
        t_bucket=_bucket(f.T, 1),
        s_bucket=_bucket(f.S, 1),
        rows_bucket=_bucket(f.rows, 16),
    )


def _default(key: VarlenKey) -> VarlenConfig:
    """The portable default (:func:`portable_config`), with fewer stages, then narrower KV tiles and
    then fewer query rows, where a block of the GPU the key names has less shared memory than it
    needs (Turing's 64 KiB, Pascal's 48 KiB: one stage at head dim 128)."""
    if key.arch == "cpu-interpreter":
        return portable_config(key, interpreter=True)
    return fit_shared_memory(portable_config(key, interpreter=False), key, SPACE, _smaller_tile)


def _smaller_tile(config: VarlenConfig) -> VarlenConfig | None:
    """The next tile :func:`_default` tries: half the KV tile, then half the M tile (the short
    tile no larger), down to 16."""
    smaller: VarlenConfig | None = halve_first("BLOCK_N", "BLOCK_M")(config)
    if smaller is None:
        return None
    return dataclasses.replace(smaller, SHORT_M=min(smaller.SHORT_M, smaller.BLOCK_M))


def _serve(config: VarlenConfig, device: DeviceInfo, facts: Any) -> VarlenConfig:
    """A pinned ``KV_TMA`` config keeps pointer loads where the target lacks tensor-memory loads
    (before SM90, ROCm, or a ``TORCH_CUDA_ARCH_LIST`` naming an older GPU); the interpreter runs
    descriptors. The launch also keeps pointer loads for ring stores and while tracing."""
    if config.KV_TMA and not (device.is_interpreter or target_supports(device, (9, 0))):
        return dataclasses.replace(config, KV_TMA=False)
    return config


# Rule messages, formatted with the call's dims.
_HEAD_DIM = f"head dim {{D}} is not supported; expected one of {HEAD_DIMS}"
_EMPTY_STORE = "expected at least one row and one column, got {rows} rows and {cols} columns"
_NO_SEGMENT = "expected shape [S, 4] with S >= 1 (q_start, q_len, col, kv_end), got S=0"

KERNEL = Kernel(
    "varlen_sdpa",
    arguments=[
        # A store is never copied: every tensor read or written has a head dim of stride 1.
        Tensor("q", ("T", "Hq", "D"), dtypes=(torch.bfloat16, torch.float16), unit_inner_stride=True),
        Tensor("k_store", ("rows", "cols", "Hkv", "D"), dtype_of="q", unit_inner_stride=True),
        Tensor("v_store", ("rows", "cols", "Hkv", "D"), dtype_of="q", unit_inner_stride=True),
        Tensor("seq_info", ("S", 4), dtypes=(torch.int32,)),
        Scalar("causal", bool, default=True),
        Scalar("window", int, optional=True, bounds=(1, 2**31 - 1), why="a number of positions, int32 in the kernels"),
        Scalar("ring", bool, default=False),
        SOFTMAX_SCALE,
        Output("out", like="q", unit_inner_stride=True),
    ],
    rules=[
        Rule("q", lambda D: D in HEAD_DIMS, _HEAD_DIM),
        gqa_rule("k_store"),
        Rule("k_store", lambda rows, cols: rows >= 1 and cols >= 1, _EMPTY_STORE),
        Rule("seq_info", lambda S: S >= 1, _NO_SEGMENT),
    ],
    facts=("dtype", "D", "Hq", "Hkv", "T", "S", "rows", "causal", "has_window", "ring"),
    dynamic=("T", "S", "rows"),
    space=SPACE,
    key_type=VarlenKey,
    key=_key,
    launch=launch,
    reference=varlen_reference,
    jit_kernels=(_varlen_fwd_kernel, _varlen_merge_kernel),
    protocol=1,
    default=_default,
    serve=_serve,
    tuning="tritune.kernels.varlen.tuning:TUNING",
    op_name="tritune::varlen_attention",
)


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
    with the other arguments, nor two of its elements one address. The head dim of every tensor
    but ``seq_info`` must have stride 1. Lengths are read on the device only; check a table with
    :func:`~tritune.kernels.validate_seq_info` when debugging (out-of-range entries are clamped,
    not reported).
    """
    result: torch.Tensor = KERNEL.call(q, k_store, v_store, seq_info, causal, window, ring, softmax_scale, out)
    return result

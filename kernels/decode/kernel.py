"""Decode attention over a KV cache: the ``splitk_decode`` declaration and ``decode_attention``.

``decode_attention(q, k_cache, v_cache, kv_len)`` attends ``Lq <= 8`` new query tokens per
sequence over the first ``kv_len[b]`` positions of a ``[B, Hkv, Lmax, D]`` cache. ``kv_len`` stays on
the device and is read by the kernels, so a call never synchronises and can be captured in a CUDA
graph once and replayed for any lengths up to ``Lmax``.

Layout contract: every tensor may have any strides as long as its last (head-dim) stride is 1; a
tensor whose last stride is not 1 is refused with a ValueError rather than copied, because a copy
of a cache would cost more than the attention itself (``kv_len`` is read through any stride). A
given ``out`` must give each element its own memory (no zero stride, no expanded view) and share
none with an input: the kernels write it tile by tile while other programs still read. ``kv_len``
values outside ``[0, Lmax]`` are clamped on the device.

The op is ``tritune::decode_attention``; plain eager calls launch directly (:mod:`..declare`), and
serving loops should capture decode steps in CUDA graphs anyway, where neither costs anything per
replay. The key buckets the cache length and ``batch x KV heads``, the sizes the split plan reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tritune.search_spaces.base import TargetLimits
from tritune.search_spaces.splitk_decode import HEAD_DIMS, SPACE, DecodeConfig, portable_config, row_blocks

from .._launch import SOFTMAX_SCALE, gqa_rule
from ..declare import Kernel, Output, Rule, Tensor
from ..device import DeviceInfo, target_supports
from ..fit_default import fit_shared_memory, halve_first
from ..spec import TuningKey, pow2_bucket
from ._triton_decode import _decode_merge_kernel, _decode_split_kernel
from .launch import launch
from .reference import decode_reference

__all__ = ["KERNEL", "MAX_QUERY_TOKENS", "DecodeKey", "decode_attention", "lq_bucket"]

#: Most new tokens per sequence one call serves (speculative / multi-token decode steps).
MAX_QUERY_TOKENS = 8
#: Cache length bucket from which a large batch's default splits each cache (:func:`default_config`).
LONG_CACHE = 16384
_DTYPES = (torch.bfloat16, torch.float16)


def lq_bucket(lq: int) -> int:
    """New tokens per sequence, bucketed to 1, 2, 4 or 8 (the M tile only changes at powers of two)."""
    return min(pow2_bucket(lq, minimum=1), MAX_QUERY_TOKENS)


@dataclass(frozen=True)
class DecodeKey(TuningKey):
    dtype: str
    head_dim: int
    #: Query heads per KV head (not ``group``: that name is TuningKey.group(), the bucket group).
    gqa_group: int
    #: New tokens per sequence, bucketed to 1/2/4/8.
    lq: int
    #: Sequences x KV heads, rounded up to a power of two.
    bh_bucket: int
    #: The cache length Lmax, rounded up to a power of two (the true lengths live on the device).
    lkv_bucket: int

    BUCKETS: ClassVar[tuple[str, ...]] = ("bh_bucket", "lkv_bucket")


def _key(device: DeviceInfo, f: Any) -> DecodeKey:
    return DecodeKey(
        arch=device.arch,
        sm_count=device.sm_count,
        dtype=f.dtype,
        head_dim=f.D,
        gqa_group=f.Hq // f.Hkv,
        lq=lq_bucket(f.Lq),
        bh_bucket=pow2_bucket(f.B * f.Hkv, minimum=1),
        lkv_bucket=pow2_bucket(f.Lmax),
    )


def default_config(key: DecodeKey) -> DecodeConfig:
    """The portable default: the space's defaults where they fit every CUDA GPU, else smaller tiles;
    with fewer stages, then narrower KV tiles, where a block of the GPU the key names has less
    shared memory than they need (Turing's 64 KiB, Pascal's 48 KiB: two stages at head dim 128).
    A large batch over long caches splits each cache (:func:`_split_large_batch`)."""
    if key.arch == "cpu-interpreter":
        return portable_config(key, interpreter=True)
    config = fit_shared_memory(portable_config(key, interpreter=False), key, SPACE, halve_first("BLOCK_N"))
    return _split_large_batch(config, key)


def _split_large_batch(config: DecodeConfig, key: DecodeKey) -> DecodeConfig:
    """``config`` at the space's largest wave target where the unsplit launch is more than two
    programs per SM and the caches reach :data:`LONG_CACHE` keys; else ``config``.

    Why: more programs than fit one resident wave leave a tail, and how ragged it runs depends on
    the exact batch and on the occupancy the tiles get (an H100 ran B=64 x 8 KV heads unsplit at
    0.90x cuDNN with 3 stages and 1.00x with 4, while B=48 ran best with 3). Eight or so splits a
    cache make that tail small at every batch of the bucket and balance sequences of unequal
    lengths: on an H100 (D=64 and 128, B=48 to 128, caches of 16K to 128K) the largest target
    ran within 2.2% of the best of the wave targets 2 to 32 at equal lengths, and 0-9% faster
    than the unsplit default on lengths drawn from [L/2, L]. Short caches keep the default: below
    16K keys that target ran 3-14% behind the best of them (docs/perf/HISTORY.md)."""
    rows = key.gqa_group * key.lq
    if key.lkv_bucket < LONG_CACHE or key.bh_bucket * row_blocks(rows) <= 2 * key.sm_count:
        return config
    split = dataclasses.replace(config, TARGET_WAVES=max(SPACE.dimensions["TARGET_WAVES"]))
    # A batch so large that even the largest target leaves one split keeps the default.
    return split if SPACE.infeasible_reason(split, key, TargetLimits()) is None else config


def _serve(config: DecodeConfig, device: DeviceInfo, facts: Any) -> DecodeConfig:
    """A pinned ``KV_TMA`` config keeps pointer loads where the target lacks tensor-memory loads
    (before SM90, ROCm, or a ``TORCH_CUDA_ARCH_LIST`` naming an older GPU); the interpreter runs
    descriptors. The launch also keeps pointer loads for caches descriptors cannot cover and while tracing."""
    if config.KV_TMA and not (device.is_interpreter or target_supports(device, (9, 0))):
        return dataclasses.replace(config, KV_TMA=False)
    return config


KERNEL = Kernel(
    "splitk_decode",
    arguments=[
        Tensor("q", ("B", "Hq", "Lq", "D"), dtypes=_DTYPES, unit_inner_stride=True),
        Tensor("k_cache", ("B", "Hkv", "Lmax", "D"), dtype_of="q", unit_inner_stride=True),
        Tensor("v_cache", ("B", "Hkv", "Lmax", "D"), dtype_of="q", unit_inner_stride=True),
        Tensor("kv_len", ("B",), dtypes=(torch.int32,)),
        SOFTMAX_SCALE,
        Output("out", like="q", unit_inner_stride=True),
    ],
    rules=[
        Rule("q", lambda D: D in HEAD_DIMS, f"head dim {{D}} is not supported; expected one of {HEAD_DIMS}"),
        Rule(
            "q",
            lambda Lq: 1 <= Lq <= MAX_QUERY_TOKENS,
            f"expected 1 to {MAX_QUERY_TOKENS} query tokens (dim 2), got {{Lq}}",
        ),
        gqa_rule(),
    ],
    facts=("dtype", "D", "B", "Hq", "Hkv", "Lq", "Lmax"),
    space=SPACE,
    key_type=DecodeKey,
    key=_key,
    launch=launch,
    reference=decode_reference,
    jit_kernels=(_decode_split_kernel, _decode_merge_kernel),
    # Split geometry comes from the space's rules and the SM count; trials are graph-timed.
    protocol=1,
    default=default_config,
    serve=_serve,
    tuning="tritune.kernels.decode.tuning:TUNING",
    op_name="tritune::decode_attention",
)


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
    return KERNEL.call(q, k_cache, v_cache, kv_len, softmax_scale, out)  # type: ignore[no-any-return]

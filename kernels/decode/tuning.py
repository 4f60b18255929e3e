"""The tuning half of ``splitk_decode``: problems, the correctness gate and the keys ``tune`` sweeps.

Imported by the tuner only (``Kernel(tuning=...)``), never by serving code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.nn.attention.bias import CausalBias

from tritune.search_spaces.splitk_decode import HEAD_DIMS, SPACE, DecodeConfig, max_splits

from .._sdpa_peer import SdpaCall, bottom_right_causal, bound_arguments, fastest_sdpa
from ..declare import KernelTuning
from ..device import DeviceInfo
from ..spec import Peer, Problem, pow2_bucket
from .kernel import KERNEL, DecodeKey
from .reference import compare

__all__ = ["TUNED_KV_HEADS", "TUNING", "DecodeTuning"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: KV heads of the problems the tuner times on a GPU (``bh_bucket // 8`` sequences).
TUNED_KV_HEADS = 8
#: Cache lengths (``lkv_bucket``) and batches ``tune`` sweeps on a GPU when none are named. Every power
#: of two between batches: a neighbour's borrowed winner can replay slower than the portable default.
_GPU_LKV = (1024, 4096, 16384, 32768, 131072)
_GPU_BATCHES = (1, 4, 8, 16, 32, 64)
_GPU_HEAD_DIMS = (128, 64)


class DecodeTuning(KernelTuning):
    """Random caches at the key's sizes, graph-timed; the fp64 reference's dtype tolerance."""

    #: ``tune --key batch=...`` and ``lkv=...``: sequences (of :data:`TUNED_KV_HEADS` KV heads) and cache lengths.
    key_aliases: ClassVar[dict[str, tuple[str, Callable[[int], int]]]] = {
        "batch": ("bh_bucket", lambda b: pow2_bucket(TUNED_KV_HEADS * b, minimum=1)),
        "lkv": ("lkv_bucket", pow2_bucket),
    }

    def make_problem(self, key: DecodeKey, device: torch.device, seed: int) -> Problem:
        """Random caches of ``lkv_bucket`` positions, each sequence valid on a random [Lmax/2, Lmax].

        On a GPU: 8 KV heads and ``bh_bucket // 8`` sequences; on the interpreter: tiny shapes.
        One sequence is always full length, so the slowest split plan is timed.
        """
        device = torch.device(device)
        dtype = _DTYPES[key.dtype]
        if device.type == "cpu":
            kv_heads = 1
            lmax = min(key.lkv_bucket, 128)
        else:
            kv_heads = min(key.bh_bucket, TUNED_KV_HEADS)
            lmax = key.lkv_bucket
        batch = max(1, key.bh_bucket // kv_heads)
        q_heads = kv_heads * key.gqa_group
        lengths = torch.randint(
            lmax // 2, lmax + 1, (batch,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32
        )
        lengths[0] = lmax
        # Drawn on the device itself: the largest keys hold tens of GB of cache.
        gen = torch.Generator(device=device).manual_seed(seed)

        def normal(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

        q = normal(batch, q_heads, key.lq, key.head_dim)
        k_cache = normal(batch, kv_heads, lmax, key.head_dim)
        v_cache = normal(batch, kv_heads, lmax, key.head_dim)
        element = torch.finfo(dtype).bits // 8
        keys_read = int(lengths.sum()) * kv_heads
        bytes_moved = (2 * keys_read * key.head_dim + 2 * q.numel()) * element
        flops = 4.0 * float(lengths.sum()) * q_heads * key.lq * key.head_dim
        return Problem(
            args=(q, k_cache, v_cache, lengths.to(device)),
            kwargs={},
            flops=flops,
            bytes_moved=float(bytes_moved),
            flush_l2=True,
            # Always timed as CUDA-graph replays, the way serving loops run decode steps. Eager timing
            # counts the host's launches wherever they outlast the GPU work, which biases tunes toward
            # configs with fewer launches rather than faster kernels.
            launch_bound=True,
        )

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        return compare(out, expected, problem.args[0].dtype)

    def default_keys(self, device: DeviceInfo) -> list[DecodeKey]:
        """GPU: D 128 and 64, B in {1, 4, 8, 16, 32, 64} with 8 KV heads, caches 1K..128K, one new token,
        group 4. The interpreter: D 64, one sequence of 2 KV heads, caches of 64 and 128 positions."""
        if device.is_interpreter:
            dims, bhs, lengths = (64,), (2,), (64, 128)
        else:
            dims, bhs, lengths = _GPU_HEAD_DIMS, tuple(TUNED_KV_HEADS * b for b in _GPU_BATCHES), _GPU_LKV
        return [
            DecodeKey(
                arch=device.arch,
                sm_count=device.sm_count,
                dtype="bf16",
                head_dim=d,
                gqa_group=4,
                lq=1,
                bh_bucket=pow2_bucket(bh, minimum=1),
                lkv_bucket=pow2_bucket(n),
            )
            for d in dims
            for bh in bhs
            for n in lengths
        ]

    def winner_variants(self, config: Any, key: DecodeKey, device: DeviceInfo) -> list[Any]:
        """A stored winner's one-launch twin (``FUSED_MERGE``), then its K/V-through-descriptors
        twin (``KV_TMA``; the option came after the shipped winners were tuned). An eager call pays
        each launch's host time, which at small batches exceeds the GPU time, so a re-tune measures
        the one-launch config first and the eager choice can pick it (the space's rule drops either
        where the target or the key cannot take it)."""
        variants = [] if config.FUSED_MERGE else [dataclasses.replace(config, FUSED_MERGE=True)]
        if not config.KV_TMA:
            variants.append(dataclasses.replace(config, KV_TMA=True))
        return variants

    def starting_configs(self, key: DecodeKey, device: DeviceInfo) -> list[Any]:
        """Where the space's default wave target leaves one or two splits per sequence (a large
        batch), the default tiles at the two largest wave targets (where they split each cache 4
        ways or more), each also with a stage more: an H100 at B=64 (8 KV heads) ran 8 splits of a
        128K cache 6% faster than one over lengths drawn from [64K, 128K] and 10% faster at equal
        lengths (docs/perf/HISTORY.md). Then the unsplit launch with 32-key tiles of 2 warps, the
        best unsplit tiles there, and, where the default splits (a batch past two programs per
        SM), the unsplit launch with 4 stages, which tied the splits at equal lengths at B=64.
        The default itself is never a start (every tune measures it)."""
        if device.is_interpreter:
            return []
        default = KERNEL.default_config(key)
        unsplit = dataclasses.replace(default, TARGET_WAVES=DecodeConfig().TARGET_WAVES)
        rows = key.gqa_group * key.lq

        def splits(config: DecodeConfig) -> int:
            """Splits of a cache of the key's full length (the split target, capped by MIN_CHUNK)."""
            return max_splits(config, key.sm_count, key.bh_bucket, rows, key.lkv_bucket)

        if splits(unsplit) > 2:
            return []
        starts: list[DecodeConfig] = []
        for waves in sorted(SPACE.dimensions["TARGET_WAVES"], reverse=True)[:2]:
            wider = dataclasses.replace(unsplit, TARGET_WAVES=waves)
            if splits(wider) >= 4:
                starts += [wider, dataclasses.replace(wider, num_stages=4)]
        starts.append(dataclasses.replace(unsplit, BLOCK_N=32, num_warps=2))
        if default != unsplit:
            starts.append(dataclasses.replace(unsplit, num_stages=4))
        limits = KERNEL.limits(device)
        feasible = [c for c in starts if c != default and SPACE.infeasible_reason(c, key, limits) is None]
        return list(dict.fromkeys(feasible))

    def valid_key(self, key: DecodeKey) -> bool:
        """A served dtype and head dim, 1 to 8 new tokens (bucketed), a positive group and sizes."""
        return (
            key.dtype in _DTYPES
            and key.head_dim in HEAD_DIMS
            and key.lq in (1, 2, 4, 8)
            and key.gqa_group >= 1
            and key.bh_bucket >= 1
            and key.lkv_bucket >= 1
        )

    def peer(self, key: DecodeKey, problem: Problem) -> Peer | None:
        """``scaled_dot_product_attention`` of the new tokens over the caches, on the fastest backend here.

        ``kv_len`` is read once (before timing). Where every sequence holds the same length the
        caches are sliced to it and the call needs no mask (several new tokens get
        ``causal_lower_right``), so flash attention may serve it. Where lengths differ, the call
        gets the boolean padding mask ``[B, 1, Lq, Lmax]`` a user of a ragged batch passes (keys
        past each length hidden, the new tokens causal among themselves); flash attention takes no
        mask, so cuDNN or efficient attention serves it. The cache past each length must hold
        finite values, as the tuner's caches do: a masked NaN key still poisons SDPA's sum.
        ``None`` where a query row sees no key (a length below the number of new tokens), which
        the kernel returns as zeros and SDPA as NaN.
        """
        call = bound_arguments(KERNEL.arguments, problem)
        q, k, v, kv_len = call["q"], call["k_cache"], call["v_cache"], call["kv_len"]
        seqlen_q, lmax = q.shape[2], k.shape[2]
        lengths = [min(max(int(n), 0), lmax) for n in kv_len.tolist()]
        if not lengths or min(lengths) < seqlen_q:
            return None
        mask: torch.Tensor | CausalBias | None
        if len(set(lengths)) == 1:
            k, v = k[:, :, : lengths[0]], v[:, :, : lengths[0]]
            mask = bottom_right_causal(seqlen_q, lengths[0])
        else:
            # New token i of a sequence of n keys sees positions up to n - Lq + i (below n).
            valid = torch.tensor(lengths, device=q.device)[:, None, None, None]  # [B, 1, 1, 1]
            last = valid - seqlen_q + torch.arange(seqlen_q, device=q.device)[:, None]  # [B, 1, Lq, 1]
            mask = torch.arange(lmax, device=q.device) <= last  # [B, 1, Lq, Lmax]
        sdpa = SdpaCall(q, k, v, mask, call.get("softmax_scale"))
        return fastest_sdpa([sdpa], lambda outs: outs[0])


TUNING = DecodeTuning()

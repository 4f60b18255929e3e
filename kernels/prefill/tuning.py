"""The tuning half of ``tma_prefill``: problems, the correctness gate and the keys ``tune`` sweeps.

Imported by the tuner only (``Kernel(tuning=...)``), never by serving code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from tritune.search_spaces.tma_prefill import HEAD_DIMS, TUNED_QUERY_HEADS, WS_HEAD_DIMS

from .._sdpa_peer import SdpaCall, bottom_right_causal, bound_arguments, fastest_sdpa
from ..declare import KernelTuning
from ..device import DeviceInfo
from ..spec import Peer, Problem, pow2_bucket
from .kernel import KERNEL, PrefillKey, ws_default
from .reference import visible_pairs

__all__ = ["TUNING", "PrefillTuning"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Error bound of :meth:`PrefillTuning.check`, relative to max|reference|.
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
#: What ``tune`` sweeps on a GPU when no key is named: bf16 causal, Lkv >= Lq, at these
#: (head dim, GQA group) layouts: small 64-dim heads at GQA 8; Llama-3-70B's 128-dim heads at
#: GQA 8; Llama-3-8B's and Mistral-7B's 128-dim heads at GQA 4.
_GPU_LAYOUTS = ((64, 8), (128, 8), (128, 4))
_GPU_LQ = (512, 1024, 2048, 4096)
_GPU_LKV = (16384, 32768, 65536, 131072)


class PrefillTuning(KernelTuning):
    """B=1 problems at the key's bucket lengths, graph-timed with a cold L2; a max-error gate."""

    #: ``tune --key lq=...`` and ``lkv=...``: query and key lengths, bucketed as calls are.
    key_aliases: ClassVar[dict[str, tuple[str, Callable[[int], int]]]] = {
        "lq": ("lq_bucket", pow2_bucket),
        "lkv": ("lkv_bucket", pow2_bucket),
    }

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        """Max-abs error within 2e-2 (bf16) or 4e-3 (fp16) of max|reference|; NaN never passes."""
        if not bool(torch.isfinite(out).all()):
            return "non-finite values in the output"
        tolerance = _TOLERANCE.get(out.dtype, 1e-5)
        bound = tolerance * float(expected.abs().max()) if expected.numel() else 0.0
        err = float((out.to(expected.dtype) - expected).abs().max()) if expected.numel() else 0.0
        if err > bound:
            return f"max error {err:.3g} exceeds {tolerance:g} x max|reference| = {bound:.3g}"
        return None

    def make_problem(self, key: PrefillKey, device: torch.device, seed: int) -> Problem:
        """B=1 with 16 query heads at the key's bucket lengths (on the interpreter: 2 KV heads)."""
        device = torch.device(device)
        dtype = _DTYPES[key.dtype]
        kv_heads = 2 if device.type == "cpu" else max(1, TUNED_QUERY_HEADS // key.gqa_group)
        q_heads = kv_heads * key.gqa_group
        seqlen_q, seqlen_k, head_dim = key.lq_bucket, key.lkv_bucket, key.head_dim
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

        q = randn(1, q_heads, seqlen_q, head_dim)
        k = randn(1, kv_heads, seqlen_k, head_dim)
        v = randn(1, kv_heads, seqlen_k, head_dim)
        kv_len = torch.tensor(seqlen_k, dtype=torch.int32, device=device)
        pairs = visible_pairs(seqlen_q, seqlen_k, key.causal) * q_heads
        element = q.element_size()
        return Problem(
            args=(q, k, v),
            kwargs={"causal": key.causal, "kv_len": kv_len, "softmax_scale": None},
            flops=4.0 * head_dim * pairs,
            bytes_moved=float(element * (2 * q.numel() + k.numel() + v.numel())),
            flush_l2=True,
            # Timed as CUDA-graph replays (L2 still flushed): what a config changes is GPU time, and
            # at the short keys (0.1-0.3 ms) an eager TMA launch's host work (four descriptors, and
            # a second launch for SPLIT_KV) can outlast the flush ahead of it and count, which makes
            # eager timings of one config vary by tens of percent between runs.
            launch_bound=True,
        )

    def check_problem(self, key: PrefillKey, device: torch.device, seed: int) -> Problem:
        """The key's problem with Lq capped at 256 rows and Lkv at 4096 keys.

        A dense fp32 reference at Lq 4096 x Lkv 128K costs tens of seconds per key; the capped
        problem keeps the same head dim, GQA group, causality and boundary handling, and the
        tuner still compares each candidate with the portable output at the full timed size.
        """
        capped = dataclasses.replace(key, lq_bucket=min(key.lq_bucket, 256), lkv_bucket=min(key.lkv_bucket, 4096))
        return self.make_problem(capped, device, seed)

    def default_keys(self, device: DeviceInfo) -> list[PrefillKey]:
        """GPU: bf16 causal at head dim 64 with GQA 8 and at 128 with GQA 8 and 4, Lq 512..4096,
        Lkv 16K..128K (Lkv >= Lq).

        The interpreter: head dim 64, Lq 16 and 32, Lkv 64, GQA 2 (tiny, so ``tune --device cpu``
        finishes quickly).
        """
        if device.is_interpreter:
            layouts, lqs, lkvs = ((64, 2),), (16, 32), (64,)
        else:
            layouts, lqs, lkvs = _GPU_LAYOUTS, _GPU_LQ, _GPU_LKV
        return [
            PrefillKey(device.arch, device.sm_count, "bf16", d, group, True, pow2_bucket(a), pow2_bucket(b))
            for d, group in layouts
            for a in lqs
            for b in lkvs
        ]

    def starting_configs(self, key: PrefillKey, device: DeviceInfo) -> list[Any]:
        """On SM90 at head dims 64/128: the ws path's starting config, then its other tile shape.

        128 x 128 tiles with two stages at head dim 128 (three at 64) are FlashAttention-3's
        choice for Hopper; 64-wide KV tiles with one more stage are the lighter alternative.
        Only configs the space admits for the key are returned (none off SM90).
        """
        if device.is_interpreter or key.arch != "sm90" or key.head_dim not in WS_HEAD_DIMS:
            return []
        first = ws_default(key)
        other = dataclasses.replace(
            first,
            BLOCK_N=64 if first.BLOCK_N == 128 else 128,
            num_stages=first.num_stages + 1 if first.BLOCK_N == 128 else first.num_stages - 1,
        )
        limits = KERNEL.limits(device)
        return [c for c in (first, other) if KERNEL.space.infeasible_reason(c, key, limits) is None]

    def winner_variants(self, config: Any, key: PrefillKey, device: DeviceInfo) -> list[Any]:
        """A stored TMA winner that splits the KV range (two launches and their tensor descriptors,
        host time an eager call pays) is followed by its one-launch twin (``SPLIT_KV=1``), so a
        re-tune always measures it and the eager choice can pick it."""
        if getattr(config, "path", None) == "tma" and config.SPLIT_KV > 1:
            return [dataclasses.replace(config, SPLIT_KV=1)]
        return []

    def valid_key(self, key: PrefillKey) -> bool:
        """A served dtype and head dim, a positive group, and at least as many keys as queries.

        Fewer keys than queries leaves the first rows of a causal call seeing nothing: not a
        shape worth a tune (the default sweep leaves those out too).
        """
        return (
            key.dtype in _DTYPES
            and key.head_dim in HEAD_DIMS
            and key.gqa_group >= 1
            and 1 <= key.lq_bucket <= key.lkv_bucket
        )

    def peer(self, key: PrefillKey, problem: Problem) -> Peer | None:
        """``scaled_dot_product_attention`` on the fastest backend here, bottom-right causal, GQA.

        Causal calls get ``causal_lower_right(Lq, Lkv)``: query ``i`` sees the keys up to
        ``Lkv - Lq + i``, the kernel's alignment. ``kv_len`` is read once (before timing): where
        every batch's length is the same, K and V are sliced to it. ``None`` where SDPA cannot
        compute what the kernel does: lengths that differ between batches (that needs a dense
        ``[B, Lq, Lkv]`` mask, no call a user would make at these sizes), or query rows that see
        no key (a length of 0, or causal with fewer keys than queries), which the kernel returns
        as zeros and SDPA as NaN.
        """
        call = bound_arguments(KERNEL.arguments, problem)
        q, k, v = call["q"], call["k"], call["v"]
        causal, kv_len = call.get("causal", True), call.get("kv_len")
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        if kv_len is not None:
            lengths = {min(max(int(n), 0), seqlen_k) for n in kv_len.reshape(-1).tolist()}
            if len(lengths) != 1:
                return None
            seqlen_k = lengths.pop()
            k, v = k[:, :, :seqlen_k], v[:, :, :seqlen_k]
        if seqlen_k == 0 or (causal and seqlen_q > seqlen_k):
            return None
        mask = bottom_right_causal(seqlen_q, seqlen_k) if causal else None
        sdpa = SdpaCall(q, k, v, mask, call.get("softmax_scale"))
        return fastest_sdpa([sdpa], lambda outs: outs[0])


TUNING = PrefillTuning()

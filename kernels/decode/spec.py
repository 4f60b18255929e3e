"""The ``splitk_decode`` kernel spec: its key, facts, launch, reference and tuning problems."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tritune.search_spaces.splitk_decode import SPACE, DecodeConfig, portable_config

from ..device import DeviceInfo
from ..spec import KernelSpec, Problem, TuningKey, pow2_bucket
from ._triton_decode import _decode_merge_kernel, _decode_split_kernel
from .op import DTYPE_NAMES, KERNEL, MAX_QUERY_TOKENS, DecodeFacts, check_inputs, launch
from .reference import compare, decode_reference

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: KV heads of the problems the tuner times on a GPU (``bh_bucket // 8`` sequences).
TUNED_KV_HEADS = 8
#: Cache lengths (``lkv_bucket``) and batches ``tune`` sweeps on a GPU when none are named. Every power
#: of two between batches: a neighbour's borrowed winner can replay slower than the portable default.
_GPU_LKV = (1024, 4096, 16384, 32768, 131072)
_GPU_BATCHES = (1, 4, 8, 16, 32, 64)


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


def _key_for(arch: str, sm_count: int, facts: tuple[Any, ...]) -> DecodeKey:
    f = DecodeFacts(*facts)
    return DecodeKey(
        arch=arch,
        sm_count=sm_count,
        dtype=f.dtype,
        head_dim=f.head_dim,
        gqa_group=f.q_heads // f.kv_heads,
        lq=lq_bucket(f.lq),
        bh_bucket=pow2_bucket(f.batch * f.kv_heads, minimum=1),
        lkv_bucket=pow2_bucket(f.lmax),
    )


class DecodeSpec(KernelSpec[DecodeConfig, DecodeKey]):
    name = KERNEL
    jit_kernels = (_decode_split_kernel, _decode_merge_kernel)
    # Split geometry comes from the space's rules and the SM count; trials are graph-timed.
    protocol = 1
    key_type = DecodeKey
    space = SPACE

    # ---- the runtime half --------------------------------------------------------------

    def facts(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: torch.Tensor,
        *,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> DecodeFacts:
        return check_inputs(q, k_cache, v_cache, kv_len, out, softmax_scale)

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> DecodeKey:
        return _key_for(device.arch, device.sm_count, tuple(facts))

    def default_config(self, key: DecodeKey) -> DecodeConfig:
        return portable_config(key, interpreter=key.arch == "cpu-interpreter")

    def launch(
        self,
        config: DecodeConfig,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: torch.Tensor,
        *,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        launch(config, q, k_cache, v_cache, kv_len, out, scale)
        return out

    # ---- the tuning half ---------------------------------------------------------------

    def reference(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: torch.Tensor,
        *,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return decode_reference(q, k_cache, v_cache, kv_len, softmax_scale=softmax_scale)

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        return compare(out, expected, problem.args[0].dtype)

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

    def default_keys(
        self,
        device: DeviceInfo,
        head_dims: list[int] | None = None,
        batches: list[int] | None = None,
        lkv: list[int] | None = None,
    ) -> list[DecodeKey]:
        """GPU: D 128 and 64, B in {1, 4, 8, 16, 32, 64} with 8 KV heads, caches 1K..128K, one new token, group 4."""
        if device.is_interpreter:
            dims, bhs, lengths = head_dims or [64], [2 * b for b in batches or [1]], lkv or [64, 128]
        else:
            dims = head_dims or [128, 64]
            bhs = [TUNED_KV_HEADS * b for b in batches or _GPU_BATCHES]
            lengths = lkv or list(_GPU_LKV)
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


SPEC = DecodeSpec()

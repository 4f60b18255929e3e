"""The ``tma_prefill`` kernel spec: keys, defaults, path eligibility, launch and reference.

Two paths serve one contract (see :mod:`.reference`): the portable kernel (any CUDA GPU) and the
TMA kernel (SM90+, causal, 16-byte aligned layouts, head dims 64/128/256). The dispatcher picks a
config per key; :meth:`PrefillSpec.serveable` then makes sure the chosen path may serve the call,
honouring ``settings().enable_tma_causal_prefill``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch._library.triton import set_wrap_triton_enabled

from tritune.search_spaces.base import TargetLimits
from tritune.search_spaces.tma_prefill import (
    HEAD_DIMS,
    SPACE,
    TMA_HEAD_DIMS,
    TUNED_QUERY_HEADS,
    PrefillConfig,
    grid_programs,
    pack_gqa_applies,
)

from .. import settings as settings_module
from .._launch import DTYPE_NAMES
from ..device import DeviceInfo, target_supports
from ..spec import KernelSpec, Problem, TuningKey, pow2_bucket
from ._triton_portable import _prefill_fwd_kernel, prefill_portable
from ._triton_tma import _merge_splits_kernel, _prefill_tma_kernel, prefill_tma
from .reference import prefill_reference

log = logging.getLogger("tritune.prefill")

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: Error bound of :meth:`PrefillSpec.check`, relative to max|reference|.
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}

#: The portable default for head dim 256 (64 x 64 tiles of that width crowd 99 KiB parts).
_PORTABLE_D256 = PrefillConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
_PORTABLE_INTERPRETER = PrefillConfig(BLOCK_M=32, BLOCK_N=32)
_TMA_DEFAULT = PrefillConfig(path="tma", BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
_TMA_D256 = PrefillConfig(path="tma", BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
_TMA_INTERPRETER = PrefillConfig(path="tma", BLOCK_M=32, BLOCK_N=32)

_warned_targets: set[str] = set()


class PrefillFacts(NamedTuple):
    """One call reduced to plain scalars (what keys and path eligibility may look at)."""

    dtype: str
    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    has_kv_len: bool
    #: Inner stride 1, 16-byte strides and bases on q, k, v and out (tensor descriptors need them).
    tma_layout_ok: bool


@dataclass(frozen=True)
class PrefillKey(TuningKey):
    dtype: str
    head_dim: int
    gqa_group: int
    causal: bool
    lq_bucket: int
    lkv_bucket: int

    BUCKETS: ClassVar[tuple[str, ...]] = ("lq_bucket", "lkv_bucket")


def _tma_layout_ok(t: torch.Tensor, compiling: bool) -> bool:
    """Whether a tensor descriptor may cover ``t`` (2-byte elements): what ``TensorDescriptor`` asserts.

    Runs on every call for four tensors, hence the plain arithmetic: unit inner stride, every other
    stride a multiple of 8 elements (16 bytes; OR-ing them keeps any low bit), no empty dimension.
    """
    *outer, inner = t.stride()
    bits = 0
    for stride in outer:
        bits |= stride
    if inner != 1 or bits % 8 or t.numel() == 0:
        return False
    # torch.compile cannot trace data pointers: the TMA op's body checks the base again at run time.
    return compiling or t.data_ptr() % 16 == 0


def visible_pairs(seqlen_q: int, kv_len: int, causal: bool) -> int:
    """Query-key pairs the mask leaves visible (bottom-right causal), for flop counts."""
    if not causal:
        return seqlen_q * kv_len
    # Row i sees kv_len - seqlen_q + 1 + i keys (at least 0): sum the positive counts.
    lowest = max(kv_len - seqlen_q + 1, 1)
    return (kv_len - lowest + 1) * (lowest + kv_len) // 2 if kv_len >= lowest else 0


def _values(option: int | Iterable[int] | None, default: Iterable[int]) -> list[int]:
    if option is None:
        return list(default)
    if isinstance(option, int):
        return [option]
    return [int(v) for v in option]


@functools.lru_cache(maxsize=256)
def portable_for(config: PrefillConfig, key: PrefillKey, limits: TargetLimits) -> PrefillConfig:
    """The portable config standing in for a TMA one: same tiles if they fit, else the default."""
    candidate = dataclasses.replace(config, path="portable", PACK_GQA=False, SPLIT_KV=1)
    if SPACE.infeasible_reason(candidate, key, limits) is None:
        return candidate
    return SPEC.default_config(key)


class PrefillSpec(KernelSpec[PrefillConfig, PrefillKey]):
    name = "tma_prefill"
    jit_kernels = (_prefill_fwd_kernel, _prefill_tma_kernel, _merge_splits_kernel)
    # Trials are timed as CUDA-graph replays with the L2 flushed (make_problem's launch_bound).
    protocol = 1
    key_type = PrefillKey
    space = SPACE

    # ---- the runtime half ----------------------------------------------------------------

    def facts(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        kv_len: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> PrefillFacts:
        batch, q_heads, seqlen_q, head_dim = q.shape
        compiling = torch.compiler.is_compiling()
        layout_ok = _tma_layout_ok(q, compiling) and _tma_layout_ok(k, compiling) and _tma_layout_ok(v, compiling)
        return PrefillFacts(
            dtype=DTYPE_NAMES.get(q.dtype, str(q.dtype)),
            batch=batch,
            q_heads=q_heads,
            kv_heads=k.shape[1],
            seqlen_q=seqlen_q,
            seqlen_k=k.shape[2],
            head_dim=head_dim,
            causal=bool(causal),
            has_kv_len=kv_len is not None,
            tma_layout_ok=layout_ok and (out is None or _tma_layout_ok(out, compiling)),
        )

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> PrefillKey:
        f = PrefillFacts(*facts)
        return PrefillKey(
            arch=device.arch,
            sm_count=device.sm_count,
            dtype=f.dtype,
            head_dim=f.head_dim,
            gqa_group=f.q_heads // max(f.kv_heads, 1),
            causal=f.causal,
            lq_bucket=pow2_bucket(f.seqlen_q),
            lkv_bucket=pow2_bucket(f.seqlen_k),
        )

    def default_config(self, key: PrefillKey) -> PrefillConfig:
        """The portable default: 64 x 64 tiles, 4 warps, 2 stages (smaller where it must be)."""
        if key.arch == "cpu-interpreter":
            return _PORTABLE_INTERPRETER
        if key.head_dim > 128:
            return _PORTABLE_D256
        return self.space.default()

    def tma_default(self, key: PrefillKey) -> PrefillConfig:
        """The TMA path's default for ``key`` (served by ``enable_tma_causal_prefill=on``)."""
        if key.arch == "cpu-interpreter":
            return _TMA_INTERPRETER
        return _TMA_D256 if key.head_dim > 128 else _TMA_DEFAULT

    def pinned_config(self, values: Mapping[str, Any]) -> PrefillConfig:
        """A ``use_config`` dict: fields left out take the defaults of the path it names."""
        if isinstance(values, Mapping) and values.get("path") == "tma":
            return self.space.parse(values, base=_TMA_DEFAULT)
        return self.space.parse(values)

    def serveable(self, config: PrefillConfig, device: DeviceInfo, facts: tuple[Any, ...]) -> PrefillConfig:
        """Serve ``config`` if its path may run this call, else its portable stand-in.

        ``enable_tma_causal_prefill``: ``auto`` keeps the selected config where eligible; ``on``
        serves a TMA config (the selected one, else the TMA default) wherever eligible and warns
        once per device when the target cannot run it; ``off`` never serves TMA.
        """
        mode = settings_module.settings().enable_tma_causal_prefill
        wants_tma = config.path == "tma" if mode == "auto" else mode == "on"
        if not wants_tma and config.path != "tma":
            return config
        f = PrefillFacts(*facts)
        if wants_tma and self._tma_target(device, warn=mode == "on") and self._tma_call(f):
            if config.path != "tma":
                key = self.key_for(device, f)
                forced = self.tma_default(key)
                if self.space.infeasible_reason(forced, key, self.limits(device)) is not None:
                    # The TMA default's tiles do not fit this GPU (e.g. 99 KB of shared memory).
                    return config
                config = forced
            group = f.q_heads // f.kv_heads
            if config.PACK_GQA and not pack_gqa_applies(config, group):
                config = dataclasses.replace(config, PACK_GQA=False)
            # A split tuned for one head count must not blow up the workspace of a call whose grid
            # already fills the GPU (keys do not hold batch or heads).
            if (
                config.SPLIT_KV > 1
                and not device.is_interpreter
                and grid_programs(config, group, f.seqlen_q, f.q_heads, f.batch) >= 2 * device.sm_count
            ):
                config = dataclasses.replace(config, SPLIT_KV=1)
            return config
        if config.path == "tma":
            return portable_for(config, self.key_for(device, f), self.limits(device))
        return config

    def _tma_target(self, device: DeviceInfo, *, warn: bool) -> bool:
        # The interpreter runs tensor descriptors too: that is how the CPU tier covers the path.
        if device.is_interpreter or target_supports(device, (9, 0)):
            return True
        if warn and device.slug not in _warned_targets:
            _warned_targets.add(device.slug)
            log.warning(
                "TRITUNE_ENABLE_TMA_CAUSAL_PREFILL=on, but %s (%s) cannot run the TMA path (it needs SM90+, "
                "and every architecture in TORCH_CUDA_ARCH_LIST SM90+): serving the portable path",
                device.name,
                device.arch,
            )
        return False

    @staticmethod
    def _tma_call(f: PrefillFacts) -> bool:
        return f.causal and f.tma_layout_ok and f.head_dim in TMA_HEAD_DIMS and f.dtype in _DTYPES

    def launch(
        self,
        config: PrefillConfig,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        kv_len: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``config``'s path on validated arguments (the tuner's entry; no dispatch)."""
        out = torch.empty_like(q) if out is None else out
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        run = prefill_tma if config.path == "tma" else prefill_portable
        # Bare kernels, as the op's body gets them in eager mode: wrap_triton's tracing route
        # would add its host cost to every launch the tuner times.
        with set_wrap_triton_enabled(False):
            run(q, k, v, kv_len, out, causal=causal, softmax_scale=scale, config=config)
        return out

    # ---- the tuning half -----------------------------------------------------------------

    def reference(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        kv_len: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return prefill_reference(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=softmax_scale)

    def check(
        self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None
    ) -> str | None:
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

    def default_keys(
        self,
        device: DeviceInfo,
        head_dims: int | Iterable[int] | None = None,
        lq: int | Iterable[int] | None = None,
        lkv: int | Iterable[int] | None = None,
    ) -> list[PrefillKey]:
        """GPU: bf16 causal GQA-8 at head dims 64/128, Lq 512..4096, Lkv 16K..128K (Lkv >= Lq).

        The interpreter: head dim 64, Lq 16 and 32, Lkv 64, GQA 2 (tiny, so ``tune --device cpu``
        finishes quickly).
        """
        if device.is_interpreter:
            dims, lqs, lkvs, group = _values(head_dims, (64,)), _values(lq, (16, 32)), _values(lkv, (64,)), 2
        else:
            dims = _values(head_dims, (64, 128))
            lqs = _values(lq, (512, 1024, 2048, 4096))
            lkvs = _values(lkv, (16384, 32768, 65536, 131072))
            group = 8
        for d in dims:
            if d not in HEAD_DIMS:
                raise ValueError(f"head_dims: {d} is not served; expected one of {HEAD_DIMS}")
        keys: dict[PrefillKey, None] = {}
        for d in dims:
            for a in lqs:
                for b in lkvs:
                    if b >= a:
                        buckets = (pow2_bucket(a), pow2_bucket(b))
                        keys[PrefillKey(device.arch, device.sm_count, "bf16", d, group, True, *buckets)] = None
        return list(keys)


SPEC = PrefillSpec()

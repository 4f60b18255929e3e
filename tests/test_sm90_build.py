"""Every Triton kernel of the four families, built for sm_90 by Triton's compiler (no GPU needed).

The interpreter runs a kernel's Python line by line, so a name bound only under a ``constexpr``
branch and read on another path, or anything else the compiler's front end refuses, passes the
CPU tier and fails on the GPU (``NameError('ws_slot is not defined')`` in the varlen kernel did).
Here each case runs its spec's ``launch`` at a GPU key on meta tensors with the launches
intercepted (:mod:`sm90_build`), specializes each launch as ``JITFunction.run`` would on an H200
(argument types, ``constexpr`` values, 16-byte divisibility, tensor descriptors), and one
subprocess without ``TRITON_INTERPRET`` compiles them all to cubins for sm_90. A case fails with
the compiler's message, or when a kernel needs more shared memory than an H200 block has (the
launch would fail there with OutOfResources).

Cases: each kernel's portable default at GPU keys (``spec.default_keys`` of an H200, some with a
served head dim or mode the default keys leave out), and configs drawn with a fixed seed from the
feasible space under constraints that reach the split and packed variants. A last test checks
that every launched kernel (a jit function named ``*_kernel`` in a spec's source modules) was built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sm90_build
import torch

from tritune.kernels import _launch, registry
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, Problem, smem_limit_bytes

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
SMEM_LIMIT = smem_limit_bytes(H200.capability)
META = torch.device("meta")
SCRIPT = Path(__file__).with_name("sm90_build.py")
log = logging.getLogger("tritune.tests.sm90_build")

Constraint = Any  # a field's value, or a predicate on it


def _more_than_one(value: int) -> bool:
    return value > 1


def _at_least_64(value: int) -> bool:
    return value >= 64


def _is_256(value: int) -> bool:
    return value == 256


@dataclass(frozen=True)
class Case:
    kernel: str
    name: str
    #: The first of the kernel's default H200 keys with these fields ...
    key: Mapping[str, Any] = field(default_factory=dict)
    #: ... with these fields replaced (head dims and modes the default keys leave out).
    replace: Mapping[str, Any] = field(default_factory=dict)
    #: None: the portable default at the key. Else a config drawn with a fixed seed from the
    #: feasible ones whose fields satisfy these constraints; or a function of (spec, key).
    config: Mapping[str, Constraint] | Callable[[Any, Any], Any] | None = None
    #: The kernels the case launches, in order, where its variant implies them (None: not checked).
    launches: tuple[str, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.kernel}/{self.name}"


# Kernel names of the launches a case's variant implies (checked where given).
PREFILL_SPLIT = ("_prefill_tma_kernel", "_merge_splits_kernel")
DECODE_MERGED = ("_decode_split_kernel", "_decode_merge_kernel")
VARLEN_SPLIT = ("_varlen_fwd_kernel", "_varlen_merge_kernel")
Q4K_FP8 = ("_quantize_rows_fp8_kernel", "_q4k_gemm_fp8_kernel")
# The folded kernel with and without SWAP_AB (a constexpr of the one kernel).
Q4K_FOLD = ("_quantize_rows_fp8_kernel", "_q4k_gemm_fp8_fold_kernel")
Q4K_STAGED = ("_staged_prepass_kernel", "_q4k_dequant_fp8_kernel", "_q4k_dequant_fp8_kernel")
Q4K_GEMV = ("_quantize_rows_gemv_kernel", "_q4k_gemv_kernel")
Q4K_GEMV_FUSED = "_q4k_gemv_fused_kernel"
Q4K_INT8 = ("_int8_prepass_kernel", "_q4k_gemm_int8_kernel")


def _tma_default(spec: Any, key: Any) -> Any:
    """The prefill kernel's TMA default (what ``TRITUNE_ENABLE_TMA_CAUSAL_PREFILL=on`` serves)."""
    from tritune.kernels.prefill.kernel import tma_default

    return tma_default(key)


def _ws_default(spec: Any, key: Any) -> Any:
    """The prefill kernel's warp-specialized (Gluon) starting config at the key's head dim."""
    from tritune.kernels.prefill.kernel import ws_default

    return ws_default(key)


def _fused_default(spec: Any, key: Any) -> Any:
    """The decode kernel's portable default with the merge fused into the split launch."""
    return dataclasses.replace(spec.default_config(key), FUSED_MERGE=True)


def _varlen_tma_winner(spec: Any, key: Any) -> Any:
    """The shipped H200 varlen winner at head dim 128, 4K tokens (128 x 128 tiles, 3 stages, KV_TMA)."""
    return spec.space.parse(
        {"BLOCK_M": 128, "BLOCK_N": 128, "KV_TMA": True, "MAX_SPLITS": 64, "MIN_CHUNK": 512, "SHORT_M": 16,
         "TARGET_WAVES": 4, "num_stages": 3, "num_warps": 8}
    )  # fmt: skip


CASES = [
    # tma_prefill: the default keys are bf16, causal, GQA 8, head dims 64/128, Lq 512.., Lkv 16K..
    Case("tma_prefill", "portable-default-d64", key={"head_dim": 64}),
    Case("tma_prefill", "portable-default-d128", key={"head_dim": 128}),
    Case("tma_prefill", "portable-default-d80-noncausal", replace={"head_dim": 80, "causal": False}),
    Case("tma_prefill", "portable-default-d256", replace={"head_dim": 256}),
    Case("tma_prefill", "portable-sampled-d128", key={"head_dim": 128, "lq_bucket": 4096}, config={"path": "portable"}),
    Case("tma_prefill", "tma-default-d128", key={"head_dim": 128}, config=_tma_default),
    Case("tma_prefill", "tma-default-d256", replace={"head_dim": 256}, config=_tma_default),
    Case(
        "tma_prefill",
        "tma-pack-split-d128",
        key={"head_dim": 128, "lq_bucket": 512, "lkv_bucket": 131072},
        config={"path": "tma", "PACK_GQA": True, "SPLIT_KV": _more_than_one},
        launches=PREFILL_SPLIT,
    ),
    Case(
        "tma_prefill",
        "tma-split-d64",
        key={"head_dim": 64, "lq_bucket": 512, "lkv_bucket": 65536},
        config={"path": "tma", "PACK_GQA": False, "SPLIT_KV": _more_than_one},
        launches=PREFILL_SPLIT,
    ),
    Case(
        "tma_prefill",
        "tma-pack-d64",
        key={"head_dim": 64, "lq_bucket": 2048},
        config={"path": "tma", "PACK_GQA": True, "SPLIT_KV": 1},
        launches=("_prefill_tma_kernel",),
    ),
    Case("tma_prefill", "ws-default-d128", key={"head_dim": 128}, config=_ws_default, launches=("_prefill_ws_kernel",)),
    Case(
        "tma_prefill",
        "ws-default-d64-noncausal",
        key={"head_dim": 64},
        replace={"causal": False},
        config=_ws_default,
        launches=("_prefill_ws_kernel",),
    ),
    # splitk_decode: the default keys are bf16, GQA 4, one new token, B x 8 KV heads, caches 1K..128K.
    Case(
        "splitk_decode",
        "default-d128-merged",
        key={"head_dim": 128, "bh_bucket": 8, "lkv_bucket": 131072},
        launches=DECODE_MERGED,
    ),
    Case(
        "splitk_decode",
        "default-d64-one-split",
        key={"head_dim": 64, "bh_bucket": 512, "lkv_bucket": 1024},
        launches=("_decode_split_kernel",),
    ),
    Case("splitk_decode", "default-d80-lq4", key={"lkv_bucket": 32768}, replace={"head_dim": 80, "lq": 4}),
    Case("splitk_decode", "default-d256-fp16", key={"lkv_bucket": 32768}, replace={"head_dim": 256, "dtype": "fp16"}),
    Case("splitk_decode", "sampled-d128", key={"head_dim": 128, "bh_bucket": 32, "lkv_bucket": 16384}, config={}),
    Case("splitk_decode", "sampled-d64-lq8", key={"head_dim": 64, "bh_bucket": 8}, replace={"lq": 8}, config={}),
    # The merge fused into the split launch: B=1 at 4K (the launch-bound key it is for), head dim 256
    # in fp16, and two row blocks per KV head (GQA 16 x 8 new tokens), so two counters each.
    Case(
        "splitk_decode",
        "fused-default-d128",
        key={"head_dim": 128, "bh_bucket": 8, "lkv_bucket": 4096},
        config=_fused_default,
        launches=("_decode_split_kernel",),
    ),
    Case(
        "splitk_decode",
        "fused-default-d256-fp16",
        key={"lkv_bucket": 32768},
        replace={"head_dim": 256, "dtype": "fp16"},
        config=_fused_default,
        launches=("_decode_split_kernel",),
    ),
    Case(
        "splitk_decode",
        "fused-sampled-d64-row-blocks",
        key={"head_dim": 64, "bh_bucket": 8, "lkv_bucket": 16384},
        replace={"gqa_group": 16, "lq": 8},
        config={"FUSED_MERGE": True},
        launches=("_decode_split_kernel",),
    ),
    # varlen_sdpa: the default keys are bf16, causal, GQA 4, 32K-row stores, decode and prefill mixes.
    Case("varlen_sdpa", "default-d128-decode-split", key={"head_dim": 128, "t_bucket": 32}, launches=VARLEN_SPLIT),
    Case("varlen_sdpa", "default-d64-prefill", key={"head_dim": 64, "t_bucket": 2048}),
    # A store no longer than MIN_CHUNK: no split-K with the default config (where ws_slot was unbound).
    Case(
        "varlen_sdpa",
        "default-d128-short-store",
        key={"head_dim": 128},
        replace={"rows_bucket": 512},
        launches=("_varlen_fwd_kernel",),
    ),
    Case(
        "varlen_sdpa",
        "default-d80-ring-window",
        key={"head_dim": 64},
        replace={"head_dim": 80, "ring": True, "windowed": True},
    ),
    Case("varlen_sdpa", "default-d64-noncausal-fp16", key={"head_dim": 64}, replace={"causal": False, "dtype": "fp16"}),
    Case(
        "varlen_sdpa",
        "sampled-no-split",
        key={"head_dim": 128, "t_bucket": 4096},
        config={"MAX_SPLITS": 1},
        launches=("_varlen_fwd_kernel",),
    ),
    Case(
        "varlen_sdpa",
        "sampled-split",
        key={"head_dim": 64, "t_bucket": 32},
        config={"MAX_SPLITS": _more_than_one},
        launches=VARLEN_SPLIT,
    ),
    # KV_TMA loads (as a direct op body launches them), the last at the shipped H200 winner whose
    # build comes closest to an H200 block's shared memory (230,400 of 232,448 bytes).
    Case(
        "varlen_sdpa",
        "kv-tma-no-split-d128",
        key={"head_dim": 128, "t_bucket": 4096},
        config={"KV_TMA": True, "MAX_SPLITS": 1},
        launches=("_varlen_fwd_kernel",),
    ),
    Case(
        "varlen_sdpa",
        "kv-tma-split-d64",
        key={"head_dim": 64, "t_bucket": 32},
        config={"KV_TMA": True, "MAX_SPLITS": _more_than_one},
        launches=VARLEN_SPLIT,
    ),
    Case("varlen_sdpa", "kv-tma-winner-d128-m128", key={"head_dim": 128, "t_bucket": 4096}, config=_varlen_tma_winner),
    # q4k_fp8_gemm: the default keys are the Llama-3-8B shapes over M buckets (K=14336, N=4096 here),
    # accurate ones first; the fp8 and staged paths are feasible at opt-in keys (fp8=True) only.
    Case("q4k_fp8_gemm", "gemv-default-m1", key={"k": 14336, "m_bucket": 1}, launches=(Q4K_GEMV_FUSED,)),
    Case("q4k_fp8_gemm", "gemv-default-m4", key={"k": 14336, "m_bucket": 4}, launches=(Q4K_GEMV_FUSED,)),
    Case(
        "q4k_fp8_gemm",
        "portable-default-m16-splitk",
        key={"k": 14336, "m_bucket": 16},
        launches=("_q4k_gemm_portable_kernel", "_splitk_reduce_kernel"),
    ),
    Case("q4k_fp8_gemm", "portable-default-m64", key={"k": 14336, "m_bucket": 64}),
    Case("q4k_fp8_gemm", "portable-default-m4096", key={"k": 14336, "m_bucket": 4096}),
    Case("q4k_fp8_gemm", "portable-default-m256-fp16", key={"k": 14336, "m_bucket": 256}, replace={"dtype": "float16"}),
    Case(
        "q4k_fp8_gemm",
        "fp8-m4096",
        key={"k": 14336, "m_bucket": 4096},
        replace={"fp8": True},
        config={"path": "fp8", "SCALE_FOLD": False, "BLOCK_M": _at_least_64},
        launches=Q4K_FP8,
    ),
    Case(
        "q4k_fp8_gemm",
        "fp8-splitk-m16",
        key={"k": 14336, "m_bucket": 16},
        replace={"fp8": True},
        config={"path": "fp8", "SCALE_FOLD": False, "SPLIT_K": _more_than_one},
        launches=(*Q4K_FP8, "_splitk_reduce_kernel"),
    ),
    Case(
        "q4k_fp8_gemm",
        "fp8-fold-m4096",
        key={"k": 14336, "m_bucket": 4096},
        replace={"fp8": True},
        config={"path": "fp8", "SCALE_FOLD": True, "SWAP_AB": False, "BLOCK_M": _at_least_64},
        launches=Q4K_FOLD,
    ),
    Case(
        "q4k_fp8_gemm",
        "fp8-fold-splitk-m1",
        key={"k": 14336, "m_bucket": 1},
        replace={"fp8": True},
        config={"path": "fp8", "SCALE_FOLD": True, "SWAP_AB": False, "SPLIT_K": _more_than_one},
        launches=(*Q4K_FOLD, "_splitk_reduce_kernel"),
    ),
    Case(
        "q4k_fp8_gemm",
        "fp8-fold-swap-m4096-bm256",
        key={"k": 14336, "m_bucket": 4096},
        replace={"fp8": True},
        config={"path": "fp8", "SWAP_AB": True, "BLOCK_M": _is_256},
        launches=Q4K_FOLD,
    ),
    Case(
        "q4k_fp8_gemm",
        "fp8-fold-swap-m256",
        key={"k": 14336, "m_bucket": 256},
        replace={"fp8": True},
        config={"path": "fp8", "SWAP_AB": True, "BLOCK_M": _at_least_64, "BLOCK_N": 256},
        launches=Q4K_FOLD,
    ),
    Case(
        "q4k_fp8_gemm",
        "staged-m4096",
        key={"k": 14336, "m_bucket": 4096},
        replace={"fp8": True},
        config={"path": "staged", "CHUNK_N": 2048},
        # N=4096 in two chunks; each chunk's GEMM is cuBLASLt's, not a Triton launch.
        launches=Q4K_STAGED,
    ),
    Case(
        "q4k_fp8_gemm",
        "gemv-m1",
        key={"k": 14336, "m_bucket": 1},
        config={"path": "gemv", "SPLIT_K": 1, "FUSE_QUANT": False, "FUSED_REDUCE": False, "K_LANES": False},
        launches=Q4K_GEMV,
    ),
    Case(
        "q4k_fp8_gemm",
        "gemv-splitk-m1",
        key={"k": 14336, "m_bucket": 1},
        config={
            "path": "gemv",
            "SPLIT_K": _more_than_one,
            "FUSE_QUANT": False,
            "FUSED_REDUCE": False,
            "K_LANES": False,
        },
        launches=(*Q4K_GEMV, "_splitk_reduce_kernel"),
    ),
    # The lanes along K: the one-launch kernel reading the pre-pass's words, then the reduce.
    Case(
        "q4k_fp8_gemm",
        "gemv-k-lanes-splitk-m1",
        key={"k": 14336, "m_bucket": 1},
        config={"path": "gemv", "SPLIT_K": _more_than_one, "FUSE_QUANT": False, "FUSED_REDUCE": False, "K_LANES": True},
        launches=("_quantize_rows_gemv_kernel", Q4K_GEMV_FUSED, "_splitk_reduce_kernel"),
    ),
    # The GEMV in fewer launches: quantizing x itself, reducing its splits itself, and both.
    Case(
        "q4k_fp8_gemm",
        "gemv-fuse-quant-m1",
        key={"k": 4096, "n": 14336, "m_bucket": 1},
        config={"path": "gemv", "SPLIT_K": 1, "FUSE_QUANT": True},
        launches=(Q4K_GEMV_FUSED,),
    ),
    Case(
        "q4k_fp8_gemm",
        "gemv-fused-reduce-m1",
        key={"k": 14336, "m_bucket": 1},
        config={"path": "gemv", "SPLIT_K": _more_than_one, "FUSE_QUANT": False, "FUSED_REDUCE": True},
        launches=("_quantize_rows_gemv_kernel", Q4K_GEMV_FUSED),
    ),
    Case(
        "q4k_fp8_gemm",
        "gemv-one-launch-splitk-m1",
        key={"k": 14336, "m_bucket": 1},
        config={"path": "gemv", "SPLIT_K": _more_than_one, "FUSE_QUANT": True, "FUSED_REDUCE": True},
        launches=(Q4K_GEMV_FUSED,),
    ),
    Case(
        "q4k_fp8_gemm",
        "fp8-fold-swap-splitk-m16",
        key={"k": 14336, "m_bucket": 16},
        replace={"fp8": True},
        config={"path": "fp8", "SWAP_AB": True, "SPLIT_K": _more_than_one},
        launches=(*Q4K_FOLD, "_splitk_reduce_kernel"),
    ),
    Case(
        "q4k_fp8_gemm",
        "int8-m4096",
        key={"k": 14336, "m_bucket": 4096},
        replace={"fp8": True},
        config={"path": "int8", "SWAP_AB": False, "BLOCK_M": _at_least_64},
        launches=Q4K_INT8,
    ),
    Case(
        "q4k_fp8_gemm",
        "int8-swap-m4096-bm256",
        key={"k": 14336, "m_bucket": 4096},
        replace={"fp8": True},
        config={"path": "int8", "SWAP_AB": True, "BLOCK_M": _is_256},
        launches=Q4K_INT8,
    ),
    Case(
        "q4k_fp8_gemm",
        "int8-swap-splitk-m16",
        key={"k": 14336, "m_bucket": 16},
        replace={"fp8": True},
        config={"path": "int8", "SWAP_AB": True, "SPLIT_K": _more_than_one},
        launches=(*Q4K_INT8, "_splitk_reduce_kernel"),
    ),
    Case(
        "q4k_fp8_gemm",
        "int8-m512-fp16",
        key={"k": 4096, "n": 14336, "m_bucket": 512},
        replace={"dtype": "float16", "fp8": True},
        config={"path": "int8"},
        launches=Q4K_INT8,
    ),
    # The tma path's other K loops (scales by TMA: K per split whole chunks of 1024 codes).
    Case(
        "q4k_fp8_gemm",
        "tma-loader-warp-m256",
        key={"k": 4096, "n": 14336, "m_bucket": 256},
        config={"path": "tma", "LOADER_WARP": True, "W_REGISTERS": False, "SPLIT_K": 1},
        launches=("_q4k_gemm_tma_loader_kernel",),
    ),
    Case(
        "q4k_fp8_gemm",
        "tma-register-a-m512",
        key={"k": 14336, "n": 4096, "m_bucket": 512},
        config={"path": "tma", "W_REGISTERS": True, "SPLIT_K": 1},
        launches=("_q4k_gemm_tma_rs_kernel",),
    ),
    # The dequant path: each chunk's GEMM is cuBLAS's (torch.mm), not a Triton launch.
    Case(
        "q4k_fp8_gemm",
        "dequant-m4096-whole",
        key={"k": 14336, "m_bucket": 4096},
        config={"path": "dequant", "CHUNK_N": 4096},
        launches=("_q4k_dequant_kernel",),
    ),
    Case(
        "q4k_fp8_gemm",
        "dequant-m512-fp16-chunks",
        key={"k": 4096, "n": 14336, "m_bucket": 512},
        replace={"dtype": "float16"},
        config={"path": "dequant", "CHUNK_N": 4096, "BLOCK_K": 256},
        # 14336 rows: three chunks of 4096 and one of 2048.
        launches=("_q4k_dequant_kernel",) * 4,
    ),
]


def _key(spec: KernelSpec[Any, Any], case: Case) -> Any:
    keys = spec.default_keys(H200)
    matching = [k for k in keys if all(getattr(k, name) == value for name, value in case.key.items())]
    if not matching:
        raise LookupError(f"no default H200 key of {spec.name} has {dict(case.key)}")
    return dataclasses.replace(matching[0], **case.replace)


def _satisfies(config: Any, constraints: Mapping[str, Constraint]) -> bool:
    for name, want in constraints.items():
        value = getattr(config, name)
        if not (want(value) if callable(want) else value == want):
            return False
    return True


def _config(spec: KernelSpec[Any, Any], case: Case, key: Any) -> Any:
    if case.config is None:
        return spec.default_config(key)
    if callable(case.config):
        return case.config(spec, key)
    constraints = case.config
    feasible = [c for c in spec.space.feasible(key, spec.limits(H200)) if _satisfies(c, constraints)]
    if not feasible:
        raise LookupError(f"no feasible {spec.name} config at {key} satisfies {sorted(constraints)}")
    return random.Random(case.id).choice(feasible)


def _meta_problem(spec: KernelSpec[Any, Any], key: Any) -> Problem:
    """The key's GPU problem on meta tensors: GPU shapes, nothing allocated, nothing computed.

    ``make_problem`` seeds ``torch.Generator(device=...)``, which has no meta form: a CPU generator
    stands in while it runs (random draws accept one for meta tensors).
    """
    generator = torch.Generator

    class MetaGenerator(generator):
        def __new__(cls, device: Any = "cpu") -> torch.Generator:
            return generator() if torch.device(device).type == "meta" else generator(device)

    torch.Generator = MetaGenerator
    try:
        return spec.make_problem(key, META, 0)
    finally:
        torch.Generator = generator


@dataclass
class Built:
    """One case: its key and config, then per recorded launch its record and build result."""

    key: Any = None
    config: Any = None
    error: str | None = None
    launches: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)


class Builds(dict[str, Built]):
    """Case id -> :class:`Built`, with a repr short enough for a failure report."""

    def __repr__(self) -> str:
        return f"<sm_90 builds of {len(self)} cases>"


def _no_gemm(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``torch._scaled_mm`` while launches are recorded on meta tensors."""


def _record(case: Case, problems: dict[Any, Problem]) -> tuple[Built, list[dict[str, Any]]]:
    built = Built()
    try:
        spec = registry.get_spec(case.kernel)
        built.key = _key(spec, case)
        built.config = _config(spec, case, built.key)
        if built.key not in problems:
            problems[built.key] = _meta_problem(spec, built.key)
        problem = problems[built.key]
        # The staged Q4_K path's per-chunk GEMM is cuBLASLt's (torch._scaled_mm), whose out=
        # overload has no meta kernel: only the Triton launches around it are built here.
        with sm90_build.record_launches() as recorder, pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "_scaled_mm", _no_gemm)
            spec.launch(built.config, *problem.args, **problem.kwargs)
        records = [sm90_build.specialize(launch) for launch in recorder.launches]
    except Exception as exc:
        built.error = f"{type(exc).__name__}: {exc}"
        return built, []
    return built, records


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    """Record every case, then compile the distinct launches in one subprocess."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    started = time.perf_counter()
    results = Builds()
    distinct: dict[str, dict[str, Any]] = {}
    owners: list[tuple[str, dict[str, Any], str]] = []
    problems: dict[Any, Problem] = {}
    with pytest.MonkeyPatch.context() as patch:
        # Launch plans read the SM count of the tensors' device: the H200's.
        patch.setitem(_launch.SM_COUNTS, META, H200.sm_count)
        for case in CASES:
            built, records = _record(case, problems)
            results[case.id] = built
            for record in records:
                identity = json.dumps(record, sort_keys=True)
                distinct.setdefault(identity, {**record, "id": len(distinct)})
                owners.append((case.id, record, identity))
    recorded = time.perf_counter() - started

    tmp = tmp_path_factory.mktemp("sm90")
    records_file = tmp / "records.json"
    records_file.write_text(json.dumps(list(distinct.values())))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", str(records_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = {result["id"]: result for result in map(json.loads, run.stdout.splitlines())}
    assert len(outcome) == len(distinct), run.stderr[-3000:]
    for case_id, record, identity in owners:
        results[case_id].launches.append((record, outcome[distinct[identity]["id"]]))
    log.info(
        "sm_90 builds: %d launches in %d cases, %d distinct; recorded in %.1f s, compiled in %.1f s",
        len(owners),
        len(CASES),
        len(distinct),
        recorded,
        time.perf_counter() - started - recorded,
    )
    return results


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_builds_for_sm90(case: Case, builds: Builds) -> None:
    built = builds[case.id]
    assert built.error is None, f"{case.id}: could not record the launch: {built.error}"
    assert built.launches, f"{case.id}: {built.config} launched no kernel"
    launched = tuple(record["kernel"] for record, _ in built.launches)
    if case.launches is not None:
        assert launched == case.launches, f"{case.id}: {built.config} launched {launched}, not {case.launches}"
    failures = []
    for record, result in built.launches:
        where = f"{record['kernel']} ({built.config}, {record['options']})"
        if result["error"] is not None:
            failures.append(f"{where} does not compile for sm_90:\n{result['error']}")
        elif result["shared"] > SMEM_LIMIT:
            failures.append(f"{where} needs {result['shared']} bytes of shared memory; an H200 block has {SMEM_LIMIT}")
    assert not failures, "\n\n".join(failures)


def test_varlen_kv_tma_configs_build_tma_loads(builds: Builds) -> None:
    """Each varlen case whose config has ``KV_TMA`` builds its main kernel with TMA loads (the spec's
    launch runs the op's body with ``wrap_triton`` off, where host-side descriptors are allowed),
    within the space's estimate, which ``test_builds_for_sm90`` holds to an H200 block's shared
    memory; the rule admits each."""
    from tritune.search_spaces.base import attention_smem_bytes, padded_head_dim
    from tritune.search_spaces.varlen_sdpa import block_m_for

    spec = registry.get_spec("varlen_sdpa")
    cases = [case.id for case in CASES if case.kernel == "varlen_sdpa" and builds[case.id].config.KV_TMA]
    assert len(cases) >= 3, cases
    for case_id in cases:
        built = builds[case_id]
        config, key = built.config, built.key
        assert spec.space.infeasible_reason(config, key, spec.limits(H200)) is None, case_id
        estimate = attention_smem_bytes(
            block_m_for(config.BLOCK_M, key.gqa_group),
            config.BLOCK_N,
            padded_head_dim(key.head_dim),
            config.num_warps,
            config.num_stages,
            kv_tma=True,
        )
        for record, result in built.launches:
            if record["kernel"] == "_varlen_fwd_kernel":
                assert result["tma_loads"] > 0, (case_id, config)
                assert result["shared"] <= estimate, (case_id, config, result["shared"], estimate)


def _launched_kernels() -> set[str]:
    """``module:name`` of each Triton kernel a spec declares it may launch (its ``jit_kernels``)."""
    names = set()
    for spec in registry.all_specs():
        for kernel in spec.jit_kernels:
            fn = kernel.fn
            names.add(f"{fn.__module__}:{fn.__name__}")
    return names


def test_every_kernel_is_built(builds: Builds) -> None:
    built = {f"{record['module']}:{record['kernel']}" for b in builds.values() for record, _ in b.launches}
    kernels = _launched_kernels()
    assert len(kernels) >= 12, kernels
    assert kernels <= built, f"no case builds {sorted(kernels - built)}: add one to CASES"


def test_fused_decode_merge_synchronises_through_memory(builds: Builds) -> None:
    """A fused merge's split kernel counts arrivals with one acq_rel atomic at gpu scope (the release
    of the partials, the acquire of the merging program) and reads the partials through L2 only."""
    fused = [case.id for case in CASES if case.kernel == "splitk_decode" and case.name.startswith("fused-")]
    assert len(fused) == 3
    for case_id in fused:
        ((_record, result),) = builds[case_id].launches
        assert result["atomics"] == ["atom.global.gpu.acq_rel.add.u32"], (case_id, result["atomics"])
        assert result["cg_loads"] > 0, case_id
    # Without the fused merge the split kernel synchronises with nothing.
    split, merge = builds["splitk_decode/default-d128-merged"].launches
    assert split[1]["atomics"] == [] and merge[1]["atomics"] == []


def test_fused_gemv_reduce_synchronises_through_memory(builds: Builds) -> None:
    """The GEMV's fused reduce counts arrivals as the decode kernel's fused merge does (one acq_rel
    atomic at gpu scope) and reads the partials through L2 only; without it the kernel
    synchronises with nothing."""
    for case_id in ("q4k_fp8_gemm/gemv-one-launch-splitk-m1", "q4k_fp8_gemm/gemv-fused-reduce-m1"):
        _record, result = builds[case_id].launches[-1]
        assert result["atomics"] == ["atom.global.gpu.acq_rel.add.u32"], (case_id, result["atomics"])
        assert result["cg_loads"] > 0, case_id
    ((_record, quant_only),) = builds["q4k_fp8_gemm/gemv-fuse-quant-m1"].launches
    assert quant_only["atomics"] == [] and quant_only["cg_loads"] == 0


#: (K, N, SPLIT_K) of the shipped H200 bundle's GEMV winners (BLOCK_N 32, BLOCK_K 256, 4 warps).
GEMV_WINNERS = [(14336, 4096, 4), (4096, 14336, 1), (4096, 4096, 4)]
#: sha256 of the SASS (``nvdisasm -c``) of ``_q4k_gemv_kernel`` at each winner, as the bundle's
#: timings measured it: another digest means those timings describe other code.
GEMV_WINNER_SASS = {
    (14336, 4096, 4): "271aea68d48e38b5c25cffd40d79e9c79d4c7153b0b481b6f26a684793f8cd39",
    (4096, 14336, 1): "5368decdcb820ac09fbb5b21c8a5f9f40a091bb9114a77157b0c38354e91363c",
    (4096, 4096, 4): "c7453db31907474553e6f4f302a9e907150423cea497e29f2ddea9e0dc635616",
}


def _build_gemv(cases: list[dict[str, Any]], cache: Path) -> list[list[dict[str, Any]]]:
    """Each case's launches built for sm_90 by the script's ``--gemv`` (in a process without the
    interpreter, compiling into ``cache``)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--gemv", json.dumps(cases)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line)["launches"] for line in run.stdout.splitlines()]


def _float_sums(launch: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in launch["reductions"] if r["type"] == "f32" and r["combine"] == "addf"]


def test_gemv_one_launch_builds_as_the_unfused_launches_add(tmp_path: Path) -> None:
    """At the bundle's three GEMV winners: today's kernel builds to the SASS the bundle measured,
    and the one-launch kernel (``FUSE_QUANT``, ``FUSED_REDUCE`` where split) builds without
    spilling, with the acq_rel arrival where split, and with its float sums in the unfused
    launches' order: each sub-block's sum and lost sum over 4 values a thread and 8 lanes (the
    lowest), as the pre-pass's, and the final sum over the K tile in the unfused kernel's
    layout. So the results are the same bits on sm_90 (the GPU tier checks them)."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    tile = {"path": "gemv", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}
    cases = []
    for k, n, split in GEMV_WINNERS:
        cases.append({"k": k, "n": n, "config": {**tile, "SPLIT_K": split}})
        fused = {**tile, "SPLIT_K": split, "FUSE_QUANT": True, "FUSED_REDUCE": split > 1}
        cases.append({"k": k, "n": n, "config": fused})
    lines = _build_gemv(cases, tmp_path)
    assert len(lines) == 2 * len(GEMV_WINNERS)
    for (k, n, split), unfused, (fused,) in zip(GEMV_WINNERS, lines[::2], lines[1::2], strict=True):
        where = f"K={k} N={n} SPLIT_K={split}"
        prepass, gemv = unfused[0], unfused[1]
        assert (prepass["kernel"], gemv["kernel"]) == Q4K_GEMV, where
        assert gemv["sass_sha256"] == GEMV_WINNER_SASS[(k, n, split)], f"{where}: _q4k_gemv_kernel's code changed"
        assert fused["kernel"] == Q4K_GEMV_FUSED, where
        assert fused["spill_bytes"] == 0, (where, fused)
        assert fused["atomics"] == (["atom.global.gpu.acq_rel.add.u32"] if split > 1 else []), (where, fused)
        # The pre-pass's two sums per sub-block, and the fused kernel's, over a 32-wide last axis.
        pre_sums = [r["along_axis"] for r in _float_sums(prepass) if r["shape"][-1] == 32]
        fused_sums = [r["along_axis"] for r in _float_sums(fused) if r["shape"][-1] == 32]
        assert len(pre_sums) == len(fused_sums) == 2, (where, pre_sums, fused_sums)
        expected = {"per_thread": 4, "lanes": 8, "warps": 1, "lowest_lanes": True}
        assert pre_sums == fused_sums == [expected, expected], (where, pre_sums, fused_sums)
        # The final sum over the K tile's sub-blocks: [1, BLOCK_N, G] along axis 2.
        (gemv_final,) = [r["layout"] for r in _float_sums(gemv) if r["shape"] == [1, 32, 8]]
        (fused_final,) = [r["layout"] for r in _float_sums(fused) if r["shape"] == [1, 32, 8]]
        assert fused_final == gemv_final, where


#: (K, N, BLOCK_K, BLOCK_N, num_warps, SPLIT_K, M) of GEMV tiles built with ``K_LANES`` (and, at
#: one row, without it).
K_LANES_TILES = [
    (4096, 14336, 512, 32, 4, 1, 1),
    (14336, 4096, 256, 128, 4, 8, 1),
    (4096, 4096, 1024, 64, 8, 1, 1),
    (4096, 4096, 512, 128, 8, 8, 2),
    (4096, 14336, 256, 64, 4, 8, 4),
]


#: Records the given bundle entries' launches of one JIT kernel, as ``--bundle-winners`` does.
_RECORD = """
import json, sys
sys.path.insert(0, "tests")
import sm90_build
from tritune.configs_db.values import strict_loads

bundle, path, jit_kernel = sys.argv[1:]
winners = strict_loads(open(bundle).read())["winners"]
entries = [(w["key"], w["config"]) for w in winners if w["kernel"] == "q4k_fp8_gemm" and w["config"]["path"] == path]
found = sm90_build.record_winners("q4k_fp8_gemm", entries[:2], jit_kernel)
print(json.dumps([len(f["entries"]) for f in found]))
"""


@pytest.mark.parametrize(("path", "jit_kernel"), [("gemv", Q4K_GEMV_FUSED), ("staged", "_staged_prepass_kernel")])
def test_recording_a_bundles_winners_sees_their_launches(path: str, jit_kernel: str) -> None:
    """The recording half of ``--bundle-winners`` in a process without the interpreter (as the
    script runs): two shipped H200 winners of ``path`` are recorded. Eager replay is off there (a
    replayed call would go around the interception and reach for a GPU), and a staged call's fp8
    GEMM, which has no meta kernel, ends the call after its pre-pass was recorded."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    root = Path(__file__).parents[1]
    bundle = root / "configs_db" / "bundles" / "nvidia-h200-sm90-132sm.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _RECORD, str(bundle), path, jit_kernel],
        env=env, capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert sum(json.loads(run.stdout.splitlines()[-1])) == 2, run.stdout


def test_gemv_k_lanes_reads_whole_rows_per_warp(tmp_path: Path) -> None:
    """With ``K_LANES`` one warp's load of code words reads whole K tiles of weight rows: 4 words
    (16 bytes) a thread and the lanes along K, so one instruction reads BLOCK_K / 2 consecutive
    bytes of each of 32 * 16 / BLOCK_K rows. Without it the 32 lanes run across 32 weight rows,
    16 bytes of each, and d and dmin are gathered per sub-block (2-byte loads, 32 rows an
    instruction): the uncoalesced reads Nsight Compute counted at the shipped M=1 winners. The
    K_LANES builds spill nothing and load no 2-byte d or dmin, at one row and at the most the
    space's register rule admits at two and four rows (64 product words a thread)."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    cases = []
    for k, n, block_k, block_n, warps, split, m in K_LANES_TILES:
        tile = {"path": "gemv", "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "SPLIT_K": split}
        for lanes in (False, True) if m == 1 else (True,):
            config = {**tile, "FUSE_QUANT": True, "FUSED_REDUCE": split > 1, "K_LANES": lanes}
            cases.append({"k": k, "n": n, "m": m, "config": config})
    lines = _build_gemv(cases, tmp_path)
    assert len(lines) == len(cases)
    for case, (launch,) in zip(cases, lines, strict=True):
        config = case["config"]
        where = f"K={case['k']} N={case['n']} {config}"
        assert launch["kernel"] == Q4K_GEMV_FUSED, where
        assert launch["spill_bytes"] == 0, (where, launch)
        words = config["BLOCK_K"] // 8
        codes = [load for load in launch["loads"] if load["type"] == "i32" and len(load["shape"]) > 2]
        assert codes, (where, launch["loads"])
        halves = [load for load in launch["loads"] if load["type"] == "f16"]
        for load in codes:
            assert load["per_thread"][-1] == 4, (where, load)
            if config["K_LANES"]:
                assert load["shape"] == [1, config["BLOCK_N"], words], (where, load)
                assert load["lanes"][-1] == min(32, words // 4), (where, load)
            else:
                assert load["shape"] == [1, config["BLOCK_N"], words // 4, 4], (where, load)
                assert load["lanes"][1] == 32, (where, load)
        assert bool(halves) is not config["K_LANES"], (where, halves)


def test_q4k_dequantization_converts_no_codes(tmp_path: Path) -> None:
    """The small-M Q4_K tiles (portable, and swapped folded fp8) make their float codes with bit
    operations: the int-to-float conversions (a quarter of the ALU rate on Hopper) in the main loop
    stay far below the weights each thread dequantizes per iteration, and nothing spills."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, variant) as sm90_build.py's script takes them.
    configs = [(16, 64, 256, 4, 3, "portable"), (16, 64, 256, 4, 4, True)]
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--sass", json.dumps(configs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for config, line in zip(configs, run.stdout.splitlines(), strict=True):
        result = json.loads(line)
        opcodes = result["loop_opcodes"]
        assert opcodes.get("HMMA", 0) + opcodes.get("QGMMA", 0) > 0, (config, "no MMA in the loop found", opcodes)
        conversions = sum(opcodes.get(op, 0) for op in ("I2F", "I2FP"))
        assert conversions <= result["weights_per_thread"] // 8, (config, opcodes)
        assert result["spill_bytes"] == 0, (config, result)


def test_q4k_int8_starting_tiles_use_wgmma_without_spilling(tmp_path: Path) -> None:
    """The int8 kernel's starting tiles on an H200 (``Q4KTuning.starting_configs`` at large M)
    compile to int8 wgmma (s32 accumulators), the swapped ones with the weight as the register A
    operand, none spilling and each within the shared memory the space estimates."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    from tritune.kernels.q4k.kernel import KERNEL
    from tritune.search_spaces.q4k_fp8_gemm import Int8Config, smem_bytes

    keys = [k for k in KERNEL.default_keys(H200) if k.fp8 and k.m_bucket == 4096 and k.k == 4096]
    starts = {c for key in keys for c in KERNEL.starting_configs(key, H200) if isinstance(c, Int8Config)}
    assert len(starts) >= 3, starts
    starts = sorted(starts, key=lambda c: (c.BLOCK_M, c.SWAP_AB))
    variants = [
        (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K, c.num_warps, c.num_stages, "int8-swap" if c.SWAP_AB else "int8")
        for c in starts
    ]
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(variants)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for config, line in zip(starts, run.stdout.splitlines(), strict=True):
        result = json.loads(line)
        # wgmma's N side: x's rows when swapped, the weight's otherwise (Triton 3.6 issues int8
        # wgmma at most 128 wide: a 256-row x tile takes two).
        n_side = config.BLOCK_M if config.SWAP_AB else config.BLOCK_N
        (mma,) = result["mma"]
        shape = re.fullmatch(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.s32\.s8\.s8", mma)
        assert shape is not None and n_side % int(shape.group(1)) == 0, (config, result)
        assert result["wgmma_a"] == (["registers"] if config.SWAP_AB else ["shared"]), (config, result)
        assert result["spill_bytes"] == 0, (config, result)
        assert result["shared"] <= smem_bytes(config), (config, result)

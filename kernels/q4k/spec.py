"""The kernel spec of ``q4k_fp8_gemm``: keys, defaults, launch, reference and checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import triton
from torch._library.triton import set_wrap_triton_enabled

from tritune.search_spaces import q4k_fp8_gemm as q4k_space
from tritune.search_spaces.base import ConfigError
from tritune.search_spaces.q4k_fp8_gemm import Q4KConfig

from ..device import DeviceInfo, target_supports
from ..spec import KernelSpec, Problem, TuningKey, pow2_bucket
from ._triton_q4k import (
    _q4k_dequant_fp8_kernel,
    _q4k_gemm_fp8_fold_kernel,
    _q4k_gemm_fp8_fold_swap_kernel,
    _q4k_gemm_fp8_kernel,
    _q4k_gemm_portable_kernel,
    _q4k_gemv_kernel,
    _quantize_rows_fp8_kernel,
    _quantize_rows_gemv_kernel,
    _splitk_reduce_kernel,
    _staged_prepass_kernel,
)
from .launch import run_q4k_gemm
from .reference import q4k_linear_reference, sqnr_db
from .weight import Q4KWeight

#: SQNR (dB) each path must reach against the exactly dequantized float32 reference.
#: fp8: e4m3 activations (about 31 dB on Gaussian data; 28.5 dB with SCALE_FOLD, whose weights are
#: e4m3 too); staged: SCALE_FOLD's e4m3 weights and activations; gemv: int8 activations with one
#: scale per 32 values against exact weights (about 43 dB on Gaussian data); portable: bf16/fp16
#: rounding only.
MIN_SQNR_DB = {"fp8": 25.0, "staged": 25.0, "gemv": 30.0, "portable": 40.0}

_GPU_SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096))  # (K, N)
_GPU_M_BUCKETS = (1, 16, 64, 256, 1024, 4096, 8192)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Q4KKey(TuningKey):
    dtype: str
    m_bucket: int
    n: int
    k: int

    BUCKETS: ClassVar[tuple[str, ...]] = ("m_bucket",)


def check_path(out: torch.Tensor, expected: torch.Tensor, path: str) -> str | None:
    """``None`` if ``out`` reaches ``path``'s SQNR floor against ``expected``, else why not."""
    if torch.isnan(out).any():
        return "output contains NaN"
    sqnr = sqnr_db(out, expected)
    floor = MIN_SQNR_DB[path]
    if not sqnr >= floor:
        return f"SQNR {sqnr:.1f} dB is below the {path} path's {floor:.0f} dB"
    return None


class Q4KSpec(KernelSpec[Q4KConfig, Q4KKey]):
    name = "q4k_fp8_gemm"
    jit_kernels = (
        _quantize_rows_fp8_kernel,
        _q4k_gemm_portable_kernel,
        _q4k_gemm_fp8_kernel,
        _q4k_gemm_fp8_fold_kernel,
        _q4k_gemm_fp8_fold_swap_kernel,
        _staged_prepass_kernel,
        _q4k_dequant_fp8_kernel,
        _quantize_rows_gemv_kernel,
        _q4k_gemv_kernel,
        _splitk_reduce_kernel,
    )
    # Small-M trials are graph-timed (make_problem's launch_bound), large-M ones eager.
    protocol = 1
    key_type = Q4KKey
    space = q4k_space.SPACE

    # ---- the runtime half --------------------------------------------------------------

    def facts(self, x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None = None) -> tuple[Any, ...]:
        """``(M, N, K, dtype name)`` of a call with ``x`` already flattened to ``[M, K]``."""
        n, k = weight.shape
        return (x.shape[0], n, k, str(x.dtype).removeprefix("torch."))

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> Q4KKey:
        m, n, k, dtype = facts
        return Q4KKey(
            arch=device.arch, sm_count=device.sm_count, dtype=dtype, m_bucket=pow2_bucket(m, minimum=1), n=n, k=k
        )

    def default_config(self, key: Q4KKey) -> Q4KConfig:
        """Portable defaults by M (chosen on Llama-3-8B shapes, bf16; docs/perf/HISTORY.md).

        Up to M=64: 64-wide N tiles, split along K until about 1.5 programs per SM (one pass over
        the weight; 256-deep K tiles for decode). Beyond: 128x128x64 tiles, 8 warps.
        """
        if key.arch == "cpu-interpreter":
            block_m = 16 if key.m_bucket <= 16 else 32
            return Q4KConfig(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
        if key.m_bucket <= q4k_space.SMALL_M:
            decode = key.m_bucket <= 16
            block_k = 256 if decode else 128
            tiles = triton.cdiv(key.n, 64) * triton.cdiv(key.m_bucket, 16 if decode else key.m_bucket)
            split = 1
            while split < 8 and 2 * tiles * split < 3 * key.sm_count and (key.k // block_k) % (2 * split) == 0:
                split *= 2
            return Q4KConfig(
                BLOCK_M=16 if decode else key.m_bucket,
                BLOCK_N=64,
                BLOCK_K=block_k,
                GROUP_M=1,
                num_warps=4,
                num_stages=3 if decode else 4,
                SPLIT_K=split,
            )
        # GROUP_M only reorders programs when more than one M tile exists (the space prunes the
        # duplicate launch otherwise).
        group_m = 8 if key.m_bucket > 128 else 1
        return Q4KConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=group_m, num_warps=8, num_stages=3)

    def starting_configs(self, key: Q4KKey, device: DeviceInfo) -> list[Q4KConfig]:
        """Swapped folded fp8 tiles that compile to register-A wgmma with dequantization overlapping
        the MMA (sm_90 ptxas builds, ``tests/sm90_build.py``), for the tuner to measure first; at
        large M also staged-path chunks (where the key admits them: bf16, N and K multiples of 16).

        Large M: 256-column x tiles (wgmma's widest N, each weight dequantized once per 256 rows
        of x), then 128x256. Small M: 16-row x tiles with deep K tiles, split along K toward
        about one program per SM; for buckets of 32 and 64 rows also one M tile of the whole
        bucket with 128 weight rows, split 2-8 ways along K. Only on SM90+ (wgmma). Before them, at
        decode-sized M on any GPU, GEMV tiles (:meth:`_gemv_starts`). Only those the space admits
        at ``key``.
        """
        if device.is_interpreter:
            return []
        starts = self._gemv_starts(key, device)
        if not target_supports(device, (9, 0)):
            return self._admitted(starts, key, device)
        fold = {"path": "fp8", "SCALE_FOLD": True, "SWAP_AB": True}
        if key.m_bucket > q4k_space.SMALL_M:
            group_m = 8 if key.m_bucket > 256 else 1
            starts += [
                {**fold, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": 8, "num_stages": st, "GROUP_M": group_m}
                for m, n, k, st in ((256, 128, 64, 3), (256, 128, 128, 3), (256, 128, 64, 4), (128, 256, 64, 3))
            ]
            # The staged path (bf16 keys): large chunks amortise the GEMM's launch; the
            # dequantization tile matters little.
            for bn, bk, warps, chunk in ((32, 256, 4, 4096), (128, 128, 8, 4096), (64, 128, 4, 2048)):
                starts.append({"path": "staged", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "CHUNK_N": chunk})
        else:
            tiles = triton.cdiv(key.n, 64)
            for split in (1, 2, 4, 8):
                if split == 1 or tiles * split <= 2 * key.sm_count:
                    starts.append({**fold, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4,
                                   "num_stages": 4, "GROUP_M": 1, "SPLIT_K": split})  # fmt: skip
            starts.append({**fold, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 8, "num_stages": 4,
                           "GROUP_M": 1})  # fmt: skip
            if key.m_bucket > 16:
                # Prefill-sized small M: one M tile of the whole bucket, 128 weight rows, split along K.
                for split in (2, 4, 8):
                    starts.append({**fold, "BLOCK_M": key.m_bucket, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4,
                                   "num_stages": 3, "GROUP_M": 1, "SPLIT_K": split})  # fmt: skip
        return self._admitted(starts, key, device)

    @staticmethod
    def _gemv_starts(key: Q4KKey, device: DeviceInfo) -> list[dict[str, Any]]:
        """One row of x: GEMV tiles of 32-64 weight rows by 256-1024 of K, split along K until about
        four programs per SM."""
        if key.m_bucket > q4k_space.GEMV_MAX_M:
            return []
        starts: list[dict[str, Any]] = []
        # Narrow, shallow tiles first, then deeper K tiles: a program's loads of one tile are in
        # flight while it works on the previous one, so deeper tiles keep more bytes in flight.
        for block_n, block_k, warps in ((32, 256, 4), (32, 512, 4), (64, 512, 4), (32, 1024, 4), (64, 1024, 8)):
            tiles = triton.cdiv(key.n, block_n)
            for split in (2, 1, 4):
                if split == 1 or tiles * split <= 4 * device.sm_count:
                    starts.append({"path": "gemv", "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps,
                                   "SPLIT_K": split})  # fmt: skip
        return starts

    def _admitted(self, starts: list[dict[str, Any]], key: Q4KKey, device: DeviceInfo) -> list[Q4KConfig]:
        """The starting configs the space admits at ``key`` (the others dropped, not raised)."""
        limits = self.limits(device)
        configs = [self.space.parse(values) for values in starts]
        return [c for c in configs if self.space.infeasible_reason(c, key, limits) is None]

    def pinned_config(self, values: Mapping[str, Any]) -> Q4KConfig:
        """A ``use_config`` dict; fields left out take the defaults of the path it names.

        A field the pinned path does not read, set to anything but its default, is refused: the
        space's ``parse`` would reset it, and the pin would silently run something else than asked
        (``{"SCALE_FOLD": True}`` without ``"path": "fp8"`` is the portable kernel).
        """
        base = Q4KConfig()
        if values.get("path") == "fp8":
            base = dataclasses.replace(base, path="fp8", BLOCK_K=128)
        elif values.get("path") == "staged":
            base = dataclasses.replace(base, path="staged", BLOCK_N=32, BLOCK_K=256)
        config = self.space.parse(values, base=base)
        read = q4k_space.PATH_FIELDS[config.path]
        default = Q4KConfig()
        unread = sorted(
            name for name, value in values.items()
            if name != "path" and name not in read and value != getattr(default, name)
        )  # fmt: skip
        if unread:
            raise ConfigError(
                f"{self.name}: the {config.path} path does not read {', '.join(unread)}; "
                f"name the path that does (the {config.path} path reads {', '.join(read)})"
            )
        return config

    def serveable(self, config: Q4KConfig, device: DeviceInfo, facts: tuple[Any, ...]) -> Q4KConfig:
        """The fp8 path needs e4m3 tensor cores (SM89+, every built arch) or the interpreter; the
        staged path needs row-wise scaled fp8 GEMMs (SM90+ or the interpreter's CPU ``_scaled_mm``),
        a bf16 x and N, K multiples of 16. Otherwise the key's portable default serves.

        A pinned SPLIT_K that does not divide K's tiles is halved until it does.
        """
        _, n, k, dtype = facts
        if config.path == "fp8" and not (device.is_interpreter or target_supports(device, (8, 9))):
            config = self.default_config(self.key_for(device, facts))
        if config.path == "staged" and not (
            (device.is_interpreter or target_supports(device, (9, 0)))
            and dtype == "bfloat16"
            and n % 16 == 0
            and k % 16 == 0
        ):
            config = self.default_config(self.key_for(device, facts))
        tiles = k // config.BLOCK_K
        split = config.SPLIT_K
        while split > 1 and tiles % split:
            split //= 2
        return config if split == config.SPLIT_K else dataclasses.replace(config, SPLIT_K=split)

    def launch(
        self,
        config: Q4KConfig,
        x: torch.Tensor,
        weight: Q4KWeight,
        bias: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        n = weight.shape[0]
        if out is None:
            out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        # Bare kernels, as the op's body gets them in eager mode (the tuner times this launch).
        with set_wrap_triton_enabled(False):
            run_q4k_gemm(config, x2d, *weight.tensors(), bias, out.view(-1, n))
        return out

    # ---- the tuning half ---------------------------------------------------------------

    def reference(self, x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return q4k_linear_reference(x, weight, bias)

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        """SQNR against the exact-weight reference at the floor of the config's path.

        Without a config the loosest floor (fp8) applies.
        """
        return check_path(out, expected, config.path if config is not None else "fp8")

    def make_problem(self, key: Q4KKey, device: torch.device, seed: int) -> Problem:
        generator = torch.Generator(device=device).manual_seed(seed)
        m = key.m_bucket
        w = torch.randn((key.n, key.k), generator=generator, device=device) * 0.02
        weight = Q4KWeight.quantize(w)
        x = torch.randn((m, key.k), generator=generator, device=device).to(_DTYPES[key.dtype])
        x_bytes = x.numel() * x.element_size()
        return Problem(
            args=(x, weight),
            flops=2.0 * m * key.n * key.k,
            bytes_moved=float(weight.nbytes + x_bytes + m * key.n * x.element_size()),
            flush_l2=True,
            launch_bound=m <= q4k_space.SMALL_M,
        )

    def check_problem(self, key: Q4KKey, device: torch.device, seed: int) -> Problem:
        """The key's problem with M capped at 256 rows: the fp32 reference of an 8192-row product
        costs seconds per key, and the tuner still cross-checks the full size against the
        portable output."""
        return self.make_problem(dataclasses.replace(key, m_bucket=min(key.m_bucket, 256)), device, seed)

    def default_keys(self, device: DeviceInfo, **options: Any) -> list[Q4KKey]:
        """GPU: the Llama-3-8B MLP and attention shapes over M buckets; interpreter: one tiny key.

        Options: ``m`` (iterable of M values) and ``dtype`` ("bfloat16" or "float16") narrow them.
        """
        dtype = str(options.get("dtype") or "bfloat16")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)}")
        if device.is_interpreter:
            shapes: Iterable[tuple[int, int]] = ((256, 64),)
            buckets: Iterable[int] = (16,)
        else:
            shapes, buckets = _GPU_SHAPES, _GPU_M_BUCKETS
        if options.get("m"):
            buckets = sorted({pow2_bucket(int(m), minimum=1) for m in options["m"]})
        return [
            Q4KKey(arch=device.arch, sm_count=device.sm_count, dtype=dtype, m_bucket=mb, n=n, k=k)
            for (k, n) in shapes
            for mb in buckets
        ]


SPEC = Q4KSpec()

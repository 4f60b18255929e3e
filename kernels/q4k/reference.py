"""The pure-PyTorch reference of ``q4k_linear``, the error measures its checks use and each path's floor."""

from __future__ import annotations

import math

import torch

from .weight import Q4KWeight

#: ggml's accuracy bound for a Q4_K mul_mat: the normalised mean squared error
#: ``sum((out - ref)**2) / sum(ref**2)`` against the exactly dequantized product (the bound
#: llama.cpp's test-backend-ops uses for Q4_K), i.e. an SQNR of at least 33.0 dB.
GGML_MAX_NMSE = 5e-4
#: The paths that meet :data:`GGML_MAX_NMSE` (on Gaussian and model-like activations alike) and so
#: serve without the ``TRITUNE_Q4K_FP8`` opt-in.
ACCURATE_PATHS = frozenset({"portable", "gemv", "dequant", "tma"})

#: SQNR (dB) each path must reach against the exactly dequantized float32 reference; the accurate
#: paths must also meet :data:`GGML_MAX_NMSE`. fp8: e4m3 activations (about 31 dB on Gaussian data;
#: 28.5 dB with SCALE_FOLD, whose weights are e4m3 too); staged: SCALE_FOLD's e4m3 weights and
#: activations; int8: int8 weights and activations, one scale per row each (37-39 dB on Gaussian
#: activations, 28.5 dB with outlier channels); gemv:
#: int8 activations with one scale per 32 values against exact weights (about 43 dB); portable,
#: dequant and tma: bf16/fp16 rounding of the weights only (the tma path's ``PACKED_DEQUANT``
#: rounds each group's scale and min first: about 45 dB in bf16, :func:`packed_dequantized`).
MIN_SQNR_DB = {"fp8": 25.0, "staged": 25.0, "int8": 25.0, "gemv": 33.0, "portable": 40.0, "dequant": 40.0, "tma": 40.0}


def q4k_linear_reference(x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 ``x @ W^T (+ bias)`` with W dequantized exactly as gguf does."""
    w = weight.dequantize()
    out = torch.matmul(x.float(), w.t())
    if bias is not None:
        out = out + bias.float()
    return out


def packed_dequantized(weight: Q4KWeight, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weights (in ``dtype``) that the tma path's ``PACKED_DEQUANT`` computes: each
    32-code group's scale ``d*sc`` and min ``dmin*m`` rounded to ``dtype``, then ``q*scale - min``
    rounded once (a fused multiply-add; exact in float64 before that rounding)."""
    n, k = weight.shape
    codes = torch.stack((weight.qs & 0xF, weight.qs >> 4), dim=-1).reshape(n, k // 32, 32).double()
    d, dmin = weight.super_scales.double().unbind(-1)
    scale = (d.repeat_interleave(8, dim=1) * weight.scales.double()).float().to(dtype).double()
    offset = (dmin.repeat_interleave(8, dim=1) * weight.mins.double()).float().to(dtype).double()
    return _round_once((codes * scale[..., None] - offset[..., None]).reshape(n, k), dtype)


def _round_once(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``exact`` rounded once to the 16-bit ``dtype`` (to nearest, ties to even).

    torch converts float64 to a 16-bit float through float32, which can round twice. Rounding to
    float32 to odd first (toward zero, then the last bit set if anything was cut) keeps the one
    rounding to ``dtype`` exact: float32 carries more than two extra bits.
    """
    nearest = exact.float()
    overshot = nearest.double().abs() > exact.abs()
    toward_zero = torch.where(overshot, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    inexact = toward_zero.double() != exact
    odd = (toward_zero.view(torch.int32) | inexact.to(torch.int32)).view(torch.float32)
    return odd.to(dtype)


def sqnr_db(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``out`` against ``expected`` in dB (NaN if any NaN)."""
    out64, ref64 = out.double(), expected.double()
    if not torch.isfinite(out64).all():
        return math.nan
    noise = (out64 - ref64).square().sum().item()
    signal = ref64.square().sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def nmse(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Normalised mean squared error ``sum((out - expected)**2) / sum(expected**2)`` in float64
    (ggml's measure; NaN if ``out`` is not finite)."""
    out64, ref64 = out.double(), expected.double()
    if not torch.isfinite(out64).all():
        return math.nan
    noise = (out64 - ref64).square().sum().item()
    signal = ref64.square().sum().item()
    return noise / signal if signal > 0 else (0.0 if noise == 0.0 else math.inf)


def check_against_portable(out: torch.Tensor, portable: torch.Tensor, path: str) -> str | None:
    """``None`` if ``out`` of ``path`` is as close to the portable path's output as its accuracy
    allows: ggml's NMSE bound for an accurate path, its SQNR floor less 1 dB for a lossy one."""
    if torch.isnan(out).any():
        return "output contains NaN"
    if path in ACCURATE_PATHS:
        error = nmse(out, portable)
        if not error <= GGML_MAX_NMSE:
            return f"NMSE {error:.2e} against the portable output exceeds ggml's Q4_K bound {GGML_MAX_NMSE:g}"
        return None
    sqnr = sqnr_db(out, portable)
    floor = MIN_SQNR_DB[path] - 1.0
    if not sqnr >= floor:
        return f"SQNR {sqnr:.1f} dB against the portable output is below the {path} path's {floor:.0f} dB"
    return None


def check_path(out: torch.Tensor, expected: torch.Tensor, path: str) -> str | None:
    """``None`` if ``out`` reaches ``path``'s SQNR floor against ``expected`` (and, for an accurate
    path, ggml's NMSE bound), else why not."""
    if torch.isnan(out).any():
        return "output contains NaN"
    sqnr = sqnr_db(out, expected)
    floor = MIN_SQNR_DB[path]
    if not sqnr >= floor:
        return f"SQNR {sqnr:.1f} dB is below the {path} path's {floor:.0f} dB"
    if path in ACCURATE_PATHS:
        error = nmse(out, expected)
        if not error <= GGML_MAX_NMSE:
            return f"NMSE {error:.2e} exceeds ggml's Q4_K bound {GGML_MAX_NMSE:g}"
    return None

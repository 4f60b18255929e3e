"""The pure-PyTorch reference of ``q4k_linear``, the error measure its checks use and each path's floor."""

from __future__ import annotations

import math

import torch

from .weight import Q4KWeight

#: SQNR (dB) each path must reach against the exactly dequantized float32 reference.
#: fp8: e4m3 activations (about 31 dB on Gaussian data; 28.5 dB with SCALE_FOLD, whose weights are
#: e4m3 too); staged: SCALE_FOLD's e4m3 weights and activations; gemv: int8 activations with one
#: scale per 32 values against exact weights (about 43 dB on Gaussian data); portable: bf16/fp16
#: rounding only.
MIN_SQNR_DB = {"fp8": 25.0, "staged": 25.0, "gemv": 30.0, "portable": 40.0}


def q4k_linear_reference(x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 ``x @ W^T (+ bias)`` with W dequantized exactly as gguf does."""
    w = weight.dequantize()
    out = torch.matmul(x.float(), w.t())
    if bias is not None:
        out = out + bias.float()
    return out


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


def check_path(out: torch.Tensor, expected: torch.Tensor, path: str) -> str | None:
    """``None`` if ``out`` reaches ``path``'s SQNR floor against ``expected``, else why not."""
    if torch.isnan(out).any():
        return "output contains NaN"
    sqnr = sqnr_db(out, expected)
    floor = MIN_SQNR_DB[path]
    if not sqnr >= floor:
        return f"SQNR {sqnr:.1f} dB is below the {path} path's {floor:.0f} dB"
    return None

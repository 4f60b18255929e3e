"""The pure-PyTorch reference of ``q4k_linear`` and the error measure its checks use."""

from __future__ import annotations

import math

import torch

from .weight import Q4KWeight


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

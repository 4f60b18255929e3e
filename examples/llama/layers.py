"""The decoder's building blocks around tritune's kernels: RMSNorm, RoPE and fused Q4_K projections.

Norms and rotary embeddings are a few element-wise PyTorch ops in float32; the heavy work (every
linear layer, every attention) is in the kernels. The residual stream stays float32, as llama.cpp
keeps it, and activations enter the kernels in the model's dtype (bf16).
"""

from __future__ import annotations

import torch

from tritune.kernels import Q4KWeight

from .config import LlamaConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in float32 and returned in ``dtype``."""
    x = x.float()
    return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight).to(dtype)


def fuse_rows(*weights: Q4KWeight) -> Q4KWeight:
    """One Q4_K weight whose rows are those of ``weights`` in order (e.g. Q, K and V).

    Q4_K blocks run along a row, so stacking rows is exact: one ``q4k_linear`` launch then does the
    work of several, and its output splits back into theirs.
    """
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"weights: expected one input width K, got shapes {[w.shape for w in weights]}")
    parts = [w.tensors() for w in weights]
    return Q4KWeight(*(torch.cat(field, dim=0) for field in zip(*parts, strict=True)))


class Rope:
    """Rotary position embeddings as llama.cpp applies them to Llama: adjacent pairs rotate.

    Pair ``i`` of each head rotates by ``position * theta**(-2i / D) / factor_i / linear_factor``,
    ``factor_i`` from the file's ``rope_freqs.weight`` (Llama-3 scaling) or 1. The cos/sin tables
    cover ``positions`` positions, are computed once in float64 and kept in float32; a call gathers
    its rows with a device index, so it needs no host value and can be captured in a CUDA graph.
    """

    def __init__(
        self, config: LlamaConfig, freq_factors: torch.Tensor | None, positions: int, device: torch.device
    ) -> None:
        dim = config.head_dim
        inv_freq = config.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(device=device, dtype=torch.float64)
        angles = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv_freq
        angles = angles / config.rope_linear_factor
        self.cos = angles.cos().float()  # [positions, D/2]
        self.sin = angles.sin().float()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` for the int64 ``positions [T]``; same dtype as ``x``."""
        cos = self.cos.index_select(0, positions)[:, None]  # [T, 1, D/2]
        sin = self.sin.index_select(0, positions)[:, None]
        pairs = x.float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)

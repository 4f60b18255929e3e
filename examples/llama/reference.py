"""A plain PyTorch Llama forward over the same weights, for checking the kernel-backed model.

Written independently of ``model.py``: unfused projections (each Q4_K weight dequantized exactly
with ``Q4KWeight.dequantize()``), RoPE as complex rotations of adjacent pairs (Meta's reference
formulation, which is llama.cpp's for Llama), GQA by repeating K/V heads and PyTorch's
``scaled_dot_product_attention`` with a causal mask over the whole sequence.

``dtype=torch.float64`` is the ground truth. ``dtype=torch.bfloat16`` is how PyTorch itself runs
the model in bf16 (Hugging Face's recipe: bf16 weights, activations and residual stream; norms
and rotations in float32): the yardstick for what bf16 inference costs in accuracy.

It runs on the CPU unless ``device`` says otherwise. Each weight is dequantized where it is
used, one at a time, so memory holds the Q4_K weights and one dense matrix: on a GPU,
Llama-3-8B's float64 reference of a short prompt takes seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tritune.kernels import Q4KWeight

from .config import LlamaConfig
from .loader import LlamaWeights


def _matrix(weight: Q4KWeight | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    values = weight.dequantize() if isinstance(weight, Q4KWeight) else weight
    return values.to(device=device, dtype=dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(compute)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(compute)).to(x.dtype)


def _rotations(config: LlamaConfig, weights: LlamaWeights, length: int, device: torch.device) -> torch.Tensor:
    """complex128 ``[length, D/2]``: ``exp(i * position * frequency)`` per position and pair."""
    dim = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    if weights.rope_freq_factors is not None:
        freqs = freqs / weights.rope_freq_factors.to(device).double()
    positions = torch.arange(length, dtype=torch.float64, device=device) / config.rope_linear_factor
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [L, H, D]``'s adjacent pairs by ``rotations [L, D/2]``."""
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotations[:, None]).flatten(-2).to(x.dtype)


@torch.no_grad()
def reference_logits(
    config: LlamaConfig,
    weights: LlamaWeights,
    tokens: Sequence[int],
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` (in ``dtype``, on ``device``) of a causal forward over ``tokens``."""
    device = torch.device(device)
    length = len(tokens)
    ids = torch.as_tensor(tokens, dtype=torch.int64, device=device)
    rotations = _rotations(config, weights, length, device)
    h = F.embedding(ids, weights.token_embd.to(device)).to(dtype)
    for w in weights.layers:
        x = _rms_norm(h, w.attn_norm.to(device), config.rms_eps)
        q = (x @ _matrix(w.attn_q, dtype, device).T).view(length, config.heads, config.head_dim)
        k = (x @ _matrix(w.attn_k, dtype, device).T).view(length, config.kv_heads, config.head_dim)
        v = (x @ _matrix(w.attn_v, dtype, device).T).view(length, config.kv_heads, config.head_dim)
        q, k = _rotate(q, rotations), _rotate(k, rotations)
        group = config.heads // config.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        h = h + attn.transpose(0, 1).reshape(length, config.q_width) @ _matrix(w.attn_output, dtype, device).T
        x = _rms_norm(h, w.ffn_norm.to(device), config.rms_eps)
        gate, up = x @ _matrix(w.ffn_gate, dtype, device).T, x @ _matrix(w.ffn_up, dtype, device).T
        h = h + (F.silu(gate) * up) @ _matrix(w.ffn_down, dtype, device).T
    x = _rms_norm(h, weights.output_norm.to(device), config.rms_eps)
    return x @ _matrix(weights.output, dtype, device).T


#: Top-1 agreement with the float64 reference that a model's logits always pass: random weights
#: leave near ties, where any rounding may pick the other token.
MIN_TOP1 = 0.9


def top1_floor(bf16_top1: float, rows: int) -> float:
    """The least top-1 agreement with the float64 reference a model must reach: :data:`MIN_TOP1`,
    or PyTorch's own bf16 forward's agreement on the same rows less three binomial standard errors,
    whichever is lower.

    On random weights PyTorch's bf16 forward itself agrees on only about 93% of the rows of 128,
    and a model as accurate as it can land a few rows under 0.9 by chance; three standard errors
    keep a model that is truly less accurate from passing.
    """
    spread = (bf16_top1 * (1.0 - bf16_top1) / max(rows, 1)) ** 0.5
    return min(MIN_TOP1, bf16_top1 - 3.0 * spread)

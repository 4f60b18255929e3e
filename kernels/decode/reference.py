"""Pure-PyTorch reference of decode attention, one sequence at a time, in fp64 (or fp32).

Used by the tests, the tuner's correctness gate and the benchmarks. Each sequence's cache is
sliced to its ``kv_len`` before anything is computed, so whatever lies past it (garbage, NaN)
cannot reach the result. The semantics are the kernel's contract:

- ``kv_len[b]`` (clamped to ``[0, Lmax]``) valid keys per sequence;
- the ``Lq`` new tokens are causal among themselves: token ``i`` sits at position
  ``kv_len - Lq + i`` and sees the keys at positions ``<=`` its own;
- a query row that sees no key returns zeros.
"""

from __future__ import annotations

import math

import torch

#: (atol, rtol) of a decode output against this reference, relative to the output's scale.
#: bf16/fp16 rounding of P before the second MMA and of the output dominate; NaN never passes.
TOLERANCES = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-4, 1e-4)}


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over the first ``kv_len[b]`` keys of ``[B, Hkv, Lmax, D]`` caches."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    batch, q_heads, lq, head_dim = q.shape
    kv_heads, lmax = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    lengths = [min(max(int(n), 0), lmax) for n in kv_len.tolist()]
    out = torch.zeros(batch, kv_heads, group * lq, head_dim, dtype=dtype, device=q.device)
    # The new tokens of one GQA group share their KV head: rows are (query head, token) pairs.
    qg = q.reshape(batch, kv_heads, group * lq, head_dim)
    token = torch.arange(group * lq, device=q.device) % lq
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k = k_cache[b, :, :n].to(dtype)  # [Hkv, n, D]
        v = v_cache[b, :, :n].to(dtype)  # [Hkv, n, D]
        scores = (qg[b].to(dtype) @ k.transpose(-1, -2)) * scale  # [Hkv, rows, n]
        position = n - lq + token  # [rows]
        visible = torch.arange(n, device=q.device)[None, :] <= position[:, None]  # [rows, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.amax(dim=-1, keepdim=True)
        # A row without any visible key has top = -inf; shift it by 0 so its weights are exactly 0.
        weights = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
        total = weights.sum(dim=-1, keepdim=True)
        out[b] = (weights @ v) / torch.where(total > 0, total, torch.ones_like(total))
    return out.reshape(batch, q_heads, lq, head_dim)


def compare(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """``None`` if ``out`` matches ``expected`` within ``dtype``'s tolerance, else why not.

    The absolute part scales with the largest reference value (outputs are convex combinations of
    V rows, so their errors follow V's scale, not each element's); NaN or inf never passes.
    """
    if out.shape != expected.shape:
        return f"shape {tuple(out.shape)} differs from the reference's {tuple(expected.shape)}"
    got = out.to(torch.float64)
    want = expected.to(torch.float64)
    bad = ~torch.isfinite(got)
    if bool(bad.any()):
        return f"{int(bad.sum())} non-finite output values"
    atol, rtol = TOLERANCES[dtype]
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-3)
    err = (got - want).abs()
    limit = atol * scale + rtol * want.abs()
    if bool((err > limit).any()):
        worst = int(torch.argmax(err - limit))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
        return (
            f"max error {float(err.max()):.3g} (scale {scale:.3g}, atol {atol:g}, rtol {rtol:g}); "
            f"worst at {index}: got {float(got[index]):.6g}, expected {float(want[index]):.6g}"
        )
    return None

"""Numerics the attention references share: the masked softmax, and the check against a reference.

Every family's contract gives a query row that sees no key a zero output; :func:`masked_attention`
is that softmax, used by each ``reference.py``. :func:`compare` is the tolerance check of decode and
varlen outputs against their fp64 references (tests, the tuner's gate and the benchmarks).
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "compare", "masked_attention"]

#: (atol, rtol) of an attention output against its fp64 reference, relative to the output's scale.
#: bf16/fp16 rounding of P before the second MMA and of the output dominate; NaN never passes.
TOLERANCES = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-4, 1e-4)}


def masked_attention(scores: torch.Tensor, visible: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``softmax(scores)`` over the ``visible`` keys, times ``values``; rows that see no key give zeros.

    ``scores [..., rows, n]`` (already scaled), ``visible`` broadcastable to it, ``values [..., n, D]``.
    """
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    # A row without any visible key has top = -inf; shift it by 0 so its weights are exactly 0.
    weights = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    total = weights.sum(dim=-1, keepdim=True)
    return (weights @ values) / torch.where(total > 0, total, torch.ones_like(total))


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

"""Pure-PyTorch reference of varlen attention: one segment at a time, dense masks, fp64 (or fp32).

Used by the tests, the tuner's correctness gate and the benchmarks. Each segment's keys are
gathered from its store column by position before anything is computed, so whatever lies outside
them (rows past ``kv_end``, ring slots already overwritten) cannot reach the result. The
semantics are the kernel's contract:

- segment ``(q_start, q_len, col, kv_end)`` owns query rows ``q_start .. q_start + q_len - 1``;
  its query ``j`` sits at position ``kv_end - q_len + j``;
- its sequence holds positions ``0 .. kv_end - 1``, position ``p`` at store row ``p`` (flat) or
  ``p % rows`` (ring, where only positions ``>= kv_end - rows`` still exist);
- causal: a query sees the keys at positions up to its own; otherwise every key;
  ``window=W``: also only the keys at positions ``> its own - W``;
- a query row that sees no key, and a row no segment covers, is zero.
"""

from __future__ import annotations

import math

import torch

#: (atol, rtol) of an output against this reference, relative to the output's scale.
#: bf16/fp16 rounding of P before the second MMA and of the output dominate; NaN never passes.
TOLERANCES = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-4, 1e-4)}
#: Score elements computed at once: bounds the reference's memory at long contexts.
_CHUNK_ELEMENTS = 1 << 26


def sequence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention of one sequence's queries ``q [L, Hq, D]`` over its keys ``k, v [n, Hkv, D]``.

    ``q_positions [L]`` and ``k_positions [n]`` are the absolute positions that causality and
    the window compare. Returns ``[L, Hq, D]`` in ``dtype``.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    length, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(length, q_heads, head_dim, dtype=dtype, device=q.device)
    if length == 0 or k.shape[0] == 0:
        return out
    # Query heads of one GQA group share their K/V head: [Hkv, group, L, D] against [Hkv, 1, D, n].
    qg = q.to(dtype).permute(1, 0, 2).reshape(kv_heads, group, length, head_dim)
    kt = k.to(dtype).permute(1, 2, 0)[:, None]
    vg = v.to(dtype).permute(1, 0, 2)[:, None]
    step = max(1, _CHUNK_ELEMENTS // max(1, q_heads * k.shape[0]))
    for start in range(0, length, step):
        rows = slice(start, min(length, start + step))
        qp = q_positions[rows, None].to(torch.int64)
        kp = k_positions[None, :].to(torch.int64)
        visible = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=q.device)
        if causal:
            visible &= kp <= qp
        if window is not None:
            visible &= kp > qp - window
        scores = (qg[:, :, rows] @ kt) * scale  # [Hkv, group, rows, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.amax(dim=-1, keepdim=True)
        # A row without any visible key has top = -inf; shift it by 0 so its weights are exactly 0.
        weights = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
        total = weights.sum(dim=-1, keepdim=True)
        part = (weights @ vg) / torch.where(total > 0, total, torch.ones_like(total))
        out[rows] = part.reshape(q_heads, -1, head_dim).permute(1, 0, 2)
    return out


def segment_keys(
    k_store: torch.Tensor, v_store: torch.Tensor, col: int, kv_end: int, *, ring: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys, values and positions of one sequence that the store still holds."""
    rows = k_store.shape[0]
    first = max(0, kv_end - rows) if ring else 0
    end = kv_end if ring else min(kv_end, rows)
    positions = torch.arange(first, max(end, first), device=k_store.device)
    index = positions % rows if ring else positions
    return k_store[index, col], v_store[index, col], positions


def varlen_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    ring: bool = False,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``varlen_attention``'s result as a loop of :func:`sequence_reference` over the segments, in ``dtype``."""
    result = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for q_start, q_len, col, kv_end in seq_info.tolist():
        if q_len <= 0:
            continue
        k, v, positions = segment_keys(k_store, v_store, col, kv_end, ring=ring)
        q_positions = torch.arange(kv_end - q_len, kv_end, device=q.device)
        result[q_start : q_start + q_len] = sequence_reference(
            q[q_start : q_start + q_len], k, v, q_positions, positions,
            causal=causal, window=window, softmax_scale=softmax_scale, dtype=dtype,
        )  # fmt: skip
    return result


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

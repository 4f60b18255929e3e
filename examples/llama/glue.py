"""The element-wise work between a block's kernels: residual adds, RMSNorm, RoPE and SwiGLU.

Two implementations of one small interface, so that :meth:`LlamaModel.forward` reads the same for
both:

- :class:`TorchGlue`: PyTorch ops in float32, as a PyTorch user writes them. Each op is a launch
  and a pass over memory, about forty a block: at decode time, one token a step, their launches
  cost about as much as the block's four Q4_K GEMVs (``docs/perf``'s model records profile both).
- :class:`TritonGlue`: four Triton launches a block, each one pass over its rows: the residual
  add fused with the next RMSNorm, RoPE fused with the split of the fused Q/K/V projection, and
  SwiGLU's ``silu(gate) * up``. Every value is computed in float32 from the same formulas as
  :class:`TorchGlue`; only rounding order differs (fused multiply-adds).

The residual stream stays float32 in both; what enters a kernel is rounded once to the model's
dtype. The Triton interpreter (CPU tensors) truncates float32 to bf16 where a GPU rounds to
nearest, so there the kernels round bf16 outputs on the bf16 grid first and the cast is exact.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritune.kernels.q4k._triton_dequant import _bf16_grid

from .layers import Rope, rms_norm


@triton.jit
def _round_bf16(x, ROUND: tl.constexpr):
    """``x`` on the bf16 grid where ``ROUND`` (a bf16 output on the interpreter), else ``x``."""
    if ROUND:
        x = _bf16_grid(x)
    return x


@triton.jit
def _add_norm_kernel(
    h_ptr, delta_ptr, weight_ptr, rows_ptr, h_out_ptr, x_out_ptr, width, eps,
    stride_h, stride_delta, stride_h_out, stride_x,
    HAS_DELTA: tl.constexpr, HAS_ROWS: tl.constexpr, STORE_H: tl.constexpr, ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: ``h (+ delta)``, stored if ``STORE_H``, and ``h / rms(h) * weight`` in x's dtype."""
    row = tl.program_id(0)
    src = tl.load(rows_ptr + row) if HAS_ROWS else row
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    h = tl.load(h_ptr + src * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h = h + tl.load(delta_ptr + src * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
    if STORE_H:
        tl.store(h_out_ptr + row * stride_h_out + offs, h, mask=mask)
    inv = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / width + eps)
    x = h * inv * tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_out_ptr + row * stride_x + offs, _round_bf16(x, ROUND).to(x_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, stride_qkv, stride_table,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    HEADS_P2: tl.constexpr, V_P2: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """One token: its Q and K heads rotated pair by pair (``x[2i], x[2i+1]``), V copied."""
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    pair = tl.arange(0, HALF_P2)
    in_head = pair < HALF
    head = tl.arange(0, HEADS_P2)
    cos = tl.load(cos_ptr + position * stride_table + pair, mask=in_head, other=0.0)[None, :]
    sin = tl.load(sin_ptr + position * stride_table + pair, mask=in_head, other=0.0)[None, :]
    row = qkv_ptr + token * stride_qkv
    D: tl.constexpr = 2 * HALF
    # Q and K heads are adjacent in the fused row: rotate them as one [HEADS + KV_HEADS, HALF] tile.
    rotated = (head < HEADS + KV_HEADS)[:, None] & in_head[None, :]
    even_ptrs = row + head[:, None] * D + 2 * pair[None, :]
    even = tl.load(even_ptrs, mask=rotated, other=0.0).to(tl.float32)
    odd = tl.load(even_ptrs + 1, mask=rotated, other=0.0).to(tl.float32)
    new_even = _round_bf16(even * cos - odd * sin, ROUND).to(q_ptr.dtype.element_ty)
    new_odd = _round_bf16(even * sin + odd * cos, ROUND).to(q_ptr.dtype.element_ty)
    is_q = rotated & (head < HEADS)[:, None]
    q_out = q_ptr + token * (HEADS * D) + head[:, None] * D + 2 * pair[None, :]
    tl.store(q_out, new_even, mask=is_q)
    tl.store(q_out + 1, new_odd, mask=is_q)
    is_k = rotated & (head >= HEADS)[:, None]
    k_out = k_ptr + token * (KV_HEADS * D) + (head - HEADS)[:, None] * D + 2 * pair[None, :]
    tl.store(k_out, new_even, mask=is_k)
    tl.store(k_out + 1, new_odd, mask=is_k)
    kv = tl.arange(0, V_P2)
    in_v = kv < KV_HEADS * D
    v_row = tl.load(row + (HEADS + KV_HEADS) * D + kv, mask=in_v, other=0.0)
    tl.store(v_ptr + token * (KV_HEADS * D) + kv, v_row, mask=in_v)


@triton.jit
def _swiglu_kernel(gate_up_ptr, out_ptr, width, stride_in, stride_out, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """``silu(gate) * up`` for one row's ``BLOCK`` columns, in float32."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, _round_bf16(out, ROUND).to(out_ptr.dtype.element_ty), mask=mask)


class Glue(Protocol):
    """What :meth:`LlamaModel.forward` needs between its kernels."""

    def norm(self, h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of float32 ``h [T, hidden]`` (of its ``rows`` only, if given) in the model's dtype."""
        ...

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``h + delta`` (float32; None where ``rows`` is given: nothing reads it) and its RMSNorm
        (of ``rows`` only, if given) in the model's dtype."""
        ...

    def rope_qkv(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection ``[T, (Hq + 2 Hkv) D]`` as contiguous ``q [T, Hq, D]`` and ``k``
        rotated for ``positions``, and ``v [T, Hkv, D]`` (a view of ``qkv`` where one serves)."""
        ...

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused ``[T, 2 F]`` projection, in its dtype: ``[T, F]``."""
        ...


class GlueShape:
    """What every glue reads: the attention heads, the norms' epsilon, the RoPE tables, the dtype."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float, rope: Rope, dtype: torch.dtype) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.eps, self.rope, self.dtype = eps, rope, dtype


class TorchGlue(GlueShape):
    """The glue in PyTorch ops (float32), one launch per op."""

    def norm(self, h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            h = h.index_select(0, rows)
        return rms_norm(h, weight, self.eps, self.dtype)

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        h = h + delta.float()
        return (None if rows is not None else h), self.norm(h, weight, rows)

    def rope_qkv(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split((self.heads * d, self.kv_heads * d, self.kv_heads * d), dim=-1)
        q = self.rope(q.view(tokens, self.heads, d), positions)
        k = self.rope(k.view(tokens, self.kv_heads, d), positions)
        return q, k, v.reshape(tokens, self.kv_heads, d)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


#: Columns of one SwiGLU program.
SWIGLU_BLOCK = 1024


def _rounds(out: torch.Tensor) -> bool:
    """Whether a kernel writing ``out`` rounds on the bf16 grid itself: a bf16 output on the
    interpreter (CPU tensors), whose casts truncate."""
    return out.is_cpu and out.dtype == torch.bfloat16


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its rows, as the kernels index it."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _output(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised output the kernels fill (the tests fill it with NaN first)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


class TritonGlue(GlueShape):
    """The glue in four Triton launches a block (see the module docstring); the same interface."""

    def norm(self, h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._norm(h, None, weight, rows)[1]

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        return self._norm(h, delta, weight, rows)

    def _norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        count, width = (rows.shape[0] if rows is not None else h.shape[0]), h.shape[1]
        h, delta = _rows_contiguous(h), None if delta is None else _rows_contiguous(delta)
        weight, rows = weight.contiguous(), None if rows is None else rows.contiguous()
        x = _output((count, width), h, self.dtype)
        store_h = delta is not None and rows is None
        h_out = _output(tuple(h.shape), h) if store_h else None
        if count:
            _add_norm_kernel[(count,)](
                h, delta if delta is not None else h, weight, rows if rows is not None else h, h_out if store_h else x,
                x, width, self.eps, h.stride(0), delta.stride(0) if delta is not None else 0,
                h_out.stride(0) if h_out is not None else 0, x.stride(0), HAS_DELTA=delta is not None,
                HAS_ROWS=rows is not None, STORE_H=store_h, ROUND=_rounds(x), BLOCK=triton.next_power_of_2(width),
            )  # fmt: skip
        return h_out, x

    def rope_qkv(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, d, qkv, positions = qkv.shape[0], self.head_dim, _rows_contiguous(qkv), positions.contiguous()
        cos, sin = self.rope.cos.contiguous(), self.rope.sin.contiguous()
        q = _output((tokens, self.heads, d), qkv)
        k = _output((tokens, self.kv_heads, d), qkv)
        v = _output((tokens, self.kv_heads, d), qkv)
        if tokens:
            _rope_qkv_kernel[(tokens,)](
                qkv, positions, cos, sin, q, k, v, qkv.stride(0), cos.stride(0),
                HEADS=self.heads, KV_HEADS=self.kv_heads, HALF=d // 2, HALF_P2=triton.next_power_of_2(d // 2),
                HEADS_P2=triton.next_power_of_2(self.heads + self.kv_heads),
                V_P2=triton.next_power_of_2(self.kv_heads * d), ROUND=_rounds(q),
            )  # fmt: skip
        return q, k, v

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        tokens, width, gate_up = gate_up.shape[0], gate_up.shape[1] // 2, _rows_contiguous(gate_up)
        out = _output((tokens, width), gate_up)
        if tokens:
            block = min(SWIGLU_BLOCK, triton.next_power_of_2(width))
            _swiglu_kernel[(tokens, triton.cdiv(width, block))](
                gate_up, out, width, gate_up.stride(0), out.stride(0), ROUND=_rounds(out), BLOCK=block
            )
        return out

"""Host side of ``q4k_fp8_gemm``: allocate workspaces and launch the kernels for one config.

Arguments arrive validated (see :func:`tritune.kernels.q4k.op.q4k_linear`): ``x`` is ``[M, K]``
with unit stride along K, the weight tensors are :class:`~tritune.kernels.q4k.weight.Q4KWeight`'s,
``out`` is a contiguous ``[M, N]`` of x's dtype and ``bias`` (if any) is ``[N]`` with any stride.
Launches go through ``wrap_triton`` so the registered op stays traceable by ``torch.compile``.
"""

from __future__ import annotations

import torch
import triton

from tritune.search_spaces import q4k_fp8_gemm as q4k_space
from tritune.search_spaces.q4k_fp8_gemm import Q4KConfig

from .._oplib import wrap_triton
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

KERNELS = (
    _quantize_rows_fp8_kernel,
    _quantize_rows_gemv_kernel,
    _q4k_gemv_kernel,
    _q4k_gemm_fp8_kernel,
    _q4k_gemm_fp8_fold_kernel,
    _q4k_gemm_fp8_fold_swap_kernel,
    _q4k_gemm_portable_kernel,
    _splitk_reduce_kernel,
    _staged_prepass_kernel,
    _q4k_dequant_fp8_kernel,
)

_REDUCE_BLOCK_M = 16
_REDUCE_BLOCK_N = 128
_FOLD_BLOCK_N = 128
#: Sub-blocks per program of the GEMV pre-pass: 16 rows of K=4096 make 128 programs.
_GEMV_PREPASS_TILE = 16
#: Most rows of x one GEMV program multiplies (more rows take more programs).
_GEMV_MAX_ROWS = 8


def _prepass_block(k: int) -> int:
    # The largest power-of-two chunk (256 .. 2048) that divides K; K is a multiple of 256.
    block = 2048
    while k % block:
        block //= 2
    return block


def _quantize_rows(x: torch.Tensor, *, row_sums: bool, interpreted: bool) -> tuple[torch.Tensor, ...]:
    """The fp8 pre-pass: e4m3 rows of ``x``, their float32 scales, and (if asked) exact 32-wide
    row sums; without them the third tensor is ``row_scale`` again (the kernel never writes it)."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    row_scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    rowsum = torch.empty((m, k // 32), dtype=torch.float32, device=x.device) if row_sums else row_scale
    block = _prepass_block(k)
    wrap_triton(_quantize_rows_fp8_kernel)[(m,)](
        x,
        xq,
        row_scale,
        rowsum,
        k,
        x.stride(0),
        x.stride(1),
        BLOCK_K=block,
        K_TILES=k // block,
        ROUND_IN_FP32=interpreted,
        ROW_SUMS=row_sums,
        num_warps=4,
    )
    return xq, row_scale, rowsum


def quantize_rows_gemv(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The GEMV path's pre-pass: x as int8 with one scale per 32-wide sub-block, packed four to a
    word in the codes' nibble order (int32 ``[M, K/4]``), and per sub-block its scale, what its
    sum lost to the rounding and its exact sum (float32 ``[M, K/32]`` each)."""
    m, k = x.shape
    words = torch.empty((m, k // 4), dtype=torch.int32, device=x.device)
    scales, lost, sums = (torch.empty((m, k // 32), dtype=torch.float32, device=x.device) for _ in range(3))
    subs = k // 32
    wrap_triton(_quantize_rows_gemv_kernel)[(m, triton.cdiv(subs, _GEMV_PREPASS_TILE))](
        x, words, scales, lost, sums, k, x.stride(0), x.stride(1), SUBS=subs, TILE=_GEMV_PREPASS_TILE, num_warps=4
    )
    return words, scales, lost, sums


def staged_prepass(
    x: torch.Tensor, super_scales: torch.Tensor, *, interpreted: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The staged path's first launch: e4m3 rows of ``x``, their float32 scales ``[M]``, and each
    weight column's inverse power of two ``inv_fold`` ``[1, N]`` (``_scaled_mm``'s ``scale_b``)."""
    m, k = x.shape
    n = super_scales.shape[0]
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    row_scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    inv_fold = torch.empty((1, n), dtype=torch.float32, device=x.device)
    block = _prepass_block(k)
    wrap_triton(_staged_prepass_kernel)[(m + triton.cdiv(n, _FOLD_BLOCK_N),)](
        x, xq, row_scale, super_scales, inv_fold, m, n, x.stride(0), x.stride(1), super_scales.stride(0),
        K=k, BLOCK_K=block, K_TILES=k // block, FOLD_BLOCK_N=_FOLD_BLOCK_N, ROUND_IN_FP32=interpreted, num_warps=4,
    )  # fmt: skip
    return xq, row_scale, inv_fold


def dequantize_chunk(
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    super_scales: torch.Tensor,
    inv_fold: torch.Tensor,
    scratch: torch.Tensor,
    row0: int,
    rows: int,
    *,
    block_n: int,
    block_k: int,
    num_warps: int,
    interpreted: bool,
) -> None:
    """Weight rows ``row0 .. row0 + rows - 1`` as folded e4m3 into ``scratch[:rows]`` (``[CHUNK_N, K]``)."""
    k = scratch.shape[1]
    wrap_triton(_q4k_dequant_fp8_kernel)[(triton.cdiv(rows, block_n), k // block_k)](
        qs, scales, mins, super_scales, inv_fold, scratch, row0, rows, k,
        qs.stride(0), scales.stride(0), super_scales.stride(0),
        ROUND_IN_FP32=interpreted, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip


def _run_staged(
    config: Q4KConfig,
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    super_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    interpreted: bool,
) -> None:
    """The staged path: e4m3 x and each column's fold (one launch), then per chunk of ``CHUNK_N``
    weight rows a dequantization into one reused scratch and cuBLASLt's fp8 GEMM into that chunk's
    columns of ``out`` (a strided view: cuBLASLt writes it with ``ldc = N``, no copy).

    The bias is added after the GEMMs, in place (row-wise scaled fp8 GEMMs take no bias on every
    build); that rounds the product to ``out``'s dtype once before the addition.
    """
    m, k = x.shape
    n = qs.shape[0]
    xq, row_scale, inv_fold = staged_prepass(x, super_scales, interpreted=interpreted)
    chunk = min(config.CHUNK_N, n)
    scratch = torch.empty((chunk, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale_a = row_scale.view(m, 1)
    for row0 in range(0, n, chunk):
        rows = min(chunk, n - row0)
        dequantize_chunk(
            qs, scales, mins, super_scales, inv_fold, scratch, row0, rows,
            block_n=config.BLOCK_N, block_k=config.BLOCK_K, num_warps=config.num_warps, interpreted=interpreted,
        )  # fmt: skip
        torch._scaled_mm(
            xq,
            scratch[:rows].t(),
            scale_a=scale_a,
            scale_b=inv_fold[:, row0 : row0 + rows],
            out_dtype=out.dtype,
            use_fast_accum=config.FAST_ACCUM,
            out=out[:, row0 : row0 + rows],
        )
    if bias is not None:
        out.add_(bias)


def run_q4k_gemm(
    config: Q4KConfig,
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    super_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """``out = x @ dequant(W)^T (+ bias)`` with ``config``; writes every element of ``out``.

    Launches go through ``wrap_triton``: bare kernels in eager mode (the caller switches it off,
    as ``TritonOp`` and the spec's launch do), traced ones inside the registered op.
    """
    launcher = wrap_triton
    m, k = x.shape
    n = qs.shape[0]
    if m == 0:
        return
    if config.BLOCK_K > q4k_space.SUPER_BLOCK and config.path != "gemv":
        raise ValueError(f"config: BLOCK_K={config.BLOCK_K} is for the gemv path only, not {config.path!r}")
    # Plain // and % (not divmod): under torch.compile's dynamic shapes k is a SymInt.
    k_tiles = k // config.BLOCK_K // config.SPLIT_K
    if (k // config.BLOCK_K) % config.SPLIT_K or k % config.BLOCK_K:
        raise ValueError(
            f"config: SPLIT_K={config.SPLIT_K} must divide the {k // config.BLOCK_K} BLOCK_K={config.BLOCK_K} "
            f"tiles of K={k}"
        )
    has_bias = bias is not None
    bias_arg = bias if bias is not None else out
    # A bias view such as b[::2] is read through its stride.
    stride_bn = bias.stride(0) if bias is not None else 0
    grid = (triton.cdiv(m, config.BLOCK_M) * triton.cdiv(n, config.BLOCK_N), config.SPLIT_K)
    if config.SPLIT_K > 1:
        target = torch.empty((config.SPLIT_K, m, n), dtype=torch.float32, device=out.device)
        stride_ok, stride_om, stride_on = target.stride()
    else:
        target = out
        stride_ok, (stride_om, stride_on) = 0, out.stride()
    launch = {
        "HAS_BIAS": has_bias,
        "BLOCK_M": config.BLOCK_M,
        "BLOCK_N": config.BLOCK_N,
        "BLOCK_K": config.BLOCK_K,
        "GROUP_M": config.GROUP_M,
        "SPLIT_K": config.SPLIT_K,
        "K_TILES": k_tiles,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    # CPU tensors run on the interpreter, whose e4m3 casts and bf16 dots need workarounds.
    interpreted = x.device.type == "cpu"
    if config.path == "staged":
        _run_staged(config, x, qs, scales, mins, super_scales, bias, out, interpreted)
        return
    if config.path == "gemv":
        rows = min(triton.next_power_of_2(m), _GEMV_MAX_ROWS)
        words, x_scales, lost, sums = quantize_rows_gemv(x)
        launcher(_q4k_gemv_kernel)[(triton.cdiv(n, config.BLOCK_N), config.SPLIT_K, triton.cdiv(m, rows))](
            words, x_scales, lost, sums, qs, scales, mins, super_scales, bias_arg, target, m, n, k,
            qs.stride(0), scales.stride(0), super_scales.stride(0), stride_om, stride_on, stride_ok, stride_bn,
            HAS_BIAS=has_bias, ASM=not interpreted, ROWS=rows, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
            SPLIT_K=config.SPLIT_K, K_TILES=k_tiles, num_warps=config.num_warps,
        )  # fmt: skip
    elif config.path == "fp8":
        # Folded weights carry their mins: only the centred kernel needs x's 32-wide row sums.
        xq, row_scale, rowsum = _quantize_rows(x, row_sums=not config.SCALE_FOLD, interpreted=interpreted)
        # The fp8 kernels read the weight, bias and output alike.
        rest = (
            qs,
            scales,
            mins,
            super_scales,
            bias_arg,
            target,
            m,
            n,
            k,
            qs.stride(0),
            scales.stride(0),
            super_scales.stride(0),
            stride_om,
            stride_on,
            stride_ok,
            stride_bn,
        )
        if config.SCALE_FOLD:
            # The swapped kernel takes the same arguments and writes the same (untransposed) tiles.
            fold_kernel = _q4k_gemm_fp8_fold_swap_kernel if config.SWAP_AB else _q4k_gemm_fp8_fold_kernel
            launcher(fold_kernel)[grid](xq, row_scale, *rest, ROUND_IN_FP32=interpreted, **launch)
        else:
            launcher(_q4k_gemm_fp8_kernel)[grid](xq, row_scale, rowsum, *rest, **launch)
    else:
        launcher(_q4k_gemm_portable_kernel)[grid](
            x,
            qs,
            scales,
            mins,
            super_scales,
            bias_arg,
            target,
            m,
            n,
            x.stride(0),
            x.stride(1),
            qs.stride(0),
            scales.stride(0),
            super_scales.stride(0),
            stride_om,
            stride_on,
            stride_ok,
            stride_bn,
            # The interpreter (CPU tensors) multiplies bf16 tiles wrongly: give it fp32 operands.
            DOT_IN_FP32=interpreted,
            **launch,
        )
    if config.SPLIT_K > 1:
        reduce_grid = (triton.cdiv(m, _REDUCE_BLOCK_M), triton.cdiv(n, _REDUCE_BLOCK_N))
        launcher(_splitk_reduce_kernel)[reduce_grid](
            target,
            bias_arg,
            out,
            m,
            n,
            target.stride(0),
            target.stride(1),
            out.stride(0),
            out.stride(1),
            stride_bn,
            HAS_BIAS=has_bias,
            SPLIT_K=config.SPLIT_K,
            BLOCK_M=_REDUCE_BLOCK_M,
            BLOCK_N=_REDUCE_BLOCK_N,
            num_warps=4,
        )

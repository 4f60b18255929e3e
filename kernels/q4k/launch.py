"""Host side of ``q4k_fp8_gemm``: plan, allocate workspaces and launch the kernels of one config.

Arguments arrive checked by the declaration (:mod:`.kernel`): ``x`` is ``[..., K]`` bf16 or fp16
with any strides, ``weight`` a :class:`~.weight.Q4KWeight` ``[N, K]``, ``bias`` (if any) ``[N]``
with any stride, ``out`` a contiguous ``[..., N]`` of x's dtype. Launches go through
``wrap_triton`` (looked up at each call), so the registered op stays traceable by
``torch.compile`` and plain eager calls reach the bare kernels.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from tritune.search_spaces.q4k_fp8_gemm import (
    DequantConfig,
    Fp8Config,
    GemvConfig,
    Int8Config,
    PortableConfig,
    Q4KConfig,
    StagedConfig,
    TmaConfig,
)

from .._launch import arrival_counters, ceil_div, next_pow2, traced
from .._oplib import wrap_triton
from ._gluon_tma import _q4k_gemm_tma_kernel
from ._gluon_tma_loader import _q4k_gemm_tma_loader_kernel
from ._gluon_tma_rs import _q4k_gemm_tma_rs_kernel
from ._triton_dequant import _q4k_dequant_kernel
from ._triton_fold import _q4k_gemm_fp8_fold_kernel
from ._triton_fp8 import _q4k_gemm_fp8_kernel
from ._triton_gemv import _q4k_gemv_fused_kernel, _q4k_gemv_kernel, _quantize_rows_gemv_kernel
from ._triton_int8 import _int8_prepass_kernel, _q4k_gemm_int8_kernel
from ._triton_portable import _q4k_gemm_portable_kernel
from ._triton_quantize import _quantize_rows_fp8_kernel
from ._triton_splitk import _splitk_reduce_kernel
from ._triton_staged import _q4k_dequant_fp8_kernel, _staged_prepass_kernel
from .launch_tma import dispatch_tma
from .weight import Q4KWeight

#: Every kernel :func:`launch` may run (the declaration's ``jit_kernels``).
JIT_KERNELS = (
    _quantize_rows_fp8_kernel,
    _q4k_gemm_portable_kernel,
    _q4k_gemm_fp8_kernel,
    _q4k_gemm_fp8_fold_kernel,
    _staged_prepass_kernel,
    _q4k_dequant_fp8_kernel,
    _quantize_rows_gemv_kernel,
    _q4k_gemv_kernel,
    _q4k_gemv_fused_kernel,
    _splitk_reduce_kernel,
    _int8_prepass_kernel,
    _q4k_gemm_int8_kernel,
    _q4k_dequant_kernel,
    _q4k_gemm_tma_kernel,
    _q4k_gemm_tma_loader_kernel,
    _q4k_gemm_tma_rs_kernel,
)

_REDUCE_BLOCK_M = 16
_REDUCE_BLOCK_N = 128
_FOLD_BLOCK_N = 128
#: Weight rows per program of the int8 pre-pass's scale half: N=4096 makes 128 programs.
_INT8_SCALE_BLOCK_N = 32
#: Sub-blocks per program of the GEMV pre-pass: 16 rows of K=4096 make 128 programs.
_GEMV_PREPASS_TILE = 16
#: Most rows of x one GEMV program multiplies (more rows take more programs).
_GEMV_MAX_ROWS = 8
#: Values of a 32-wide sub-block each thread of the GEMV pre-pass holds (its [16, 32] tile at 4
#: warps): the fused GEMV kernel quantizes its tiles at the same count, so its sums match.
_GEMV_VALUES_PER_THREAD = 4


class _Plan(NamedTuple):
    """What a tiled launch (portable, fp8, GEMV) needs beyond the tensors, fixed by config and shape."""

    grid: tuple[int, ...]
    #: The kernel's constexpr arguments and launch options.
    constants: dict[str, Any]
    reduce_grid: tuple[int, int] | None
    #: GEMV only: the fused kernel runs (``FUSE_QUANT``, ``K_LANES``, or ``FUSED_REDUCE`` with a split).
    gemv_fused: bool = False
    #: Arrival counters a fused reduce needs (one per output tile); 0: no fused reduce.
    counters: int = 0


@functools.lru_cache(maxsize=1024)
def _plan(
    config: PortableConfig | Fp8Config | GemvConfig | Int8Config, m: int, n: int, k: int, has_bias: bool
) -> _Plan:
    # Plain // and % (not divmod): a traced call's sizes may be SymInts.
    if k % config.BLOCK_K or (k // config.BLOCK_K) % config.SPLIT_K:
        raise ValueError(
            f"config: SPLIT_K={config.SPLIT_K} must divide the {k // config.BLOCK_K} BLOCK_K={config.BLOCK_K} "
            f"tiles of K={k}"
        )
    split = config.SPLIT_K
    constants: dict[str, Any] = {
        "HAS_BIAS": has_bias,
        "BLOCK_N": config.BLOCK_N,
        "BLOCK_K": config.BLOCK_K,
        "SPLIT_K": split,
        "K_TILES": k // config.BLOCK_K // split,
        "num_warps": config.num_warps,
    }
    fused_reduce = False
    gemv_fused = False
    if isinstance(config, GemvConfig):
        rows = min(next_pow2(m), _GEMV_MAX_ROWS)
        grid: tuple[int, ...] = (ceil_div(n, config.BLOCK_N), split, ceil_div(m, rows))
        constants["ROWS"] = rows
        fused_reduce = config.FUSED_REDUCE and split > 1
        gemv_fused = config.FUSE_QUANT or fused_reduce or config.K_LANES
        if gemv_fused:
            # Copies of the tile's x values quantized at once: enough to give each thread
            # _GEMV_VALUES_PER_THREAD of them where the tile alone has fewer.
            copies = max(1, 32 * config.num_warps * _GEMV_VALUES_PER_THREAD // (rows * config.BLOCK_K))
            constants.update(FUSE_QUANT=config.FUSE_QUANT, FUSED_REDUCE=fused_reduce, COPIES=copies)
            if config.K_LANES:
                # Only where set: the kernel's default keeps every other config's build as it was.
                constants["K_LANES"] = True
    else:
        grid = (ceil_div(m, config.BLOCK_M) * ceil_div(n, config.BLOCK_N), split)
        constants.update(
            BLOCK_M=config.BLOCK_M, GROUP_M=config.GROUP_M, num_stages=config.num_stages
        )  # fmt: skip
    reduce_at = reduce_grid(m, n) if split > 1 else None
    if fused_reduce:
        return _Plan(grid, constants, None, gemv_fused, grid[0] * grid[2])
    return _Plan(grid, constants, reduce_at, gemv_fused)


def launch(config: Q4KConfig, x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = x @ dequant(weight)^T (+ bias)`` with ``config``; writes every element of ``out``."""
    n, k = weight.shape
    # A 2-D x or out is its own [M, K] / [M, N] view (reshape and view each cost host time per call).
    x2d = x if x.dim() == 2 else x.reshape(-1, k)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    out2d = out if out.dim() == 2 else out.view(-1, n)
    m = x2d.shape[0]
    if m == 0:
        return
    qs, scales, mins, super_scales = weight.qs, weight.scales, weight.mins, weight.super_scales
    # CPU tensors run on the interpreter, whose e4m3 casts and bf16 dots need workarounds.
    interpreted = x.is_cpu
    if isinstance(config, StagedConfig):
        _run_staged(config, x2d, qs, scales, mins, super_scales, bias, out2d, interpreted)
        return
    if isinstance(config, DequantConfig):
        _run_dequant(config, x2d, qs, scales, mins, super_scales, bias, out2d, interpreted)
        return
    if isinstance(config, TmaConfig):
        dispatch_tma(config, x2d, (qs, scales, mins, super_scales), bias, out2d)
        return
    plan = _plan(config, m, n, k, bias is not None)
    bias_arg = bias if bias is not None else out2d
    # A bias view such as b[::2] is read through its stride.
    stride_bn = bias.stride(0) if bias is not None else 0
    if plan.gemv_fused:
        _run_gemv_fused(plan, x2d, weight, bias_arg, stride_bn, out2d, interpreted)
        return
    if plan.reduce_grid is not None:
        target = torch.empty((config.SPLIT_K, m, n), dtype=torch.float32, device=out2d.device)
        stride_ok, stride_om, stride_on = target.stride()
    else:
        target = out2d
        stride_ok, (stride_om, stride_on) = 0, out2d.stride()
    if isinstance(config, GemvConfig):
        words, x_scales, lost, sums = quantize_rows_gemv(x2d)
        wrap_triton(_q4k_gemv_kernel)[plan.grid](
            words, x_scales, lost, sums, qs, scales, mins, super_scales, bias_arg, target, m, n, k,
            qs.stride(0), scales.stride(0), super_scales.stride(0), stride_om, stride_on, stride_ok, stride_bn,
            ASM=not interpreted, **plan.constants,
        )  # fmt: skip
    elif isinstance(config, Int8Config):
        xq, x_scale, w_scale = int8_prepass(x2d, scales, mins, super_scales)
        wrap_triton(_q4k_gemm_int8_kernel)[plan.grid](
            xq, x_scale, w_scale, qs, scales, mins, super_scales, bias_arg, target, m, n, k, qs.stride(0),
            scales.stride(0), super_scales.stride(0), stride_om, stride_on, stride_ok, stride_bn,
            SWAP_AB=config.SWAP_AB, **plan.constants,
        )  # fmt: skip
    elif isinstance(config, Fp8Config):
        # Folded weights carry their mins: only the centred kernel needs x's 32-wide row sums.
        xq, row_scale, rowsum = _quantize_rows(x2d, row_sums=not config.SCALE_FOLD, interpreted=interpreted)
        # The fp8 kernels read the weight, bias and output alike.
        rest = (
            qs, scales, mins, super_scales, bias_arg, target, m, n, k, qs.stride(0), scales.stride(0),
            super_scales.stride(0), stride_om, stride_on, stride_ok, stride_bn,
        )  # fmt: skip
        if config.SCALE_FOLD:
            # SWAP_AB writes the same (untransposed) tiles from the transposed product.
            wrap_triton(_q4k_gemm_fp8_fold_kernel)[plan.grid](
                xq, row_scale, *rest, ROUND_IN_FP32=interpreted, SWAP_AB=config.SWAP_AB, **plan.constants
            )
        else:
            wrap_triton(_q4k_gemm_fp8_kernel)[plan.grid](xq, row_scale, rowsum, *rest, **plan.constants)
    else:
        wrap_triton(_q4k_gemm_portable_kernel)[plan.grid](
            x2d, qs, scales, mins, super_scales, bias_arg, target, m, n, x2d.stride(0), x2d.stride(1),
            qs.stride(0), scales.stride(0), super_scales.stride(0), stride_om, stride_on, stride_ok, stride_bn,
            # The interpreter (CPU tensors) multiplies bf16 tiles wrongly: give it fp32 operands.
            DOT_IN_FP32=interpreted, **plan.constants,
        )  # fmt: skip
    if plan.reduce_grid is not None:
        splitk_reduce(plan.reduce_grid, target, bias_arg, out2d, stride_bn, has_bias=bias is not None)


def reduce_grid(m: int, n: int) -> tuple[int, int]:
    """The grid of :func:`splitk_reduce` over an ``[M, N]`` output."""
    return ceil_div(m, _REDUCE_BLOCK_M), ceil_div(n, _REDUCE_BLOCK_N)


def splitk_reduce(
    grid: tuple[int, int], partials: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, stride_bn: int, *,
    has_bias: bool,
) -> None:  # fmt: skip
    """Sum a split launch's float32 partials ``[SPLIT_K, M, N]`` (plus the bias where ``has_bias``;
    ``bias`` is any tensor otherwise) into ``out`` ``[M, N]``, on :func:`reduce_grid`'s grid."""
    split, m, n = partials.shape
    wrap_triton(_splitk_reduce_kernel)[grid](
        partials, bias, out, m, n, partials.stride(0), partials.stride(1), out.stride(0), out.stride(1), stride_bn,
        HAS_BIAS=has_bias, SPLIT_K=split, BLOCK_M=_REDUCE_BLOCK_M, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4,
    )  # fmt: skip


def _run_gemv_fused(
    plan: _Plan,
    x: torch.Tensor,
    weight: Q4KWeight,
    bias: torch.Tensor,
    stride_bn: int,
    out: torch.Tensor,
    interpreted: bool,
) -> None:
    """The GEMV path with ``FUSE_QUANT`` and/or ``FUSED_REDUCE``: the fused kernel, plus the launches
    that are not fused (the pre-pass without ``FUSE_QUANT``, the reduce with a split and without
    ``FUSED_REDUCE``). ``bias`` is ``out`` where the call has none (``HAS_BIAS`` is in the plan)."""
    m, n = out.shape
    constants = plan.constants
    split = constants["SPLIT_K"]
    if constants["FUSE_QUANT"]:
        # The kernel reads x itself (K contiguous: launch made it so); no pre-pass, nothing allocated.
        quantized: tuple[torch.Tensor | None, ...] = (None, None, None, None)
        x_arg: torch.Tensor | None = x
    else:
        quantized, x_arg = quantize_rows_gemv(x), None
    # The partials of a split; allocated per call, as the decode kernel's (stream-ordered, so a
    # captured graph gets its own from its pool).
    part = torch.empty((split, m, n), dtype=torch.float32, device=out.device) if split > 1 else out
    counters = arrival_counters(plan.counters, out.device, fresh=traced(x)) if plan.counters else None
    qs, scales, mins, super_scales = weight.qs, weight.scales, weight.mins, weight.super_scales
    try:
        wrap_triton(_q4k_gemv_fused_kernel)[plan.grid](
            x_arg, *quantized, qs, scales, mins, super_scales, bias, out, part, counters, m, n, weight.shape[1],
            x.stride(0), qs.stride(0), scales.stride(0), super_scales.stride(0), out.stride(0), out.stride(1),
            part.stride(0) if split > 1 else 0, part.stride(1) if split > 1 else 0, stride_bn,
            ASM=not interpreted, **constants,
        )  # fmt: skip
    except BaseException:
        # The interpreter runs the programs one by one: a launch that raised part-way has left
        # tiles counted, which would keep their last split from reducing in every later launch.
        if counters is not None and not counters.is_cuda:
            counters.zero_()
        raise
    if split > 1 and not constants["FUSED_REDUCE"]:
        splitk_reduce(plan.reduce_grid, part, bias, out, stride_bn, has_bias=constants["HAS_BIAS"])


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
        x, xq, row_scale, rowsum, k, x.stride(0), x.stride(1),
        BLOCK_K=block, K_TILES=k // block, ROUND_IN_FP32=interpreted, ROW_SUMS=row_sums, num_warps=4,
    )  # fmt: skip
    return xq, row_scale, rowsum


def int8_prepass(
    x: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, super_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 path's pre-pass (one launch): int8 rows of ``x`` ``[M, K]``, their float32 scales
    ``[M]``, and each weight row's float32 scale ``[N]`` (its largest weight over 127).

    The weight's scales are computed per call from its sub-block fields (a read of 5/64 of a byte
    per weight) rather than kept on the weight: the op rebuilds the weight from its four tensors.
    """
    m, k = x.shape
    n = super_scales.shape[0]
    xq = torch.empty((m, k), dtype=torch.int8, device=x.device)
    x_scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    w_scale = torch.empty((n,), dtype=torch.float32, device=x.device)
    block = _prepass_block(k)
    wrap_triton(_int8_prepass_kernel)[(m + ceil_div(n, _INT8_SCALE_BLOCK_N),)](
        x, xq, x_scale, scales, mins, super_scales, w_scale, m, n, x.stride(0), x.stride(1), scales.stride(0),
        super_scales.stride(0), K=k, BLOCK_K=block, K_TILES=k // block, SCALE_BLOCK_N=_INT8_SCALE_BLOCK_N,
        num_warps=4,
    )  # fmt: skip
    return xq, x_scale, w_scale


def quantize_rows_gemv(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The GEMV path's pre-pass: x as int8 with one scale per 32-wide sub-block, packed four to a
    word in the codes' nibble order (int32 ``[M, K/4]``), and per sub-block its scale, what its
    sum lost to the rounding and its exact sum (float32 ``[M, K/32]`` each)."""
    m, k = x.shape
    words = torch.empty((m, k // 4), dtype=torch.int32, device=x.device)
    scales, lost, sums = (torch.empty((m, k // 32), dtype=torch.float32, device=x.device) for _ in range(3))
    subs = k // 32
    wrap_triton(_quantize_rows_gemv_kernel)[(m, ceil_div(subs, _GEMV_PREPASS_TILE))](
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
    wrap_triton(_staged_prepass_kernel)[(m + ceil_div(n, _FOLD_BLOCK_N),)](
        x, xq, row_scale, super_scales, inv_fold, m, n, x.stride(0), x.stride(1), super_scales.stride(0),
        K=k, BLOCK_K=block, K_TILES=k // block, FOLD_BLOCK_N=_FOLD_BLOCK_N, ROUND_IN_FP32=interpreted, num_warps=4,
    )  # fmt: skip
    return xq, row_scale, inv_fold


def _run_staged(
    config: StagedConfig,
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
        # Weight rows row0 .. row0 + rows - 1 as folded e4m3 into scratch[:rows].
        wrap_triton(_q4k_dequant_fp8_kernel)[(ceil_div(rows, config.BLOCK_N), k // config.BLOCK_K)](
            qs, scales, mins, super_scales, inv_fold, scratch, row0, rows, k,
            qs.stride(0), scales.stride(0), super_scales.stride(0),
            ROUND_IN_FP32=interpreted, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, num_warps=config.num_warps,
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


def _run_dequant(
    config: DequantConfig,
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    super_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    interpreted: bool,
) -> None:
    """The dequant path: per chunk of ``CHUNK_N`` weight rows, their exact values in x's dtype
    written into one reused scratch, then cuBLAS's GEMM of x with that chunk into the chunk's
    columns of ``out`` (a strided view that cuBLAS writes with ``ldc = N``, no copy; a chunk of
    the whole weight is ``out`` itself).

    The bias, in x's dtype, is the GEMM's ``C`` term (``addmm``): where ``out`` is written whole,
    cuBLASLt adds it in its epilogue, before the one rounding to ``out``'s dtype.
    """
    k = x.shape[1]
    n = qs.shape[0]
    chunk = min(config.CHUNK_N, n)
    # Allocated per call from the caching allocator (a captured graph's pool under capture), like
    # every other workspace here: nothing outlives the call.
    scratch = torch.empty((chunk, k), dtype=x.dtype, device=x.device)
    bias_x = None if bias is None else bias.to(x.dtype).contiguous()
    for row0 in range(0, n, chunk):
        rows = min(chunk, n - row0)
        # Weight rows row0 .. row0 + rows - 1 in x's dtype into scratch[:rows].
        wrap_triton(_q4k_dequant_kernel)[(ceil_div(rows, config.BLOCK_N), k // config.BLOCK_K)](
            qs, scales, mins, super_scales, scratch, row0, rows, k,
            qs.stride(0), scales.stride(0), super_scales.stride(0),
            ROUND_BF16_IN_FP32=interpreted and x.dtype == torch.bfloat16, BLOCK_N=config.BLOCK_N,
            BLOCK_K=config.BLOCK_K, num_warps=config.num_warps,
        )  # fmt: skip
        weight_t = scratch[:rows].t()
        dest = out[:, row0 : row0 + rows]
        if bias_x is None:
            torch.mm(x, weight_t, out=dest)
        else:
            torch.addmm(bias_x[row0 : row0 + rows], x, weight_t, out=dest)

"""Host side of ``q4k_fp8_gemm``'s tma path: descriptors, the Gluon launch and its opaque op.

The kernel (:mod:`._gluon_tma`) reads x and the code words through Gluon tensor descriptors,
which are host objects: a tracer (``torch.compile``) cannot follow a launch that builds them, so
the path runs in an opaque op of its own (``tritune::q4k_linear_tma``) except where the
declaration's op body already runs on plain tensors (an eager call), which launches directly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.experimental.gluon import language as gl

from tritune.search_spaces.q4k_fp8_gemm import SPACE, TMA_SCALE_CHUNK_K, PortableConfig, TmaConfig, tma_scales_by_tma

from .._fastlaunch import bound
from .._launch import GLUON_DTYPES, arrival_counters, ceil_div, traced, unchecked_gluon_descriptor
from .._oplib import in_direct_body, register_schema_op
from ._gluon_tma import _q4k_gemm_tma_kernel
from ._gluon_tma_loader import _q4k_gemm_tma_loader_kernel
from ._gluon_tma_rs import _q4k_gemm_tma_rs_kernel

#: The fields the nested op carries by name: the tma member's, less ``path`` (the op's name says it).
_OP_FIELDS = tuple(name for name in SPACE.members["tma"].dimensions if name != "path")
_SCHEMA_TYPES = {bool: "bool", int: "int"}
#: A Q4_K weight's four tensors, as :class:`~.weight.Q4KWeight` holds them: codes ``[N, K/2]``,
#: scales and mins ``[N, K/32]``, super-scales ``[N, K/256, 2]``.
WeightParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
#: Most rows a TMA box may span: a taller x tile is copied as several boxes of this many rows.
TMA_BOX_ROWS = 256


@functools.lru_cache(maxsize=64)
def _layouts(dtype: torch.dtype, block_m: int, block_n: int, block_k: int) -> tuple[Any, Any]:
    """The shared-memory layouts of the x box ``[BLOCK_M, BLOCK_K]`` and the code-word box
    ``[BLOCK_N, BLOCK_K / 8]`` (int32), built once per (dtype, tiles)."""
    return (
        gl.NVMMASharedLayout.get_default_for([block_m, block_k], GLUON_DTYPES[dtype]),
        gl.NVMMASharedLayout.get_default_for([block_n, block_k // 8], gl.int32),
    )


@functools.lru_cache(maxsize=1)
def _scale_layouts() -> tuple[Any, Any]:
    """The shared-memory layouts of the scale chunks' boxes (uint8 scales and mins, float16
    super-block scales): unswizzled, so a step's columns are a plain slice."""
    return (
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2),
    )


def scales_by_tma_ok(config: TmaConfig, parts: WeightParts, k: int) -> bool:
    """Whether the kernel may copy the scales by TMA (``SCALES_TMA``): each split's K whole
    chunks (:func:`tma_scales_by_tma`, which also makes the rows of k/32 and k/64 bytes 16-byte
    multiples), and contiguous scales, mins and super-scales on 16-byte aligned bases."""
    return tma_scales_by_tma(config, k) and all(
        part.is_contiguous() and part.data_ptr() % 16 == 0 for part in parts[1:]
    )


def x_layout_ok(x: torch.Tensor) -> bool:
    """Whether a descriptor can cover x ``[M, K]``: a unit inner stride, a 16-byte aligned base and row stride."""
    return x.stride(1) == 1 and x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0


def codes_layout_ok(qs: torch.Tensor) -> bool:
    """Whether a descriptor can cover the code bytes ``qs`` ``[N, K/2]`` as int32 words: contiguous
    rows, a 16-byte aligned base and row stride (what :class:`~.weight.Q4KWeight` makes)."""
    return qs.stride(1) == 1 and qs.data_ptr() % 16 == 0 and qs.stride(0) % 16 == 0


def launch_tma(
    config: TmaConfig,
    x: torch.Tensor,
    parts: WeightParts,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    scales_tma: bool = True,
) -> None:
    """The Gluon launch (and, with a split and without ``FUSED_REDUCE``, the reduce) on tensors
    :func:`x_layout_ok` and :func:`codes_layout_ok` admit: ``out`` ``[M, N]`` ``= x @ dequant(W)^T
    (+ bias)``, N a multiple of ``BLOCK_N`` and K of ``BLOCK_K * SPLIT_K`` (the space and
    :func:`.kernel.serve` see to both). The scales come by TMA wherever :func:`scales_by_tma_ok`
    allows it (``scales_tma=False`` loads them into registers instead, for a comparison); where
    they cannot, ``LOADER_WARP`` and ``W_REGISTERS`` configs run the plain kernel
    (:func:`tma_kernel_for`)."""
    qs, scales, mins, super_scales = parts
    m, k = x.shape
    n = qs.shape[0]
    bm, bn, bk, split = config.BLOCK_M, config.BLOCK_N, config.BLOCK_K, config.SPLIT_K
    x_box = min(bm, TMA_BOX_ROWS)
    x_layout, q_layout = _layouts(x.dtype, x_box, bn, bk)
    x_desc = unchecked_gluon_descriptor(x, [x_box, bk], x_layout)
    q_desc = unchecked_gluon_descriptor(qs.view(torch.int32), [bn, bk // 8], q_layout)
    by_tma = scales_tma and scales_by_tma_ok(config, parts, k)
    if by_tma:
        byte_layout, half_layout = _scale_layouts()
        sc_desc = unchecked_gluon_descriptor(scales, [bn, TMA_SCALE_CHUNK_K // 32], byte_layout)
        mn_desc = unchecked_gluon_descriptor(mins, [bn, TMA_SCALE_CHUNK_K // 32], byte_layout)
        # (d, dmin) pairs as one row of k / 128 float16 per weight row.
        ss_desc = unchecked_gluon_descriptor(super_scales.view(n, -1), [bn, TMA_SCALE_CHUNK_K // 128], half_layout)
    else:
        sc_desc = mn_desc = ss_desc = q_desc  # not read
    out_strides = out.stride()
    if split > 1:
        # Float32 partials from the caching allocator (a captured graph's pool under capture).
        part = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
        part_strides = part.stride()[:2]
    else:
        part, part_strides = out, (0, 0)
    fused = config.FUSED_REDUCE and split > 1
    grid = (n // bn, split, ceil_div(m, bm))
    counters = arrival_counters(grid[0] * grid[2], out.device, fresh=traced(x)) if fused else out
    stride_bn = bias.stride(0) if bias is not None else 0
    bias_arg = bias if bias is not None else out
    kernel, extra = tma_kernel_for(config, by_tma)
    # Bound: later launches of a compiled config skip JITFunction.run's per-call Python.
    bound(kernel)[grid](
        x_desc, q_desc, sc_desc, mn_desc, ss_desc, scales, mins, super_scales, bias_arg, out, part, counters, m,
        scales.stride(0), super_scales.stride(0), *out_strides, *part_strides, stride_bn,
        # A split without the fused reduce leaves the bias to the reduce launch.
        HAS_BIAS=bias is not None and (split == 1 or fused),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_TILES=k // bk // split, NUM_STAGES=config.num_stages,
        SWAP=config.SWAP_AB, SPLIT_K=split, FUSED_REDUCE=fused, PACKED_DEQUANT=config.PACKED_DEQUANT,
        SCALES_TMA=by_tma, num_warps=config.num_warps, **extra,
    )  # fmt: skip
    if split > 1 and not fused:
        from .launch import reduce_grid, splitk_reduce  # launch.py imports this module

        splitk_reduce(reduce_grid(m, n), part, bias_arg, out, stride_bn, has_bias=bias is not None)


def tma_kernel_for(config: TmaConfig, scales_by_tma: bool) -> tuple[Any, dict[str, bool]]:
    """The Gluon kernel a config's K loop runs and the constexprs it adds to the plain kernel's:
    with the scales by TMA, the weight tile in registers (``W_REGISTERS``, with or without the
    loader warp) or the loader warp alone (``LOADER_WARP``); otherwise the plain kernel, whose
    outputs are the same."""
    if scales_by_tma and config.W_REGISTERS and config.SWAP_AB and config.PACKED_DEQUANT:
        return _q4k_gemm_tma_rs_kernel, {"LOADER": config.LOADER_WARP}
    if scales_by_tma and config.LOADER_WARP:
        return _q4k_gemm_tma_loader_kernel, {}
    return _q4k_gemm_tma_kernel, {}


def portable_stand_in(config: TmaConfig) -> PortableConfig:
    """The portable config with the tma config's tiles: what runs where descriptors cannot cover
    the tensors. Its M tile is at most the portable member's largest, 128 rows."""
    return PortableConfig(
        BLOCK_M=min(config.BLOCK_M, max(SPACE.members["portable"].dimensions["BLOCK_M"])),
        BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K,
        GROUP_M=1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        SPLIT_K=config.SPLIT_K,
    )


def _schema() -> str:
    types = SPACE.members["tma"].field_types
    fields = ", ".join(f"{_SCHEMA_TYPES[types[name]]} {name}" for name in _OP_FIELDS)
    tensors = "Tensor x, Tensor qs, Tensor scales, Tensor mins, Tensor super_scales, Tensor? bias, Tensor(a!) out"
    return f"({tensors}, *, {fields}) -> ()"


@functools.lru_cache(maxsize=256)
def _op_config(fields: tuple[tuple[str, Any], ...]) -> TmaConfig:
    """The config an op call's fields stand for (built once per distinct config)."""
    config: TmaConfig = SPACE.from_fields({"path": "tma", **dict(fields)})
    return config


def _body(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    super_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    **fields: Any,
) -> None:
    run_tma(_op_config(tuple(fields.items())), x, (qs, scales, mins, super_scales), bias, out)


_TMA_OP = register_schema_op("tritune::q4k_linear_tma", _body, _schema(), mutated=(6,), opaque=True)


def run_tma(
    config: TmaConfig, x: torch.Tensor, parts: WeightParts, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """The tma path on plain tensors: x ``[M, K]`` with a unit inner stride, ``out`` ``[M, N]``.

    An x whose base or row stride is not 16-byte aligned (a slice of a wider tensor) is copied
    once into a fresh tensor; code bytes no descriptor can cover (a direct call of the op with a
    view) run the portable kernel with the same tiles instead.
    """
    if not x_layout_ok(x):
        x = x.clone(memory_format=torch.contiguous_format)
    if not codes_layout_ok(parts[0]):
        from .launch import launch
        from .weight import Q4KWeight

        launch(portable_stand_in(config), x, Q4KWeight(*parts), bias, out)
        return
    launch_tma(config, x, parts, bias, out)


def dispatch_tma(
    config: TmaConfig, x: torch.Tensor, parts: WeightParts, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """From the declaration's launch: run directly on plain tensors, else through the opaque op
    (a tracer sees one call it need not look into)."""
    if in_direct_body():
        run_tma(config, x, parts, bias, out)
    else:
        _TMA_OP(x, *parts, bias, out, **{name: getattr(config, name) for name in _OP_FIELDS})

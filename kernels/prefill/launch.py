"""The launches of prefill attention: the portable, TMA and warp-specialized (ws) paths, by ``config.path``.

The portable launch is a plain ``wrap_triton(kernel)[grid](...)``, which ``torch.compile`` traces
inside the kernel's ``triton_op``. The TMA launch builds host-side ``TensorDescriptor`` objects,
which torch cannot trace inside a ``triton_op`` body yet, so it runs inside its own opaque op,
``tritune::prefill_attention_tma``: a traced call records that op; a call whose body runs on plain
tensors (:func:`~tritune.kernels._oplib.in_direct_body`) runs its body directly, without paying
the op's dispatch a second time. The ws path (Gluon, SM90 only) does the same through
``tritune::prefill_attention_ws``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from triton.experimental.gluon import language as gl

from tritune.search_spaces.tma_prefill import SPACE, PortableConfig, PrefillConfig, TmaConfig, WsConfig

from .._fastlaunch import bound
from .._launch import (
    GLUON_DTYPES,
    LOG2E,
    ceil_div,
    next_pow2,
    prepare_interpreter,
    runs_on_interpreter,
    unchecked_descriptor,
    unchecked_gluon_descriptor,
)
from .._oplib import in_direct_body, register_schema_op, wrap_triton
from ._gluon_ws import CONSUMER_WARPS, _prefill_ws_kernel
from ._triton_portable import _prefill_fwd_kernel
from ._triton_tma import _merge_splits_kernel, _prefill_tma_kernel

__all__ = ["kernel_scale", "launch", "launch_portable", "launch_tma", "launch_ws"]

#: Whether the kernels were decorated for the interpreter, which launches then prepare first.
_INTERPRETED = runs_on_interpreter(_prefill_fwd_kernel)
#: In-tile offsets are int32: a K/V tile whose elements lie this far apart takes 64-bit ones.
_INT32_SPAN = 2**31
#: float32's smallest normal number, the scale a zero ``softmax_scale`` runs with (:func:`kernel_scale`).
_FLT_MIN = 1.1754943508222875e-38
#: Query rows one program of the merge kernel combines.
_MERGE_BLOCK_M = 16
#: CUDA caps a grid's y and z extents at this: a call with more batches on either launches in chunks.
_GRID_YZ = 65535


def kernel_scale(softmax_scale: float) -> tuple[float, bool]:
    """``(qk_scale, NEG_SCALE)`` of the kernels for ``softmax_scale``: the scale in log2 units and
    whether it is negative (the row max of the scaled scores is then the raw scores' min).

    A zero (or subnormal) scale runs as float32's smallest normal one: every finite score still
    gives an exponent of 0 (all visible keys weigh the same, as with 0), while a hidden key's
    ``-inf`` stays ``-inf`` where ``-inf * 0`` would be NaN.
    """
    qk_scale = softmax_scale * LOG2E
    if abs(qk_scale) < _FLT_MIN:
        return _FLT_MIN, False
    return qk_scale, qk_scale < 0


def _wide_tile(t: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether a ``[rows, cols]`` tile of ``t``'s last two dims spans 2**31 elements or more."""
    return bool(rows * t.stride(2) + cols * t.stride(3) >= _INT32_SPAN)


def _in_batch_chunks(
    launch_path: Callable[..., None],
    chunk: int,
    config: PrefillConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """``launch_path`` on batches ``[b0, b0 + chunk)`` in turn: what serves a call whose grid would
    put more batches on its y or z axis than CUDA allows (:data:`_GRID_YZ`).

    Each chunk is a batch view of every tensor (a ``[B]`` ``kv_len`` too; a ``[]`` one serves them
    all). A view starts a whole batch stride past its tensor's base, so where descriptors could
    cover the tensor (16-byte aligned base and strides) they cover each view too.
    """
    per_batch = kv_len is not None and kv_len.dim() == 1
    for b0 in range(0, q.shape[0], chunk):
        b1 = b0 + chunk
        lengths = kv_len[b0:b1] if per_batch and kv_len is not None else kv_len
        launch_path(config, q[b0:b1], k[b0:b1], v[b0:b1], lengths, causal, softmax_scale, out[b0:b1])


def _kv_len_stride(kv_len: torch.Tensor | None) -> int:
    # A [] kv_len serves every sequence; a [B] view such as lengths[::2] is read through its stride.
    return kv_len.stride(0) if kv_len is not None and kv_len.dim() == 1 else 0


def launch_portable(
    config: PortableConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """Launch the portable kernel on checked inputs, writing ``out`` through its strides."""
    batch, q_heads, seqlen_q, head_dim = q.shape
    if batch > _GRID_YZ:  # batches on the grid's z axis
        _in_batch_chunks(launch_portable, _GRID_YZ, config, q, k, v, kv_len, causal, softmax_scale, out)
        return
    qk_scale, neg_scale = kernel_scale(softmax_scale)
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    grid = (ceil_div(seqlen_q, config.BLOCK_M), q_heads, batch)
    head_dim_pad = next_pow2(head_dim)
    wide = _wide_tile(k, config.BLOCK_N, head_dim_pad) or _wide_tile(v, config.BLOCK_N, head_dim_pad)
    wrap_triton(_prefill_fwd_kernel)[grid](
        q, k, v, out, kv_len, *q.stride(), *k.stride(), *v.stride(), *out.stride(), _kv_len_stride(kv_len),
        seqlen_q, seqlen_k, qk_scale,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, CAUSAL=causal, HAS_KV_LEN=kv_len is not None,
        DOT_IN_FP32=q.device.type == "cpu", NEG_SCALE=neg_scale, WIDE_KV_TILES=wide,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def launch_tma(
    config: TmaConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """Launch the TMA kernel (and the merge, with a KV split) on checked, TMA-eligible inputs."""
    batch, q_heads, seqlen_q, head_dim = q.shape
    split = config.SPLIT_KV
    if batch * split > _GRID_YZ:  # batches x splits on the grid's z axis (the merge's: batches)
        chunk = _GRID_YZ // split
        _in_batch_chunks(launch_tma, chunk, config, q, k, v, kv_len, causal, softmax_scale, out)
        return
    qk_scale, neg_scale = kernel_scale(softmax_scale)
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    heads = group if config.PACK_GQA else 1
    rows = config.BLOCK_M // heads
    # tma_layout_ok and the op body's base check established what the descriptors assert.
    q_desc = unchecked_descriptor(q, [1, heads, rows, head_dim])
    k_desc = unchecked_descriptor(k, [1, 1, config.BLOCK_N, head_dim])
    v_desc = unchecked_descriptor(v, [1, 1, config.BLOCK_N, head_dim])
    o_desc = unchecked_descriptor(out, [1, heads, rows, head_dim])
    if split > 1:
        part_o = torch.empty((split, batch, q_heads, seqlen_q, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, split, batch, q_heads, seqlen_q), dtype=torch.float32, device=q.device)
        part_m, part_l = part_ml[0], part_ml[1]
    else:
        part_o = part_m = part_l = None
    grid = (ceil_div(seqlen_q, rows), q_heads // heads, batch * split)
    wrap_triton(_prefill_tma_kernel)[grid](
        q_desc, k_desc, v_desc, o_desc, kv_len, part_o, part_m, part_l, _kv_len_stride(kv_len),
        batch, q_heads, seqlen_q, seqlen_k, qk_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N,
        PACK_GQA=bool(config.PACK_GQA), SPLIT_KV=split, CAUSAL=causal, HAS_KV_LEN=kv_len is not None,
        DOT_IN_FP32=q.device.type == "cpu", NEG_SCALE=neg_scale,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        merge_grid = (ceil_div(seqlen_q, _MERGE_BLOCK_M), q_heads, batch)
        wrap_triton(_merge_splits_kernel)[merge_grid](
            part_o, part_m, part_l, out, *out.stride(), batch, q_heads, seqlen_q,
            HEAD_DIM=head_dim, BLOCK_M=_MERGE_BLOCK_M, SPLIT_KV=split, num_warps=4,
        )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _ws_layouts(dtype: torch.dtype, rows: int, block_n: int, head_dim: int) -> tuple[Any, Any]:
    """The shared-memory layouts of the ws path's Q/O and K/V descriptors (``[1, 1, rows, D]``
    boxes over the 4-D tensors), built once per (dtype, tiles): what a launch would otherwise
    recompute on every call."""
    element = GLUON_DTYPES[dtype]
    return (
        gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], element),
        gl.NVMMASharedLayout.get_default_for([1, 1, block_n, head_dim], element),
    )


def launch_ws(
    config: WsConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """Launch the warp-specialized Gluon kernel (SM90 only) on checked, TMA-eligible inputs.

    One program per ``BLOCK_M`` query rows of one head: two consumer warpgroups of
    ``BLOCK_M // 2`` rows each and a producer warp (:mod:`._gluon_ws`). The descriptors are host
    objects, so the launch stays CUDA-graph capturable and ``kv_len`` is read on the device.
    """
    batch, q_heads, seqlen_q, head_dim = q.shape
    if batch > _GRID_YZ:  # batches on the grid's y axis
        _in_batch_chunks(launch_ws, _GRID_YZ, config, q, k, v, kv_len, causal, softmax_scale, out)
        return
    qk_scale, neg_scale = kernel_scale(softmax_scale)
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    rows = config.BLOCK_M // 2
    q_layout, kv_layout = _ws_layouts(q.dtype, rows, config.BLOCK_N, head_dim)
    q_box = [1, 1, rows, head_dim]
    kv_box = [1, 1, config.BLOCK_N, head_dim]
    # M tiles on the slowest axis (at most 65535: Lq up to 8M rows), walked longest first.
    grid = (q_heads, batch, ceil_div(seqlen_q, config.BLOCK_M))
    bound(_prefill_ws_kernel)[grid](
        unchecked_gluon_descriptor(q, q_box, q_layout), unchecked_gluon_descriptor(k, kv_box, kv_layout),
        unchecked_gluon_descriptor(v, kv_box, kv_layout), unchecked_gluon_descriptor(out, q_box, q_layout),
        kv_len, _kv_len_stride(kv_len), seqlen_q, seqlen_k, qk_scale,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N,
        NUM_STAGES=config.num_stages, CAUSAL=causal, HAS_KV_LEN=kv_len is not None, NEG_SCALE=neg_scale,
        CONSUMER_REGS=config.CONSUMER_REGS, PRODUCER_REGS=config.PRODUCER_REGS,
        num_warps=CONSUMER_WARPS.value,
    )  # fmt: skip


# ---- the nested TMA and ws ops ---------------------------------------------------------------

_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}
_SCHEMA_ARGUMENTS = "Tensor q, Tensor k, Tensor v, Tensor? kv_len, bool causal, float softmax_scale, Tensor(a!) out"


def _op_fields(path: str) -> tuple[str, ...]:
    """The config fields the nested op of ``path`` carries by name: its member's, less ``path``
    (the op's name says the path)."""
    return tuple(name for name in SPACE.members[path].dimensions if name != "path")


#: The fields each nested op carries, by path.
_OP_FIELDS = {path: _op_fields(path) for path in ("tma", "ws")}


def _schema(path: str) -> str:
    types = SPACE.members[path].field_types
    fields = ", ".join(f"{_SCHEMA_TYPES[types[name]]} {name}" for name in _OP_FIELDS[path])
    return f"({_SCHEMA_ARGUMENTS}, *, {fields}) -> ()"


@functools.lru_cache(maxsize=256)
def _op_config(fields: tuple[tuple[str, Any], ...], path: str) -> TmaConfig | WsConfig:
    """The TMA (or ws) config an op call's fields stand for (built once per distinct config)."""
    config: TmaConfig | WsConfig = SPACE.from_fields({"path": path, **dict(fields)})
    return config


def _nested_body(path: str) -> Callable[..., None]:
    """The body of a nested op for ``path`` ("tma" or "ws"): its config from the op's fields, then
    the launch (or the portable stand-in where descriptors cannot cover the tensors)."""

    def body(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_len: torch.Tensor | None,
        causal: bool,
        softmax_scale: float,
        out: torch.Tensor,
        **fields: Any,
    ) -> None:
        _run_tma(_op_config(tuple(fields.items()), path), q, k, v, kv_len, causal, softmax_scale, out)

    return body


_TMA_OP = register_schema_op(
    "tritune::prefill_attention_tma", _nested_body("tma"), _schema("tma"), mutated=(6,), opaque=True
)
#: The ws path's Gluon descriptors are host objects too: its launch runs in an opaque op of its own,
#: carrying the ws member's fields.
_WS_OP = register_schema_op(
    "tritune::prefill_attention_ws", _nested_body("ws"), _schema("ws"), mutated=(6,), opaque=True
)


def _op_field_values(config: TmaConfig | WsConfig) -> Mapping[str, Any]:
    return {name: getattr(config, name) for name in _OP_FIELDS[config.path]}


def _run_tma(
    config: TmaConfig | WsConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """The TMA (or ws) launch on real tensors, or its portable stand-in where descriptors cannot cover them."""
    from .kernel import portable_stand_in, tma_layout_ok

    if not tma_layout_ok(q, k, v, out):
        # A compiled graph gets here with a misaligned base (its facts could not see pointers), and
        # a direct call of the nested op with any layout: the descriptors are built unchecked.
        # The stand-in keeps the TMA tiles only where the portable kernel fits them.
        stand_in = portable_stand_in(config, q, k, v, kv_len, causal, softmax_scale, out)
        launch_portable(stand_in, q, k, v, kv_len, causal, softmax_scale, out)
        return
    if isinstance(config, WsConfig):
        launch_ws(config, q, k, v, kv_len, causal, softmax_scale, out)
    else:
        launch_tma(config, q, k, v, kv_len, causal, softmax_scale, out)


# ---- the declaration's launch ----------------------------------------------------------------


def launch(
    config: PrefillConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """Run ``config``'s path on checked arguments (outputs allocated, the scale resolved)."""
    if _INTERPRETED:
        prepare_interpreter()
    if isinstance(config, PortableConfig):
        launch_portable(config, q, k, v, kv_len, causal, softmax_scale, out)
    elif in_direct_body():
        # Plain tensors already: the TMA op's own dispatch would be a second toll.
        _run_tma(config, q, k, v, kv_len, causal, softmax_scale, out)
    else:
        op = _WS_OP if config.path == "ws" else _TMA_OP
        op(q, k, v, kv_len, causal, softmax_scale, out, **_op_field_values(config))

"""``q4k_linear``: a linear layer with a GGUF Q4_K weight, registered as ``tritune::q4k_linear``.

In plain eager mode the checks and the facts are one pass over the arguments' attributes
(:func:`_eager_facts`); anything unusual takes the detailed checks, which explain an error.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tritune.search_spaces.q4k_fp8_gemm import Q4KConfig

from .._launch import (
    check_device,
    check_out_memory,
    device_index,
    out_is_separate,
    prepare_interpreter,
    runs_on_interpreter,
)
from .._oplib import register_op
from ..dispatcher import dispatch, dispatch_eager
from .launch import KERNELS, run_q4k_gemm
from .spec import SPEC
from .weight import Q4KWeight

_DTYPES = (torch.bfloat16, torch.float16)
#: The dtype names of the facts (``SPEC.facts``: ``str(dtype)`` without ``torch.``).
_DTYPE_KEYS = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _q4k_linear_op(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    super_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    path: str,
    BLOCK_M: int,
    BLOCK_N: int,
    BLOCK_K: int,
    GROUP_M: int,
    num_warps: int,
    num_stages: int,
    SPLIT_K: int,
    SCALE_FOLD: bool,
    SWAP_AB: bool,
    CHUNK_N: int,
    FAST_ACCUM: bool,
) -> None:
    if _CPU_RUNS:
        prepare_interpreter()
    config = Q4KConfig(
        path, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K, SCALE_FOLD, SWAP_AB,
        CHUNK_N, FAST_ACCUM,
    )  # fmt: skip
    run_q4k_gemm(config, x, qs, scales, mins, super_scales, bias, out)


q4k_linear_op = register_op("tritune::q4k_linear", _q4k_linear_op, mutates_args=("out",), kernels=KERNELS)

#: Whether the kernels were decorated for the interpreter: CPU tensors may run (what ``check_device``
#: asks), and the body prepares the interpreter before its first launch.
_CPU_RUNS = runs_on_interpreter(KERNELS[0])
_TENSOR = torch.Tensor
_is_compiling = torch.compiler.is_compiling


def _check(x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if not isinstance(weight, Q4KWeight):
        raise TypeError(f"weight: expected a Q4KWeight, got {type(weight).__name__}")
    n, k = weight.shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x: expected dtype torch.bfloat16 or torch.float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected shape [..., K={k}] to match the weight, got {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x: on {x.device}, but weight is on {weight.device}")
    check_device("x", x, KERNELS[0])
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias: on {bias.device}, but x is on {x.device}")
        if not bias.is_floating_point():
            raise TypeError(f"bias: expected a floating-point dtype, got {bias.dtype}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        expected = (*x.shape[:-1], n)
        if tuple(out.shape) != expected:
            raise ValueError(f"out: expected shape {expected}, got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"out: expected dtype {x.dtype} (x's), got {out.dtype}")
        if out.device != x.device:
            raise ValueError(f"out: on {out.device}, but x is on {x.device}")
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
        qs, scales, mins, super_scales = weight.tensors()
        check_out_memory(
            out,
            {"x": x, "bias": bias, "weight.qs": qs, "weight.scales": scales, "weight.mins": mins,
             "weight.super_scales": super_scales},
        )  # fmt: skip


def _eager_facts(
    x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None, out: torch.Tensor | None
) -> tuple[Any, ...] | None:
    """``SPEC.facts`` of a valid plain eager call, read once from the arguments; else None.

    A decode step calls this once per projection, and every tensor attribute read costs time:
    :func:`_check` then ``SPEC.facts`` read several twice. This accepts only what ``_check``
    accepts and returns ``SPEC.facts``'s value for the flattened ``x`` (the tests compare them);
    ``None`` (bad input, a tensor subclass, ``torch.compile``) sends the call to ``_check``, which
    raises the error naming the argument. A given ``out`` also pays the memory checks.
    """
    if _is_compiling() or type(x) is not _TENSOR or type(weight) is not Q4KWeight:
        return None
    n, k = weight.shape
    name = _DTYPE_KEYS.get(x.dtype)
    shape = x.shape
    if name is None or not shape or shape[-1] != k:
        return None
    device = x.device
    if device != weight.qs.device or not (x.is_cuda or (_CPU_RUNS and x.is_cpu)):
        return None
    if bias is not None and (
        type(bias) is not _TENSOR or bias.shape != (n,) or bias.device != device or not bias.is_floating_point()
    ):
        return None
    if out is not None and (
        type(out) is not _TENSOR
        or out.shape != (*shape[:-1], n)
        or out.dtype is not x.dtype
        or out.device != device
        or not out.is_contiguous()
        or not out_is_separate(out, (x, bias, *weight.tensors()))
    ):
        return None
    return (shape[0] if len(shape) == 2 else math.prod(shape[:-1]), n, k, name)


def q4k_linear(
    x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T + bias`` for a Q4_K weight ``W`` ``[N, K]``; ``x`` is ``[..., K]`` bf16 or fp16.

    The result is ``[..., N]`` in x's dtype, written to ``out`` when given (contiguous, sharing no
    memory with x, bias or the weight). The config (portable or fp8 path, tiles, split-K) comes
    from the dispatcher for this GPU, M bucket, N and K.
    """
    facts = _eager_facts(x, weight, bias, out)
    if facts is None:
        _check(x, weight, bias, out)
    n, k = weight.shape
    # A 2-D x is its own [M, K] view (reshape and view each cost host time per call).
    x2d = x if facts is not None and x.dim() == 2 else x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if facts is None:
        values = dispatch(SPEC.name, x.device.type, device_index(x.device), SPEC.facts(x2d, weight, bias))
    else:
        values = dispatch_eager(SPEC.name, x.device, facts)
    out2d = out if facts is not None and out.dim() == 2 else out.view(-1, n)
    # Plain eager calls run the body directly (TritonOp); tracers and dispatch modes see the op.
    q4k_linear_op(x2d, *weight.tensors(), bias, out2d, *values)
    return out

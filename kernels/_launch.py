"""Host-side pieces the attention families share: argument checks, device facts and workspaces.

Nothing here runs at import: the SM-count cache fills on a device's first launch, the arrival
counters on a device's first fused split-K launch, and the interpreter's fix on the first launch
of an interpreted kernel (:func:`prepare_interpreter`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from ._interpreter import fix_interpreter_index
from ._recording import recording
from .arguments import Rule, Scalar
from .device import device_info

__all__ = [
    "COUNTERS",
    "DTYPE_NAMES",
    "GLUON_DTYPES",
    "LOG2E",
    "MAX_SOFTMAX_SCALE",
    "MERGE_TILE",
    "SM_COUNTS",
    "SOFTMAX_SCALE",
    "arrival_counters",
    "check_out_memory",
    "device_index",
    "gqa_rule",
    "out_is_separate",
    "overlaps_itself",
    "prepare_interpreter",
    "runs_on_interpreter",
    "same_layout",
    "sm_count",
    "traced",
    "unchecked_descriptor",
    "unchecked_gluon_descriptor",
    "workspace",
]

log = logging.getLogger("tritune.launch")

#: Gluon's names of the dtypes the Gluon kernels take (bf16 and fp16 activations).
GLUON_DTYPES: dict[torch.dtype, Any] = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
#: Key names of the dtypes the attention kernels serve.
DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: log2(e): the kernels keep scores in the log2 domain, with this folded into the softmax scale.
LOG2E = 1.4426950408889634
#: Largest ``|softmax_scale|`` served (see :data:`SOFTMAX_SCALE`).
MAX_SOFTMAX_SCALE = 1e4
#: The ``softmax_scale`` argument of every attention kernel: None means ``1 / sqrt(D)``.
#:
#: Zero and negative scales are served. The kernels multiply fp32 scores by ``softmax_scale *
#: log2(e)``, so with ``|softmax_scale| <= 1e4`` a score stays finite up to ``FLT_MAX / (1e4 *
#: log2 e)``, about 2.4e34: any score of fp16 inputs (at most ``256 * 65504**2``, about 1.1e12) and
#: of bf16 inputs with elements up to about 9e15. Beyond the bound a product overflows to inf for
#: smaller scores and the row's softmax turns into NaN or zeros. Typical scales are ``1 / sqrt(D)``
#: (0.0625-0.125), so the bound leaves ample room for temperatures.
SOFTMAX_SCALE = Scalar(
    "softmax_scale",
    float,
    optional=True,
    bounds=(-MAX_SOFTMAX_SCALE, MAX_SOFTMAX_SCALE),
    why="the kernels scale fp32 scores by it",
    resolve=lambda D: 1.0 / math.sqrt(D),
)


def gqa_rule(kv_argument: str | None = None) -> Rule:
    """The rule every attention kernel states: q's heads ``Hq`` a multiple of the KV heads ``Hkv``."""
    owner = f"{kv_argument}'s " if kv_argument else ""
    return Rule(
        "q",
        lambda Hq, Hkv: Hkv > 0 and Hq % Hkv == 0,
        "{Hq} query heads are not a multiple of " + owner + "{Hkv} KV heads (GQA)",
    )


#: fp32 values of one merge program's tile of partials (64 registers a thread at 4 warps).
MERGE_TILE = 8192
#: Device -> SM count, filled on a device's first launch (the launch path must not query it per call).
SM_COUNTS: dict[torch.device, int] = {}
#: (device, stream handle, or None for CUDA-graph captures) -> zeroed int32 arrival counters.
COUNTERS: dict[tuple[torch.device, int | None], torch.Tensor] = {}
#: Counter buffers since replaced by bigger ones: never freed, as a captured graph may still use one.
_RETIRED_COUNTERS: list[torch.Tensor] = []
#: Fewest counters a buffer holds (4 KiB), so that a growing batch rarely reallocates.
_MIN_COUNTERS = 1024
_warned_capture_counters: set[torch.device] = set()
#: Whether :func:`prepare_interpreter` has run in this process.
_interpreter_prepared = False


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)``, for launch grids on the host: Triton 3.6's ``triton.cdiv`` is a constexpr
    function, and called from host code each call unwraps its arguments (microseconds a launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two at least ``n`` (``n >= 1``): ``triton.next_power_of_2`` without its
    host cost (see :func:`ceil_div`)."""
    return 1 << (n - 1).bit_length()


def runs_on_interpreter(kernel: Any) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (the test ``register_op`` uses too)."""
    return isinstance(kernel, InterpretedFunction)


def prepare_interpreter() -> None:
    """Make the Triton interpreter able to run tritune's kernels; the op bodies call this before
    launching interpreted kernels, so that ``TRITON_INTERPRET=1`` works without any setup.

    Runs once per process, at the first interpreted launch: a process that never launches on the
    interpreter never patches it.
    """
    global _interpreter_prepared
    if not _interpreter_prepared:
        fix_interpreter_index()
        _interpreter_prepared = True


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a zero stride, an expanded or overlapping view).

    Sorted by stride, each dimension of size > 1 must step past everything the smaller ones reach:
    true of every contiguous, permuted (for instance transposed) or sliced layout. An exotic
    interleaved layout that does not overlap but fails this is refused too.
    """
    if t.is_contiguous():
        return False
    shape = t.shape
    if 0 in shape:
        return False
    reach = 1
    for stride, size in sorted((stride, size) for size, stride in zip(shape, t.stride(), strict=True) if size > 1):
        if stride < reach:
            return True
        reach += (size - 1) * stride
    return False


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` addresses of the bytes ``t`` reads or writes, None when it has no element.

    Absolute addresses: views of one storage compare by their offsets in it, and tensors of
    distinct storages can only meet if their memory is the same (``from_blob``, DLPack aliases).
    """
    first = t.data_ptr()
    if t.is_contiguous():
        end = first + t.nbytes
        return (first, end) if end > first else None
    extent = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if not size:
            return None
        extent += (size - 1) * stride
    return first, first + extent * t.element_size()


def out_is_separate(out: torch.Tensor, inputs: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether ``out`` has no self-overlap and no byte in common with ``inputs``: the fast paths' form
    of :func:`check_out_memory` for plain tensors (False sends the call to the detailed checks)."""
    if torch._C._are_functorch_transforms_active() or overlaps_itself(out):
        return False
    span = _byte_span(out)
    if span is None:
        return True
    first, end = span
    for t in inputs:
        if t is not None:
            other = _byte_span(t)
            if other is not None and other[0] < end and first < other[1]:
                return False
    return True


def _memory_known(t: torch.Tensor) -> bool:
    """Whether ``t``'s addresses are real: not a fake, meta or functorch-wrapped tensor."""
    return not (isinstance(t, FakeTensor) or t.is_meta or torch._C._functorch.is_functorch_wrapped_tensor(t))


def check_out_memory(out: torch.Tensor, inputs: dict[str, torch.Tensor | None], name: str = "out") -> None:
    """Refuse an ``out`` (ValueError naming it ``name``) whose elements share memory, or that shares memory
    with an input: the kernels write ``out`` tile by tile while other programs still read, so
    either gives a wrong result. Checked on real tensors only: a traced graph has no addresses.
    """
    if torch.compiler.is_compiling() or not _memory_known(out):
        return
    if overlaps_itself(out):
        raise ValueError(
            f"{name}: some of its elements share memory (shape {tuple(out.shape)}, strides {tuple(out.stride())}: "
            "a zero stride or an expanded view); expected a tensor in which each element has its own memory"
        )
    span = _byte_span(out)
    if span is None:
        return
    first, end = span
    for input_name, t in inputs.items():
        if t is None or not _memory_known(t):
            continue
        other = _byte_span(t)
        if other is not None and other[0] < end and first < other[1]:
            raise ValueError(
                f"{name}: overlaps {input_name} in memory; expected a separate tensor (the kernels read "
                f"{input_name} while writing {name})"
            )


def device_index(device: torch.device) -> int:
    """The dispatcher's device index: the CUDA ordinal, or -1 for a device without one (CPU)."""
    return -1 if device.index is None else device.index


def sm_count(device: torch.device) -> int:
    """SM count of ``device`` (1 for the interpreter), cached per device."""
    count = SM_COUNTS.get(device)
    if count is None:
        count = SM_COUNTS[device] = device_info(device).sm_count
    return count


def same_layout(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor with ``t``'s dtype, device, shape and strides whose address has the
    same remainder modulo 16 bytes: a kernel launched on it is specialized as on ``t`` (Triton
    specializes pointers on 16-byte alignment and integers on divisibility by 16)."""
    if t.numel() == 0:
        return torch.empty_like(t)
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    offset = (t.data_ptr() % 16) // t.element_size()
    storage = torch.empty(span + offset, dtype=t.dtype, device=t.device)
    return storage.as_strided(t.shape, t.stride(), offset)


def unchecked_descriptor(t: torch.Tensor, box: list[int]) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(t, box)`` without the class's own checks, for a launch whose
    eligibility rule has established them for this call: a 16-byte aligned base, outer strides of
    16 bytes, a unit inner stride, no empty dimension, a power-of-two box. Those checks are Python
    run on every launch; the fields are the same (a test compares them).
    """
    descriptor = TensorDescriptor.__new__(TensorDescriptor)
    descriptor.base = t
    descriptor.shape = t.shape
    descriptor.strides = t.stride()
    descriptor.block_shape = box
    descriptor.padding = "zero"
    return descriptor


def unchecked_gluon_descriptor(t: torch.Tensor, box: list[int], layout: Any) -> GluonTensorDescriptor:
    """A Gluon host descriptor over ``t``'s real shape and strides, built without the class's own
    checks: the Gluon twin of :func:`unchecked_descriptor`, for a launch whose eligibility rule
    established them (16-byte base and strides, unit inner stride, no empty dimension); repeating
    them costs about 5 us a descriptor in Python. ``layout`` is the box's shared-memory layout.
    """
    descriptor = GluonTensorDescriptor.__new__(GluonTensorDescriptor)
    descriptor.base = t
    descriptor.shape = list(t.shape)
    descriptor.strides = list(t.stride())
    descriptor.block_shape = box
    descriptor.layout = layout
    descriptor.padding = "zero"
    return descriptor


def workspace(numel: int, device: torch.device) -> torch.Tensor:
    """fp32 partials of a split launch."""
    # Never initialised: a merge reads only the partials that its launch's split programs wrote.
    return torch.empty(numel, dtype=torch.float32, device=device)


def traced(t: torch.Tensor) -> bool:
    """Whether a launch on ``t`` is being traced (fake or functional tensors, a dispatch mode, compiling).

    An ``nn.Parameter`` is a plain tensor here (it adds no dispatch of its own)."""
    return (
        (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter)
        # A recording's own dispatch mode (:mod:`._replay`) watches a plain eager call.
        or (torch._C._len_torch_dispatch_stack() > 0 and recording() is None)
        or torch.compiler.is_compiling()
    )


def _zeroed_counters(numel: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(max(_MIN_COUNTERS, 1 << (numel - 1).bit_length()), dtype=torch.int32, device=device)


def _cached_counters(slot: tuple[torch.device, int | None], numel: int) -> torch.Tensor:
    buffer = COUNTERS.get(slot)
    if buffer is None or buffer.numel() < numel:
        if buffer is not None:
            _RETIRED_COUNTERS.append(buffer)
        buffer = COUNTERS[slot] = _zeroed_counters(numel, slot[0])
    return buffer


def arrival_counters(numel: int, device: torch.device, *, fresh: bool = False) -> torch.Tensor:
    """At least ``numel`` int32 counters on ``device``, all zero, which the kernel leaves at zero.

    A fused split-K launch counts here the split programs of a row block that have finished; the
    last to arrive merges and puts the counter back to 0. So a buffer is zeroed once, when it is
    allocated, never per call (a memset launch would cost what fusing the merge saves), and a CUDA
    graph that captured its address finds it zero at every replay. A buffer outgrown by a bigger
    launch is kept alive, never freed, since a graph may hold its address.

    Two launches running at the same time must not share counters. Eager launches get a buffer
    per CUDA stream. Graph captures all share one buffer per device (replays may run on any
    stream), which eager launches size as they go, so that a warm-up call before the capture
    leaves one in place: replaying two graphs with decode launches concurrently on one device,
    or capturing two on forked streams of one graph, is not supported. A capture that finds the
    buffer too small gets its own, zeroed by a memset that every replay runs (correct, one more
    graph node). ``fresh``: the launch is being traced (:func:`traced`): a new zeroed tensor,
    which the traced graph then allocates and zeroes on each call.
    """
    if fresh:
        return torch.zeros(numel, dtype=torch.int32, device=device)
    if device.type != "cuda":
        # The interpreter runs one launch at a time.
        return _cached_counters((device, 0), numel)
    if torch.cuda.is_current_stream_capturing():
        buffer = COUNTERS.get((device, None))
        if buffer is not None and buffer.numel() >= numel:
            return buffer
        if device not in _warned_capture_counters:
            _warned_capture_counters.add(device)
            log.info(
                "%s: a CUDA-graph capture zeroes its own arrival counters on every replay; call once before "
                "capturing (same shapes) to avoid the memset",
                device,
            )
        # Allocated from the graph's pool: stream-ordered, and the memset is captured before the kernel.
        return torch.zeros(numel, dtype=torch.int32, device=device)
    _cached_counters((device, None), numel)
    slot = (device, torch.cuda.current_stream(device).cuda_stream)
    buffer = _cached_counters(slot, numel)
    rec = recording()
    if rec is not None:  # a replay of this call may use the buffer while it is this stream's
        rec.static(buffer, lambda: COUNTERS.get(slot) is buffer)
    return buffer

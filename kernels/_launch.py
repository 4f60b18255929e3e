"""Host-side pieces the attention families share: argument checks, device facts and workspaces.

Nothing here runs at import: the SM-count cache fills on a device's first launch, the arrival
counters on a device's first fused split-K launch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

from .device import device_info

__all__ = [
    "COUNTERS",
    "DTYPE_NAMES",
    "LOG2E",
    "MERGE_TILE",
    "SM_COUNTS",
    "arrival_counters",
    "check_device",
    "check_tensor",
    "device_index",
    "runs_on_interpreter",
    "sm_count",
    "traced",
    "workspace",
]

log = logging.getLogger("tritune.launch")

#: Key names of the dtypes the attention kernels serve.
DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: log2(e): the kernels keep scores in the log2 domain, with this folded into the softmax scale.
LOG2E = 1.4426950408889634
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


def check_tensor(name: str, t: object, rank: int) -> torch.Tensor:
    """``t`` if it is a tensor of ``rank`` dims, else a TypeError/ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected {rank} dims, got shape {tuple(t.shape)}")
    return t


def runs_on_interpreter(kernel: Any) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (the test ``register_op`` uses too)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(name: str, t: torch.Tensor, kernel: Any) -> None:
    """Refuse ``t`` (ValueError naming ``name``) unless ``kernel`` can run on its device.

    CUDA tensors run on any kernel; CPU tensors only on the Triton interpreter, which Triton
    chooses when a kernel is decorated: without it a CPU launch fails deep inside Triton.
    """
    kind = t.device.type
    if kind == "cuda":
        return
    if kind == "cpu":
        if runs_on_interpreter(kernel):
            return
        raise ValueError(
            f"{name}: a CPU tensor runs only on the Triton interpreter, which this process is not using; "
            "pass CUDA tensors, or set TRITON_INTERPRET=1 before tritune's kernels are imported"
        )
    raise ValueError(f"{name}: expected a CUDA tensor (or a CPU one on the Triton interpreter), got device {t.device}")


def device_index(device: torch.device) -> int:
    """The dispatcher's device index: the CUDA ordinal, or -1 for a device without one (CPU)."""
    return -1 if device.index is None else device.index


def sm_count(device: torch.device) -> int:
    """SM count of ``device`` (1 for the interpreter), cached per device."""
    count = SM_COUNTS.get(device)
    if count is None:
        count = SM_COUNTS[device] = device_info(device).sm_count
    return count


def workspace(numel: int, device: torch.device) -> torch.Tensor:
    """fp32 partials of a split launch."""
    # Never initialised: a merge reads only the partials that its launch's split programs wrote.
    return torch.empty(numel, dtype=torch.float32, device=device)


def traced(t: torch.Tensor) -> bool:
    """Whether a launch on ``t`` is being traced (fake or functional tensors, a dispatch mode, compiling)."""
    return type(t) is not torch.Tensor or torch._C._len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling()


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
    return _cached_counters((device, torch.cuda.current_stream(device).cuda_stream), numel)

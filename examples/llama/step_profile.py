"""Where a forward's time goes: the kernels of one call, grouped by the op they belong to, and the host gaps.

:func:`profile_call` runs a call under ``torch.profiler`` and sorts its kernels by name into
:data:`GROUPS`: tritune's Q4_K linear kernels, cuBLAS GEMMs, attention (tritune's and PyTorch's
SDPA backends) and everything else (norms, RoPE, SwiGLU, residual adds, copies). The span runs from
the first kernel's start to the last one's end; whatever part of it no kernel covers is a host
gap, time the GPU waited for the Python host to launch work (near zero for a CUDA-graph replay).

Grouping is by kernel name, so it needs no annotation in the model and works for graph replays,
whose kernels have no host op above them. Its limit: PyTorch's math SDPA backend runs as batched
GEMMs and a softmax, which land under cuBLAS and other. On the CPU (the Triton interpreter) there
are no device kernels; the top-level host ops stand in for them, so the code paths run end to end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

GROUPS = ("q4k_linear", "cuBLAS linear", "attention", "norms/rope/other")

_Q4K = ("q4k", "quantize_rows", "staged_prepass", "splitk_reduce")
_ATTENTION = ("attention", "prefill", "decode_split", "decode_merge", "varlen", "merge_splits", "flash", "fmha",
              "cudnn", "sdpa", "softmax")  # fmt: skip
_GEMM = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "aten::linear", "aten::mm", "aten::addmm")


def classify(kernel: str) -> str:
    """The group of :data:`GROUPS` a kernel (or, on the CPU, a host op) of this name belongs to."""
    name = kernel.lower()
    if any(part in name for part in _Q4K):
        return "q4k_linear"
    if any(part in name for part in _ATTENTION):
        return "attention"
    if any(part in name for part in _GEMM):
        return "cuBLAS linear"
    return "norms/rope/other"


@dataclass
class CallProfile:
    """The kernels of one profiled call, in microseconds."""

    #: First kernel start to last kernel end.
    span_us: float
    #: Time covered by at least one kernel.
    busy_us: float
    #: Kernel time per group (kernels that overlap count in full).
    groups: dict[str, float]
    kernels: int
    #: The longest kernels by total time: (name, group, microseconds, launches).
    top: list[tuple[str, str, float, int]] = field(default_factory=list)

    @property
    def gaps_us(self) -> float:
        """Span no kernel covers: the GPU waiting on the host."""
        return max(0.0, self.span_us - self.busy_us)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        covered += stop - max(start, end)
        end = stop
    return covered


def profile_call(fn: Callable[[], object], device: torch.device, *, top: int = 8) -> CallProfile:
    """Profile one call of ``fn`` (already warmed up) and group its kernels by op."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        kernels = [e for e in events if e.cpu_parent is None]
    intervals = [(float(e.time_range.start), float(e.time_range.end)) for e in kernels]
    groups = dict.fromkeys(GROUPS, 0.0)
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in kernels:
        duration = float(event.time_range.end - event.time_range.start)
        groups[classify(event.name)] += duration
        by_name[event.name].append(duration)
    longest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    span = max((e for _, e in intervals), default=0.0) - min((s for s, _ in intervals), default=0.0)
    return CallProfile(
        span_us=span,
        busy_us=_union_us(intervals),
        groups=groups,
        kernels=len(kernels),
        top=[(name, classify(name), sum(times), len(times)) for name, times in longest],
    )

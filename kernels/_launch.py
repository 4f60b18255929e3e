"""Host-side pieces the attention families share: argument checks, device facts and workspaces.

Nothing here runs at import: the SM-count cache fills on a device's first launch.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

from .device import device_info

__all__ = [
    "DTYPE_NAMES",
    "LOG2E",
    "MERGE_TILE",
    "SM_COUNTS",
    "check_device",
    "check_tensor",
    "device_index",
    "runs_on_interpreter",
    "sm_count",
    "workspace",
]

#: Key names of the dtypes the attention kernels serve.
DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: log2(e): the kernels keep scores in the log2 domain, with this folded into the softmax scale.
LOG2E = 1.4426950408889634
#: fp32 values of one merge program's tile of partials (64 registers a thread at 4 warps).
MERGE_TILE = 8192
#: Device -> SM count, filled on a device's first launch (the launch path must not query it per call).
SM_COUNTS: dict[torch.device, int] = {}


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

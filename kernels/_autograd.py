"""Autograd and tritune's kernels: they are forward-only.

A call whose inputs require grad (with grad mode on) goes through the kernel's registered op, so
that autograd sees it, and the first such call of each kernel warns that its result carries no
gradient: the kernels have no backward.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["needs_grad", "warn_forward_only"]


def needs_grad(args: tuple[Any, ...], tensors: tuple[int, ...]) -> int | None:
    """Where autograd must see the op: grad mode is on and the tensor at this ``tensors`` position
    (the first such) requires grad; None where no tensor does."""
    if not torch.is_grad_enabled():
        return None
    for i in tensors:
        t = args[i]
        if t is not None and t.requires_grad:
            return i
    return None


#: Kernels already warned to be forward-only in this process.
_warned: set[str] = set()


def warn_forward_only(kernel: str, argument: str) -> None:
    """Say once per kernel that its result carries no gradient: the kernels have no backward, and
    a gradient silently missing from a training step would be a wrong answer nobody sees."""
    if kernel in _warned:
        return
    _warned.add(kernel)
    warnings.warn(
        f"{kernel} is forward-only: its result carries no gradient to {argument} (which requires grad); "
        "call it under torch.no_grad() or torch.inference_mode(), or detach its inputs",
        UserWarning,
        stacklevel=4,
    )

"""The recording of an eager call's launches, as bound launches and buffers report to it.

:mod:`._replay` records a call by running its launch function with a :class:`Recording` set for
the thread; :mod:`._fastlaunch` reports each bound launch to it, and :mod:`._launch` each persistent
buffer a launch uses. Kept apart from :mod:`._replay` so those low-level modules import nothing
that imports them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Recording", "is_watch_hook", "recording", "watch_launch"]

_local = threading.local()


def set_recording(rec: Recording | None) -> None:
    """Start (``rec``) or end (None) the recording of this thread's call."""
    _local.recording = rec


def recording() -> Recording | None:
    """The recording of the call running in this thread, if one is being recorded."""
    return getattr(_local, "recording", None)


class Recording:
    """What one call's launch function did: launches, torch ops that write into given memory,
    allocations and persistent buffers used."""

    __slots__ = ("allocations", "launches", "ops", "refused", "statics")

    def __init__(self) -> None:
        #: (launcher, function, packed metadata, grid, argument values) per launch, in order.
        self.launches: list[tuple[Any, Any, Any, tuple[int, int, int], tuple[Any, ...]]] = []
        #: (launches before it, op, args, kwargs) per replayable torch op (a GEMM into ``out``).
        self.ops: list[tuple[int, Any, tuple[Any, ...], dict[str, Any]]] = []
        self.allocations: list[torch.Tensor] = []
        #: Persistent buffers and the check that the launch function would hand out the same one.
        self.statics: list[tuple[torch.Tensor, Callable[[], bool]]] = []
        self.refused: str | None = None

    def launch(
        self, launcher: Any, function: Any, packed: Any, grid: tuple[int, int, int], values: tuple[Any, ...]
    ) -> None:
        self.launches.append((launcher, function, packed, grid, values))

    def op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A torch op ran between the launches recorded so far and the next one."""
        self.ops.append((len(self.launches), func, args, kwargs))

    def static(self, buffer: torch.Tensor, still_valid: Callable[[], bool]) -> None:
        """``buffer`` outlives the call; a replay may use its address while ``still_valid()``."""
        self.statics.append((buffer, still_valid))

    def refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why


def watch_launch(*args: Any, **kwargs: Any) -> None:
    """Triton's launch hook while a call is recorded: a launch that went through ``JITFunction.run``."""
    rec = recording()
    if rec is not None:
        rec.refuse("a kernel launched through JITFunction.run (compiling, or not through wrap_triton)")


def is_watch_hook(hook: Any) -> bool:
    """Whether ``hook`` is the recording's own launch hook (bound launches ignore it)."""
    return hook is watch_launch

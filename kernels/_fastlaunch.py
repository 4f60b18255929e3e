"""Launching a compiled Triton kernel again without ``JITFunction.run``'s per-call Python.

Each launch through ``kernel[grid](...)`` runs Triton's ``JITFunction.run``: it asks the driver
for the device and stream, binds and specializes the arguments, formats the options into a
string for its cache key, checks the kernel's globals, builds launch metadata for the launch
hooks (Triton 3.6 builds it even when no hook is set, and the launcher then calls both empty
hook chains from C). torch's ``wrap_triton`` adds two wrapper objects per launch on top.
``scripts/measure_launch_path.py`` times that Python with and without bound launches.

A :class:`BoundKernel` runs the first launch of each specialization through ``JITFunction.run``
(which compiles, caches and launches) and keeps the compiled kernel it returns. Later launches
bind the arguments with Triton's own binder, so a pointer's alignment or an integer's
divisibility selects the same compiled kernel Triton would, and call that kernel's launcher
directly, with the arguments ``JITFunction.run`` would pass. A kernel taking host tensor
descriptors keeps each one's encoding across launches over the same tensor
(:mod:`._descriptor_cache`).

The cache key holds what ``JITFunction.run`` compiles for: the device, the debug and
instrumentation modes, each argument's specialization (constexpr values by value: tritune's
launches pass each constexpr with one type, so ``True`` and ``1`` never meet) and the launch
options. Not mirrored: the check that a kernel's globals kept their values (tritune's kernels read
module constants only).

What it does not mirror goes through ``JITFunction.run``: a launch hook set (profilers), a
``pre_run_hook``, a callable grid, a Triton whose internals are not the ones mirrored here
(:data:`MIRRORED_TRITON`), or ``TRITUNE_FAST_LAUNCH=0``. Interpreted kernels are launched as
they are.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import triton
from triton import knobs
from triton.experimental.gluon._runtime import GluonJITFunction
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from ._descriptor_cache import caching_launcher
from ._recording import is_watch_hook, recording
from .settings import on_change, settings

__all__ = ["MIRRORED_TRITON", "BoundKernel", "bound", "forget", "set_enabled"]

log = logging.getLogger("tritune.launch")

#: Triton releases (major.minor) whose ``JITFunction.run`` this module mirrors: the device
#: caches' layout (binder last), the compiled kernel's ``run``/``function``/``packed_metadata``
#: and the launcher's leading arguments. Any other release launches through ``JITFunction.run``.
MIRRORED_TRITON = ("3.6",)

_TRITON_MIRRORED = ".".join(triton.__version__.split(".")[:2]) in MIRRORED_TRITON
#: Whether bound launches are on (``TRITUNE_FAST_LAUNCH``), kept current by the settings' listener.
_enabled: bool | None = None


def _refresh() -> None:
    global _enabled
    _enabled = None


on_change(_refresh)


def set_enabled(on: bool | None) -> None:
    """Turn bound launches on or off for the process (benchmarks); None follows ``TRITUNE_FAST_LAUNCH``."""
    global _enabled
    _enabled = None if on is None else on and _TRITON_MIRRORED


def _fast_launch_on() -> bool:
    global _enabled
    if _enabled is None:
        _enabled = _TRITON_MIRRORED and settings().fast_launch
    return _enabled


def _modes(fn: JITFunction[Any]) -> tuple[bool, str]:
    """The debug and instrumentation modes ``JITFunction.run`` adds to every compile's options: the
    kernel's own ``debug`` (which may be set after its first launch) or Triton's, and Triton's mode."""
    return bool(fn.debug or knobs.runtime.debug), knobs.compilation.instrumentation_mode


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set: a non-empty hook chain, or a callable assigned in its place.
    The hook a recording of the call sets (:mod:`._recording`) does not count."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    entering = getattr(enter, "calls", enter)
    if entering and not (type(entering) is list and len(entering) == 1 and is_watch_hook(entering[0])):
        return True
    return bool(getattr(leave, "calls", leave))


class BoundKernel:
    """A ``JITFunction`` whose compiled kernels are launched directly once compiled.

    Used as the kernel itself is: ``bound(kernel)[grid](*args, **kwargs)``. One instance per
    kernel (:func:`bound`); its cache holds, per (device, specialization, options), the compiled
    kernel's launcher, function handle and packed metadata.
    """

    __slots__ = ("_compiled", "_disabled", "fn")

    def __init__(self, fn: JITFunction[Any]) -> None:
        self.fn = fn
        self._compiled: dict[Any, tuple[Any, Any, Any]] = {}
        #: Set when this kernel's compiled objects do not look like the mirrored release's.
        self._disabled = False

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Launch on ``grid``; the compiled kernel's first launch goes through ``JITFunction.run``."""
        fn = self.fn
        if (
            self._disabled
            or not _fast_launch_on()
            or type(grid) is not tuple
            or fn.pre_run_hooks
            or _launch_hooks_set()
        ):
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        if not self._compiled:
            # Nothing kept yet: Triton compiles and launches, and its kernel is kept afterwards.
            return self._through_triton(None, grid, args, kwargs)
        # The device and stream as JITFunction.run asks them (Triton's driver, which a test may replace).
        active = driver.active
        device = active.get_current_device()
        caches = fn.device_caches.get(device)
        if caches is None:  # this device's first launch of the kernel builds its binder
            return self._through_triton(None, grid, args, kwargs)
        bound_args, specialization, options = caches[-1](*args, **kwargs)
        key = (device, *_modes(fn), *specialization, *options.items())
        try:
            entry = self._compiled.get(key)
        except TypeError:  # an unhashable option or constexpr: Triton's own launch decides what it means
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        if entry is None:
            return self._through_triton(key, grid, args, kwargs)
        launcher, function, packed_metadata = entry
        grid_size = len(grid)
        grid_y, grid_z = grid[1] if grid_size > 1 else 1, grid[2] if grid_size > 2 else 1
        rec = recording()
        if rec is not None:  # an eager call being recorded for replay (:mod:`._replay`)
            rec.launch(launcher, function, packed_metadata, (grid[0], grid_y, grid_z), tuple(bound_args.values()))
        launcher(
            grid[0],
            grid_y,
            grid_z,
            active.get_current_stream(device),
            function,
            packed_metadata,
            None,  # launch metadata: only launch hooks read it, and none is set
            None,
            None,
            *bound_args.values(),
        )
        return None

    def _through_triton(self, key: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``JITFunction.run``, keeping the compiled kernel it returns under ``key`` (found now when None)."""
        kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        if kernel is None or hasattr(kernel, "result"):
            return kernel  # not compiled yet (or compiled asynchronously), or a recorder stands in: nothing to keep
        parts = tuple(getattr(kernel, name, None) for name in ("run", "function", "packed_metadata"))
        if not callable(parts[0]) or parts[1] is None:
            self._disabled = True
            log.info("%s: the compiled kernel is not laid out as Triton 3.6's; launching through Triton", self.fn)
            return kernel
        if key is None:
            device = driver.active.get_current_device()
            caches = self.fn.device_caches.get(device)
            if caches is None:
                return kernel
            _, specialization, options = caches[-1](*args, **kwargs)
            key = (device, *_modes(self.fn), *specialization, *options.items())
        # A kernel taking host tensor descriptors launches through one that keeps their encodings.
        parts = (caching_launcher(parts[0]) or parts[0], *parts[1:])
        with contextlib.suppress(TypeError):  # unhashable: nothing kept, its launches go through Triton
            self._compiled[key] = parts  # type: ignore[assignment]
        return kernel


_BOUND: dict[int, BoundKernel] = {}
#: The kernel types :func:`bound` binds: Triton's and Gluon's, not their interpreted stand-ins.
_BOUNDABLE = (JITFunction, GluonJITFunction)


def bound(kernel: Any) -> Any:
    """What a direct op body launches ``kernel`` through: its :class:`BoundKernel` for a
    ``JITFunction`` or a Gluon kernel (whose ``run`` is ``JITFunction.run`` with a binder of its
    own, which the bound launch calls too), else ``kernel`` itself (an interpreted kernel)."""
    if type(kernel) not in _BOUNDABLE:
        return kernel
    wrapper = _BOUND.get(id(kernel))
    if wrapper is None or wrapper.fn is not kernel:
        wrapper = _BOUND[id(kernel)] = BoundKernel(kernel)
    return wrapper


def forget() -> None:
    """Drop every bound kernel's cache and the replays built on them (tests; Triton's own caches
    are untouched)."""
    from . import _replay  # imports this module's importers

    _BOUND.clear()
    _refresh()
    _replay.forget_all()

"""Host tensor descriptors encoded once per distinct tensor, not once per launch.

A kernel that takes host-side tensor descriptors (the TMA prefill, the Gluon ws prefill and Q4_K
tma kernels) has Triton 3.6's launcher encode each one into a ``CUtensorMap`` at every launch: a
Python wrapper walks the arguments and calls the driver's ``cuTensorMapEncodeTiled`` through
``make_tensordesc_arg``. The encoded map depends only on what the wrapper hands that call: the
base address, shape and strides, the padding, and the compiled kernel's per-descriptor metadata
(element type and size, swizzle, box). So a launch over the same tensors (a model's weight; an
activation buffer the caching allocator hands out again) can pass the map encoded before.

:func:`caching_launcher` builds, from a compiled kernel's launcher, a launch that keeps the
encoded arguments per descriptor position, keyed by exactly those inputs, and otherwise passes
what the launcher would. Triton's own ``make_tensordesc_arg`` encodes every miss. A replayed
launch (:mod:`._replay`) calls the raw launch itself and looks each descriptor's encoding up from
its address, shape, strides and padding (:meth:`_Slot.expand`), building no descriptor object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triton.backends.nvidia import driver as nvidia_driver

__all__ = ["DESCRIPTORS_KEPT", "AddressedDescriptor", "caching_launcher", "set_enabled"]

#: Encoded descriptors kept per descriptor position of one compiled kernel; past it they are all
#: dropped (a workload cycling through more tensors than this gains nothing from keeping them).
DESCRIPTORS_KEPT = 64
#: The names the 3.6 launcher's descriptor wrapper closes over (``wrap_handle_tensordesc``).
_WRAPPER_CELLS = ("launcher", "tensordesc_indices", "tensordesc_meta")

_enabled = True


def set_enabled(on: bool) -> None:
    """Keep encoded descriptors (the default) or encode at every launch, from the next launch on
    (overhead measurements time both in one process)."""
    global _enabled
    _enabled = on


class AddressedDescriptor:
    """A host tensor descriptor as the launcher reads it, built from an address instead of a
    tensor: its base (itself, whose ``data_ptr`` is the address), shape, strides and padding."""

    __slots__ = ("address", "padding", "shape", "strides")

    def __init__(self, address: int, shape: Any, strides: Any, padding: str) -> None:
        self.address, self.shape, self.strides, self.padding = address, shape, strides, padding

    @property
    def base(self) -> AddressedDescriptor:
        return self

    def data_ptr(self) -> int:
        return self.address


class _Slot:
    """One descriptor position of a kernel: its metadata and the encodings kept for it."""

    __slots__ = ("kept", "meta", "position")

    def __init__(self, position: int, meta: Any) -> None:
        self.position = position
        self.meta = meta
        self.kept: dict[tuple[Any, ...], list[Any]] = {}

    def encode(self, descriptor: Any) -> list[Any]:
        """The launcher arguments ``descriptor`` expands to: the encoded map, shape and strides."""
        if not _enabled:
            return nvidia_driver.make_tensordesc_arg(descriptor, self.meta)
        key = (descriptor.base.data_ptr(), tuple(descriptor.shape), tuple(descriptor.strides), descriptor.padding)
        expanded = self.kept.get(key)
        if expanded is None:
            expanded = nvidia_driver.make_tensordesc_arg(descriptor, self.meta)
            if len(self.kept) >= DESCRIPTORS_KEPT:
                self.kept.clear()
            self.kept[key] = expanded
        return expanded

    def expand(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], padding: str) -> list[Any]:
        """:meth:`encode` of a descriptor given by its fields (a replayed launch's), without
        building one where its encoding is kept."""
        if _enabled:
            expanded = self.kept.get((address, shape, strides, padding))
            if expanded is not None:
                return expanded
        return self.encode(AddressedDescriptor(address, shape, strides, padding))


def _wrapper_cells(launch: Any) -> dict[str, Any] | None:
    """The descriptor wrapper's closure (raw launch, descriptor positions, metadata), or None
    where ``launch`` is not that wrapper (a kernel without descriptors, another Triton)."""
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or closure is None:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure), strict=True))
    if not all(name in cells for name in _WRAPPER_CELLS):
        return None
    return cells


def caching_launcher(launcher: Any) -> Callable[..., None] | None:
    """A launch with ``launcher``'s call signature that keeps encoded descriptors, or None where
    there is nothing to keep or the launcher is not laid out as Triton 3.6's ``CudaLauncher``
    (kernels that need a scratch allocation per launch keep Triton's own path as well)."""
    cells = _wrapper_cells(getattr(launcher, "launch", None))
    if cells is None or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    raw = cells["launcher"]
    positions = sorted(cells["tensordesc_indices"])
    metas = list(cells["tensordesc_meta"])
    if len(positions) != len(metas):
        return None
    slots = tuple(_Slot(position, meta) for position, meta in zip(positions, metas, strict=True))
    cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl

    def launch(
        grid_x: int, grid_y: int, grid_z: int, stream: int, function: Any, packed_metadata: Any, *rest: Any
    ) -> None:
        # ``rest``: the launch metadata and the two hooks (three leading), then the kernel's arguments.
        args: list[Any] = list(rest[:3])
        kernel_args = rest[3:]
        start = 0
        for slot in slots:
            args.extend(kernel_args[start : slot.position])
            args.extend(slot.encode(kernel_args[slot.position]))
            start = slot.position + 1
        args.extend(kernel_args[start:])
        raw(grid_x, grid_y, grid_z, stream, function, cooperative, pdl, None, None, packed_metadata, *args)

    # What a replayed launch (:mod:`._replay`) calls instead: the raw launch with the flags, and
    # each descriptor position's kept encodings, expanded there in place of the descriptor.
    launch.descriptor_parts = (raw, slots, cooperative, pdl)  # type: ignore[attr-defined]
    return launch

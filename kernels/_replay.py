"""Eager calls replayed per argument layout: a declared kernel's launches recorded once, then rebuilt.

A plain eager call spends most of its host time between its checked arguments and the GPU: the
launch function's Python (plans, views, strides, workspaces), Triton's binder for each launch, the
launcher asking every tensor for its address and checking it with the driver. For one config,
device, stream and argument *layout* (every tensor's shape, strides, dtype and address modulo 16,
every scalar's value) all of that comes out the same at every call except the addresses. So a
layout's second call runs the launch function under a :class:`Recording`, which notes each launch
(compiled kernel, grid, arguments), each buffer allocated meanwhile and each persistent buffer
used; later calls of that layout rebuild the same launches from the new addresses and call the
launchers directly (:meth:`_Plan.replay`).

A recording is kept only where replaying it does exactly what the launch function would:

- every kernel launched through a bound launch (:mod:`._fastlaunch`), already compiled: a launch
  through ``JITFunction.run`` (a compile, a launch hook, a kernel launched without ``wrap_triton``)
  fires the launch hook the recording watches, and refuses it;
- no torch op but views, allocations and the GEMMs of :data:`_REPLAYED_OPS` (a dispatch mode
  watches): a copy, a fill or an in-place update on an argument would not happen again. A GEMM
  writing into a given ``out`` (the Q4_K dequant path's cuBLAS call, the staged path's scaled
  fp8 one) is replayed in its place among the launches, on views rebuilt from the call's tensors
  at the recorded offsets, shapes and strides;
- every pointer handed to a kernel, and every GEMM operand, lies in exactly one argument tensor
  (a GEMM reading it as its own dtype), one allocation made during the call (replayed at the same
  offset of one scratch buffer, which a small one shares with the thread's earlier replays on
  its stream), or a persistent buffer that registered itself with a check of its
  validity (the arrival counters);
- at least one launch or GEMM.

Once a layout has replayed after its checks, the call's raw arguments (before any check: each
tensor's shape, strides, dtype, device and address modulo 16, each scalar's type and value, the
current device and stream; :mod:`._early_key`) are remembered with the call's facts, device and
outputs, and later calls with that key skip the checks as well: they dispatch on those facts,
allocate the outputs (or take the passed ones, once each is found apart from the inputs: that
depends on the addresses) and replay. A call that holds a tensor needing grad or a tensor
subclass, or runs under a mode, takes the checked way; nothing is replayed while a CUDA graph
is being captured or with a launch hook set. A layout is recorded from its second call on, so a
workload of ever new shapes never pays a recording.

What a recording cannot see is host logic reading anything but the layout: a launch function (or
a derived fact) that decides on tensor values it reads without a torch op, the time, or a global
that changes. A declaration whose launch does so passes ``replay=False``. Nor does a replay see
Triton's debug or instrumentation mode, or a kernel's ``pre_run_hooks``, set after its layout
was recorded: set them before the first call (or drop the recordings with
``_fastlaunch.forget()``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton import knobs
from triton.runtime.driver import driver

from ._descriptor_cache import AddressedDescriptor
from ._fastlaunch import _fast_launch_on, _launch_hooks_set
from ._launch import _byte_span, out_is_separate
from ._oplib import no_modes, run_unwrapped
from ._recording import Recording, set_recording, watch_launch
from .settings import on_change, settings

__all__ = [
    "INPUT",
    "OBJECT",
    "OUTPUT",
    "PLANS_KEPT",
    "RAN",
    "RECORD_ATTEMPTS",
    "SCALAR",
    "LaunchPlans",
    "forget_all",
    "set_enabled",
]

log = logging.getLogger("tritune.launch")

#: Recordings tried per layout before its calls stop trying: a layout's first call may compile a
#: kernel or allocate a persistent buffer, which a later one does not.
RECORD_ATTEMPTS = 3
#: Layouts kept per kernel; past it they are all dropped (a workload of ever new shapes).
PLANS_KEPT = 512
#: Configs whose plans one raw-argument layout keeps; past it they are dropped.
_CONFIGS_PER_LAYOUT = 8
#: Alignment of each allocation within a replay's one scratch buffer (the caching allocator's own).
_SCRATCH_ALIGN = 512
#: A replay's scratch of at most this many bytes is kept between replays (see :func:`_kept_scratch`);
#: a bigger one, which comes with GPU work that dwarfs an allocation, is allocated per replay.
KEPT_SCRATCH_BYTES = 16 << 20


class _KeptScratch:
    """One thread's kept scratch: per device, the stream it serves and the buffer."""

    __slots__ = ("__weakref__", "by_device")

    def __init__(self) -> None:
        self.by_device: dict[torch.device, tuple[int, torch.Tensor]] = {}


_kept = threading.local()
#: Every thread's :class:`_KeptScratch`, for :func:`forget_all` (a thread's goes with the thread).
_kept_all: weakref.WeakSet[_KeptScratch] = weakref.WeakSet()
_kept_lock = threading.Lock()

#: Allocations a recorded call may make: replayed at their offsets in the replay's scratch buffer.
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)

#: Torch ops a recorded call may run besides views and allocations: GEMMs writing into a given
#: ``out``, replayed as the same op on the call's views (a dequantize-then-cuBLAS launch). Every
#: tensor they touch already exists, so a replay rebuilds each as a view and calls the op again.
_REPLAYED_OPS = frozenset({torch.ops.aten.mm.out, torch.ops.aten.addmm.out, torch.ops.aten._scaled_mm.out})

_capturing: Any = torch._C._cuda_isCurrentStreamCapturing if torch.cuda._is_compiled() else (lambda: False)

#: Whether eager calls replay (``TRITUNE_EAGER_REPLAY``; None: read the setting at the next call).
_enabled: bool | None = None
_ALL: list[LaunchPlans] = []


def set_enabled(on: bool | None) -> None:
    """Replay eager calls or run every one through its launch function, for the process
    (measurements); None follows ``TRITUNE_EAGER_REPLAY``."""
    global _enabled
    _enabled = on


def forget_all() -> None:
    """Drop every kernel's recorded layouts (tests; a change of settings)."""
    global _enabled
    _enabled = None
    for plans in _ALL:
        plans.clear()
    with _kept_lock:
        for kept in list(_kept_all):
            kept.by_device.clear()


on_change(forget_all)


def _replay_on() -> bool:
    global _enabled
    if _enabled is None:
        _enabled = settings().eager_replay
    return _enabled


class _OpWatch(TorchDispatchMode):
    """Lets views, allocations and the GEMMs of :data:`_REPLAYED_OPS` through a recording (noting
    the latter two); any other torch op refuses it."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.recording.allocations.append(out)
        elif func in _REPLAYED_OPS:
            self.recording.op(func, tuple(args), dict(kwargs or {}))
        elif not func.is_view:
            self.recording.refuse(f"the launch runs {func}")
        return out


class _Unmapped(Exception):
    pass


class _OpTensor:
    """A tensor a replayed torch op takes: a view at a byte offset into one of the call's tensors
    (or its scratch), rebuilt per replay."""

    __slots__ = ("dtype", "offset", "shape", "source", "strides")

    def __init__(self, source: int, offset: int, t: torch.Tensor) -> None:
        self.source, self.offset = source, offset
        self.shape, self.strides, self.dtype = tuple(t.shape), t.stride(), t.dtype

    def rebuild(self, tensors: Sequence[torch.Tensor | None], scratch: torch.Tensor | None) -> torch.Tensor:
        if self.source == len(tensors):
            assert scratch is not None
            typed = scratch.view(self.dtype)  # 512-byte aligned: every offset is whole elements
            return typed.as_strided(self.shape, self.strides, self.offset // typed.element_size())
        base = tensors[self.source]
        assert base is not None
        return base.as_strided(self.shape, self.strides, base.storage_offset() + self.offset // base.element_size())


def _rebuilt(value: Any, tensors: Sequence[torch.Tensor | None], scratch: torch.Tensor | None) -> Any:
    return value.rebuild(tensors, scratch) if type(value) is _OpTensor else value


class _Plan:
    """The launches (and replayed torch ops) of one layout, rebuilt from a call's addresses."""

    __slots__ = ("checks", "config", "launches", "ops", "scratch_bytes")

    def __init__(
        self,
        config: Any,
        launches: list[Any],
        scratch_bytes: int,
        checks: list[Callable[[], bool]],
        ops: list[tuple[int, Any, tuple[Any, ...], dict[str, Any]]] | None = None,
    ) -> None:
        #: Kept so that the config's id in the key cannot be reused by another object.
        self.config = config
        #: (launcher, function, the arguments before the kernel's (packed metadata and what the
        #: launcher puts before it), grid, values template, pointer slots, descriptor slots).
        self.launches = launches
        self.scratch_bytes = scratch_bytes
        self.checks = checks
        #: (launches before it, op, args, kwargs), tensors as :class:`_OpTensor`: a replay needs
        #: the call's tensors, not only their addresses.
        self.ops = ops or []

    def replay(
        self,
        addresses: list[int],
        device: torch.device,
        stream: int,
        tensors: Sequence[torch.Tensor | None],
    ) -> bool:
        """Launch this layout's kernels on ``addresses`` (the arguments' tensors, in order), and run
        its torch ops, in the recorded order, on views of ``tensors`` (the same tensors)."""
        for check in self.checks:
            if not check():
                return False
        ops = self.ops
        scratch = None
        if self.scratch_bytes:
            if self.scratch_bytes <= KEPT_SCRATCH_BYTES:
                scratch = _kept_scratch(self.scratch_bytes, device, stream)
            else:
                scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=device)
            addresses = [*addresses, scratch.data_ptr()]
        done = 0
        for index, (launcher, function, head, grid, template, pointers, descriptors) in enumerate(self.launches):
            while done < len(ops) and ops[done][0] <= index:
                self._run_op(ops[done], tensors, scratch)
                done += 1
            values = template.copy()
            for position, source, offset in pointers:
                values[position] = addresses[source] + offset
            for position, source, offset, shape, strides, padding, slot, width in descriptors:
                address = offset if source is None else addresses[source] + offset
                if slot is None:
                    values[position] = AddressedDescriptor(address, shape, strides, padding)
                else:  # the launcher's kept encoding, expanded in place
                    values[position : position + width] = slot.expand(address, shape, strides, padding)
            launcher(grid[0], grid[1], grid[2], stream, function, *head, *values)
        for op in ops[done:]:
            self._run_op(op, tensors, scratch)
        del scratch  # one of this replay's own is freed after its launches were queued, as the launch function's
        return True

    @staticmethod
    def _run_op(
        op: tuple[int, Any, tuple[Any, ...], dict[str, Any]],
        tensors: Sequence[torch.Tensor | None],
        scratch: torch.Tensor | None,
    ) -> None:
        _, func, args, kwargs = op
        func(
            *[_rebuilt(a, tensors, scratch) for a in args],
            **{name: _rebuilt(v, tensors, scratch) for name, v in kwargs.items()},
        )


def _kept_scratch(nbytes: int, device: torch.device, stream: int) -> torch.Tensor:
    """At least ``nbytes`` of scratch for a replay on ``stream``: the buffer this thread's last
    replay on ``device`` used, where it served the same stream and is big enough; else a new one,
    which replaces it. That saves an allocation a call.

    Reuse is safe as the caching allocator's is: a replay's launches and GEMMs are queued on the
    current stream, in order, so they find the scratch after the previous replay's are done with
    it. Per thread: two threads replaying on one stream interleave their launches. A buffer
    replaced goes back to the caching allocator, which hands it out again only on the stream it
    was allocated on. At most one buffer per thread and device is held, dropped by
    :func:`forget_all`. Nothing is replayed during a capture, so no graph holds a kept buffer."""
    kept = getattr(_kept, "scratch", None)
    if kept is None:
        kept = _kept.scratch = _KeptScratch()
        with _kept_lock:
            _kept_all.add(kept)
    held = kept.by_device.get(device)
    if held is not None and held[0] == stream and held[1].numel() >= nbytes:
        return held[1]
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    kept.by_device[device] = (stream, buffer)
    return buffer


def _direct(launcher: Any) -> tuple[Any, tuple[Any, ...]]:
    """What a replay calls for ``launcher`` and the arguments it puts before the packed metadata.

    Triton 3.6's ``CudaLauncher.__call__`` allocates no scratch for a kernel that needs none and
    passes the cooperative-grid and PDL flags on to its raw launch: a replay calls that launch
    itself with them. Any other launcher is called as it is (the descriptor-keeping launch's raw
    launch is called by :func:`_build_plan`'s plan, see :func:`_descriptor_slots`)."""
    raw = getattr(launcher, "launch", None)
    flags = ("launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if type(launcher).__name__ != "CudaLauncher" or raw is None or not all(hasattr(launcher, f) for f in flags):
        return launcher, ()
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        return launcher, ()
    return raw, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)


def _descriptor_slots(launcher: Any, values: tuple[Any, ...]) -> dict[int, Any] | None:
    """Per descriptor position, the slot of the descriptor-keeping launch ``launcher``
    (:func:`._descriptor_cache.caching_launcher`) that keeps its encodings; None for any other
    launcher, or where the recorded arguments hold no descriptor at a slot's position."""
    parts = getattr(launcher, "descriptor_parts", None)
    if parts is None:
        return None
    slots = {slot.position: slot for slot in parts[1]}
    return slots if {i for i, v in enumerate(values) if _is_descriptor(v)} == set(slots) else None


def _is_descriptor(value: Any) -> bool:
    """Whether a launch argument is a host tensor descriptor (Triton's or Gluon's) over a tensor."""
    return hasattr(value, "block_shape") and isinstance(getattr(value, "base", None), torch.Tensor)


def _build_plan(config: Any, rec: Recording, tensors: Sequence[torch.Tensor | None]) -> _Plan:
    """The plan replaying ``rec``; raises :class:`_Unmapped` where it cannot replay exactly."""
    spans: list[tuple[int, int, int]] = []  # (first, end, source)
    for source, t in enumerate(tensors):
        span = None if t is None else _byte_span(t)  # None: no element
        if span is not None:
            spans.append((*span, source))
    scratch_source = len(tensors)
    scratch_bytes = 0
    allocation_spans: list[tuple[int, int, int]] = []  # (first, end, offset in the scratch buffer)
    devices = {t.device for t in tensors if t is not None}
    for t in rec.allocations:
        if t.device not in devices:
            raise _Unmapped(f"the launch allocates on {t.device}, which no argument is on")
        nbytes = t.untyped_storage().nbytes()
        if nbytes:
            base = t.untyped_storage().data_ptr()
            allocation_spans.append((base, base + nbytes, scratch_bytes))
            scratch_bytes += -(-nbytes // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    static_spans = [span for buffer, _ in rec.statics if (span := _byte_span(buffer)) is not None]

    def locate(address: int) -> tuple[int, int] | None:
        """(source, offset) of a pointer; None for a persistent buffer's (passed as it is)."""
        found = [(source, address - first) for first, end, source in spans if first <= address < end]
        found += [(scratch_source, at + address - lo) for lo, hi, at in allocation_spans if lo <= address < hi]
        if len(found) == 1:
            return found[0]
        if found:
            raise _Unmapped("a kernel's pointer lies in two arguments that share memory")
        if any(first <= address < end for first, end in static_spans):
            return None
        raise _Unmapped("a kernel's pointer is in no argument, allocation or registered buffer")

    launches = []
    for recorded, function, packed, grid, values in rec.launches:
        launcher, head = _direct(recorded)
        slots = _descriptor_slots(recorded, values)
        if slots is not None:
            # The descriptor-keeping launch: its raw launch called directly, each descriptor
            # expanded in place into its kept encoding (a map, then its shape and strides).
            launcher, _, cooperative, pdl = recorded.descriptor_parts
            head = (cooperative, pdl, None, None)
        template: list[Any] = []
        pointers, descriptors = [], []
        for position, value in enumerate(values):
            at = len(template)  # where the value goes among the launcher's arguments
            if isinstance(value, torch.Tensor):
                where = locate(value.data_ptr())
                template.append(value.data_ptr() if where is None else None)
                if where is not None:
                    pointers.append((at, *where))
            elif _is_descriptor(value):
                base = value.base.data_ptr()
                where = locate(base)
                shape, strides = tuple(value.shape), tuple(value.strides)
                slot = None if slots is None else slots[position]
                if slot is None:
                    fields = [AddressedDescriptor(base, shape, strides, value.padding)]
                else:
                    fields = slot.expand(base, shape, strides, value.padding)
                if where is None and slot is None:  # a persistent buffer's, encoded by the launcher
                    template += fields
                else:
                    # A persistent buffer's (source None, its address as the offset) is looked up
                    # each time as well: with the kept encodings off, every launch encodes.
                    source, offset = (None, base) if where is None else where
                    template += [None] * len(fields)
                    descriptors.append((at, source, offset, shape, strides, value.padding, slot, len(fields)))
            elif hasattr(value, "data_ptr") or hasattr(value, "block_shape"):
                raise _Unmapped("a launch argument holds an address through an object the replay cannot rebuild")
            else:
                template.append(value)
        launches.append(
            (launcher, function, (*head, packed, None, None, None), grid, template, tuple(pointers), tuple(descriptors))
        )

    def op_value(value: Any) -> Any:
        """An op's argument as a replay rebuilds it: a tensor as an :class:`_OpTensor`, anything
        else as it is."""
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            raise _Unmapped("a replayed torch op takes a sequence of tensors")
        if not isinstance(value, torch.Tensor):
            return value
        span = _byte_span(value)
        where = locate(value.data_ptr())
        if where is None or span is None:
            # A persistent buffer would be kept alive by the plan; an empty operand has no address.
            raise _Unmapped("a replayed torch op takes a registered buffer or an empty tensor")
        source, offset = where
        if locate(span[1] - 1) != (source, offset + span[1] - 1 - span[0]):
            raise _Unmapped("a replayed torch op's operand reaches past the memory it starts in")
        if source < len(tensors):
            base = tensors[source]
            assert base is not None
            if base.dtype != value.dtype:
                raise _Unmapped("a replayed torch op reads an argument as another dtype")
        if offset % value.element_size():
            raise _Unmapped("a replayed torch op's tensor starts inside an element")
        return _OpTensor(source, offset, value)

    ops = [
        (position, func, tuple(op_value(a) for a in args), {name: op_value(v) for name, v in kwargs.items()})
        for position, func, args, kwargs in rec.ops
    ]
    return _Plan(config, launches, scratch_bytes, [check for _, check in rec.statics], ops)


_watch_lock = threading.Lock()
_watchers = 0


def _watch(on: bool) -> bool:
    """Add (``on``) or drop the recordings' launch hook; threads recording at once share it, and
    the last to finish removes it. False where Triton's hook is not a chain (nothing added)."""
    global _watchers
    enter = knobs.runtime.launch_enter_hook
    if not hasattr(enter, "add"):
        return False
    with _watch_lock:
        _watchers += 1 if on else -1
        if on:
            enter.add(watch_launch)
        elif not _watchers:
            enter.remove(watch_launch)
    return True


#: What :meth:`LaunchPlans.run` returns when the call's launch function ran (under a recording)
#: and no plan came of it.
RAN = object()

#: Kinds of a declared argument in an early key's layout (see :mod:`._early_key`).
INPUT, OUTPUT, OBJECT, SCALAR = range(4)


class _Early:
    """What a call of one raw-argument layout needs besides its plans: its facts, device and outputs."""

    __slots__ = ("device", "facts", "outputs", "plans")

    def __init__(self, facts: Any, device: torch.device, outputs: list[torch.Tensor]) -> None:
        self.facts, self.device = facts, device
        #: Each output's (shape, strides, dtype), allocated per call as the checks allocated it.
        self.outputs = tuple((tuple(t.shape), t.stride(), t.dtype) for t in outputs)
        #: id(config) -> the plan of that config (the dispatcher hands out one object per key).
        self.plans: dict[int, _Plan] = {}


class LaunchPlans:
    """One kernel's recorded layouts: :meth:`run` replays a call's layout, or records it;
    :meth:`replay_early` replays a call from its raw arguments, before its checks."""

    __slots__ = ("_attempts", "_plans", "early_entries", "name", "recording_started")

    def __init__(self, name: str) -> None:
        self.name = name
        #: Layout key -> its plan, or None once its recordings all failed.
        self._plans: dict[tuple[Any, ...], _Plan | None] = {}
        #: Layout key -> recordings refused so far (0: seen once). A layout is recorded from its
        #: second call on: a workload of ever new shapes never pays a recording.
        self._attempts: dict[tuple[Any, ...], int] = {}
        #: Raw-argument key (:mod:`._early_key`) -> what its calls need, once a checked call of that
        #: key was replayed.
        self.early_entries: dict[tuple[Any, ...], _Early] = {}
        #: Whether a call was recorded since the last clear: until then calls compute no early key
        #: (and never ask Triton's driver, which a machine without a GPU lacks).
        self.recording_started = False
        _ALL.append(self)

    def clear(self) -> None:
        self._plans.clear()
        self._attempts.clear()
        self.early_entries.clear()
        self.recording_started = False

    def early(self, key: tuple[Any, ...]) -> _Early | None:
        """What a call of raw-argument ``key`` needs, once a checked call of it was replayed."""
        try:
            return self.early_entries.get(key)
        except TypeError:  # an unhashable argument: the checks say what is wrong with it
            return None

    def remember_early(
        self,
        key: tuple[Any, ...],
        facts: Any,
        device: torch.device,
        outputs: list[torch.Tensor],
        config: Any,
        plan: _Plan,
    ) -> None:
        """Note that a checked call of raw-argument ``key`` had these facts, device and outputs,
        and replays ``plan`` for ``config``: the key's next calls may skip their checks."""
        entry = self.early_entries.get(key)
        if entry is None:
            if len(self.early_entries) >= PLANS_KEPT:
                self.early_entries.clear()
            entry = self.early_entries[key] = _Early(facts, device, outputs)
        if len(entry.plans) >= _CONFIGS_PER_LAYOUT:
            entry.plans.clear()  # config objects come and go (a dispatcher cleared, a key tuned online)
        entry.plans[id(config)] = plan

    def run(
        self,
        launch: Callable[..., None],
        config: Any,
        args: tuple[Any, ...],
        tensors: Sequence[torch.Tensor | None],
        scalars: tuple[Any, ...],
        device: torch.device,
    ) -> Any:
        """Run ``launch(config, *args)``'s launches on this call's tensors, or record them.

        Returns the plan that ran (replayed or just recorded), :data:`RAN` when the launch function
        ran under a recording that gave no plan, or None when the call must run its launch function
        as usual (nothing was launched then). ``tensors``: every tensor the call hands the launch
        (inputs and outputs by position, then an object's parts; None for an optional one left
        out), in a fixed order; ``scalars``: its other arguments.
        """
        # Under a mode the launch function sees traced tensors and acts on it (prepared launches
        # reach here without the call's own check).
        if not _replay_on() or not _fast_launch_on() or _capturing() or _launch_hooks_set() or not no_modes():
            return None
        active = driver.active
        current = active.get_current_device()
        stream = active.get_current_stream(current)
        key: list[Any] = [id(config), device, current, stream, *scalars]
        addresses: list[int] = []
        for t in tensors:
            if t is None:
                key.append(None)
                addresses.append(0)
            else:
                address = t.data_ptr()
                addresses.append(address)
                key += (t.shape, t.stride(), t.dtype, address & 15)
        layout = tuple(key)
        plan = self._plans.get(layout)
        if plan is not None:
            if plan.config is config and plan.replay(addresses, device, stream, tensors):
                return plan
            self._plans.pop(layout, None)  # a persistent buffer changed, or the id is another config's
            return None
        if layout in self._plans:
            return None  # recorded and refused RECORD_ATTEMPTS times
        if layout not in self._attempts:
            if len(self._attempts) >= PLANS_KEPT:
                self._attempts.clear()
            self._attempts[layout] = 0
            return None
        recorded = self._record(layout, launch, config, args, tensors)
        return RAN if recorded is None else recorded

    def replay_early(
        self,
        entry: _Early,
        config: Any,
        stream: int,
        addresses: list[int],
        output_slots: Sequence[int],
        tensors: list[torch.Tensor | None],
    ) -> list[torch.Tensor] | None:
        """Replay ``config``'s plan for an early key's call on ``stream`` (the key's): its outputs,
        or None when the call must go the checked way (no plan for this config, a persistent
        buffer changed, or a passed output shares memory with an input). ``tensors``: the call's
        tensors in ``addresses``' order (None at the slot of an output to allocate), for a plan
        that replays torch ops."""
        plan = entry.plans.get(id(config))
        if plan is None or plan.config is not config:
            return None
        device = entry.device
        outputs = []
        passed = []
        for slot, (shape, strides, dtype) in zip(output_slots, entry.outputs, strict=True):
            out = tensors[slot]
            if out is None:
                out = tensors[slot] = torch.empty_strided(shape, strides, dtype=dtype, device=device)
                addresses[slot] = out.data_ptr()
            else:
                passed.append(out)
            outputs.append(out)
        if passed:
            inputs = tuple(t for n, t in enumerate(tensors) if n not in output_slots)
            if not all(out_is_separate(out, inputs) for out in passed):
                return None  # the checks name the overlap
        if not plan.replay(addresses, device, stream, tensors):
            entry.plans.pop(id(config), None)  # another thread may have dropped it as well
            return None
        for out in passed:  # written in place, as the launch function's op would mark it
            torch.autograd.graph.increment_version(out)
        return outputs

    def _record(
        self,
        layout: tuple[Any, ...],
        launch: Callable[..., None],
        config: Any,
        args: tuple[Any, ...],
        tensors: Sequence[torch.Tensor | None],
    ) -> _Plan | None:
        """Run the launch function under a recording; keep and return the plan if it can be replayed."""
        self.recording_started = True
        rec = Recording()
        set_recording(rec)
        watched = _watch(True)
        if not watched:
            rec.refuse("Triton's launch hook is not a hook chain")
        try:
            with _OpWatch(rec):
                run_unwrapped(launch, (config, *args), ())
        finally:
            set_recording(None)
            if watched:
                _watch(False)
        why = rec.refused
        if why is None and not rec.launches and not rec.ops:
            why = "nothing was launched through a bound launch"
        plan: _Plan | None = None
        if why is None:
            try:
                plan = _build_plan(config, rec, tensors)
            except _Unmapped as refusal:
                why = str(refusal)
        if why is not None:
            attempts = self._attempts.get(layout, 0) + 1
            self._attempts[layout] = attempts
            if attempts < RECORD_ATTEMPTS:
                return None
            log.debug("%s: eager calls of this layout run their launch function: %s", self.name, why)
        if len(self._plans) >= PLANS_KEPT:
            self.clear()
        self._plans[layout] = plan
        self._attempts.pop(layout, None)
        return plan

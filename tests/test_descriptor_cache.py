"""Kept descriptor encodings (``kernels/_descriptor_cache.py``) pass what Triton's launcher would.

No GPU is needed: the launcher is Triton 3.6's own descriptor wrapper (``wrap_handle_tensordesc``)
around a recording raw launch, and the driver's encoding is replaced by a counting stand-in that
returns what it was given, so a stale encoding would show as wrong arguments.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from triton.backends.nvidia import driver as nvidia_driver
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from tritune.kernels import _descriptor_cache, _fastlaunch

pytestmark = pytest.mark.skipif(not _fastlaunch._TRITON_MIRRORED, reason="mirrors Triton 3.6's launcher")

#: A kernel signature with descriptors at positions 0 and 2 and a constexpr at the end.
SIGNATURE = {"a": "tensordesc<bf16[16, 64]>", "n": "i32", "b": "tensordesc<i32[64, 8]>", "p": "*fp32", "K": "constexpr"}
METAS = [{"slot": "a"}, {"slot": "b"}]


@pytest.fixture
def encodes(monkeypatch) -> list[tuple[Any, ...]]:
    """Replace the driver's encoding by one that records each call and returns its inputs."""
    calls: list[tuple[Any, ...]] = []

    def encode(arg: Any, meta: Any) -> list[Any]:
        calls.append((arg.base.data_ptr(), tuple(arg.shape), meta["slot"]))
        encoded = ("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), meta["slot"])
        return [encoded, *arg.shape, *arg.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)
    return calls


def _launcher(raw_calls: list[tuple[Any, ...]], scratch: int = 0) -> SimpleNamespace:
    """What a compiled kernel's ``run`` is: Triton's wrapper as ``launch``, and the launch flags."""
    return SimpleNamespace(
        launch=nvidia_driver.wrap_handle_tensordesc(lambda *args: raw_calls.append(args), SIGNATURE, METAS),
        global_scratch_size=scratch,
        profile_scratch_size=0,
        launch_cooperative_grid=False,
        launch_pdl=True,
    )


def _descriptor(t: torch.Tensor, box: list[int]) -> GluonTensorDescriptor:
    desc = GluonTensorDescriptor.__new__(GluonTensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), list(t.stride())
    desc.block_shape, desc.padding = box, "zero"
    return desc


def _through_triton(launcher: SimpleNamespace, *args: Any) -> None:
    """What ``CudaLauncher.__call__`` does with no scratch: the flags and two empty scratch slots."""
    grid_x, grid_y, grid_z, stream, function, *rest = args
    flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
    launcher.launch(grid_x, grid_y, grid_z, stream, function, *flags, None, None, *rest)


def _call_args(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> tuple[Any, ...]:
    return (3, 2, 1, 7, 1001, ("packed",), None, None, None, _descriptor(a, [16, 64]), 5, _descriptor(b, [64, 8]), p, 4)


def test_kept_encodings_pass_what_the_launcher_passes(encodes) -> None:
    triton_calls: list[tuple[Any, ...]] = []
    kept_calls: list[tuple[Any, ...]] = []
    launch = _descriptor_cache.caching_launcher(_launcher(kept_calls))
    assert launch is not None
    a, b, p = torch.randn(32, 64), torch.randint(0, 9, (64, 8), dtype=torch.int32), torch.randn(4)
    for _ in range(3):
        _through_triton(_launcher(triton_calls), *_call_args(a, b, p))
        launch(*_call_args(a, b, p))
    assert kept_calls == triton_calls
    assert len(encodes) == 3 * 2 + 2, "Triton encodes both descriptors every launch; the kept launch once each"


def test_another_tensor_is_encoded_again(encodes) -> None:
    calls: list[tuple[Any, ...]] = []
    launch = _descriptor_cache.caching_launcher(_launcher(calls))
    assert launch is not None
    a, b, p = torch.randn(32, 64), torch.randint(0, 9, (64, 8), dtype=torch.int32), torch.randn(4)
    launch(*_call_args(a, b, p))
    other = torch.randn(48, 64)  # another address and shape
    launch(*_call_args(other, b, p))
    launch(*_call_args(a[:16], b, p))  # same address, another shape
    assert [call[2] for call in encodes] == ["a", "b", "a", "a"]
    # Each launch got its own tensor's encoding, never a kept one of another.
    assert [call[13][1:3] for call in calls] == [
        (a.data_ptr(), (32, 64)),
        (other.data_ptr(), (48, 64)),
        (a.data_ptr(), (16, 64)),
    ]


def test_kept_encodings_are_bounded(encodes, monkeypatch) -> None:
    monkeypatch.setattr(_descriptor_cache, "DESCRIPTORS_KEPT", 2)
    launch = _descriptor_cache.caching_launcher(_launcher([]))
    assert launch is not None
    b, p = torch.randint(0, 9, (64, 8), dtype=torch.int32), torch.randn(4)
    tensors = [torch.randn(32, 64) for _ in range(3)]
    for t in (*tensors, tensors[0]):
        launch(*_call_args(t, b, p))
    # The third tensor dropped the first two: the first is encoded again.
    assert [call[0] for call in encodes if call[2] == "a"] == [t.data_ptr() for t in (*tensors, tensors[0])]


@pytest.mark.parametrize("case", ["no-descriptors", "scratch"])
def test_launchers_it_does_not_cover_are_left_alone(case) -> None:
    launcher = _launcher([], scratch=64 if case == "scratch" else 0)
    if case == "no-descriptors":
        launcher.launch = lambda *args: None
    assert _descriptor_cache.caching_launcher(launcher) is None


def test_switched_off_it_encodes_every_launch(encodes) -> None:
    calls: list[tuple[Any, ...]] = []
    launch = _descriptor_cache.caching_launcher(_launcher(calls))
    assert launch is not None
    a, b, p = torch.randn(32, 64), torch.randint(0, 9, (64, 8), dtype=torch.int32), torch.randn(4)
    _descriptor_cache.set_enabled(False)
    try:
        launch(*_call_args(a, b, p))
        launch(*_call_args(a, b, p))
    finally:
        _descriptor_cache.set_enabled(True)
    launch(*_call_args(a, b, p))
    assert len(encodes) == 2 * 2 + 2, "off: both descriptors each launch; back on: encoded once more, then kept"
    assert calls[0] == calls[1] == calls[2]


def test_a_replay_passes_the_raw_launch_what_the_kept_launch_passes(encodes) -> None:
    """A replayed launch (``kernels/_replay.py``) calls the raw launch itself, each descriptor
    expanded in place from the kept encodings: on fresh tensors it passes exactly what the
    descriptor-keeping launch passes on them, and a persistent buffer's descriptor stays fixed."""
    from tritune.kernels import _replay
    from tritune.kernels._recording import Recording

    recorded_calls: list[tuple[Any, ...]] = []
    launch = _descriptor_cache.caching_launcher(_launcher(recorded_calls))
    assert launch is not None
    a, b, p = torch.randn(32, 64), torch.randint(0, 9, (64, 8), dtype=torch.int32), torch.randn(4)
    args = _call_args(a, b, p)
    launch(*args)  # the recorded call itself
    rec = Recording()
    rec.launch(launch, args[4], args[5], args[:3], args[9:])
    rec.static(b, lambda: True)  # b stands for a persistent buffer: passed as recorded
    plan = _replay._build_plan(("config",), rec, [a, p])
    assert plan.launches[0][0] is launch.descriptor_parts[0], "the replay calls the raw launch itself"
    encoded = len(encodes)
    kept = []  # fresh tensors stay alive: each has its own address
    for _ in range(2):
        fresh_a, fresh_p = torch.randn(32, 64), torch.randn(4)
        kept += [fresh_a, fresh_p]
        direct: list[tuple[Any, ...]] = []
        direct_launch = _descriptor_cache.caching_launcher(_launcher(direct))
        assert direct_launch is not None
        direct_launch(*_call_args(fresh_a, b, fresh_p))
        before = len(recorded_calls)
        assert plan.replay([fresh_a.data_ptr(), fresh_p.data_ptr()], fresh_a.device, 7, [fresh_a, fresh_p])
        [replayed] = recorded_calls[before:]
        assert _addresses(replayed) == _addresses(direct[0])
    # Each direct launch encodes both descriptors (a launcher of its own); the replay only each
    # fresh a: b, a persistent buffer, was encoded once when the plan was built.
    assert [call[2] for call in encodes[encoded:]] == ["a", "b", "a", "a", "b", "a"]


def _addresses(call: tuple[Any, ...]) -> tuple[Any, ...]:
    """A raw launch's arguments with each tensor as its address (a replay passes addresses)."""
    return tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in call)


def test_switched_off_a_replay_encodes_every_launch_a_persistent_buffers_descriptor_too(encodes) -> None:
    """With the kept encodings off (the overhead measurement's baseline), a replay encodes each
    descriptor at every launch, a persistent buffer's included."""
    from tritune.kernels import _replay
    from tritune.kernels._recording import Recording

    launch = _descriptor_cache.caching_launcher(_launcher([]))
    assert launch is not None
    a, b, p = torch.randn(32, 64), torch.randint(0, 9, (64, 8), dtype=torch.int32), torch.randn(4)
    args = _call_args(a, b, p)
    rec = Recording()
    rec.launch(launch, args[4], args[5], args[:3], args[9:])
    rec.static(b, lambda: True)
    plan = _replay._build_plan(("config",), rec, [a, p])
    before = len(encodes)
    _descriptor_cache.set_enabled(False)
    try:
        for _ in range(2):
            assert plan.replay([a.data_ptr(), p.data_ptr()], a.device, 7, [a, p])
    finally:
        _descriptor_cache.set_enabled(True)
    assert [call[2] for call in encodes[before:]] == ["a", "b", "a", "b"]

"""Host TMA descriptors encoded once per layout (``kernels/_tma_descriptors.py``).

No GPU: Triton 3.6's own ``wrap_handle_tensordesc`` wraps a recording launcher, and the driver's
``fill_tma_descriptor`` is replaced by a counter, so the test sees what the launcher would receive
and how often the driver is asked to encode.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from triton.backends.nvidia import driver as nvidia
from triton.runtime.driver import driver

from tritune.kernels import _fastlaunch, _tma_descriptors

pytestmark = pytest.mark.skipif(not _fastlaunch._TRITON_MIRRORED, reason="mirrors Triton 3.6's launcher only")

_META = {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [16, 64], "fp4_padded": False}
_SIGNATURE = {0: "tensordesc<bf16[16, 64]>", 1: "*bf16", 2: "i32"}


@pytest.fixture
def encoder(monkeypatch):
    """Counts the driver's encodings; each returns a fresh token naming the address it encoded."""
    encoded: list[int] = []

    def fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        encoded.append(ptr)
        return ("map", ptr, tuple(block), tuple(shape), len(encoded))

    fake = SimpleNamespace(utils=SimpleNamespace(fill_tma_descriptor=fill))
    monkeypatch.setattr(driver, "_active", fake)
    _tma_descriptors.forget()
    yield encoded
    _tma_descriptors.forget()


def _launcher(calls: list[tuple[Any, ...]], metas: list[Any] | None = None) -> Any:
    wrapped = nvidia.wrap_handle_tensordesc(lambda *args: calls.append(args), _SIGNATURE, metas or [_META])
    return SimpleNamespace(launch=wrapped)


def _desc(t: torch.Tensor) -> Any:
    return SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), padding="zero")


def _launch(launcher: Any, desc: Any, out: torch.Tensor) -> None:
    head = tuple(range(nvidia._BASE_ARGS_FORMAT_LEN))
    launcher.launch(*head, desc, out, 7)


def test_a_layout_is_encoded_once_and_launched_as_triton_would(encoder):
    x, out = torch.empty(32, 64, dtype=torch.bfloat16), torch.empty(4)
    reference: list[tuple[Any, ...]] = []
    _launch(_launcher(reference), _desc(x), out)
    calls: list[tuple[Any, ...]] = []
    launcher = _launcher(calls)
    _tma_descriptors.cache_encodings(launcher)
    for _ in range(3):
        _launch(launcher, _desc(x), out)
    assert len(encoder) == 2, "Triton's own launch once, the cached launcher once for three launches"
    # Argument for argument what Triton's handler passes (the map token aside: a fresh one per encoding).
    assert all(len(call) == len(reference[0]) for call in calls)
    base = nvidia._BASE_ARGS_FORMAT_LEN
    assert all(call[:base] == reference[0][:base] and call[base + 1 :] == reference[0][base + 1 :] for call in calls)
    assert calls[0][base] is calls[2][base], "the kept encoding is reused"


def test_another_address_shape_or_stride_is_encoded_again(encoder):
    calls: list[tuple[Any, ...]] = []
    launcher = _launcher(calls)
    _tma_descriptors.cache_encodings(launcher)
    storage = torch.empty(64 * 128, dtype=torch.bfloat16)
    out = torch.empty(4)
    views = [storage[: 32 * 64].view(32, 64), storage[64:].view(-1, 64)[:32], storage[: 16 * 64].view(16, 64),
             storage.view(64, 128)[:, :64]]  # fmt: skip
    for view in views:
        _launch(launcher, _desc(view), out)
    assert len(encoder) == 4
    _launch(launcher, _desc(views[0]), out)
    assert len(encoder) == 4


def test_the_cache_is_bounded(encoder, monkeypatch):
    monkeypatch.setattr(_tma_descriptors, "CAPACITY", 2)
    launcher = _launcher([])
    _tma_descriptors.cache_encodings(launcher)
    tensors = [torch.empty(16, 64, dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty(4)
    for t in (*tensors, tensors[0]):
        _launch(launcher, _desc(t), out)
    assert len(_tma_descriptors._ENCODED) == 2
    assert len(encoder) == 4, "the oldest layout was dropped and encoded again"


def test_launchers_without_encoded_descriptors_are_left_alone():
    plain = SimpleNamespace(launch=print)
    _tma_descriptors.cache_encodings(plain)
    assert plain.launch is print
    decomposed = _launcher([], metas=[None])
    before = decomposed.launch
    _tma_descriptors.cache_encodings(decomposed)
    assert decomposed.launch is before
    cached = _launcher([])
    _tma_descriptors.cache_encodings(cached)
    again = cached.launch
    _tma_descriptors.cache_encodings(cached)
    assert cached.launch is again

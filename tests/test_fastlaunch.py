"""Bound launches (``kernels/_fastlaunch.py``) pass the compiled kernel what ``JITFunction.run`` would.

No GPU is needed: Triton's driver is replaced by one that reports device 0 and an sm_90 target,
and compiling is replaced by a stub whose launcher records its arguments. The binder, the
specialization and ``JITFunction.run`` itself are Triton's own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton.language as tl
from fake_triton import stub_compiles
from triton import knobs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from tritune.kernels import _fastlaunch, settings
from tritune.kernels._oplib import run_unwrapped, wrap_triton

pytestmark = pytest.mark.skipif(not _fastlaunch._TRITON_MIRRORED, reason="bound launches mirror Triton 3.6 only")


def _toy(x_ptr, out_ptr, n, stride, scale, flag_ptr, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):
    pass


@pytest.fixture
def toy(monkeypatch):
    """A fresh JITFunction of ``_toy`` on the fake driver; yields (kernel, compiled list, launches)."""
    kernel = JITFunction(_toy)
    compiled, launches = stub_compiles(kernel, monkeypatch)
    _fastlaunch.forget()
    yield kernel, compiled, launches
    _fastlaunch.forget()


def _args(n: int = 64, offset: int = 0) -> tuple[Any, ...]:
    x = torch.randn(n + 8)[offset:]
    return (x, torch.empty(n), n, 1 if n == 1 else 32, 0.5, None)


def _launch_bound(kernel: JITFunction, args: tuple[Any, ...], grid: Any = (4, 2), **kwargs: Any) -> None:
    _fastlaunch.bound(kernel)[grid](*args, **kwargs)


def test_later_launches_pass_what_jitfunction_run_passes(toy) -> None:
    kernel, compiled, launches = toy
    args = _args()
    kernel[(4, 2)](*args, BLOCK=32, num_warps=4)
    _launch_bound(kernel, args, BLOCK=32, num_warps=4)  # first bound launch: through JITFunction.run
    _launch_bound(kernel, args, BLOCK=32, num_warps=4)  # compiled: launched directly
    assert len(compiled) == 1
    through_triton, first_bound, direct = launches
    assert through_triton == first_bound
    # Grid padded to three dims, stream, function handle, packed metadata, then every argument in order.
    assert direct[:6] == through_triton[:6] == (4, 2, 1, 7, 1000, ("packed", 0))
    assert direct[9:] == through_triton[9:]
    assert list(direct[9:])[-2:] == [32, False]  # constexprs too, defaults applied, as Triton passes them
    # No launch hook is set: no metadata, no hook calls.
    assert direct[6:9] == (None, None, None)
    assert through_triton[6] == "metadata"


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"offset": 1}, id="misaligned-pointer"),
        pytest.param({"n": 17}, id="int-not-divisible-by-16"),
        pytest.param({"n": 1}, id="int-equal-to-one"),
    ],
)
def test_a_new_specialization_compiles_as_triton_would(toy, change) -> None:
    kernel, compiled, launches = toy
    _launch_bound(kernel, _args(), BLOCK=32)
    _launch_bound(kernel, _args(), BLOCK=32)
    assert len(compiled) == 1
    _launch_bound(kernel, _args(**change), BLOCK=32)
    assert len(compiled) == 2, "the changed argument must select another compiled kernel"
    # And Triton agrees: launching it through JITFunction.run finds that same kernel, compiling nothing.
    kernel[(4, 2)](*_args(**change), BLOCK=32)
    assert len(compiled) == 2
    assert launches[-1][4] == launches[-2][4] == 1001


def test_constexprs_and_options_key_the_cache(toy) -> None:
    kernel, compiled, _ = toy
    for block, warps in ((32, 4), (64, 4), (32, 8), (32, 4)):
        _launch_bound(kernel, _args(), BLOCK=block, num_warps=warps)
        _launch_bound(kernel, _args(), BLOCK=block, num_warps=warps)
    assert len(compiled) == 3


@pytest.mark.parametrize("reason", ["setting-off", "launch-hook", "callable-grid"])
def test_what_is_not_mirrored_goes_through_jitfunction_run(toy, monkeypatch, reason) -> None:
    kernel, _, launches = toy
    grid: Any = (4, 2)
    seen: list[Any] = []
    if reason == "setting-off":
        monkeypatch.setenv("TRITUNE_FAST_LAUNCH", "0")
        settings.reload()
    elif reason == "launch-hook":
        monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [seen.append])
    else:
        grid = lambda meta: (4, 2)  # noqa: E731
    for _ in range(3):
        _launch_bound(kernel, _args(), grid, BLOCK=32)
    assert len(launches) == 3
    assert all(launch[6] == "metadata" for launch in launches), "every launch went through JITFunction.run"


def test_set_enabled_turns_bound_launches_off_and_back(toy) -> None:
    kernel, _, launches = toy
    _fastlaunch.set_enabled(False)
    for _ in range(2):
        _launch_bound(kernel, _args(), BLOCK=32)
    _fastlaunch.set_enabled(None)
    for _ in range(2):
        _launch_bound(kernel, _args(), BLOCK=32)
    assert [launch[6] for launch in launches] == ["metadata", "metadata", "metadata", None]


def test_op_bodies_launch_bound_kernels_and_tracers_get_torchs_wrapper() -> None:
    kernel = JITFunction(_toy)
    seen: list[Any] = []
    run_unwrapped(lambda: seen.append(wrap_triton(kernel)), (), ())
    assert isinstance(seen[0], _fastlaunch.BoundKernel) and seen[0].fn is kernel
    # With wrap_triton on (a tracer runs the body) the launch must stay visible to torch.
    assert not isinstance(wrap_triton(kernel), _fastlaunch.BoundKernel)


def test_interpreted_kernels_are_launched_as_they_are() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = InterpretedFunction(_toy)
    assert _fastlaunch.bound(interpreted) is interpreted
    kernel = JITFunction(_toy)
    assert _fastlaunch.bound(kernel) is _fastlaunch.bound(kernel)


@gluon.jit
def _gluon_toy(desc, out_ptr, n, BLOCK: gl.constexpr):
    pass


def _descriptor(rows: int, box: list[int]) -> Any:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = torch.empty((rows, 64), dtype=torch.bfloat16)
    return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))


def test_gluon_launches_with_descriptors_pass_what_jitfunction_run_passes(monkeypatch) -> None:
    """A Gluon kernel is bound too: the descriptor reaches the launcher as ``JITFunction.run``
    passes it (the launcher encodes it), and another box selects another compiled kernel."""
    kernel = _gluon_toy
    assert isinstance(_fastlaunch.bound(kernel), _fastlaunch.BoundKernel)
    compiled, launches = stub_compiles(kernel, monkeypatch)
    _fastlaunch.forget()
    try:
        desc, out = _descriptor(128, [32, 64]), torch.empty(8)
        kernel[(2,)](desc, out, 128, BLOCK=32)
        for _ in range(2):
            _fastlaunch.bound(kernel)[(2,)](desc, out, 128, BLOCK=32)
        assert len(compiled) == 1
        through_triton, _, direct = launches
        assert direct[:6] == through_triton[:6] and direct[9:] == through_triton[9:]
        assert direct[9] is desc and direct[6:9] == (None, None, None)
        _fastlaunch.bound(kernel)[(2,)](_descriptor(128, [64, 64]), out, 128, BLOCK=32)
        assert len(compiled) == 2, "another box must select another compiled kernel"
    finally:
        _fastlaunch.forget()


def test_a_stand_in_for_jitfunction_run_sees_every_launch(toy, monkeypatch) -> None:
    """A recorder replacing ``JITFunction.run`` (as the sm_90 build tests do) returns no compiled
    kernel: nothing is kept, so every launch reaches it, and Triton's driver is never asked."""
    kernel, _, _ = toy
    seen: list[Any] = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: seen.append(grid))
    monkeypatch.setattr(driver, "_active", None)
    for _ in range(3):
        _launch_bound(kernel, _args(), BLOCK=32)
    assert seen == [(4, 2)] * 3


def test_an_instrumentation_mode_set_later_selects_its_own_kernel(toy, monkeypatch) -> None:
    kernel, compiled, launches = toy
    for _ in range(2):
        _launch_bound(kernel, _args(), BLOCK=32)
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    for _ in range(2):
        _launch_bound(kernel, _args(), BLOCK=32)
    assert len(compiled) == 2
    assert [launch[4] for launch in launches] == [1000, 1000, 1001, 1001]


def test_a_kernels_debug_flag_set_after_its_first_launch_keys_the_cache(toy) -> None:
    """``JITFunction.run`` folds the kernel's own ``debug`` into its options: so must the bound cache."""
    kernel, compiled, launches = toy
    for _ in range(2):
        _launch_bound(kernel, _args(), BLOCK=32)
    kernel.debug = True
    kernel[(4, 2)](*_args(), BLOCK=32)  # Triton compiles the debug build
    assert len(compiled) == 2
    _launch_bound(kernel, _args(), BLOCK=32)
    assert launches[-1][4] == 1001, "the bound launch must run the debug build too"


def test_an_unhashable_option_launches_through_triton_once_per_call(toy) -> None:
    """Triton keys options by their text; a value the bound cache cannot hash must neither raise
    after the kernel ran nor launch it twice."""
    kernel, compiled, launches = toy
    for calls in (1, 2, 3):
        _launch_bound(kernel, _args(), BLOCK=32, extern_libs={"lib": "path"})
        assert len(launches) == calls
    assert len(compiled) == 1

"""Eager calls replayed per argument layout (``kernels/_replay.py``) launch what the launch function would.

No GPU: Triton's driver and compiler are replaced (:mod:`fake_triton`), so every launch reaches a
list. A replayed call must hand the launcher the same arguments as the launch function run on the
same tensors (addresses for tensors, the same descriptors' fields), and anything a replay could not
repeat exactly must keep the call on its launch function.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
import triton.language as tl
from fake_triton import stub_compiles
from triton import knobs
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels import _fastlaunch, _launch, _replay, settings
from tritune.kernels._early_key import build_early_key
from tritune.kernels._oplib import run_unwrapped, wrap_triton
from tritune.kernels._recording import recording

pytestmark = pytest.mark.skipif(not _fastlaunch._TRITON_MIRRORED, reason="bound launches mirror Triton 3.6 only")

CONFIG = ("a config",)


def _toy(x_ptr, out_ptr, n, stride, scale, flag_ptr, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):
    pass


class Toy:
    """A kernel on the fake driver, a launch function over it, and the launches that reached the driver."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kernel = JITFunction(_toy)
        _, self.launches = stub_compiles(self.kernel, monkeypatch)
        self.plans = _replay.LaunchPlans("toy")
        self.body_runs = 0

    def launch(self, config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """A launch function: two launches, a view, a workspace and a flag pointer into ``out``."""
        self.body_runs += 1
        n = x.shape[0]
        ws = torch.empty(n + 3, dtype=torch.float32, device=x.device)
        wrap_triton(self.kernel)[(4, 2)](x[2:], ws, n - 2, x.stride(0), scale, out[1:], BLOCK=32)
        wrap_triton(self.kernel)[(n // 16,)](ws, out, n, 1, scale * 2, None, BLOCK=16, EVEN=True)

    def call(self, x: torch.Tensor, scale: float = 0.5, launch: Any = None, config: Any = CONFIG) -> torch.Tensor:
        """What a declared kernel's eager call does: allocate ``out``, replay or run the launch function."""
        launch = launch or self.launch
        out = torch.empty_like(x)
        if not self.plans.run(launch, config, (x, out, scale), [x, out], (scale,), x.device):
            run_unwrapped(launch, (config, x, out, scale), ())
        return out

    def launched_by_body(self, x: torch.Tensor, out: torch.Tensor, scale: float = 0.5) -> list[tuple[Any, ...]]:
        """The launcher arguments the launch function itself passes on these tensors."""
        before = len(self.launches)
        run_unwrapped(self.launch, (CONFIG, x, out, scale), ())
        return self.launches[before:]


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(_replay, "_capturing", lambda: False)
    _fastlaunch.forget()
    yield Toy(monkeypatch)
    _fastlaunch.forget()


def _comparable(value: Any) -> Any:
    """A launcher argument as the kernel sees it: an address for a tensor, a descriptor's fields."""
    if isinstance(value, torch.Tensor):
        return ("address", value.data_ptr())
    if isinstance(value, int) and value > 1 << 20:  # a replayed pointer
        return ("address", value)
    if hasattr(value, "base") and hasattr(value, "strides"):
        return ("descriptor", value.base.data_ptr(), tuple(value.shape), tuple(value.strides), value.padding)
    return value


def _same_launch(replayed: tuple[Any, ...], direct: tuple[Any, ...], skip: set[int] = frozenset()) -> None:
    assert len(replayed) == len(direct)
    for i, (a, b) in enumerate(zip(replayed, direct, strict=True)):
        if i not in skip:
            assert _comparable(a) == _comparable(b), f"launcher argument {i}: {a!r} against {b!r}"


def _warm(toy: Toy, x: torch.Tensor, calls: int = 2) -> None:
    for _ in range(calls):
        toy.call(x)


def test_a_replayed_call_passes_what_the_launch_function_passes(toy) -> None:
    _warm(toy, torch.randn(64))
    runs = toy.body_runs
    x = torch.randn(64)
    before = len(toy.launches)
    out = toy.call(x)
    assert toy.body_runs == runs, "the layout's third call must replay, not run the launch function"
    replayed = toy.launches[before:]
    direct = toy.launched_by_body(x, out)
    assert len(replayed) == len(direct) == 2
    # Leading launcher arguments: grid, stream, function, packed metadata, no metadata or hooks.
    for r, d in zip(replayed, direct, strict=True):
        assert r[:9] == d[:9]
    # The workspace is fresh memory of the same size: its address differs, the rest matches.
    _same_launch(replayed[0], direct[0], skip={9 + 1})
    _same_launch(replayed[1], direct[1], skip={9 + 0})
    assert replayed[0][9 + 1] == replayed[1][9 + 0], "both launches must read the one workspace"
    assert replayed[0][9 + 0] == x.data_ptr() + 2 * x.element_size(), "a view's offset must be kept"
    assert replayed[0][9 + 5] == out.data_ptr() + out.element_size()


def _next_workspace(toy: Toy, x: torch.Tensor) -> int:
    """The workspace address the next call's first launch gets."""
    before = len(toy.launches)
    toy.call(x)
    return toy.launches[before][9 + 1]


def test_each_call_gets_its_own_outputs_and_a_kept_workspace_per_thread_and_stream(toy, monkeypatch) -> None:
    """Outputs are the caller's, so fresh at every call; the workspace is reused by replays on one
    stream of one thread (their launches run in order there), never shared across streams or
    threads, whose launches may interleave."""
    import threading

    from triton.runtime.driver import driver

    _replay.forget_all()
    _warm(toy, torch.randn(64))
    x = torch.randn(64)
    outputs = [toy.call(x) for _ in range(3)]
    assert len({out.data_ptr() for out in outputs}) == 3
    kept = _next_workspace(toy, x)
    assert _next_workspace(toy, x) == kept, "a replay on the same stream and thread reuses the workspace"
    in_thread: list[int] = []
    worker = threading.Thread(target=lambda: in_thread.append(_next_workspace(toy, x)))
    worker.start()
    worker.join()
    assert in_thread and in_thread[0] != kept, "another thread gets its own workspace"
    monkeypatch.setattr(driver.active, "get_current_stream", lambda device: 8)
    _warm(toy, x)  # another stream is another layout
    assert _next_workspace(toy, x) != kept, "another stream gets its own workspace"
    monkeypatch.undo()


def test_one_workspace_is_held_per_thread_and_device_and_forget_all_drops_every_threads(toy, monkeypatch) -> None:
    """A thread replaying on ever new streams holds one buffer, not one per stream; forget_all
    drops the buffers of every living thread, not only its caller's."""
    import threading

    from triton.runtime.driver import driver

    _replay.forget_all()
    x = torch.randn(64)
    for stream in (7, 8, 9):
        monkeypatch.setattr(driver.active, "get_current_stream", lambda device, stream=stream: stream)
        _warm(toy, x, calls=3)
    assert [held[0] for held in _replay._kept.scratch.by_device.values()] == [9]
    started, release = threading.Event(), threading.Event()

    def worker() -> None:
        _next_workspace(toy, x)
        started.set()
        release.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert started.wait(10)
        assert sum(len(kept.by_device) for kept in list(_replay._kept_all)) == 2
        _replay.forget_all()
        assert all(not kept.by_device for kept in list(_replay._kept_all))
    finally:
        release.set()
        thread.join()


def test_a_big_workspace_is_allocated_per_replay(toy, monkeypatch) -> None:
    _replay.forget_all()
    monkeypatch.setattr(_replay, "KEPT_SCRATCH_BYTES", 64)
    _warm(toy, torch.randn(64))
    x = torch.randn(64)
    toy.call(x)
    kept = getattr(_replay._kept, "scratch", None)
    assert kept is None or not kept.by_device, "a workspace over the limit must not be kept"
    monkeypatch.setattr(_replay, "KEPT_SCRATCH_BYTES", 1024)
    toy.call(x)
    assert [b.numel() for _, b in _replay._kept.scratch.by_device.values()] == [512]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda x: (torch.randn(80), 0.5), id="shape"),
        pytest.param(lambda x: (torch.randn(130)[1:129:2], 0.5), id="strides"),
        pytest.param(lambda x: (torch.randn(65)[1:], 0.5), id="misaligned"),
        pytest.param(lambda x: (x, 0.25), id="scalar"),
    ],
)
def test_another_layout_runs_the_launch_function(toy, change) -> None:
    x = torch.randn(64)
    _warm(toy, x, 3)
    runs = toy.body_runs
    toy.call(*change(x))
    assert toy.body_runs == runs + 1


def test_another_config_runs_the_launch_function(toy) -> None:
    x = torch.randn(64)
    _warm(toy, x, 3)
    runs = toy.body_runs
    toy.call(x, config=("another config",))
    assert toy.body_runs == runs + 1


def _zeroes_out(toy: Toy):
    def launch(config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        out.zero_()
        toy.launch(config, x, out, scale)

    return launch


def _launches_unbound(toy: Toy):
    def launch(config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        toy.launch(config, x, out, scale)
        toy.kernel[(1,)](x, out, 8, 1, scale, None, BLOCK=32)

    return launch


_ELSEWHERE = torch.randn(256)


def _reads_elsewhere(toy: Toy):
    def launch(config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        toy.launch(config, x, out, scale)
        wrap_triton(toy.kernel)[(1,)](_ELSEWHERE, out, 8, 1, scale, None, BLOCK=32)

    return launch


def _copies_x(toy: Toy):
    def launch(config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        toy.launch(config, x.clone(), out, scale)

    return launch


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param(_zeroes_out, id="in-place-op"),
        pytest.param(_copies_x, id="copy"),
        pytest.param(_launches_unbound, id="launch-not-through-wrap-triton"),
        pytest.param(_reads_elsewhere, id="unregistered-buffer"),
    ],
)
def test_what_a_replay_could_not_repeat_keeps_the_launch_function(toy, launch) -> None:
    body = launch(toy)
    x = torch.randn(64)
    for _ in range(_replay.RECORD_ATTEMPTS + 3):
        toy.call(x, launch=body)
    assert toy.body_runs == _replay.RECORD_ATTEMPTS + 3, "every call must run the launch function"


def test_arguments_sharing_memory_are_not_replayed(toy) -> None:
    def launch(config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        toy.launch(config, x, out, scale)

    x = torch.randn(64)
    calls = _replay.RECORD_ATTEMPTS + 2
    for _ in range(calls):
        out = torch.empty_like(x)
        # x passed as two arguments: a pointer into it could come from either.
        if not toy.plans.run(launch, CONFIG, (x, out, 0.5), [x, x, out], (0.5,), x.device):
            run_unwrapped(launch, (CONFIG, x, out, 0.5), ())
    assert toy.body_runs == calls


def test_a_registered_buffer_is_replayed_while_valid(toy) -> None:
    buffers = {"current": torch.zeros(32, dtype=torch.int32)}

    def launch(config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        toy.body_runs += 1
        buffer = buffers["current"]
        rec = recording()
        if rec is not None:
            rec.static(buffer, lambda: buffers["current"] is buffer)
        wrap_triton(toy.kernel)[(2,)](x, out, 64, 1, scale, buffer, BLOCK=32)

    x = torch.randn(64)
    for _ in range(3):
        toy.call(x, launch=launch)
    assert toy.body_runs == 2
    assert toy.launches[-1][9 + 5] == buffers["current"].data_ptr()
    buffers["current"] = torch.zeros(64, dtype=torch.int32)
    toy.call(x, launch=launch)
    assert toy.body_runs == 3, "a replaced buffer must send the call back to the launch function"
    assert toy.launches[-1][9 + 5] is buffers["current"]


def test_descriptors_are_rebuilt_on_the_new_address(toy) -> None:
    def launch(config: Any, x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        toy.body_runs += 1
        desc = TensorDescriptor.from_tensor(x.view(4, 16), [2, 16])
        wrap_triton(toy.kernel)[(2,)](desc, out, 64, 1, scale, None, BLOCK=32)

    _warm_calls = 2
    for _ in range(_warm_calls):
        toy.call(torch.randn(64), launch=launch)
    x = torch.randn(64)
    toy.call(x, launch=launch)
    assert toy.body_runs == _warm_calls
    desc = toy.launches[-1][9]
    assert desc.base.data_ptr() == x.data_ptr()
    assert (tuple(desc.shape), tuple(desc.strides), desc.padding) == ((4, 16), (16, 1), "zero")


def test_nothing_is_replayed_while_a_graph_captures_or_a_hook_is_set(toy, monkeypatch) -> None:
    x = torch.randn(64)
    _warm(toy, x, 3)
    runs = toy.body_runs
    monkeypatch.setattr(_replay, "_capturing", lambda: True)
    toy.call(x)
    monkeypatch.setattr(_replay, "_capturing", lambda: False)
    seen: list[Any] = []
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [seen.append])
    toy.call(x)
    assert toy.body_runs == runs + 2
    assert seen, "the user's hook must see the launches"


def test_the_setting_turns_replay_off(toy, monkeypatch) -> None:
    x = torch.randn(64)
    _warm(toy, x, 3)
    monkeypatch.setenv("TRITUNE_EAGER_REPLAY", "0")
    settings.reload()
    try:
        runs = toy.body_runs
        toy.call(x)
        assert toy.body_runs == runs + 1
    finally:
        monkeypatch.delenv("TRITUNE_EAGER_REPLAY")
        settings.reload()


def test_the_arrival_counters_register_for_their_stream(monkeypatch) -> None:
    """An eager launch's counters are its stream's buffer: a recording may keep their address while
    that stream's buffer stays the same object."""
    from tritune.kernels._recording import Recording, set_recording

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("S", (), {"cuda_stream": 11})())
    device = torch.device("cuda", 0)
    kept = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setitem(_launch.COUNTERS, (device, None), kept)
    monkeypatch.setitem(_launch.COUNTERS, (device, 11), kept)
    monkeypatch.setattr(_launch, "_capturing_now", lambda: False, raising=False)
    rec = Recording()
    set_recording(rec)
    try:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        buffer = _launch.arrival_counters(8, device)
    finally:
        set_recording(None)
    assert buffer is kept
    [(registered, still_valid)] = rec.statics
    assert registered is kept and still_valid()
    _launch.COUNTERS[(device, 11)] = torch.zeros(128, dtype=torch.int32)
    assert not still_valid()


# ---- replay before the checks: the raw arguments' key ------------------------------------------


class _Packed:
    """An object argument made of two tensors (as a quantized weight is)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


def _split(packed: _Packed) -> tuple[torch.Tensor, torch.Tensor]:
    return packed.a, packed.b


#: x (input), packed (object), scale (scalar), out (output): in the order a declared kernel lays them out.
_LAYOUT = (
    (0, _replay.INPUT, None),
    (3, _replay.OUTPUT, None),
    (1, _replay.OBJECT, (_Packed, _split)),
    (2, _replay.SCALAR, None),
)


def _raw(x: torch.Tensor | None = None, scale: Any = 0.5, out: Any = None, packed: Any = None) -> tuple[Any, ...]:
    x = torch.randn(4, 64) if x is None else x
    packed = _Packed(torch.randn(8, 4), torch.randn(8)) if packed is None else packed
    return (x, packed, scale, out)


def early_key(args: tuple[Any, ...], layout: Any, optional: frozenset[int] = frozenset()) -> Any:
    """The key a declared kernel of ``layout`` reads from ``args`` (its function built per call here)."""
    return build_early_key(layout, optional)(args)


def test_the_early_key_leaves_to_the_checks_what_they_must_see(toy) -> None:
    assert early_key(_raw(), _LAYOUT) is not None
    refused = {
        "an output needing grad": _raw(out=torch.empty(4, 8, requires_grad=True)),
        "an output of a tensor subclass": _raw(out=torch.nn.Parameter(torch.empty(4, 8), requires_grad=False)),
        "a tensor needing grad": _raw(x=torch.randn(4, 64, requires_grad=True)),
        "a tensor subclass": _raw(x=torch.nn.Parameter(torch.randn(4, 64), requires_grad=False)),
        "another object type": _raw(packed=(torch.randn(8, 4), torch.randn(8))),
        "a part needing grad": _raw(packed=_Packed(torch.randn(8, 4, requires_grad=True), torch.randn(8))),
    }
    for what, args in refused.items():
        assert early_key(args, _LAYOUT) is None, what


def test_the_early_key_tells_layouts_apart(toy) -> None:
    def key(**changes: Any) -> tuple[Any, ...]:
        found = early_key(_raw(**changes), _LAYOUT)
        assert found is not None
        return found[0]

    base = key()
    assert key() == base, "fresh tensors of one layout must share a key"
    others = {
        "shape": key(x=torch.randn(5, 64)),
        "strides": key(x=torch.randn(64, 4).t()),
        "dtype": key(x=torch.randn(4, 64, dtype=torch.float64)),
        "alignment": key(x=torch.randn(4 * 64 + 1)[1:].view(4, 64)),
        "scalar value": key(scale=0.25),
        "scalar type": key(scale=True),
    }
    assert key(scale=1) != key(scale=True), "True and 1 are equal: the key must still tell them apart"
    for what, other in others.items():
        assert other != base, what


def test_the_early_key_lists_addresses_in_the_replay_order(toy) -> None:
    args = _raw()
    found = early_key(args, _LAYOUT)
    assert found is not None
    x, packed = args[0], args[1]
    assert found[1] == [x.data_ptr(), 0, packed.a.data_ptr(), packed.b.data_ptr()]


def _fields(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


@pytest.mark.parametrize(
    "obj",
    [(_Packed, _split), (_Packed, lambda p: iter((p.a, p.b))), (_Packed, _split, 2)],
    ids=["tuple", "iterator", "counted parts"],
)
def test_the_early_key_reads_every_argument_in_the_layouts_order(toy, obj) -> None:
    """x, an optional input (absent, present, a view), the output's slot, an object's parts (its
    split a tuple or an iterator, or a declared number of parts), the scalar: the whole key, the
    addresses and the tensors."""
    from triton.runtime.driver import driver

    layout = (
        (0, _replay.INPUT, None),
        (4, _replay.INPUT, None),
        (3, _replay.OUTPUT, None),
        (1, _replay.OBJECT, obj),
        (2, _replay.SCALAR, None),
    )
    read = build_early_key(layout, optional=frozenset({4}))
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    for bias in (None, torch.randn(8), torch.randn(9, dtype=torch.float64)[1:]):
        args = (*_raw(), bias)
        x, packed, scale = args[0], args[1], args[2]
        found = read(args)
        assert found is not None
        key, addresses, tensors = found
        bias_fields = (None,) if bias is None else _fields(bias)
        parts = (*_fields(packed.a), *_fields(packed.b))
        expected = (device, stream, *_fields(x), *bias_fields, None, *parts, float, scale)
        assert key == expected and hash(key) == hash(expected)
        bias_address = 0 if bias is None else bias.data_ptr()
        assert addresses == [x.data_ptr(), bias_address, 0, packed.a.data_ptr(), packed.b.data_ptr()]
        assert all(a is b for a, b in zip(tensors, [x, bias, None, packed.a, packed.b], strict=True))
    out = torch.empty(4, 8)[:, 1:]  # a passed output: keyed, addressed and handed on as an input is
    args = (*_raw(out=out), None)
    found = read(args)
    assert found is not None
    key, addresses, tensors = found
    assert key[2 + 5 + 1 : 2 + 5 + 1 + 5] == _fields(out)
    assert addresses[2] == out.data_ptr() and tensors[2] is out
    assert key != read((*_raw(), None))[0], "an output passed and one to allocate are two layouts"
    assert read((None, *_raw()[1:], None)) is None, "a required tensor left None"
    assert read((*_raw(), torch.randn(8, requires_grad=True))) is None, "an optional tensor needing grad"
    assert read((*_raw(packed=_Packed(torch.randn(8, 4), None)), None)) is None, "a part left None"  # type: ignore[arg-type]


def test_an_object_of_declared_parts_must_split_into_that_many(toy) -> None:
    """With a number of parts declared, a split returning another number, or no tuple, leaves the
    call to the checks instead of keying a part short or reading one too many."""
    packed = _Packed(torch.randn(8, 4), torch.randn(8))
    for split in (lambda p: (p.a,), lambda p: (p.a, p.b, p.a), lambda p: iter((p.a, p.b))):
        read = build_early_key(((0, _replay.INPUT, None), (1, _replay.OBJECT, (_Packed, split, 2))))
        assert read((torch.randn(4, 64), packed)) is None
    for split in (_split, lambda p: [p.a, p.b], lambda p: _Pair(p.a, p.b)):
        read = build_early_key(((0, _replay.INPUT, None), (1, _replay.OBJECT, (_Packed, split, 2))))
        found = read((torch.randn(4, 64), packed))
        assert found is not None and found[2][1:] == [packed.a, packed.b]


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_an_argument_whose_layout_cannot_be_read_is_left_to_the_checks(toy) -> None:
    """A tensor the key cannot read (a nested tensor has no sizes) gives no key instead of an
    error from inside the replay machinery."""
    nested = torch.nested.nested_tensor([torch.randn(2, 64), torch.randn(3, 64)])
    assert early_key(_raw(x=nested), _LAYOUT) is None


def test_an_early_replay_launches_what_the_launch_function_does(toy) -> None:
    _warm(toy, torch.randn(64))
    x = torch.randn(64)
    out = toy.call(x)  # replayed after the checks: its plan is the layout's
    [plan] = [p for p in toy.plans._plans.values() if p is not None]
    key = ("raw key",)
    toy.plans.remember_early(key, ("facts",), x.device, [out], CONFIG, plan)
    entry = toy.plans.early(key)
    assert entry is not None and entry.outputs == (((64,), (1,), torch.float32),)
    assert toy.plans.replay_early(entry, ("another config",), 7, [x.data_ptr(), 0], (1,), [x, None]) is None
    fresh = torch.randn(64)
    before = len(toy.launches)
    runs = toy.body_runs
    [early_out] = toy.plans.replay_early(entry, CONFIG, 7, [fresh.data_ptr(), 0], (1,), [fresh, None])
    assert toy.body_runs == runs
    replayed = toy.launches[before:]
    direct = toy.launched_by_body(fresh, early_out)
    _same_launch(replayed[0], direct[0], skip={9 + 1})
    _same_launch(replayed[1], direct[1], skip={9 + 0})
    assert early_out.shape == (64,) and early_out.dtype == torch.float32


def test_an_early_replay_writes_a_passed_output_unless_it_overlaps_an_input(toy) -> None:
    """A call passing its output replays into that tensor (nothing allocated, its version bumped
    as an in-place write's); one sharing memory with an input goes the checked way, which names
    the overlap."""
    _warm(toy, torch.randn(64))
    x = torch.randn(64)
    out = toy.call(x)
    [plan] = [p for p in toy.plans._plans.values() if p is not None]
    toy.plans.remember_early(("raw key",), ("facts",), x.device, [out], CONFIG, plan)
    entry = toy.plans.early(("raw key",))
    assert entry is not None
    fresh, given = torch.randn(64), torch.empty(64)
    version = given._version
    before = len(toy.launches)
    [early_out] = toy.plans.replay_early(entry, CONFIG, 7, [fresh.data_ptr(), given.data_ptr()], (1,), [fresh, given])
    assert early_out is given and given._version > version
    replayed = toy.launches[before:]
    _same_launch(replayed[0], toy.launched_by_body(fresh, given)[0], skip={9 + 1})
    assert replayed[1][9 + 1] == given.data_ptr(), "the second launch writes the passed output"
    before = len(toy.launches)
    both = torch.randn(128)
    overlapping = toy.plans.replay_early(
        entry, CONFIG, 7, [both.data_ptr(), both[32:].data_ptr()], (1,), [both[:64], both[32:96]]
    )
    assert overlapping is None and len(toy.launches) == before


def test_an_address_held_by_another_object_refuses_the_recording() -> None:
    """An argument holding an address through an object a replay cannot rebuild (Triton's
    ``reinterpret`` wrapper, a descriptor over something other than a tensor) would be replayed
    with the recorded call's address: the recording is refused."""
    from types import SimpleNamespace

    from tritune.kernels._recording import Recording

    x = torch.randn(16)
    holders = {
        "a tensor wrapper": SimpleNamespace(data_ptr=x.data_ptr, dtype=torch.float32),
        "a descriptor over a wrapper": SimpleNamespace(block_shape=[4], base=SimpleNamespace(data_ptr=x.data_ptr)),
    }
    for holder in holders.values():
        rec = Recording()
        rec.launch(_cuda_launcher([], 0), 1001, ("packed",), (1, 1, 1), (holder, 5))
        with pytest.raises(_replay._Unmapped, match="holds an address"):
            _replay._build_plan(CONFIG, rec, [x])


def _cuda_launcher(raw: Any, scratch: int) -> Any:
    """A stand-in with the fields of Triton 3.6's ``CudaLauncher``, whose call and raw launch record."""
    fields = {
        "launch_cooperative_grid": False,
        "launch_pdl": True,
        "global_scratch_size": scratch,
        "profile_scratch_size": 0,
        "launch": staticmethod(lambda *args: raw.append(("raw", args))),
        "__call__": lambda self, *args: raw.append(("call", args)),
    }
    return type("CudaLauncher", (), fields)()


@pytest.mark.parametrize("scratch", [0, 256])
def test_a_replay_calls_the_raw_launch_of_a_launcher_without_scratch(scratch) -> None:
    """Without scratch, ``CudaLauncher.__call__`` only adds its flags: a replay calls the raw launch
    with them; a kernel needing scratch keeps the launcher's own call (it allocates the scratch)."""
    from tritune.kernels._recording import Recording

    calls: list[tuple[str, tuple[Any, ...]]] = []
    x = torch.randn(16)
    rec = Recording()
    rec.launch(_cuda_launcher(calls, scratch), 1001, ("packed",), (3, 1, 1), (x, 16, 32))
    plan = _replay._build_plan(CONFIG, rec, [x])
    fresh = torch.randn(16)
    assert plan.replay([fresh.data_ptr()], fresh.device, 7, [fresh])
    [(kind, args)] = calls
    if scratch:
        assert kind == "call"
        assert args == (3, 1, 1, 7, 1001, ("packed",), None, None, None, fresh.data_ptr(), 16, 32)
    else:
        assert kind == "raw"
        assert args == (
            3,
            1,
            1,
            7,
            1001,
            False,
            True,
            None,
            None,
            ("packed",),
            None,
            None,
            None,
            fresh.data_ptr(),
            16,
            32,
        )


# ---- what the review of the replay found ---------------------------------------------------------


def test_the_early_key_traces_under_torch_compile(toy, monkeypatch) -> None:
    """Under ``torch.compile`` the early key must stop before anything dynamo cannot trace (the
    capture query stands in here for any such call)."""

    def untraceable() -> bool:
        raise AssertionError("the capture query must not be reached while compiling")

    monkeypatch.setattr(_replay, "_capturing", untraceable)
    args = _raw()
    # The generated function is built with the kernel's declaration, outside any compiled code.
    read = build_early_key(_LAYOUT)
    compiled = torch.compile(lambda: read(args) is None, fullgraph=True, backend="eager")
    assert compiled()


def test_an_unhashable_or_storage_less_argument_is_left_to_the_checks(toy) -> None:
    found = early_key(_raw(scale=[0.5]), _LAYOUT)
    assert found is not None
    assert toy.plans.early(found[0]) is None, "an unhashable scalar must not raise here"
    sparse = torch.randn(4, 64).to_sparse()
    assert early_key(_raw(x=sparse), _LAYOUT) is None


def test_a_plan_dropped_by_another_thread_is_no_error(toy) -> None:
    """Two threads replaying one layout whose persistent buffer changed both drop its plan."""
    x = torch.randn(64)
    _warm(toy, x, 3)
    [(layout, plan)] = [(k, p) for k, p in toy.plans._plans.items() if p is not None]

    def dropped_elsewhere() -> bool:
        toy.plans._plans.pop(layout, None)  # what the other thread did meanwhile
        return False

    plan.checks.append(dropped_elsewhere)
    runs = toy.body_runs
    toy.call(x)
    assert toy.body_runs == runs + 1
    entry = _replay._Early(("facts",), x.device, [torch.empty(64)])
    entry.plans[id(CONFIG)] = plan

    def entry_dropped_elsewhere() -> bool:
        entry.plans.clear()
        return False

    plan.checks[-1] = entry_dropped_elsewhere
    assert toy.plans.replay_early(entry, CONFIG, 7, [x.data_ptr(), 0], (1,), [x, None]) is None


def test_nothing_replays_under_a_dispatch_mode(toy) -> None:
    """A prepared launch reaches the plans without the call's own mode check: under a user's
    dispatch mode its launch function must run (and see the mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(64)
    _warm(toy, x, 3)
    runs = toy.body_runs
    out = torch.empty_like(x)
    with Passthrough():
        assert toy.plans.run(toy.launch, CONFIG, (x, out, 0.5), [x, out], (0.5,), x.device) is None
    assert toy.body_runs == runs


# ---- torch ops replayed: GEMMs into a given out ------------------------------------------------


class Gemm:
    """A launch function that launches a kernel, then runs two GEMMs: one into a workspace, one
    from it (and the arguments, through views) into the output."""

    def __init__(self, toy: Toy) -> None:
        self.toy, self.plans, self.body_runs = toy, _replay.LaunchPlans("gemm"), 0

    def launch(self, config: Any, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        self.body_runs += 1
        ws = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        torch.mm(x, w.t(), out=ws)
        wrap_triton(self.toy.kernel)[(2,)](x, ws, x.shape[0], 1, scale, None, BLOCK=16)
        torch.addmm(ws[:, 1:], x[:, 2:], w[1:, 2:].t(), alpha=scale, out=out[:, 1:])
        torch.mm(x[:, :3], w[:1, :3].t(), out=out[:, :1])

    def call(self, x: torch.Tensor, w: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype)  # every element must be written
        args = (x, w, out, scale)
        if not self.plans.run(self.launch, CONFIG, args, [x, w, out], (scale,), x.device):
            run_unwrapped(self.launch, (CONFIG, *args), ())
        return out


def _expected(x: torch.Tensor, w: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    ws = x @ w.t()
    out[:, 1:] = ws[:, 1:] + scale * (x[:, 2:] @ w[1:, 2:].t())
    out[:, :1] = x[:, :3] @ w[:1, :3].t()
    return out


def test_gemms_into_a_given_out_are_replayed_on_the_calls_views(toy, monkeypatch) -> None:
    gemm = Gemm(toy)
    x, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    for _ in range(2):
        gemm.call(x, w)
    runs = gemm.body_runs
    [plan] = [p for p in gemm.plans._plans.values() if p is not None]
    assert [(position, func) for position, func, _, _ in plan.ops] == [
        (0, torch.ops.aten.mm.out),
        (1, torch.ops.aten.addmm.out),
        (1, torch.ops.aten.mm.out),
    ], "each GEMM is noted with the launches before it"
    # The replay runs them in that order among the launches: one log for both.
    run_op = _replay._Plan._run_op
    logged_op = staticmethod(lambda op, *rest: (toy.launches.append(op[1]), run_op(op, *rest)))
    monkeypatch.setattr(_replay._Plan, "_run_op", logged_op)
    for _ in range(3):
        x, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
        before = len(toy.launches)
        out = gemm.call(x, w)
        torch.testing.assert_close(out, _expected(x, w), rtol=0, atol=1e-12)
        logged = ["launch" if isinstance(entry, tuple) else entry for entry in toy.launches[before:]]
        assert logged == [torch.ops.aten.mm.out, "launch", torch.ops.aten.addmm.out, torch.ops.aten.mm.out]
    assert gemm.body_runs == runs, "a layout's third call on must replay, not run the launch function"
    # Arguments that are views into larger storages (the same layout): rebuilt at their own offsets.
    x, w = torch.randn(8, 8, dtype=torch.float64)[2:], torch.randn(7, 8, dtype=torch.float64)[2:]
    torch.testing.assert_close(gemm.call(x, w), _expected(x, w), rtol=0, atol=1e-12)
    assert gemm.body_runs == runs


def test_an_early_replay_of_gemms_builds_its_views_on_the_calls_tensors(toy) -> None:
    gemm = Gemm(toy)
    x, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    for _ in range(3):
        out = gemm.call(x, w)
    [plan] = [p for p in gemm.plans._plans.values() if p is not None]
    gemm.plans.remember_early(("raw key",), ("facts",), x.device, [out], CONFIG, plan)
    entry = gemm.plans.early(("raw key",))
    assert entry is not None
    x, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    addresses = [x.data_ptr(), w.data_ptr(), 0]
    runs = gemm.body_runs
    [early_out] = gemm.plans.replay_early(entry, CONFIG, 7, list(addresses), (2,), [x, w, None])
    assert gemm.body_runs == runs
    torch.testing.assert_close(early_out, _expected(x, w), rtol=0, atol=1e-12)


def _scaled_gemm_in_chunks(toy: Toy, calls: list[int]):
    """The staged Q4_K path's shape: a launch, then a row-wise scaled e4m3 GEMM per chunk of
    weight rows into that chunk's columns of ``out``, its column scales a view of an argument."""

    def launch(config: Any, xq, wq, row_scale, col_scale, out, scale: float) -> None:
        calls[0] += 1
        wrap_triton(toy.kernel)[(2,)](xq, out, xq.shape[0], 1, scale, None, BLOCK=16)
        for row0 in (0, 3):
            rows = slice(row0, min(row0 + 3, wq.shape[0]))
            torch._scaled_mm(
                xq, wq[rows].t(), scale_a=row_scale, scale_b=col_scale[:, rows], out_dtype=out.dtype,
                out=out[:, rows],
            )  # fmt: skip

    return launch


def test_scaled_fp8_gemms_into_a_given_out_are_replayed(toy) -> None:
    calls = [0]
    launch = _scaled_gemm_in_chunks(toy, calls)
    plans = _replay.LaunchPlans("scaled gemm")

    def inputs() -> tuple[torch.Tensor, ...]:
        xq = (torch.randn(4, 32) * 4).to(torch.float8_e4m3fn)
        wq = (torch.randn(5, 32) * 4).to(torch.float8_e4m3fn)
        return xq, wq, torch.rand(4, 1) + 0.5, torch.rand(1, 5) + 0.5

    def call(xq, wq, row_scale, col_scale) -> torch.Tensor:
        out = torch.full((4, 5), float("nan"), dtype=torch.bfloat16)  # every element must be written
        args = (xq, wq, row_scale, col_scale, out, 0.5)
        if not plans.run(launch, CONFIG, args, list(args[:5]), (0.5,), xq.device):
            run_unwrapped(launch, (CONFIG, *args), ())
        return out

    for _ in range(2):
        call(*inputs())
    runs = calls[0]
    [plan] = [p for p in plans._plans.values() if p is not None]
    assert [func for _, func, _, _ in plan.ops] == [torch.ops.aten._scaled_mm.out] * 2
    for _ in range(3):
        xq, wq, row_scale, col_scale = inputs()
        out = call(xq, wq, row_scale, col_scale)
        expected = (xq.double() * row_scale.double()) @ (wq.double() * col_scale.double().t()).t()
        torch.testing.assert_close(out.double(), expected.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    assert calls[0] == runs, "a layout's third call on must replay, not run the launch function"


def _gemm_without_out(gemm: Gemm):
    def launch(config: Any, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        gemm.body_runs += 1
        wrap_triton(gemm.toy.kernel)[(2,)](x, out, x.shape[0], 1, scale, None, BLOCK=16)
        product = torch.mm(x[:, :3], w[:1, :3].t())
        torch.mm(product, w[:1, :1], out=out[:, :1])

    return launch


_PERSISTENT = torch.randn(5, 8, dtype=torch.float64)


def _gemm_on_a_buffer_no_argument_holds(gemm: Gemm):
    def launch(config: Any, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        gemm.body_runs += 1
        wrap_triton(gemm.toy.kernel)[(2,)](x, out, x.shape[0], 1, scale, None, BLOCK=16)
        torch.mm(x, _PERSISTENT.t(), out=out)

    return launch


def _gemm_on_a_registered_buffer(gemm: Gemm):
    """A persistent buffer registered for the launches: a plan holding it as a GEMM operand would
    keep it alive after its owner dropped it."""

    def launch(config: Any, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        gemm.body_runs += 1
        rec = recording()
        if rec is not None:
            rec.static(_PERSISTENT, lambda: True)
        wrap_triton(gemm.toy.kernel)[(2,)](x, out, x.shape[0], 1, scale, None, BLOCK=16)
        torch.mm(x, _PERSISTENT.t(), out=out)

    return launch


def _allocates_elsewhere(gemm: Gemm):
    def launch(config: Any, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        gemm.body_runs += 1
        torch.empty(16, device="meta")
        wrap_triton(gemm.toy.kernel)[(2,)](x, out, x.shape[0], 1, scale, None, BLOCK=16)

    return launch


def _gemm_past_its_argument(gemm: Gemm):
    def launch(config: Any, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        gemm.body_runs += 1
        wrap_triton(gemm.toy.kernel)[(2,)](x, out, x.shape[0], 1, scale, None, BLOCK=16)
        # x's last row and, past it, memory x does not hold (its storage is larger).
        beyond = x.as_strided((2, 8), (8, 1), x.storage_offset() + 5 * 8)
        torch.mm(beyond, w[:2].t(), out=out[:2, :2])

    return launch


def _gemm_as_another_dtype(gemm: Gemm):
    def launch(config: Any, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        gemm.body_runs += 1
        ws = torch.empty(x.shape[0], 4, dtype=torch.float32, device=x.device)
        wrap_triton(gemm.toy.kernel)[(2,)](x, out, x.shape[0], 1, scale, None, BLOCK=16)
        torch.mm(x.view(torch.float32)[:, :2], w.view(torch.float32)[:4, :2].t(), out=ws)

    return launch


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param(_gemm_without_out, id="gemm-allocating-its-result"),
        pytest.param(_gemm_as_another_dtype, id="argument-read-as-another-dtype"),
        pytest.param(_gemm_on_a_buffer_no_argument_holds, id="operand-in-no-argument"),
        pytest.param(_gemm_on_a_registered_buffer, id="operand-in-a-registered-buffer"),
        pytest.param(_allocates_elsewhere, id="allocation-on-another-device"),
        pytest.param(_gemm_past_its_argument, id="operand-past-its-argument"),
    ],
)
def test_a_gemm_a_replay_could_not_rebuild_keeps_the_launch_function(toy, launch) -> None:
    gemm = Gemm(toy)
    gemm.launch = launch(gemm)  # type: ignore[method-assign]
    x, w = torch.randn(8, 8, dtype=torch.float64)[:6], torch.randn(5, 8, dtype=torch.float64)
    for _ in range(_replay.RECORD_ATTEMPTS + 3):
        gemm.call(x, w)
    assert gemm.body_runs == _replay.RECORD_ATTEMPTS + 3
    assert all(p is None for p in gemm.plans._plans.values())

"""Eager alternatives: eager calls get the config the tuner found faster for them, captures the winner."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

import pytest
import torch
import triton
import triton.language as tl

from tritune.configs_db.records import EagerAlternative, WinnerRecord
from tritune.kernels import dispatcher, settings, use_config
from tritune.kernels.declare import Kernel, Output, Tensor
from tritune.kernels.device import DeviceInfo, device_info
from tritune.kernels.dispatcher import DISPATCHER, EagerChoice, dispatch_config, dispatch_config_eager
from tritune.kernels.spec import TuningKey, pow2_bucket
from tritune.kernels.winners import build_table
from tritune.search_spaces.base import SearchSpace, TargetLimits, choice

pytestmark = pytest.mark.interpreter

CPU = device_info("cpu")


@triton.jit
def _double_kernel(X, Out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Out + offs, tl.load(X + offs, mask=mask) * 2, mask=mask)


@dataclasses.dataclass(frozen=True)
class DoubleConfig:
    BLOCK: int = choice(16, (16, 32, 64, 128))


@dataclasses.dataclass(frozen=True)
class DoubleKey(TuningKey):
    n_bucket: int

    BUCKETS: ClassVar[tuple[str, ...]] = ("n_bucket",)


#: BLOCKs launched, in order, by every call of the kernel below, and the outputs they wrote.
LAUNCHED: list[int] = []
WRITTEN: list[torch.Tensor] = []


def _launch(config: DoubleConfig, x: torch.Tensor, out: torch.Tensor) -> None:
    LAUNCHED.append(config.BLOCK)
    WRITTEN.append(out)
    n = x.numel()
    _double_kernel[(triton.cdiv(n, config.BLOCK),)](x, out, n, BLOCK=config.BLOCK)


def _feasible(config: DoubleConfig, key: DoubleKey, limits: TargetLimits) -> str | None:
    return "BLOCK=128 never fits here" if config.BLOCK == 128 else None


KERNEL = Kernel(
    "test_eager_double",
    arguments=[Tensor("x", ("N",), dtypes=(torch.float32,)), Output("out", like="x")],
    facts=("N",),
    space=SearchSpace("test_eager_double", DoubleConfig, feasibility=_feasible),
    key_type=DoubleKey,
    key=lambda device, f: DoubleKey(device.arch, device.sm_count, pow2_bucket(f.N, 1)),
    launch=_launch,
    reference=lambda x: x.double() * 2,
    jit_kernels=(_double_kernel,),
    protocol=1,
)


def _record(winner: dict[str, Any], eager: dict[str, Any] | None, speedup: float = 2.0) -> WinnerRecord:
    key = DoubleKey(CPU.arch, CPU.sm_count, 64)
    return WinnerRecord(
        kernel=KERNEL.name,
        kernel_version=KERNEL.version,
        gpu=CPU.slug,
        key=key.to_dict(),
        config=winner,
        time_ms=1.0,
        portable_ms=2.0 * speedup / 2.0,
        speedup=speedup,
        trials=4,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        tritune_version="test",
        eager=None if eager is None else EagerAlternative(eager, ms=0.5, winner_ms=0.8),
    )


@pytest.fixture
def stored(monkeypatch):
    """Serve one stored record (winner BLOCK=32, given eager config) for the kernel's 64-element key."""

    def serve(winner: dict[str, Any], eager: dict[str, Any] | None, speedup: float = 2.0) -> None:
        DISPATCHER.clear()
        DISPATCHER._tables[CPU.slug] = build_table([[_record(winner, eager, speedup)]], CPU)

    LAUNCHED.clear()
    WRITTEN.clear()
    yield serve
    DISPATCHER.clear()


def _facts(x: torch.Tensor) -> tuple[Any, ...]:
    return (x.numel(),)


def _block(config: Any) -> int:
    return int(config.BLOCK)


def test_eager_calls_get_the_eager_config_and_everything_else_the_winner(stored, monkeypatch) -> None:
    stored({"BLOCK": 32}, {"BLOCK": 64})
    facts = _facts(torch.randn(64))
    assert _block(dispatch_config_eager(KERNEL.name, torch.device("cpu"), facts)) == 64
    assert _block(dispatch_config(KERNEL.name, "cpu", -1, facts)) == 32  # compiled graphs, detailed path
    key = DoubleKey(CPU.arch, CPU.sm_count, 64)
    assert _block(DISPATCHER.select(KERNEL, CPU, key)) == 32  # tools (tune bench) see the winner
    assert isinstance(DISPATCHER.choose(KERNEL, CPU, key), EagerChoice)
    monkeypatch.setattr(dispatcher, "_capturing", lambda: True)
    assert _block(dispatch_config_eager(KERNEL.name, torch.device("cpu"), facts)) == 32


def test_the_first_eager_call_also_launches_the_winner_once(stored, monkeypatch) -> None:
    stored({"BLOCK": 32}, {"BLOCK": 64})
    x = torch.randn(64)
    for _ in range(3):
        out = torch.full_like(x, float("nan"))
        KERNEL(x, out=out)
        torch.testing.assert_close(out, x * 2)
    # The winner once (so that a capture after an eager warm-up finds it loaded), then the eager config.
    assert LAUNCHED == [32, 64, 64, 64]
    # The winner's launch wrote a scratch tensor: the caller's output is the eager config's alone.
    assert WRITTEN[0] is not WRITTEN[1] and WRITTEN[0].shape == WRITTEN[1].shape
    LAUNCHED.clear()
    monkeypatch.setattr(dispatcher, "_capturing", lambda: True)
    KERNEL(x)
    assert LAUNCHED == [32]


@pytest.mark.parametrize(
    ("eager", "why"),
    [
        pytest.param({"BLOCK": 128}, "infeasible", id="infeasible"),
        pytest.param({"BLOCK": 48}, "outside the search space", id="outside-the-space"),
        pytest.param({"TILE": 64}, "outside the search space", id="unknown-field"),
    ],
)
def test_an_unusable_eager_config_is_refused_and_the_winner_serves_all(stored, caplog, eager, why) -> None:
    with caplog.at_level(logging.WARNING, logger="tritune.dispatch"):
        stored({"BLOCK": 32}, eager)
    assert any("eager config" in r.message and why in r.message for r in caplog.records), caplog.text
    x = torch.randn(64)
    KERNEL(x)
    assert LAUNCHED == [32]
    assert _block(dispatch_config_eager(KERNEL.name, torch.device("cpu"), _facts(x))) == 32


@pytest.mark.parametrize("eager", [None, {"BLOCK": 32}], ids=["none", "same-as-winner"])
def test_without_a_distinct_eager_config_the_winner_serves_all(stored, eager) -> None:
    stored({"BLOCK": 32}, eager)
    KERNEL(torch.randn(64))
    KERNEL(torch.randn(64))
    assert LAUNCHED == [32, 32]
    assert not isinstance(DISPATCHER.choose(KERNEL, CPU, DoubleKey(CPU.arch, CPU.sm_count, 64)), EagerChoice)


def test_a_winner_that_is_the_default_serves_its_eager_config_to_eager_calls(stored) -> None:
    """The tune found nothing faster than the default (BLOCK=16, speedup 1.0 under the margin), but
    an eager config faster for plain eager calls: eager calls get it, everything else the default."""
    stored({"BLOCK": 16}, {"BLOCK": 64}, speedup=1.0)
    facts = _facts(torch.randn(64))
    assert _block(dispatch_config_eager(KERNEL.name, torch.device("cpu"), facts)) == 64
    assert _block(dispatch_config(KERNEL.name, "cpu", -1, facts)) == 16


@pytest.mark.parametrize("eager", [None, {"BLOCK": 64}], ids=["no-eager-config", "with-eager-config"])
def test_a_winner_under_the_margin_that_is_not_the_default_serves_nothing(stored, eager) -> None:
    """A winner other than the default that does not clear the margin: the default serves every
    call (an eager config timed against that winner says nothing of the default)."""
    stored({"BLOCK": 32}, eager, speedup=1.01)
    facts = _facts(torch.randn(64))
    assert _block(dispatch_config_eager(KERNEL.name, torch.device("cpu"), facts)) == 16
    assert _block(dispatch_config(KERNEL.name, "cpu", -1, facts)) == 16


def test_a_pin_serves_eager_calls_too(stored) -> None:
    stored({"BLOCK": 32}, {"BLOCK": 64})
    with use_config(KERNEL.name, {"BLOCK": 16}):
        KERNEL(torch.randn(64))
    assert LAUNCHED == [16]


def test_a_neighbour_bucket_lends_its_winner_not_its_eager_config(stored) -> None:
    """An eager alternative was chosen against its own size's GPU time: a bucket borrowing the
    winner serves the winner to eager calls too."""
    stored({"BLOCK": 32}, {"BLOCK": 64})
    x = torch.randn(100)  # bucket 128: no winner of its own; the 64 bucket is the nearest
    KERNEL(x)
    KERNEL(x)
    assert LAUNCHED == [32, 32]


def test_the_winners_launch_uses_outputs_laid_out_as_the_callers(stored) -> None:
    """A misaligned output: the winner's one launch writes a tensor of the same strides and 16-byte
    remainder (what Triton specializes on), never the caller's."""
    stored({"BLOCK": 32}, {"BLOCK": 64})
    x = torch.randn(64)
    buffer = torch.full((200,), float("nan"))
    out = buffer[1:65]  # 4 bytes past an aligned address
    KERNEL(x, out=out)
    torch.testing.assert_close(out, x * 2)
    scratch = WRITTEN[0]
    assert scratch is not out and scratch.stride() == out.stride()
    assert scratch.data_ptr() % 16 == out.data_ptr() % 16
    assert LAUNCHED == [32, 64]


def test_a_failed_winner_launch_is_tried_again(stored, monkeypatch) -> None:
    stored({"BLOCK": 32}, {"BLOCK": 64})
    x = torch.randn(64)
    real = _launch

    def fail_once(config, *args):
        if config.BLOCK == 32 and not getattr(fail_once, "failed", False):
            fail_once.failed = True  # type: ignore[attr-defined]
            raise RuntimeError("out of resources")
        real(config, *args)

    monkeypatch.setattr(KERNEL, "_launch", fail_once)
    with pytest.raises(RuntimeError, match="out of resources"):
        KERNEL(x)
    KERNEL(x)
    assert LAUNCHED == [32, 64]  # the second call launched the winner once more, then the eager config


def test_tune_show_counts_a_default_with_an_eager_config_as_served() -> None:
    """``tune show``'s verdict follows the dispatcher: a winner that is the default with an eager
    config serves; the same without one, or a winner under the margin that is not the default, does not."""
    from tritune.tuner.tables import serving_verdict

    assert serving_verdict(_record({"BLOCK": 16}, {"BLOCK": 64}, speedup=1.0), CPU) is None
    assert "only 1.000x" in str(serving_verdict(_record({"BLOCK": 16}, None, speedup=1.0), CPU))
    assert "only 1.010x" in str(serving_verdict(_record({"BLOCK": 32}, {"BLOCK": 64}, speedup=1.01), CPU))


# ---- alternatives timed before eager replay -----------------------------------------------------


GPU_INFO = DeviceInfo("NVIDIA H100 80GB HBM3", "nvidia", (9, 0), 132, "sm90")


def _gpu_record(time_ms: float, replayed: bool) -> WinnerRecord:
    record = _record({"BLOCK": 32}, {"BLOCK": 64})
    key = {**record.key, "arch": GPU_INFO.arch, "sm_count": GPU_INFO.sm_count}
    eager = dataclasses.replace(record.eager, replayed=replayed)
    return dataclasses.replace(record, gpu=GPU_INFO.slug, key=key, time_ms=time_ms, eager=eager)


@pytest.mark.parametrize(
    ("time_ms", "replayed", "replay_on", "served"),
    [
        pytest.param(0.05, False, True, False, id="gpu-bound-winner-old-timing"),
        pytest.param(0.012, False, True, False, id="host-bound-winner-old-timing"),
        pytest.param(0.05, True, True, True, id="timed-with-replay"),
        pytest.param(0.05, False, False, True, id="replay-off"),
    ],
)
def test_an_alternative_timed_without_replay_leaves_eager_calls_to_the_winner_while_replay_is_on(
    time_ms: float, replayed: bool, replay_on: bool, served: bool
) -> None:
    """Its host times came from running the launch function every call, which replayed calls no
    longer pay: they say nothing about which config serves a replayed call faster."""
    record = _gpu_record(time_ms, replayed)
    with settings.override(eager_replay=replay_on):
        table = build_table([[record]], GPU_INFO)
    [entry] = table.exact.values()
    assert entry.config == DoubleConfig(BLOCK=32)
    assert (entry.eager_config == DoubleConfig(BLOCK=64)) is served

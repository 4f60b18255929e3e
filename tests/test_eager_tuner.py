"""The tuner stores an eager alternative where a config serves eager calls faster than the winner.

The toy kernel's fake GPU times make BLOCK=128 with two warps the winner; a fake host cost per
launch decides what an eager caller pays, ``max(GPU, host)`` per call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import toy_kernel
from toy_records import toy_record

from tritune.configs_db.records import EagerAlternative, WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.kernels.device import device_info
from tritune.tuner.local_bench import LocalBench
from tritune.tuner.options import tritune_version
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id
from tritune.tuner.timing import FakeTimer

pytestmark = pytest.mark.interpreter

CPU = device_info("cpu")


class HostCostBench(LocalBench):
    """A bench whose launches' host cost is ``host(config)`` ms; it records what it was asked to time."""

    def __init__(self, host: Any) -> None:
        super().__init__(torch.device("cpu"), FakeTimer(toy_kernel.toy_cost))
        self.host, self.asked = host, []

    def host_times(self, configs: list[dict[str, Any]]) -> list[float] | None:
        self.asked.append(configs)
        return [self.host(c) for c in configs]


def _tune(
    bench: HostCostBench, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, stored: Any = None, **options: Any
) -> WinnerRecord:
    """Tune the toy key; ``stored(store, env_id, key)`` writes what the DB holds before."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = toy_kernel.SPEC.default_keys(CPU, n=[256])[0]
    if stored is not None:
        stored(store, environment_id(store, CPU), key)
    offered: list[WinnerRecord] = []
    original = ConfigStore.offer_winner
    monkeypatch.setattr(
        ConfigStore, "offer_winner", lambda self, r, e, **kw: offered.append(r) or original(self, r, e, **kw)
    )
    tuning = TuneOptions(trials=24, seed=3, batch=6, final_rounds=1, time_peer=False, **options)
    KeyTuner(toy_kernel.SPEC, key, CPU, torch.device("cpu"), store, environment_id(store, CPU), bench.timer,
             tuning, bench=bench).run()  # fmt: skip
    [record] = offered
    return record


def test_a_config_faster_for_eager_calls_is_stored_beside_the_winner(tmp_path, monkeypatch) -> None:
    # The winner takes 0.078 ms on the GPU but 0.5 ms of host work a launch (two launches, say).
    bench = HostCostBench(lambda c: 0.5 if c["BLOCK"] == 128 else 0.1)
    record = _tune(bench, tmp_path, monkeypatch, time_eager=True)
    assert record.config == {"BLOCK": 128, "BROKEN": False, "num_warps": 2}
    assert record.eager is not None
    assert record.eager.config == {"BLOCK": 64, "BROKEN": False, "num_warps": 2}
    assert record.eager.ms == pytest.approx(toy_kernel.toy_cost(toy_kernel.ToyConfig(64, False, 2)))
    assert record.eager.winner_ms == pytest.approx(0.5)
    assert record.eager.replayed, "host times of prepared launches, which replay as eager calls do"
    # The winner was timed first, then again with only configs faster on the GPU than its 0.5 ms
    # eager call, in one set of rounds.
    assert bench.asked[0] == [record.config]
    assert bench.asked[1][0] == record.config
    assert all(toy_kernel.toy_cost(toy_kernel.ToyConfig(**c)) < 0.5 for c in bench.asked[1])


def test_an_alternative_timed_with_replay_off_is_not_marked_replayed(tmp_path, monkeypatch) -> None:
    bench = HostCostBench(lambda c: 0.5 if c["BLOCK"] == 128 else 0.1)
    with settings.override(eager_replay=False):
        record = _tune(bench, tmp_path, monkeypatch, time_eager=True)
    assert record.eager is not None and not record.eager.replayed


def test_no_alternative_where_the_winner_is_also_fastest_eagerly(tmp_path, monkeypatch) -> None:
    bench = HostCostBench(lambda c: 0.01)
    record = _tune(bench, tmp_path, monkeypatch, time_eager=True)
    assert record.eager is None
    assert len(bench.asked) == 1, "nothing is faster on the GPU than the winner's eager call: no more timing"


def test_an_alternative_within_the_margin_is_not_stored(tmp_path, monkeypatch) -> None:
    # BLOCK=64 would take 0.156 ms eagerly, the winner 0.16: less than 5% apart.
    bench = HostCostBench(lambda c: 0.16 if c["BLOCK"] == 128 else 0.1)
    assert _tune(bench, tmp_path, monkeypatch, time_eager=True).eager is None


def test_host_costs_are_not_timed_on_the_interpreter_unless_asked(tmp_path, monkeypatch) -> None:
    bench = HostCostBench(lambda c: 0.5)
    assert _tune(bench, tmp_path, monkeypatch).eager is None
    assert bench.asked == []


def test_a_failed_host_timing_leaves_the_winner_alone(tmp_path, monkeypatch) -> None:
    bench = HostCostBench(lambda c: 0.5)
    bench.host_times = lambda configs: None  # type: ignore[method-assign]
    record = _tune(bench, tmp_path, monkeypatch, time_eager=True)
    assert record.eager is None and record.config["BLOCK"] == 128


def test_the_bench_times_host_cost_per_launch_on_real_launches() -> None:
    bench = LocalBench(torch.device("cpu"), FakeTimer(toy_kernel.toy_cost))
    key = toy_kernel.SPEC.default_keys(CPU, n=[256])[0]
    bench.open(toy_kernel.SPEC, key, 0, {"BLOCK": 32, "BROKEN": False, "num_warps": 4})
    times = bench.host_times([{"BLOCK": 16}, {"BLOCK": 128}])
    assert times is not None and len(times) == 2 and all(t > 0 for t in times)


def test_host_times_add_the_public_calls_own_cost_to_every_config(monkeypatch) -> None:
    """What a public call adds before its launch (checks, dispatch) is the same for every config:
    measured once on a declared kernel and added to each config's launch time."""
    import time

    from tritune.kernels.registry import load
    from tritune.tuner.candidates import CandidateBench

    spec = load("examples/rmsnorm.py:RMSNORM")
    bench = LocalBench(torch.device("cpu"), FakeTimer(lambda config: 1.0))
    key = spec.default_keys(CPU)[0]
    default = spec.space.to_dict(spec.default_config(key))
    bench.open(spec, key, 0, default)
    plain = bench.host_times([default, default])
    real = CandidateBench._public_call

    def slowed(self, values):
        pin, call = real(self, values)
        return pin, lambda: (time.sleep(0.05), call())

    monkeypatch.setattr(CandidateBench, "_public_call", slowed)
    slow = bench.host_times([default, default])
    assert plain is not None and slow is not None
    # 50 ms against interpreted calls of about 20 ms, whose timing a loaded machine moves by a few.
    assert all(s - p > 35 for s, p in zip(slow, plain, strict=True)), (plain, slow)


def test_the_public_calls_cost_is_timed_as_a_plain_eager_call_makes_it(monkeypatch) -> None:
    """Without ``out``: the call allocates its output, as the PyTorch call it is compared with
    does (a passed output would also be checked against the inputs' memory at every call)."""
    from tritune.kernels.declare import Kernel
    from tritune.kernels.registry import load

    spec = load("examples/rmsnorm.py:RMSNORM")
    bench = LocalBench(torch.device("cpu"), FakeTimer(lambda config: 1.0))
    key = spec.default_keys(CPU)[0]
    default = spec.space.to_dict(spec.default_config(key))
    bench.open(spec, key, 0, default)
    seen: list[dict[str, Any]] = []
    real = Kernel.__call__

    def watched(self, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Kernel, "__call__", watched)
    assert bench.host_times([default]) is not None
    assert seen and all(kwargs.get("out") is None for kwargs in seen)


WINNER = {"BLOCK": 128, "BROKEN": False, "num_warps": 2}


def _faster_record(key: Any, config: dict[str, Any], eager: EagerAlternative) -> WinnerRecord:
    """A winner at ``key`` faster than any the toy's fake times give, with ``eager`` beside it."""
    fast = {"time_ms": 0.001, "portable_ms": 0.1, "speedup": 100.0, "tritune_version": tritune_version()}
    return toy_record(key.n_bucket, config, eager=eager, **fast)


@pytest.mark.parametrize("now_best_eagerly", [True, False])
def test_a_kept_winner_found_again_gets_the_eager_alternative_timed_now(
    tmp_path, monkeypatch, now_best_eagerly: bool
) -> None:
    """A faster earlier time keeps the stored winner, but the alternative stored with it was timed
    another way (before eager replay): this run's, measured against the same config, replaces it."""
    old = EagerAlternative(config={"BLOCK": 32, "BROKEN": False, "num_warps": 4}, ms=0.3, winner_ms=0.9)

    def stored(store: ConfigStore, env_id: int, key: Any) -> None:
        assert store.offer_winner(_faster_record(key, WINNER, old), env_id)

    host = (lambda c: 0.01) if now_best_eagerly else (lambda c: 0.5 if c["BLOCK"] == 128 else 0.1)
    offered = _tune(HostCostBench(host), tmp_path, monkeypatch, stored=stored, time_eager=True)
    assert offered.config == WINNER
    [kept] = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}").winners()
    assert kept.config == WINNER and kept.time_ms < offered.time_ms, "the faster stored time stays"
    assert kept.eager == offered.eager
    assert (kept.eager is None) is now_best_eagerly


def test_a_kept_winner_of_another_config_keeps_its_eager_alternative(tmp_path, monkeypatch) -> None:
    old = EagerAlternative(config={"BLOCK": 32, "BROKEN": False, "num_warps": 4}, ms=0.3, winner_ms=0.9)
    other = {"BLOCK": 64, "BROKEN": False, "num_warps": 2}

    def stored(store: ConfigStore, env_id: int, key: Any) -> None:
        assert store.offer_winner(_faster_record(key, other, old), env_id)

    _tune(HostCostBench(lambda c: 0.01), tmp_path, monkeypatch, stored=stored, time_eager=True)
    [kept] = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}").winners()
    assert kept.config == other and kept.eager == old


@pytest.mark.parametrize(
    "why",
    [
        pytest.param("host-timing-failed", id="host-timing-failed"),
        pytest.param("replay-off", id="timed-with-replay-off"),
        pytest.param("not-timed", id="eager-not-timed"),
    ],
)
def test_a_kept_winner_keeps_its_alternative_where_this_run_measured_none_as_eager_calls_run(
    tmp_path, monkeypatch, why: str
) -> None:
    """Only an alternative measured with replay, as a serving process runs eager calls, replaces
    the stored one: a failed host timing says nothing, and one timed without replay is the
    stale kind."""
    old = EagerAlternative(config={"BLOCK": 32, "BROKEN": False, "num_warps": 4}, ms=0.3, winner_ms=0.9, replayed=True)

    def stored(store: ConfigStore, env_id: int, key: Any) -> None:
        assert store.offer_winner(_faster_record(key, WINNER, old), env_id)

    bench = HostCostBench(lambda c: 0.5 if c["BLOCK"] == 128 else 0.1)
    options: dict[str, Any] = {"time_eager": why != "not-timed"}
    if why == "host-timing-failed":
        bench.host_times = lambda configs: None  # type: ignore[method-assign]
    with settings.override(eager_replay=why != "replay-off"):
        _tune(bench, tmp_path, monkeypatch, stored=stored, **options)
    [kept] = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}").winners()
    assert kept.config == WINNER and kept.eager == old

"""Noise control and the final re-timing, decided on fakes: no GPU, no wall clock.

A measurement taken while the GPU throttles, or whose repetitions spread too wide, is taken once
more and flagged if it stays noisy; the final interleaved re-timing of winner, runner-up and
portable default picks what is stored.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import toy_kernel
import triton.testing

from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.kernels.device import device_info
from tritune.tuner.noise import (
    GpuState,
    NoisePolicy,
    NvmlMonitor,
    monitor_for,
    noise_problems,
    stable_measurement,
    throttle_names,
)
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id, pick_winner
from tritune.tuner.timing import GpuTimer, Measurement

CPU = device_info("cpu")
POLICY = NoisePolicy(max_spread=0.10, repeats=1)
CLEAN = Measurement(1.0, 0.98, 1.03)
WIDE = Measurement(1.1, 0.8, 1.5)
COOL = GpuState(sm_clock_mhz=1980, temperature_c=55)
HOT = GpuState(sm_clock_mhz=1410, temperature_c=87, throttle=("sw_thermal_slowdown",))


class Script:
    """Hands out prepared measurements (the ``take`` of stable_measurement) and GPU states (a monitor)."""

    def __init__(self, measurements=(), states=()):
        self.measurements, self.states = list(measurements), list(states)
        self.takes = 0

    def take(self) -> Measurement:
        self.takes += 1
        return self.measurements.pop(0)

    def read(self) -> GpuState | None:
        return self.states.pop(0) if self.states else None


def test_clean_measurement_is_taken_once():
    script = Script([CLEAN], [COOL, COOL])
    assert stable_measurement(script.take, script, POLICY) == (CLEAN, None)
    assert script.takes == 1


def test_wide_spread_is_repeated_once_and_the_clean_repeat_kept():
    script = Script([WIDE, CLEAN])
    assert stable_measurement(script.take, None, POLICY) == (CLEAN, None)
    assert script.takes == 2


def test_throttled_measurement_is_repeated_once():
    script = Script([Measurement(1.4, 1.39, 1.41), CLEAN], [COOL, HOT, COOL, COOL])
    assert stable_measurement(script.take, script, POLICY) == (CLEAN, None)
    assert script.takes == 2


def test_noisy_twice_keeps_the_faster_and_says_why():
    script = Script([WIDE, Measurement(1.05, 0.7, 1.4)], [HOT, HOT, COOL, COOL])
    kept, note = stable_measurement(script.take, script, POLICY)
    assert script.takes == 2
    assert kept.ms == 1.05
    assert note is not None and note.startswith("noisy measurement (2 attempts): spread 0.67 of the median")


def test_throttle_note_names_reason_clocks_and_temperature():
    problems = noise_problems(CLEAN, (COOL, HOT), POLICY)
    assert problems == ["throttled: sw_thermal_slowdown (SM 1980->1410 MHz, 87 C)"]


def test_without_percentiles_or_nvml_nothing_is_repeated():
    # The interpreter's timers give a median only, and there is no NVML on a CPU.
    script = Script([Measurement(3.0)])
    assert stable_measurement(script.take, None, NoisePolicy(max_spread=0.0)) == (Measurement(3.0), None)
    assert Measurement(3.0).spread is None
    assert monitor_for(torch.device("cpu")) is None


def test_only_power_and_thermal_reasons_count_as_throttling():
    # GPU idle (0x1), application clocks (0x2), sync boost (0x10), display clock (0x100): not noise.
    assert throttle_names(0x1 | 0x2 | 0x10 | 0x100) == ()
    # The software power cap (0x4) is where heavy kernels normally run on an H200: not noise either.
    assert throttle_names(0x4 | 0x40) == ("hw_thermal_slowdown",)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU driver")
def test_nvml_monitor_without_a_driver_reads_nothing_and_never_raises():
    monitor = NvmlMonitor(0)
    assert monitor.read() is None
    assert monitor.read() is None
    monitor.close()


def test_gpu_timer_reports_percentiles(monkeypatch):
    calls = []

    def fake_do_bench(fn, warmup, rep, quantiles):
        calls.append(quantiles)
        return [0.9, 1.0, 1.2]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    sample = GpuTimer().measure(lambda: None, config=None, flush_l2=True, launch_bound=False)
    assert calls == [[0.2, 0.5, 0.8]]
    assert sample == Measurement(1.0, 0.9, 1.2)
    assert sample.spread == pytest.approx(0.3)


# ---- through the tuner (in-process, with timers that script the noise) ------------------------


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")


class NoisyTimer:
    """Toy costs; every measurement of BLOCK=128 spreads wide (as if another process shared the GPU)."""

    def __init__(self):
        self.calls = 0

    def measure(self, fn, *, config, flush_l2, launch_bound):
        fn()
        self.calls += 1
        ms = toy_kernel.toy_cost(config)
        return Measurement(ms, ms * 0.5, ms * 1.5) if config.BLOCK == 128 else Measurement(ms, ms, ms)

    def __call__(self, fn, **kwargs):
        return self.measure(fn, **kwargs).ms


class RetimeTimer:
    """Toy costs on each config's first measurement; on re-timing, ``retimed`` overrides them."""

    def __init__(self, retimed):
        self.retimed = retimed
        self.seen: Counter = Counter()

    def __call__(self, fn, *, config, flush_l2, launch_bound):
        fn()
        values = toy_kernel.SPEC.space.to_dict(config)
        ident = tuple(values.values())
        self.seen[ident] += 1
        if self.seen[ident] > 1 and ident in self.retimed:
            return self.retimed[ident]
        return toy_kernel.toy_cost(config)


def _tune(tmp_path, timer, final_rounds=1):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    key = toy_kernel.SPEC.default_keys(CPU, n=[64])[0]
    options = TuneOptions(trials=40, batch=8, seed=0, final_rounds=final_rounds)
    result = KeyTuner(toy_kernel.SPEC, key, CPU, torch.device("cpu"), store, env, timer, options).run()
    return result, store.measured_trials(env, toy_kernel.SPEC.name, toy_kernel.SPEC.version, key.to_dict())


BEST = (128, False, 2)
RUNNER_UP = (128, False, 4)
PORTABLE = (32, False, 4)


def test_noisy_trials_are_repeated_and_flagged_in_the_db(toy_registered, tmp_path):
    timer = NoisyTimer()
    result, rows = _tune(tmp_path, timer, final_rounds=0)
    flagged = {tuple(r.config.values()) for r in rows if r.status == "ok" and r.error}
    assert flagged == {BEST, RUNNER_UP}
    assert all("noisy measurement (2 attempts): spread 1.00" in r.error for r in rows if r.status == "ok" and r.error)
    ok = [r for r in rows if r.status == "ok"]
    # Each noisy trial was measured twice, every other once.
    assert timer.calls == len(ok) + len(flagged)
    assert result.config == dict(zip(("BLOCK", "BROKEN", "num_warps"), BEST, strict=True))


def test_final_retiming_of_winner_runner_up_and_portable(toy_registered, tmp_path):
    timer = RetimeTimer({RUNNER_UP: 0.05})
    result, _ = _tune(tmp_path, timer, final_rounds=3)
    retimed = {ident: n - 1 for ident, n in timer.seen.items() if n > 1}
    assert retimed == {BEST: 3, RUNNER_UP: 3, PORTABLE: 3}
    assert result.config == {"BLOCK": 128, "BROKEN": False, "num_warps": 4}
    assert result.best_ms == 0.05 and result.portable_ms == toy_kernel.toy_cost(toy_kernel.ToyConfig())
    assert "re-timing put the runner-up of the trials ahead" in result.notes


def test_final_retiming_can_keep_the_portable_default(toy_registered, tmp_path):
    timer = RetimeTimer({BEST: 0.5, RUNNER_UP: 0.5})
    result, _ = _tune(tmp_path, timer)
    assert result.config == {"BLOCK": 32, "BROKEN": False, "num_warps": 4}
    assert result.speedup == 1.0
    assert "re-timing found no gain over the portable default" in result.notes


def test_pick_winner_prefers_the_portable_default_on_ties():
    assert pick_winner({"best": 1.0, "runner-up": 0.9, "portable": 1.2}, "portable") == "runner-up"
    assert pick_winner({"best": 1.0, "portable": 1.0}, "portable") == "portable"
    assert pick_winner({"portable": 0.8, "best": 1.0}, "portable") == "portable"

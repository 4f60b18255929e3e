"""Noise control for GPU timings: throttling, clocks and temperature through NVML, and the spread.

A GPU timing can be off for reasons that have nothing to do with the config: the GPU was slowing
itself down for heat or power, or something else ran on it meanwhile. Around each measurement the
tuner reads the GPU's clock-event (throttle) reasons, SM clock and temperature through NVML (no
CUDA context, nothing launched on the GPU), and looks at how much the repetitions disagree,
``(p80 - p20) / median``. A measurement taken while throttled, or spread wider than the policy
allows, is taken once more; if the repeat is noisy too, the faster of the two is kept (noise only
ever adds time) and the trial carries a note saying why it should be read with care.

On the interpreter there is no NVML and the timer gives no percentiles, so every check passes and
nothing is repeated. The decision (:func:`noise_problems`, :func:`stable_measurement`) is plain
code over :class:`GpuState` and :class:`~.timing.Measurement` values, tested with fakes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .timing import Measurement

log = logging.getLogger("tritune.tuner")

#: NVML clock-event reasons that slow the GPU below what the config deserves (nvml.h bit values).
#: Idle, application-clock and sync-boost reasons are left out: they say nothing about noise. So
#: is the software power cap (0x4): heavy kernels on an H100/H200 normally run under it, and
#: flagging it would repeat nearly every compute-bound measurement.
THROTTLE_REASONS: dict[int, str] = {
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}


@dataclass(frozen=True)
class NoisePolicy:
    #: Widest ``(p80 - p20) / median`` accepted without a repeat.
    max_spread: float = 0.10
    #: How many times a noisy measurement is taken again before it is kept with a note.
    repeats: int = 1


@dataclass(frozen=True)
class GpuState:
    """What NVML says about the GPU at one moment."""

    sm_clock_mhz: int | None = None
    temperature_c: int | None = None
    #: Names of the throttle reasons in force (see :data:`THROTTLE_REASONS`).
    throttle: tuple[str, ...] = ()


class ClockMonitor(Protocol):
    def read(self) -> GpuState | None:
        """The GPU's state now, or ``None`` if it cannot be read."""
        ...


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_REASONS.items() if mask & bit)


class NvmlMonitor:
    """Reads one GPU's state through NVML; every failure reads as ``None`` (never raises)."""

    def __init__(self, cuda_index: int) -> None:
        self.cuda_index = cuda_index
        self._nvml: Any = None
        self._handle: Any = None
        self._broken = False

    def _open(self) -> bool:
        if self._handle is not None:
            return True
        if self._broken:
            return False
        try:
            import pynvml

            # The CUDA ordinal maps to an NVML index or UUID through CUDA_VISIBLE_DEVICES, as in
            # device identification.
            from tritune.kernels.device import _nvml_index

            pynvml.nvmlInit()
            target = _nvml_index(self.cuda_index)
            if isinstance(target, int):
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(target)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(target)
            self._nvml = pynvml
            return True
        except Exception as exc:
            log.debug("NVML unavailable for GPU %d (%s): timings are not checked for throttling", self.cuda_index, exc)
            self._broken = True
            return False

    def read(self) -> GpuState | None:
        if not self._open():
            return None
        nvml = self._nvml
        try:
            reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            if reasons is None:
                reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            mask = int(reasons(self._handle))
            clock = int(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
            temperature = int(nvml.nvmlDeviceGetTemperature(self._handle, nvml.NVML_TEMPERATURE_GPU))
        except Exception as exc:
            log.debug("NVML read failed for GPU %d: %s", self.cuda_index, exc)
            return None
        return GpuState(sm_clock_mhz=clock, temperature_c=temperature, throttle=throttle_names(mask))

    def close(self) -> None:
        if self._handle is not None:
            self._handle = None
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                log.debug("NVML shutdown failed", exc_info=True)


@functools.lru_cache(maxsize=16)
def monitor_for(device: torch.device) -> ClockMonitor | None:
    """The NVML monitor of a CUDA device (one per process); ``None`` for the interpreter (and on ROCm)."""
    if device.type != "cuda" or torch.version.hip:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return NvmlMonitor(index)


def _describe_states(states: Sequence[GpuState | None]) -> str:
    known = [s for s in states if s is not None]
    clocks = [s.sm_clock_mhz for s in known if s.sm_clock_mhz is not None]
    temperatures = [s.temperature_c for s in known if s.temperature_c is not None]
    parts = []
    if clocks:
        parts.append("SM " + "->".join(f"{c}" for c in clocks) + " MHz")
    if temperatures:
        parts.append(f"{max(temperatures)} C")
    return f" ({', '.join(parts)})" if parts else ""


def noise_problems(measurement: Measurement, states: Sequence[GpuState | None], policy: NoisePolicy) -> list[str]:
    """Why ``measurement`` (with the GPU states read around it) is not trustworthy; empty if it is."""
    problems = []
    throttled = sorted({name for s in states if s is not None for name in s.throttle})
    if throttled:
        problems.append(f"throttled: {', '.join(throttled)}{_describe_states(states)}")
    spread = measurement.spread
    if spread is not None and spread > policy.max_spread:
        problems.append(
            f"spread {spread:.2f} of the median (p20 {measurement.p20:.4g} ms, p80 {measurement.p80:.4g} ms) "
            f"above {policy.max_spread:.2f}"
        )
    return problems


def stable_measurement(
    take: Callable[[], Measurement], monitor: ClockMonitor | None, policy: NoisePolicy
) -> tuple[Measurement, str | None]:
    """Take a measurement, repeating a noisy one; the measurement kept and a note if it stayed noisy."""
    attempts: list[tuple[Measurement, list[str]]] = []
    for _ in range(policy.repeats + 1):
        before = monitor.read() if monitor is not None else None
        measurement = take()
        after = monitor.read() if monitor is not None else None
        problems = noise_problems(measurement, (before, after), policy)
        if not problems:
            return measurement, None
        attempts.append((measurement, problems))
    kept, problems = min(attempts, key=lambda attempt: attempt[0].ms)
    return kept, f"noisy measurement ({len(attempts)} attempts): {'; '.join(problems)}"

"""One Optuna study per (kernel, key, GPU): sample configs, gate them, time them, store everything.

The loop, per batch of proposals:

1. Optuna proposes configs (TPE, multivariate; every feasible config enqueued when the feasible
   space fits the trial budget, which makes the sweep exhaustive). The portable default and any
   stored winner are enqueued first, so the portable time is always measured in the same run.
2. Infeasible proposals become pruned trials with the rule's reason; configs already measured
   at this key (this run or a killed earlier one) are answered from the DB, not measured again.
3. The batch compiles in parallel threads (Triton's compiler and ptxas release the GIL for most
   of their work), then each candidate is checked against the reference on a fresh random
   problem with a NaN-poisoned output, cross-checked against the portable output at the timed
   size, and timed. Each trial is committed as soon as it is measured.
4. The best config is re-timed against the portable default in interleaved rounds, and offered
   to the DB as the key's winner (the DB keeps the faster of concurrent offers).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import optuna
import torch
import triton

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, Problem, TuningKey

from .timing import Timer

log = logging.getLogger("tritune.tuner")
optuna.logging.set_verbosity(optuna.logging.WARNING)

OK, FAILED_COMPILE, FAILED_CORRECTNESS, FAILED_RUNTIME, PRUNED = (
    "ok",
    "failed-compile",
    "failed-correctness",
    "failed-runtime",
    "pruned",
)


@dataclass
class TuneOptions:
    trials: int = 40
    time_budget_s: float | None = None
    seed: int = 0
    batch: int = 8
    compile_workers: int = max(1, min(16, os.cpu_count() or 1))
    #: Rounds of the final interleaved re-timing of winner and portable default.
    final_rounds: int = 3


@dataclass
class KeyResult:
    kernel: str
    key: TuningKey
    config: dict[str, Any]
    best_ms: float
    portable_ms: float
    measured: int
    reused: int
    failed: int
    pruned: int
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.portable_ms / self.best_ms if self.best_ms > 0 else 1.0


class TuningError(RuntimeError):
    """The key cannot be tuned at all (the portable default itself fails)."""


def tritune_version() -> str:
    try:
        return metadata.version("tritune")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def environment_id(store: ConfigStore, device: DeviceInfo) -> int:
    return store.environment(
        gpu=device.slug,
        gpu_name=device.name,
        capability=f"{device.capability[0]}.{device.capability[1]}",
        sm_count=device.sm_count,
        driver=device.driver,
        cuda=device.cuda,
        torch_version=torch.__version__,
        triton_version=triton.__version__,
        tritune_version=tritune_version(),
    )


def _with_out(problem: Problem, out: torch.Tensor) -> dict[str, Any]:
    return {**problem.kwargs, "out": out}


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _consistent(out: torch.Tensor, portable: torch.Tensor) -> str | None:
    """A loose size-dependent sanity check against the portable output at the timed size."""
    if not bool(torch.isfinite(out).all()) and bool(torch.isfinite(portable).all()):
        return "non-finite values where the portable path has none"
    scale = float(portable.float().abs().max()) or 1.0
    err = float((out.float() - portable.float()).abs().max()) / scale
    return None if err <= 5e-2 else f"differs from the portable output by {err:.3g} of max|out| at the timed size"


class KeyTuner:
    """Tunes one key of one kernel on one device into one store."""

    def __init__(
        self,
        spec: KernelSpec[Any, Any],
        key: TuningKey,
        device: DeviceInfo,
        torch_device: torch.device,
        store: ConfigStore,
        env_id: int,
        timer: Timer,
        options: TuneOptions,
        on_trial: Callable[[str, dict[str, Any], str, float | None], None] | None = None,
    ) -> None:
        self.spec, self.key, self.device, self.torch_device = spec, key, device, torch_device
        self.store, self.env_id, self.timer, self.options = store, env_id, timer, options
        self.on_trial = on_trial
        self.space = spec.space
        self.key_dict = key.to_dict()
        self.limits = spec.limits(device)
        self.times: dict[tuple[Any, ...], float] = {}
        self.status: dict[tuple[Any, ...], str] = {}
        self.counts = {"measured": 0, "reused": 0, "failed": 0, "pruned": 0}

    # ---- helpers --------------------------------------------------------------------------

    def _ident(self, config: Any) -> tuple[Any, ...]:
        return tuple(self.space.to_dict(config).values())

    def _record(self, config: Any, status: str, ms: float | None, error: str | None) -> None:
        ident = self._ident(config)
        self.status[ident] = status
        if ms is not None:
            self.times[ident] = ms
        self.store.record_trial(
            self.env_id, self.spec.name, self.spec.version, self.key_dict, self.space.to_dict(config), status, ms, error
        )
        if status == OK:
            self.counts["measured"] += 1
        elif status == PRUNED:
            self.counts["pruned"] += 1
        else:
            self.counts["failed"] += 1
        if self.on_trial is not None:
            self.on_trial(self.spec.name, self.space.to_dict(config), status, ms)

    def _spent(self) -> int:
        return self.counts["measured"] + self.counts["failed"] + self.counts["reused"]

    def _launch(self, config: Any, problem: Problem, out: torch.Tensor) -> None:
        self.spec.launch(config, *problem.args, **_with_out(problem, out))

    def _sync(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    # ---- the study ------------------------------------------------------------------------

    def run(self) -> KeyResult:
        spec, opts = self.spec, self.options
        started = time.monotonic()
        default = spec.default_config(self.key)
        why = self.space.infeasible_reason(default, self.key, self.limits)
        if why is not None:
            raise TuningError(f"{spec.name} {self.key}: the portable default is infeasible here ({why})")

        seed = opts.seed
        self.problem = spec.make_problem(self.key, self.torch_device, seed)
        self.check_problem = spec.check_problem(self.key, self.torch_device, seed + 1)
        self.expected = spec.reference(*self.check_problem.args, **self.check_problem.kwargs)
        self.portable_out = spec.launch(default, *self.problem.args, **self.problem.kwargs)
        self.check_out_template = spec.launch(default, *self.check_problem.args, **self.check_problem.kwargs)
        self._sync()

        distributions = {
            name: optuna.distributions.CategoricalDistribution(list(options))
            for name, options in self.space.dimensions.items()
        }
        feasible = self.space.feasible(self.key, self.limits)
        exhaustive = len(feasible) <= opts.trials
        sampler: optuna.samplers.BaseSampler = (
            optuna.samplers.RandomSampler(seed=seed)
            if exhaustive
            else optuna.samplers.TPESampler(multivariate=True, seed=seed, n_startup_trials=min(10, opts.trials // 3))
        )
        study = optuna.create_study(direction="minimize", sampler=sampler)
        rng = random.Random(seed)

        # Resume: whatever an earlier (possibly killed) run measured is known, not re-measured.
        for row in self.store.measured_trials(self.env_id, spec.name, spec.version, self.key_dict):
            try:
                config = self.space.parse(row.config)
            except ValueError:
                continue
            ident = self._ident(config)
            self.status[ident] = row.status
            if row.status == OK and row.time_ms is not None:
                self.times[ident] = row.time_ms
                study.add_trial(
                    optuna.trial.create_trial(
                        params=self.space.to_dict(config), distributions=distributions, value=row.time_ms
                    )
                )
            self.counts["reused"] += 1

        study.enqueue_trial(self.space.to_dict(default), skip_if_exists=True)
        for winner in self.store.winners(gpu=self.device.slug, kernel=spec.name):
            if winner.key == self.key_dict and winner.kernel_version == spec.version:
                study.enqueue_trial(winner.config, skip_if_exists=True)
        if exhaustive:
            for config in feasible:
                study.enqueue_trial(self.space.to_dict(config), skip_if_exists=True)
        else:
            # TPE's random start-up draws from the whole product, mostly infeasible for large
            # spaces: start it from a seeded sample of feasible configs instead.
            for config in rng.sample(feasible, min(len(feasible), max(1, opts.trials // 3))):
                study.enqueue_trial(self.space.to_dict(config), skip_if_exists=True)

        # The budget counts trials measured by earlier runs of the same study too (resume).
        budget = opts.trials
        max_asks = 20 * budget + len(feasible)
        asks = 0
        while self._spent() < budget and asks < max_asks:
            if opts.time_budget_s is not None and time.monotonic() - started > opts.time_budget_s:
                log.info("%s %s: time budget reached", spec.name, self.key)
                break
            pending: list[tuple[optuna.trial.Trial, Any]] = []
            while len(pending) < min(opts.batch, budget - self._spent()) and asks < max_asks:
                trial = study.ask(distributions)
                asks += 1
                config = self.space.parse(trial.params)
                ident = self._ident(config)
                if ident in self.status:
                    known = self.times.get(ident)
                    if known is not None:
                        study.tell(trial, known)
                    else:
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    if exhaustive and len(self.status) >= len(feasible):
                        break
                    continue
                reason = self.space.infeasible_reason(config, self.key, self.limits)
                if reason is not None:
                    self._record(config, PRUNED, None, reason)
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    # Keep the sweep moving: the next ask measures an unseen feasible config.
                    unseen = [c for c in feasible if self._ident(c) not in self.status]
                    if unseen:
                        study.enqueue_trial(self.space.to_dict(rng.choice(unseen)))
                    continue
                self.status[ident] = "pending"
                pending.append((trial, config))
            if not pending:
                break
            compiled = self._compile([c for _, c in pending])
            for (trial, config), compile_error in zip(pending, compiled, strict=True):
                ms = self._measure(config, compile_error)
                if ms is None:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                else:
                    study.tell(trial, ms)

        return self._finish(default)

    def _compile(self, configs: list[Any]) -> list[str | None]:
        """First launch of each config (which compiles it), in parallel on a GPU."""

        def first_launch(config: Any) -> str | None:
            try:
                self._launch(config, self.problem, torch.empty_like(self.portable_out))
                return None
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"[:2000]

        if self.torch_device.type != "cuda" or self.options.compile_workers <= 1:
            # The interpreter patches triton.language globally while it runs: one at a time.
            return [first_launch(c) for c in configs]
        with ThreadPoolExecutor(max_workers=self.options.compile_workers) as pool:
            results = list(pool.map(first_launch, configs))
        self._sync()
        return results

    def _measure(self, config: Any, compile_error: str | None) -> float | None:
        if compile_error is not None:
            self._record(config, FAILED_COMPILE, None, compile_error)
            return None
        try:
            out = _nan_like(self.check_out_template)
            self._launch(config, self.check_problem, out)
            self._sync()
            problem_text = self.spec.check(out, self.expected, self.check_problem)
            if problem_text is None:
                full = _nan_like(self.portable_out)
                self._launch(config, self.problem, full)
                self._sync()
                problem_text = _consistent(full, self.portable_out)
            if problem_text is not None:
                self._record(config, FAILED_CORRECTNESS, None, problem_text)
                return None
            target = torch.empty_like(self.portable_out)
            ms = self.timer(
                lambda: self._launch(config, self.problem, target),
                config=config,
                flush_l2=self.problem.flush_l2,
                launch_bound=self.problem.launch_bound,
            )
        except Exception as exc:
            self._record(config, FAILED_RUNTIME, None, f"{type(exc).__name__}: {exc}"[:2000])
            return None
        if not math.isfinite(ms) or ms <= 0:
            self._record(config, FAILED_RUNTIME, None, f"timer returned {ms!r}")
            return None
        self._record(config, OK, ms, None)
        return ms

    def _retime(self, config: Any) -> float:
        target = torch.empty_like(self.portable_out)
        return self.timer(
            lambda: self._launch(config, self.problem, target),
            config=config,
            flush_l2=self.problem.flush_l2,
            launch_bound=self.problem.launch_bound,
        )

    def _finish(self, default: Any) -> KeyResult:
        default_ident = self._ident(default)
        if default_ident not in self.times:
            raise TuningError(
                f"{self.spec.name} {self.key}: the portable default failed ({self.status.get(default_ident)})"
            )
        best_ident = min(self.times, key=lambda i: self.times[i])
        best = self.space.config_type(*best_ident)
        notes: list[str] = []
        best_ms, portable_ms = self.times[best_ident], self.times[default_ident]
        if best_ident != default_ident and self.options.final_rounds > 0:
            # Interleaved re-timing: both see the same clocks and temperature.
            pairs = [(self._retime(best), self._retime(default)) for _ in range(self.options.final_rounds)]
            best_ms = sorted(p[0] for p in pairs)[len(pairs) // 2]
            portable_ms = sorted(p[1] for p in pairs)[len(pairs) // 2]
            if best_ms >= portable_ms:
                notes.append("re-timing found no gain over the portable default")
        if best_ident == default_ident or best_ms >= portable_ms:
            best, best_ms = default, portable_ms
        record = WinnerRecord(
            kernel=self.spec.name,
            kernel_version=self.spec.version,
            gpu=self.device.slug,
            key=self.key_dict,
            config=self.space.to_dict(best),
            time_ms=best_ms,
            portable_ms=portable_ms,
            speedup=portable_ms / best_ms,
            trials=self.counts["measured"] + self.counts["reused"],
            triton_version=triton.__version__,
            torch_version=torch.__version__,
            tritune_version=tritune_version(),
        )
        self.store.offer_winner(record, self.env_id)
        return KeyResult(
            kernel=self.spec.name,
            key=self.key,
            config=self.space.to_dict(best),
            best_ms=best_ms,
            portable_ms=portable_ms,
            measured=self.counts["measured"],
            reused=self.counts["reused"],
            failed=self.counts["failed"],
            pruned=self.counts["pruned"],
            notes=notes,
        )

"""One Optuna study per (kernel, key, GPU): sample configs, gate them, time them, store everything.

The loop, per batch of proposals:

1. Optuna proposes configs (TPE, multivariate; every feasible config enqueued when the feasible
   space fits the trial budget, which makes the sweep exhaustive). The portable default and any
   stored winner are enqueued first, so the portable time is always measured in the same run.
2. Infeasible proposals become pruned trials with the rule's reason; configs already stored at
   this key (by this run, a killed earlier one, or another tuner running now on the same DB) are
   answered from the DB, not measured again. The DB is read again before every batch.
3. The candidates run on a bench (:mod:`.candidates`), by default in a worker process
   (:mod:`.worker`): on a GPU the batch compiles in parallel threads, then each candidate is
   checked against the reference on a fresh random problem with a NaN-poisoned output,
   cross-checked against the portable output at the timed size, and timed (a noisy measurement
   is repeated once, see :mod:`.noise`). A candidate that kills or hangs the worker is a failed
   trial with the reason. Each trial is committed as soon as it is measured.
4. The last ``polish`` share of the trial budget goes to configs one step from the best so far
   (one field moved to a neighbouring choice): a hill climb from the incumbent. TPE's proposals
   depend on its seed; two tunes of one key that end near the same optimum should pick it, not
   two of its neighbours (rank stability).
5. The best config, the runner-up and the portable default are re-timed in interleaved rounds,
   and the fastest is offered to the DB as the key's winner (the DB keeps the faster of
   concurrent offers).

This process keeps Optuna, the DB writes and the choice of the winner; the bench only measures.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import optuna
import torch
import triton

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .candidates import (
    FAILED_COMPILE,
    FAILED_CORRECTNESS,
    FAILED_RUNTIME,
    OK,
    PRUNED,
    Bench,
    BenchError,
    LocalBench,
    TrialOutcome,
)
from .noise import NoisePolicy
from .timing import Timer

log = logging.getLogger("tritune.tuner")
optuna.logging.set_verbosity(optuna.logging.WARNING)

__all__ = [
    "FAILED_COMPILE",
    "FAILED_CORRECTNESS",
    "FAILED_RUNTIME",
    "OK",
    "PRUNED",
    "KeyResult",
    "KeyTuner",
    "TuneOptions",
    "TuningError",
    "environment_id",
    "pick_winner",
]

Ident = TypeVar("Ident", bound=Hashable)

#: Winners of this key under earlier kernel versions measured first after an edit (the fastest).
EARLIER_SEEDS = 2
#: Winners of the nearest other buckets measured first at a key (see ``KeyTuner._neighbour_winners``).
NEIGHBOUR_SEEDS = 3


def _usable_cpus() -> int:
    """CPUs this process may run on (affinity and cgroup-aware where the OS says), at most 16."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:
        count = os.cpu_count() or 1
    return max(1, min(16, count))


@dataclass
class TuneOptions:
    trials: int = 40
    time_budget_s: float | None = None
    seed: int = 0
    #: Candidates proposed (and compiled) together before any of their results reaches the
    #: sampler; ``None``: a quarter of the trials (at least 4), at most one per compile thread.
    #: A batch as large as the budget would make TPE a random search: it learns between batches.
    batch: int | None = None
    compile_workers: int = field(default_factory=lambda: _usable_cpus())
    #: Rounds of the final interleaved re-timing of winner, runner-up and portable default.
    final_rounds: int = 3
    #: Share of the trial budget spent last on the best config's neighbours (0 turns it off).
    polish: float = 0.3
    #: Run candidates in a worker process (crash and hang isolation). The ``tune`` command turns
    #: it on; in-process is the default here for tests of the loop with a fake timer.
    isolate: bool = False
    #: Seconds one candidate (first launch, check and timing) may take in the worker before it is
    #: killed and recorded as failed; ``None`` waits forever.
    trial_timeout_s: float | None = 120.0
    noise: NoisePolicy = field(default_factory=NoisePolicy)

    @property
    def batch_size(self) -> int:
        if self.batch is not None:
            return max(1, self.batch)
        return max(1, min(self.compile_workers, max(4, -(-self.trials // 4))))


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
    env_id: int = store.environment(
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
    return env_id


def pick_winner(times: dict[Ident, float], default: Ident) -> Ident:
    """The fastest of the re-timed configs; the portable default unless another is strictly faster."""
    return min(times, key=lambda ident: (times[ident], ident != default))


class KeyTuner:
    """Tunes one key of one kernel on one device into one store.

    ``bench`` is where candidates run; without one, the tuner makes its own for this key (a
    worker process when ``options.isolate``, else this process) and closes it afterwards. The
    ``tune`` command passes one worker for the whole run so that its start-up is paid once.
    Its study lives in memory; :class:`~.shared.SharedKeyTuner` runs the same steps on a study
    shared by several workers.
    """

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
        bench: Bench | None = None,
    ) -> None:
        self.spec, self.key, self.device, self.torch_device = spec, key, device, torch_device
        self.store, self.env_id, self.timer, self.options = store, env_id, timer, options
        self.on_trial = on_trial
        self.bench = bench
        self.space = spec.space
        self.key_dict = key.to_dict()
        self.limits = spec.limits(device)
        self.times: dict[tuple[Any, ...], float] = {}
        self.status: dict[tuple[Any, ...], str] = {}
        self.errors: dict[tuple[Any, ...], str] = {}
        self.counts = {"measured": 0, "reused": 0, "failed": 0, "pruned": 0}

    # ---- helpers --------------------------------------------------------------------------

    def _ident(self, config: Any) -> tuple[Any, ...]:
        return tuple(self.space.to_dict(config).values())

    def _record(self, config: Any, status: str, ms: float | None, error: str | None) -> None:
        ident = self._ident(config)
        self.status[ident] = status
        if ms is not None:
            self.times[ident] = ms
        if error is not None:
            self.errors[ident] = error
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

    def _own_bench(self) -> Bench:
        opts = self.options
        if not opts.isolate:
            return LocalBench(self.torch_device, self.timer, noise=opts.noise, compile_workers=opts.compile_workers)
        from .worker import Worker, worker_device

        return Worker(
            worker_device(self.torch_device),
            self.timer,
            trial_timeout_s=opts.trial_timeout_s,
            noise=opts.noise,
            compile_workers=opts.compile_workers,
        )

    def _absorb_stored(self, study: optuna.Study, distributions: dict[str, Any]) -> None:
        """Take in trials stored at this key by anyone else (an earlier run, a concurrent tuner)."""
        for row in self.store.measured_trials(self.env_id, self.spec.name, self.spec.version, self.key_dict):
            try:
                config = self.space.parse(row.config)
            except ValueError:
                continue
            ident = self._ident(config)
            if ident in self.status:
                continue
            self.status[ident] = row.status
            if row.error is not None:
                self.errors[ident] = row.error
            if row.status == OK and row.time_ms is not None:
                self.times[ident] = row.time_ms
                study.add_trial(
                    optuna.trial.create_trial(
                        params=self.space.to_dict(config), distributions=distributions, value=row.time_ms
                    )
                )
            # Pruned configs cost no measurement, now or then: they do not spend the budget.
            if row.status != PRUNED:
                self.counts["reused"] += 1

    # ---- the study ------------------------------------------------------------------------

    def run(self) -> KeyResult:
        default = self.spec.default_config(self.key)
        why = self.space.infeasible_reason(default, self.key, self.limits)
        if why is not None:
            raise TuningError(f"{self.spec.name} {self.key}: the portable default is infeasible here ({why})")
        owned = self.bench is None
        bench = self._own_bench() if self.bench is None else self.bench
        try:
            try:
                bench.open(self.spec, self.key, self.options.seed, self.space.to_dict(default))
            except BenchError as exc:
                raise TuningError(f"{self.spec.name} {self.key}: cannot set up the problem ({exc})") from exc
            try:
                return self._run(bench, default)
            except BenchError as exc:
                raise TuningError(f"{self.spec.name} {self.key}: {exc}") from exc
        finally:
            if owned:
                bench.close()

    def _distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        return {
            name: optuna.distributions.CategoricalDistribution(list(options))
            for name, options in self.space.dimensions.items()
        }

    def _sampler(self, exhaustive: bool, seed: int, *, shared: bool = False) -> optuna.samplers.BaseSampler:
        """Random over enqueued configs for an exhaustive sweep, else multivariate TPE.

        ``shared``: several workers ask the same study at once, so TPE imagines the running
        trials' results (``constant_liar``) instead of proposing the same config to each of them.
        """
        if exhaustive:
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(
            multivariate=True, seed=seed, n_startup_trials=min(10, self.options.trials // 3), constant_liar=shared
        )

    def _neighbours_of_best(self) -> list[Any]:
        """Feasible configs not yet seen, one field away from the fastest measured config.

        A field moves to the choice next to its current one (the choices are ordered), so a
        climb from the incumbent tries the nearest tiles, warp counts and stage depths first.
        """
        if not self.times:
            return []
        best = min(self.times, key=lambda ident: self.times[ident])
        found = []
        for index, options in enumerate(self.space.dimensions.values()):
            position = options.index(best[index])
            for step in (-1, 1):
                if not 0 <= position + step < len(options):
                    continue
                ident = (*best[:index], options[position + step], *best[index + 1 :])
                if ident in self.status:
                    continue
                config = self.space.config_type(*ident)
                if self.space.infeasible_reason(config, self.key, self.limits) is None:
                    found.append(config)
        return found

    def _polish_from(self, exhaustive: bool) -> int:
        """Trials measured before the climb from the best config starts (never, in an exhaustive sweep)."""
        budget = self.options.trials
        return budget if exhaustive else budget - int(self.options.polish * budget)

    def _room(self, spent: int, polish_from: int) -> int:
        """Trials the next batch may take: the exploration stops at the polish share, which is the climb's."""
        limit = polish_from if spent < polish_from else self.options.trials
        return max(0, min(self.options.batch_size, limit - spent))

    def _climb(self, slots: int, taken: Collection[Hashable] = ()) -> list[Any]:
        """The next ``slots`` configs of the climb: unseen neighbours of the best config, none in ``taken``."""
        return [c for c in self._neighbours_of_best() if self._ident(c) not in taken][:slots]

    def _stand_in(self, feasible: list[Any], rng: random.Random, taken: Collection[Hashable] = ()) -> Any | None:
        """A random unseen feasible config (none in ``taken``), asked in place of an infeasible proposal.

        TPE's proposals in a large space are often infeasible; each one's place goes to a feasible
        config, so the budget keeps measuring instead of asking the sampler over and over.
        """
        unseen = [c for c in feasible if self._ident(c) not in self.status and self._ident(c) not in taken]
        return rng.choice(unseen) if unseen else None

    def _seeds(self, default: Any, feasible: list[Any], exhaustive: bool, rng: random.Random) -> list[dict[str, Any]]:
        """Configs enqueued before the sampler proposes any: portable default, stored winner, the
        key's winner under an earlier kernel version, the winners of the nearest tuned buckets and
        the spec's starting configs first."""
        seeds = [self.space.to_dict(default)]
        stored = self.store.winners(gpu=self.device.slug, kernel=self.spec.name)
        winners = [w for w in stored if w.kernel_version == self.spec.version]
        seeds.extend(w.config for w in winners if w.key == self.key_dict)
        seeds.extend(self._earlier_winners(stored))
        seeds.extend(self._neighbour_winners(winners))
        seeds.extend(self.space.to_dict(config) for config in self.spec.starting_configs(self.key, self.device))
        if exhaustive:
            seeds.extend(self.space.to_dict(config) for config in feasible)
            return seeds
        # TPE's random start-up draws from the whole product, mostly infeasible for large
        # spaces: start it from a seeded sample of feasible configs instead.
        sample = rng.sample(feasible, min(len(feasible), max(1, self.options.trials // 3)))
        seeds.extend(self.space.to_dict(config) for config in sample)
        # Queued seeds are asked before anything else, the climb's configs included: at most the
        # exploration share of them (the portable default always), the random sample dropped first.
        return seeds[: max(1, self._polish_from(exhaustive))]

    def _earlier_winners(self, stored: list[WinnerRecord]) -> list[dict[str, Any]]:
        """This key's winners stored under other kernel versions that still parse and are feasible,
        fastest first, at most ``EARLIER_SEEDS`` distinct configs.

        An edited kernel never serves them (their times were measured on other code), but after
        an edit that left most launches alone they are the likeliest winners again: seeded, they
        are re-measured and checked like any trial, so a re-tune recovers them in a few trials.
        The cap keeps a long history of edits from crowding out the other seeds.
        """
        found: list[dict[str, Any]] = []
        earlier = [w for w in stored if w.key == self.key_dict and w.kernel_version != self.spec.version]
        for winner in sorted(earlier, key=lambda w: w.time_ms):
            try:
                config = self.space.parse(winner.config)
            except (TypeError, ValueError):
                continue
            values = self.space.to_dict(config)
            if values not in found and self.space.infeasible_reason(config, self.key, self.limits) is None:
                found.append(values)
        return found[:EARLIER_SEEDS]

    def _neighbour_winners(self, winners: list[WinnerRecord]) -> list[dict[str, Any]]:
        """Winners of the nearest other buckets of this key's group that are feasible here, nearest first.

        Neighbouring buckets' optima are usually near this one's: on the H200 the D=64, Lq=512,
        Lkv=16K prefill key's 24 trials never met the tile that ran 3.3x the portable default at
        Lkv=32K, and the portable default kept the key. A tune over many keys hands each key what
        the keys before it found; the sampler and the climb still decide.
        """
        ranked: list[tuple[float, dict[str, Any]]] = []
        for winner in winners:
            if winner.key == self.key_dict:
                continue
            try:
                other = self.spec.key_type.from_dict(winner.key)
                config = self.space.parse(winner.config)
            except (TypeError, ValueError):
                continue
            if other.group() != self.key.group():
                continue
            if self.space.infeasible_reason(config, self.key, self.limits) is None:
                ranked.append((self.key.distance(other), self.space.to_dict(config)))
        ranked.sort(key=lambda item: item[0])
        # The portable default and the key's own winner are seeded anyway: a neighbour whose winner
        # is one of them adds nothing.
        seen = [self.space.to_dict(self.spec.default_config(self.key))]
        seen.extend(w.config for w in winners if w.key == self.key_dict)
        already = len(seen)
        for _, values in ranked:
            if values not in seen:
                seen.append(values)
        return seen[already : already + NEIGHBOUR_SEEDS]

    def _run(self, bench: Bench, default: Any) -> KeyResult:
        spec, opts = self.spec, self.options
        started = time.monotonic()
        distributions = self._distributions()
        feasible = self.space.feasible(self.key, self.limits)
        exhaustive = len(feasible) <= opts.trials
        study = optuna.create_study(direction="minimize", sampler=self._sampler(exhaustive, opts.seed))
        rng = random.Random(opts.seed)

        # Resume: whatever an earlier (possibly killed) run measured is known, not re-measured.
        self._absorb_stored(study, distributions)
        for values in self._seeds(default, feasible, exhaustive, rng):
            study.enqueue_trial(values, skip_if_exists=True)

        # The budget counts trials measured by earlier runs of the same study too (resume).
        budget = opts.trials
        polish_from = self._polish_from(exhaustive)
        max_asks = 20 * budget + len(feasible)
        asks = 0
        while self._spent() < budget and asks < max_asks:
            if opts.time_budget_s is not None and time.monotonic() - started > opts.time_budget_s:
                log.info("%s %s: time budget reached", spec.name, self.key)
                break
            # Another tuner on the same DB may have measured configs since the last batch.
            self._absorb_stored(study, distributions)
            room = self._room(self._spent(), polish_from)
            if self._spent() >= polish_from:
                # Asked before the sampler's own proposals; a batch the neighbours do not fill is TPE's.
                for config in self._climb(room):
                    study.enqueue_trial(self.space.to_dict(config), skip_if_exists=True)
            pending: list[tuple[optuna.trial.Trial, Any]] = []
            while len(pending) < room and asks < max_asks:
                if exhaustive and not any(self._ident(c) not in self.status for c in feasible):
                    # Every feasible config is measured, failed or in this batch: the sweep is done.
                    break
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
                    continue
                reason = self.space.infeasible_reason(config, self.key, self.limits)
                if reason is not None:
                    self._record(config, PRUNED, None, reason)
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    # Keep the sweep moving: the next ask measures an unseen feasible config.
                    stand_in = self._stand_in(feasible, rng)
                    if stand_in is not None:
                        study.enqueue_trial(self.space.to_dict(stand_in))
                    continue
                self.status[ident] = "pending"
                pending.append((trial, config))
            if not pending:
                break
            outcomes = self._measure_batch(bench, [config for _, config in pending])
            for (trial, _), result in zip(pending, outcomes, strict=True):
                if result["status"] == OK and result["ms"] is not None:
                    study.tell(trial, result["ms"])
                else:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)

        return self._finish(bench, default)

    def _measure_batch(
        self, bench: Bench, configs: list[Any], on_result: Callable[[int, TrialOutcome], None] | None = None
    ) -> list[TrialOutcome]:
        """Run one batch on the bench, recording each trial as soon as its outcome is in.

        ``on_result(index, outcome)`` is called right after each trial is recorded.
        """
        values = [self.space.to_dict(c) for c in configs]
        early: list[TrialOutcome | None] | None = None
        if self.torch_device.type == "cuda" and self.options.compile_workers > 1 and len(configs) > 1:
            early = bench.precompile(values)
        results = []
        for index, config in enumerate(configs):
            failed_early = early[index] if early is not None else None
            result = failed_early or bench.trial(values[index], compiled=early is not None)
            self._record(config, result["status"], result["ms"], result["error"])
            if on_result is not None:
                on_result(index, result)
            results.append(result)
        return results

    def _finish(self, bench: Bench, default: Any) -> KeyResult:
        default_ident = self._ident(default)
        if default_ident not in self.times:
            status = self.status.get(default_ident)
            error = self.errors.get(default_ident)
            detail = f"{status}: {error}" if error else str(status)
            raise TuningError(f"{self.spec.name} {self.key}: the portable default failed ({detail})")
        ranked = sorted(self.times, key=lambda i: self.times[i])
        # Winner, runner-up and portable default, each once.
        contenders = list(dict.fromkeys([*ranked[:2], default_ident]))
        timed = {ident: self.times[ident] for ident in contenders}
        notes: list[str] = []
        if len(contenders) > 1 and self.options.final_rounds > 0:
            configs = [self.space.to_dict(self.space.config_type(*ident)) for ident in contenders]
            retimed = bench.retime(configs, self.options.final_rounds)
            if retimed is None:
                notes.append("final re-timing failed; the winner is chosen on the trial times")
            else:
                # Interleaved re-timing: all contenders see the same clocks and temperature.
                timed = dict(zip(contenders, retimed["ms"], strict=True))
                notes.extend(retimed["notes"])
        winner = pick_winner(timed, default_ident)
        if winner == default_ident and ranked[0] != default_ident:
            notes.append("re-timing found no gain over the portable default")
        elif winner != ranked[0]:
            notes.append("re-timing put the runner-up of the trials ahead")
        best = self.space.config_type(*winner)
        best_ms, portable_ms = timed[winner], timed[default_ident]
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

"""The search of one key's configs: one loop, for a lone tuner and for workers sharing a study.

A key's study is an Optuna study of the kernel's configs (by field name, never by position). Its
search, in phases:

1. Join (under the study's lock): open or create the study; add the trials stored in the config DB
   that it lacks as finished trials (resume: a killed run loses nothing, and nothing is measured
   twice); enqueue the seeds it lacks, once, fixed by whoever seeds first
   (:meth:`~.strategy.Strategy.seeds`: the portable default, the key's stored winner, the fallback
   key's, its winners under earlier kernel versions, other GPUs' winners at this key, the winners
   of the nearest tuned buckets, the spec's starting configs, then a seeded sample of feasible
   configs: the whole feasible space when that fits the budget, which makes the sweep exhaustive).
2. Explore in batches while the study has budget left. The budget counts distinct configs with a
   result, or running, anywhere. Each batch: ask the sampler (multivariate TPE), then look before
   measuring: a config with a result is answered from it; one held by another worker's earlier trial
   is left to it; an infeasible proposal (or one outside its path's choices) is pruned with the
   rule's reason and a random unseen feasible config is asked in its place. The rest run on the
   bench (:mod:`.candidates`), each trial stored as soon as it is measured.
3. Climb: the exploration stops at the last ``polish`` share of the budget; that share goes to the
   unseen feasible neighbours (one field moved to the next choice) of the best config so far, once
   as many results are in. TPE's proposals depend on its seed; two tunes of one key that end near
   the same optimum should pick it, not two of its neighbours (rank stability).
4. Finalize once, when nothing runs and the budget is spent: the best config, the runner-up and the
   portable default are re-timed in interleaved rounds and the fastest is offered to the DB (which
   keeps the faster of concurrent offers); the study is marked finalized.

Where the study lives and what sharing it costs is a :class:`~.backend.StudyBackend`'s: in this
process's memory for a lone tuner (:class:`.study.LocalStudy`), or in a storage shared by several
workers with heartbeats, trial claims and a cross-process lock (:class:`.shared.SharedStudy`). What
is known of each config is :class:`~.known.Known`'s; which configs go before and around the
sampler's proposals (seeds, stand-ins, the climb) is :class:`~.strategy.Strategy`'s; how each
proposal is asked, sorted out before anything is measured, and told back is
:class:`~.ask_tell.AskTell`'s.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import optuna
import torch
import triton
from optuna.trial import TrialState

from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .ask_tell import AskTell
from .backend import Asked, KeyBench, StudyBackend, Visit
from .candidates import OK, Bench, TrialOutcome
from .known import Known, OnTrial
from .options import TuneOptions, TuningError
from .strategy import Strategy
from .studies import (
    DUPLICATE,
    FINALIZED_ATTR,
    META_ATTR,
    SEEDS_ATTR,
    measured_outcome,
    study_name,
)
from .timing import Timer
from .winner import offer_winner

log = logging.getLogger("tritune.tuner")

#: How far past the time budget, as a multiple of it, a batch already compiled in parallel is still
#: measured: its compiles are paid, and what is left of each trial is a check and a timing. A cold
#: machine's first batch of a kernel (its Triton cache empty) can take twice a short online budget
#: to compile alone.
_COMPILED_GRACE = 3.0
optuna.logging.set_verbosity(optuna.logging.WARNING)


class KeySearch(AskTell):
    """The search of one key of one kernel on one device, into one store, on the study ``backend`` keeps."""

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
        backend: StudyBackend,
        on_trial: OnTrial | None = None,
    ) -> None:
        self.spec, self.key, self.device, self.torch_device = spec, key, device, torch_device
        self.store, self.env_id, self.timer, self.options = store, env_id, timer, options
        self.backend = backend
        self.space = spec.space
        self.key_dict = key.to_dict()
        self.limits = spec.limits(device)
        self.name = study_name(spec.name, spec.version, device.slug, triton.__version__, self.key_dict)
        self.known = Known(spec, self.key_dict, store, env_id, on_trial, trial_timeout_s=options.trial_timeout_s)
        self.strategy = Strategy(spec, key, device, store, options, self.known)
        #: Stand-ins are drawn from this process's stream (workers share the seeds, not the stream).
        self.rng = random.Random(backend.sampler_seed(options.seed))
        #: When this key's search began here: ``--time-budget`` counts from it over every visit.
        self.started: float | None = None
        #: The one batch asked past the time budget, to measure a portable default nobody measured.
        self.late_batch_asked = False
        self.study: optuna.Study | None = None

    def _ready(self, bench: KeyBench, default: Any) -> Bench:
        """The bench with this key's problems built (once per key on a worker's bench)."""
        return bench.ready(self.spec, self.key, self.options.seed, self.space.to_dict(default))

    def _finalized(self, study: optuna.Study) -> dict[str, Any] | None:
        """The study's finalized mark, if it covers this search's budget."""
        mark = study.user_attrs.get(FINALIZED_ATTR)
        if not isinstance(mark, dict):
            return None
        if mark.get("exhausted") or int(mark.get("budget", 0)) >= self.options.trials:
            return mark
        return None

    # ---- joining -----------------------------------------------------------------------------

    def _join(self, default: Any) -> optuna.Study:
        sampler = self.strategy.sampler(self.backend.sampler_seed(self.options.seed), self.backend.shared)
        with self.backend.lock(self.name):
            study, created = self.backend.open(self.name, sampler)
            if created:
                meta = {
                    "kernel": self.spec.name,
                    "kernel_version": self.spec.version,
                    "gpu": self.device.slug,
                    "triton": triton.__version__,
                    "key": self.key_dict,
                }
                study.set_user_attr(META_ATTR, meta)
            if self._finalized(study) is None:
                self._seed(study, default)
        return study

    def _seed(self, study: optuna.Study, default: Any) -> None:
        """Add the stored measurements and the seeds the study lacks (called under the study lock)."""
        self.known.refresh()
        trials = study.get_trials(deepcopy=False)
        self.known.add_stored(study, trials)
        present = {self.known.trial_ident(t) for t in trials if t.state != TrialState.FAIL or measured_outcome(t)}
        # Stored configs need no asking: measured (added above), failed, or pruned as infeasible.
        present |= set(self.known.status)
        # The shared start does not depend on the worker: the seeds of a single-process tune, fixed
        # by the first worker to seed the study (they include the nearest buckets' winners, which
        # a worker joining later could find more of in the DB).
        seeds = study.user_attrs.get(SEEDS_ATTR)
        if not isinstance(seeds, list):
            plan = self.strategy
            seeds = plan.seeds(default, plan.feasible, plan.exhaustive, random.Random(self.options.seed))
            study.set_user_attr(SEEDS_ATTR, seeds)
        for values in seeds:
            try:
                ident = self.known.ident(self.space.parse(values))
            except (TypeError, ValueError):
                continue
            if ident not in present:
                study.enqueue_trial(values)
                present.add(ident)

    # ---- one visit ---------------------------------------------------------------------------

    def visit(self, bench: KeyBench) -> Visit:
        """Measure this process's share of the key, and finalize it if it is complete."""
        default = self.spec.default_config(self.key)
        why = self.space.infeasible_reason(default, self.key, self.limits)
        if why is not None:
            raise TuningError(f"{self.spec.name} {self.key}: the portable default is infeasible here ({why})")
        if self.study is None:
            self.study = self._join(default)
        study = self.study
        mark = self._finalized(study)
        if mark is not None:
            if "error" in mark:
                raise TuningError(f"{mark['error']} (found in the shared study)")
            return Visit(done=True, finalized=mark)
        measured, stop = self._explore(study, bench, default)
        return self._finalize(study, bench, default, measured, stop)

    def _explore(self, study: optuna.Study, bench: KeyBench, default: Any) -> tuple[int, str]:
        """Ask and measure until the study's budget is spent; how many were measured here, and why it stopped.

        The exploration (seeds, then TPE, a random unseen feasible config in place of each infeasible
        proposal) stops at the polish share, however many workers ask at once; the climb starts once
        that many results are in, from the best of them. A worker that finds the exploration's last
        trials still running elsewhere stops with ``wait`` (it comes back).
        """
        opts = self.options
        if self.started is None:
            self.started = time.monotonic()
        budget = opts.trials
        polish_from = self.strategy.polish_from(self.strategy.exhaustive)
        max_asks = 20 * budget + len(self.strategy.feasible)
        asks = measured = 0
        while asks < max_asks:
            if self._past_deadline():
                if self.late_batch_asked or not self._default_unsettled(study):
                    log.info("%s %s: time budget reached", self.spec.name, self.key)
                    return measured, "time"
                # One batch more, of which only the portable default is measured (_measure_batch).
                self.late_batch_asked = True
            self.backend.sweep(study)
            trials = study.get_trials(deepcopy=False)
            self.known.refresh()
            if not self.backend.shared:
                # Another tuner on the same DB may have measured configs since the last batch.
                self.known.add_stored(study, trials)
            claimed = self.known.claimed(trials)
            if len(claimed) >= budget:
                return measured, "budget"
            waiting = any(t.state == TrialState.WAITING for t in trials)
            if self.strategy.exhaustive:
                seen = claimed | set(self.known.status)
                unseen = [c for c in self.strategy.feasible if self.known.ident(c) not in seen]
                if not unseen:
                    return measured, "budget"
                if not waiting:
                    # Deferred configs (two workers backed off) come back through the queue.
                    for config in self.rng.sample(unseen, min(len(unseen), opts.batch_size)):
                        study.enqueue_trial(self.space.to_dict(config))
            elif len(claimed) >= polish_from:
                if len(self.known.results(trials)) < polish_from:
                    return measured, "wait"
                if not waiting:
                    # The incumbent's neighbours that nobody measures or runs.
                    for config in self.strategy.climb(self.strategy.room(len(claimed), polish_from), claimed):
                        study.enqueue_trial(self.space.to_dict(config))
            limit = polish_from if len(claimed) < polish_from else budget
            room = self.strategy.room(len(claimed), polish_from)
            queued = {self.known.trial_ident(t) for t in trials if t.state == TrialState.WAITING}
            pending: list[tuple[Asked, Any]] = []
            while len(pending) < room and asks < max_asks:
                asked = [self._ask(study) for _ in range(min(room - len(pending), max_asks - asks))]
                asks += len(asked)
                found, infeasible = self._sort_out(study, asked, limit)
                pending.extend(found)
                # Each infeasible proposal's place goes to an unseen feasible config, asked next; not one
                # already queued (a seed), which two workers would then ask at once.
                taken = claimed | queued | {self.known.ident(config) for _, config in pending}
                replaced = 0
                for _ in range(infeasible):
                    stand_in = self.strategy.stand_in(self.rng, taken)
                    if stand_in is None:
                        break
                    study.enqueue_trial(self.space.to_dict(stand_in))
                    taken.add(self.known.ident(stand_in))
                    replaced += 1
                if not replaced:
                    break
            if pending:
                measured += self._measure(study, bench, default, pending)
        return measured, "asks"

    # ---- measuring ---------------------------------------------------------------------------

    def _past_deadline(self, grace: float = 1.0) -> bool:
        """Whether ``--time-budget`` (online: the key's seconds), times ``grace``, has run out since
        the search began."""
        budget = self.options.time_budget_s
        return budget is not None and self.started is not None and time.monotonic() - self.started > budget * grace

    def _default_unsettled(self, study: optuna.Study) -> bool:
        """Whether nobody has measured the portable default or is measuring it now.

        Past the time budget such a default is still measured: no winner is admitted without
        that baseline, so a budget spent on start-up (problems, compiles on a busy GPU) would
        otherwise leave the key with nothing to show for it.
        """
        self.known.refresh()
        ident = self.known.ident(self.spec.default_config(self.key))
        return ident not in self.known.status and ident not in self.known.claimed(study.get_trials(deepcopy=False))

    def _owed_default(self, config: Any) -> bool:
        """Whether ``config`` is the portable default and has no result here yet."""
        ident = self.known.ident(config)
        return ident == self.known.ident(self.spec.default_config(self.key)) and ident not in self.known.status

    def _measure(self, study: optuna.Study, bench: KeyBench, default: Any, pending: list[tuple[Asked, Any]]) -> int:
        told: set[int] = set()

        def tell(index: int, result: TrialOutcome) -> None:
            item = pending[index][0]
            value = result["ms"] if result["status"] == OK else None
            self._tell(study, item, result["status"], value)
            told.add(index)

        try:
            results = self._measure_batch(
                self._ready(bench, default),
                [config for _, config in pending],
                on_result=tell,
            )
        except BaseException:
            # Left to another worker at once, rather than after the heartbeat's grace period.
            self._release([item for index, (item, _) in enumerate(pending) if index not in told])
            raise
        skipped = [item for index, (item, _) in enumerate(pending) if index not in told]
        if self.backend.shared:
            self._release(skipped)
        else:
            for item in skipped:  # past the deadline: nobody measures them
                self._tell(study, item, DUPLICATE)
        return len(results)

    def _measure_batch(
        self, bench: Bench, configs: list[Any], on_result: Callable[[int, TrialOutcome], None] | None = None
    ) -> list[TrialOutcome]:
        """Run one batch on the bench, recording each trial as soon as its outcome is in.

        ``on_result(index, outcome)`` is called right after each trial is recorded. Past the time
        budget the rest of the batch is left unmeasured but for a portable default with no result.
        A batch compiled in parallel is measured on until three times the budget: its compiles, the
        dear part of a trial, are paid, and a short online budget that ran out while they ran
        would otherwise keep only the default of a batch whose every compile had finished. A batch
        asked past the budget (for the owed default) is compiled in parallel too, while within
        three times the budget. A candidate under way is never killed for the budget (a kill would
        be stored as the config's failure), so a trial started before a limit may finish after it.
        """
        values = [self.space.to_dict(c) for c in configs]
        early: list[TrialOutcome | None] | None = None
        parallel = self.torch_device.type == "cuda" and self.options.compile_workers > 1 and len(configs) > 1
        # Late too (the budget went on start-up): compiled in parallel, the batch costs about what
        # the owed default's compile alone would, and the grace below leaves time to measure it.
        if parallel and not self._past_deadline(_COMPILED_GRACE):
            early = bench.precompile(values)
        results = []
        left = 0
        for index, config in enumerate(configs):
            limit = _COMPILED_GRACE if early is not None else 1.0
            if self._past_deadline(limit) and not self._owed_default(config):
                left += 1
                continue
            failed_early = early[index] if early is not None else None
            result = failed_early or bench.trial(values[index], compiled=early is not None)
            self.known.record(config, result["status"], result["ms"], result["error"])
            if on_result is not None:
                on_result(index, result)
            results.append(result)
        if left:
            log.info("%s %s: time budget reached; %d trial(s) of the batch left unmeasured", self.spec.name, self.key,
                     left)  # fmt: skip
        return results

    # ---- the winner --------------------------------------------------------------------------

    def _finalize(self, study: optuna.Study, bench: KeyBench, default: Any, measured: int, stop: str) -> Visit:
        if stop == "wait":
            return Visit(done=False, measured=measured)
        with self.backend.lock(self.name):
            mark = self._finalized(study)
            if mark is not None:
                return Visit(done=True, measured=measured, finalized=mark)
            trials = study.get_trials(deepcopy=False)
            if any(t.state == TrialState.RUNNING for t in trials):
                return Visit(done=False, measured=measured)
            self.known.refresh()
            claimed = self.known.claimed(trials)
            exhausted = all(
                self.known.ident(c) in claimed or self.known.ident(c) in self.known.status
                for c in self.strategy.feasible
            )
            if stop == "budget" and len(claimed) < self.options.trials and not exhausted:
                # Trials counted while running were lost and are queued again: measure them first.
                return Visit(done=False, measured=measured)
            for trial in trials:
                ident = self.known.trial_ident(trial)
                if trial.state == TrialState.COMPLETE and trial.value is not None and ident is not None:
                    self.known.times[ident] = min(trial.value, self.known.times.get(ident, trial.value))
            # Results this process did not measure itself: stored by earlier runs or other workers.
            own = self.known.counts["measured"] + self.known.counts["failed"]
            self.known.counts["reused"] = max(0, len(self.known.results(trials)) - own)
            # A bench this worker cannot set up is its own failure, not the study's: raised unmarked.
            ready = self._ready(bench, default)
            try:
                result = offer_winner(self, ready, default)
            except TuningError as exc:
                study.set_user_attr(FINALIZED_ATTR, {"error": str(exc), "budget": self.options.trials})
                raise
            study.set_user_attr(
                FINALIZED_ATTR,
                {
                    "worker": self.backend.worker,
                    "budget": self.options.trials,
                    "exhausted": exhausted,
                    "config": result.config,
                    "time_ms": result.best_ms,
                    "portable_ms": result.portable_ms,
                    # False where the DB kept a faster winner stored before (the fleet's last line counts them).
                    "stored": result.stored,
                },
            )
        return Visit(done=True, measured=measured, result=result)

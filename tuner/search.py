"""The search of one key's configs: one loop, for a lone tuner and for workers sharing a study.

A key's study is an Optuna study of the kernel's configs (by field name, never by position). Its
search, in phases:

1. Join (under the study's lock): open or create the study; add the trials stored in the config DB
   that it lacks as finished trials (resume: a killed run loses nothing, and nothing is measured
   twice); enqueue the seeds it lacks, once, fixed by whoever seeds first: the portable default,
   the key's stored winner, its winners under earlier kernel versions, the winners of the nearest
   tuned buckets, the spec's starting configs, then a seeded sample of feasible configs (the whole
   feasible space when that fits the budget, which makes the sweep exhaustive).
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

Where the study lives and what sharing it costs is a :class:`StudyBackend`'s: in this process's
memory for a lone tuner (:class:`.study.LocalStudy`), or in a storage shared by several workers
with heartbeats, trial claims and a cross-process lock (:class:`.shared.SharedStudy`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import warnings
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import optuna
import torch
import triton
from optuna.trial import FrozenTrial, TrialState

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .candidates import OK, PRUNED, Bench, BenchError, TrialOutcome
from .options import KeyResult, TuneOptions, TuningError, pick_winner, tritune_version
from .studies import (
    DUPLICATE,
    FINALIZED_ATTR,
    META_ATTR,
    OUTCOME_ATTR,
    REUSED,
    SEEDS_ATTR,
    WORKER_ATTR,
    measured_outcome,
    study_name,
)
from .timing import Timer

log = logging.getLogger("tritune.tuner")
optuna.logging.set_verbosity(optuna.logging.WARNING)

#: A config as the study knows it: its fields by name, in the space's order.
Ident = tuple[tuple[str, Any], ...]
#: A trial this process asked, with the id the backend holds it by (heartbeats).
Asked = tuple[optuna.trial.Trial, int]
Started = tuple[datetime, int]
#: Called after each recorded trial with (kernel, config, status, ms).
OnTrial = Callable[[str, dict[str, Any], str, float | None], None]

#: Winners of this key under earlier kernel versions measured first after an edit (the fastest).
EARLIER_SEEDS = 2
#: Winners of the nearest other buckets measured first at a key (see ``KeySearch._neighbour_winners``).
NEIGHBOUR_SEEDS = 3


class StudyBackend(Protocol):
    """Where a key's study lives, and what sharing it with other workers costs."""

    #: Other workers ask the study too: TPE imagines their running trials (``constant_liar``), and
    #: they tell it their results themselves.
    shared: bool
    #: How this process signs what it asks and finalizes.
    worker: str

    def sampler_seed(self, seed: int) -> int:
        """The seed of this process's sampler (workers share the seeds, not the random stream)."""
        ...

    def lock(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Held to seed the study and to finalize it (once, across every worker)."""
        ...

    def open(self, name: str, sampler: optuna.samplers.BaseSampler) -> tuple[optuna.Study, bool]:
        """The study called ``name``, and whether this call created it."""
        ...

    def sweep(self, study: optuna.Study) -> None:
        """Fail and enqueue again the trials of workers that are gone."""
        ...

    def sign(self, study: optuna.Study, trial: optuna.trial.Trial) -> int | None:
        """Hold a freshly asked trial as this worker's; ``None`` if it was released before it was signed."""
        ...

    def drop(self, trial_id: int) -> None:
        """Stop holding a trial (told, or handed back)."""
        ...

    def release(self, study: optuna.Study, asked: list[Asked]) -> None:
        """Hand trials this worker will not tell back to the study, for another worker to take."""
        ...


def _started(trial: FrozenTrial) -> Started:
    """When a trial started, the trial number breaking ties: of two running trials of one config, the
    first keeps it. (Clocks of two hosts may disagree; then both may measure it, but never neither.)"""
    return trial.datetime_start or datetime.max, trial.number


@dataclass
class Visit:
    """What one visit of a key came to."""

    done: bool
    measured: int = 0
    result: KeyResult | None = None
    #: Who finalized the key, when it was done by another worker.
    finalized: dict[str, Any] | None = None


class KeyBench:
    """A bench and the key open on it: a key is opened again only after another was."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self._open: tuple[str, str, TuningKey] | None = None

    def ready(self, search: KeySearch, default: Any) -> Bench:
        wanted = (search.spec.name, search.spec.version, search.key)
        if self._open != wanted:
            self._open = None
            try:
                self.bench.open(search.spec, search.key, search.options.seed, search.space.to_dict(default))
            except BenchError as exc:
                raise TuningError(f"{search.spec.name} {search.key}: cannot set up the problem ({exc})") from exc
            self._open = wanted
        return self.bench

    def close(self) -> None:
        self.bench.close()


class KeySearch:
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
        self.backend, self.on_trial = backend, on_trial
        self.space = spec.space
        self.key_dict = key.to_dict()
        self.limits = spec.limits(device)
        self.name = study_name(spec.name, spec.version, device.slug, triton.__version__, self.key_dict)
        #: What is known of each config: its status, its time when measured, the error when failed.
        self.times: dict[Ident, float] = {}
        self.status: dict[Ident, str] = {}
        self.errors: dict[Ident, str] = {}
        self.counts = {"measured": 0, "reused": 0, "failed": 0, "pruned": 0}
        self.distributions: dict[str, optuna.distributions.BaseDistribution] = {
            name: optuna.distributions.CategoricalDistribution(list(options))
            for name, options in self.space.dimensions.items()
        }
        #: A space of per-path members (:class:`~tritune.search_spaces.base.UnionSpace`): its paths.
        self.members: dict[str, Any] | None = getattr(self.space, "members", None)
        self.feasible = self.space.feasible(key, self.limits)
        self.exhaustive = len(self.feasible) <= options.trials
        self.rng = random.Random(backend.sampler_seed(options.seed))
        self.study: optuna.Study | None = None

    # ---- configs by name ---------------------------------------------------------------------

    def _ident(self, config: Any) -> Ident:
        return tuple(self.space.to_dict(config).items())

    def _config(self, ident: Ident) -> Any:
        return self.space.parse(dict(ident))

    def _proposal(self, params: dict[str, Any]) -> Any | None:
        """The config a proposal stands for; ``None`` for one outside its path's choices."""
        try:
            return self.space.from_proposal(params)
        except (TypeError, ValueError, KeyError):
            return None

    def _trial_ident(self, trial: FrozenTrial) -> Ident | None:
        params = trial.params or trial.system_attrs.get("fixed_params")
        config = self._proposal(params) if params else None
        return None if config is None else self._ident(config)

    # ---- what is known -----------------------------------------------------------------------

    def _record(self, config: Any, status: str, ms: float | None, error: str | None) -> None:
        ident = self._ident(config)
        values = self.space.to_dict(config)
        self.status[ident] = status
        if ms is not None:
            self.times[ident] = ms
        if error is not None:
            self.errors[ident] = error
        spec = self.spec
        self.store.record_trial(self.env_id, spec.name, spec.version, self.key_dict, values, status, ms, error)
        if status == OK:
            self.counts["measured"] += 1
        elif status == PRUNED:
            self.counts["pruned"] += 1
        else:
            self.counts["failed"] += 1
        if self.on_trial is not None:
            self.on_trial(self.spec.name, values, status, ms)

    def _refresh_table(self) -> None:
        """Take in this key's trials stored in the config DB (this environment) by anyone, ever."""
        for row in self.store.measured_trials(self.env_id, self.spec.name, self.spec.version, self.key_dict):
            try:
                ident = self._ident(self.space.parse(row.config))
            except ValueError:
                continue
            if ident in self.status:
                continue
            self.status[ident] = row.status
            if row.error is not None:
                self.errors[ident] = row.error
            if row.status == OK and row.time_ms is not None:
                self.times[ident] = row.time_ms

    def _add_stored(self, study: optuna.Study, trials: list[FrozenTrial]) -> None:
        """Add the measurements known from the config DB that the study lacks, as finished trials."""
        finished = {self._trial_ident(t) for t in trials if t.state == TrialState.COMPLETE}
        for ident, ms in list(self.times.items()):
            if ident in finished:
                continue
            params = dict(ident)
            study.add_trial(
                optuna.trial.create_trial(
                    params=params,
                    distributions={name: self.distributions[name] for name in params},
                    value=ms,
                    user_attrs={OUTCOME_ATTR: REUSED, WORKER_ATTR: "config DB"},
                )
            )
            finished.add(ident)

    def _results(self, trials: list[FrozenTrial]) -> set[Ident]:
        """Configs with a result: stored (measured or failed), or finished in the study with one."""
        found = {ident for ident, status in self.status.items() if status != PRUNED}
        for trial in trials:
            if measured_outcome(trial):
                ident = self._trial_ident(trial)
                if ident is not None:
                    found.add(ident)
        return found

    def _claimed(self, trials: list[FrozenTrial]) -> set[Ident]:
        """Configs that count against the budget: those with a result, and those running."""
        claimed = self._results(trials)
        for trial in trials:
            if trial.state == TrialState.RUNNING:
                ident = self._trial_ident(trial)
                if ident is not None:
                    claimed.add(ident)
        return claimed

    def _finalized(self, study: optuna.Study) -> dict[str, Any] | None:
        """The study's finalized mark, if it covers this search's budget."""
        mark = study.user_attrs.get(FINALIZED_ATTR)
        if not isinstance(mark, dict):
            return None
        if mark.get("exhausted") or int(mark.get("budget", 0)) >= self.options.trials:
            return mark
        return None

    # ---- the sampler and the phases ----------------------------------------------------------

    def _sampler(self, exhaustive: bool, seed: int) -> optuna.samplers.BaseSampler:
        """Random over enqueued configs for an exhaustive sweep, else multivariate TPE.

        A shared study: several workers ask it at once, so TPE imagines the running trials' results
        (``constant_liar``) instead of proposing the same config to each of them. A space of paths:
        each trial holds its own path's fields, so TPE models the groups of fields that occur together.
        """
        if exhaustive:
            return optuna.samplers.RandomSampler(seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                multivariate=True,
                group=self.members is not None,
                seed=seed,
                n_startup_trials=min(10, self.options.trials // 3),
                constant_liar=self.backend.shared,
            )

    def _polish_from(self, exhaustive: bool) -> int:
        """Trials measured before the climb from the best config starts (never, in an exhaustive sweep)."""
        budget = self.options.trials
        return budget if exhaustive else budget - int(self.options.polish * budget)

    def _room(self, spent: int, polish_from: int) -> int:
        """Trials the next batch may take: the exploration stops at the polish share, which is the climb's."""
        limit = polish_from if spent < polish_from else self.options.trials
        return max(0, min(self.options.batch_size, limit - spent))

    def _neighbours_of_best(self) -> list[Any]:
        """Feasible configs not yet seen, one field away from the fastest measured config.

        A field moves to the choice next to its current one (the choices are ordered), so a
        climb from the incumbent tries the nearest tiles, warp counts and stage depths first.
        """
        if not self.times:
            return []
        best = min(self.times, key=lambda ident: self.times[ident])
        found = []
        for config in self.space.neighbours(self._config(best)):
            if self._ident(config) in self.status:
                continue
            if self.space.infeasible_reason(config, self.key, self.limits) is None:
                found.append(config)
        return found

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

    # ---- seeds -------------------------------------------------------------------------------

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

    # ---- joining -----------------------------------------------------------------------------

    def _join(self, default: Any) -> optuna.Study:
        sampler = self._sampler(self.exhaustive, self.backend.sampler_seed(self.options.seed))
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
        self._refresh_table()
        trials = study.get_trials(deepcopy=False)
        self._add_stored(study, trials)
        present = {self._trial_ident(t) for t in trials if t.state != TrialState.FAIL or measured_outcome(t)}
        # Stored configs need no asking: measured (added above), failed, or pruned as infeasible.
        present |= set(self.status)
        # The shared start does not depend on the worker: the seeds of a single-process tune, fixed
        # by the first worker to seed the study (they include the nearest buckets' winners, which
        # a worker joining later could find more of in the DB).
        seeds = study.user_attrs.get(SEEDS_ATTR)
        if not isinstance(seeds, list):
            seeds = self._seeds(default, self.feasible, self.exhaustive, random.Random(self.options.seed))
            study.set_user_attr(SEEDS_ATTR, seeds)
        for values in seeds:
            try:
                ident = self._ident(self.space.parse(values))
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
        started = time.monotonic()
        budget = opts.trials
        polish_from = self._polish_from(self.exhaustive)
        max_asks = 20 * budget + len(self.feasible)
        asks = measured = 0
        while asks < max_asks:
            if opts.time_budget_s is not None and time.monotonic() - started > opts.time_budget_s:
                log.info("%s %s: time budget reached", self.spec.name, self.key)
                return measured, "time"
            self.backend.sweep(study)
            trials = study.get_trials(deepcopy=False)
            self._refresh_table()
            if not self.backend.shared:
                # Another tuner on the same DB may have measured configs since the last batch.
                self._add_stored(study, trials)
            claimed = self._claimed(trials)
            if len(claimed) >= budget:
                return measured, "budget"
            waiting = any(t.state == TrialState.WAITING for t in trials)
            if self.exhaustive:
                seen = claimed | set(self.status)
                unseen = [c for c in self.feasible if self._ident(c) not in seen]
                if not unseen:
                    return measured, "budget"
                if not waiting:
                    # Deferred configs (two workers backed off) come back through the queue.
                    for config in self.rng.sample(unseen, min(len(unseen), opts.batch_size)):
                        study.enqueue_trial(self.space.to_dict(config))
            elif len(claimed) >= polish_from:
                if len(self._results(trials)) < polish_from:
                    return measured, "wait"
                if not waiting:
                    # The incumbent's neighbours that nobody measures or runs.
                    for config in self._climb(self._room(len(claimed), polish_from), claimed):
                        study.enqueue_trial(self.space.to_dict(config))
            limit = polish_from if len(claimed) < polish_from else budget
            room = self._room(len(claimed), polish_from)
            queued = {self._trial_ident(t) for t in trials if t.state == TrialState.WAITING}
            pending: list[tuple[Asked, Any]] = []
            while len(pending) < room and asks < max_asks:
                asked = [self._ask(study) for _ in range(min(room - len(pending), max_asks - asks))]
                asks += len(asked)
                found, infeasible = self._sort_out(study, asked, limit)
                pending.extend(found)
                # Each infeasible proposal's place goes to an unseen feasible config, asked next; not one
                # already queued (a seed), which two workers would then ask at once.
                taken = claimed | queued | {self._ident(config) for _, config in pending}
                replaced = 0
                for _ in range(infeasible):
                    stand_in = self._stand_in(self.feasible, self.rng, taken)
                    if stand_in is None:
                        break
                    study.enqueue_trial(self.space.to_dict(stand_in))
                    taken.add(self._ident(stand_in))
                    replaced += 1
                if not replaced:
                    break
            if pending:
                measured += self._measure(study, bench, default, pending)
        return measured, "asks"

    # ---- asking and telling ------------------------------------------------------------------

    def _ask(self, study: optuna.Study) -> Asked:
        """A new trial with a proposal, held and signed by this process."""
        while True:
            with warnings.catch_warnings():
                # Optuna beats only inside optimize() and says so; shared workers beat themselves.
                warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used", UserWarning)
                trial = study.ask(self.distributions if self.members is None else None)
            try:
                if self.members is not None:
                    self._suggest_path(trial)
                trial_id = self.backend.sign(study, trial)
            except optuna.exceptions.UpdateFinishedTrialError:
                trial_id = None
            if trial_id is not None:
                return trial, trial_id
            # Released by another process before it was signed (taken for a dead worker's): not ours.
            log.warning("%s: trial %d was released before this worker signed it; asking another", self.name,
                        trial.number)  # fmt: skip

    def _suggest_path(self, trial: optuna.trial.Trial) -> None:
        """A space of paths: the path first, then that path's fields only (each with the union's choices)."""
        assert self.members is not None
        discriminant = next(iter(self.space.dimensions))
        path = trial.suggest_categorical(discriminant, list(self.space.dimensions[discriminant]))
        for name in self.members[str(path)].dimensions:
            if name != discriminant:
                trial.suggest_categorical(name, list(self.space.dimensions[name]))

    def _tell(self, study: optuna.Study, asked: Asked, outcome: str, value: float | None = None) -> None:
        trial, trial_id = asked
        self.backend.drop(trial_id)
        try:
            trial.set_user_attr(OUTCOME_ATTR, outcome)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Failed as stale meanwhile (heartbeats that did not reach the database): its retry
            # finds this result in the trials table, where it was stored first.
            log.warning("%s: trial %d was failed as stale while this worker held it", self.name, trial.number)
            return
        if value is not None:
            study.tell(trial, value, skip_if_finished=True)
        elif outcome.startswith("failed"):
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        else:
            study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)

    def _sort_out(self, study: optuna.Study, asked: list[Asked], limit: int) -> tuple[list[tuple[Asked, Any]], int]:
        """Answer what is known, leave what others hold, prune the infeasible; the rest is to be measured.

        Returns the trials to measure (as many as fit under ``limit`` claimed configs) and how many
        infeasible proposals are to be replaced.

        The study is read before the trials table, and a measuring worker stores the trial before
        telling Optuna, so of two workers asking the same config at once exactly one measures it.
        """
        mine = {trial.number for trial, _ in asked}
        trials = study.get_trials(deepcopy=False)
        self._refresh_table()
        finished: dict[Ident, float] = {}
        failed: set[Ident] = set()
        # Per config, when the first of the other workers' running trials of it started.
        running: dict[Ident, Started] = {}
        started = {trial.number: _started(trial) for trial in trials}
        for trial in trials:
            ident = self._trial_ident(trial)
            if ident is None or trial.number in mine:
                continue
            if trial.state == TrialState.COMPLETE and trial.value is not None:
                finished[ident] = min(trial.value, finished.get(ident, trial.value))
            elif measured_outcome(trial):
                failed.add(ident)
            elif trial.state == TrialState.RUNNING:
                running[ident] = min(started[trial.number], running.get(ident, started[trial.number]))
        pending = []
        taken: set[Ident] = set()
        told: set[int] = set()
        infeasible = 0
        try:
            for item in asked:
                config = self._proposal(item[0].params)
                if config is None:
                    # A value outside the proposed path's choices: no config, so nothing to store.
                    self._tell(study, item, PRUNED)
                    self.counts["pruned"] += 1
                    infeasible += 1
                    told.add(item[0].number)
                    continue
                ident = self._ident(config)
                if ident in taken:
                    self._tell(study, item, DUPLICATE)
                elif ident in self.status or ident in finished or ident in failed:
                    self._tell(study, item, REUSED, self.times.get(ident, finished.get(ident)))
                elif ident in running and running[ident] < started.get(item[0].number, (datetime.max, item[0].number)):
                    # Another worker's trial of this config started first: it measures it. (Of two
                    # running at once, exactly one backs off, so a config, the portable default
                    # included, is never left unmeasured by both.)
                    self._tell(study, item, DUPLICATE)
                else:
                    reason = self.space.infeasible_reason(config, self.key, self.limits)
                    if reason is None:
                        pending.append((item, config))
                        taken.add(ident)
                        continue
                    self._record(config, PRUNED, None, reason)
                    self._tell(study, item, PRUNED)
                    infeasible += 1
                taken.add(ident)
                told.add(item[0].number)
        except BaseException:
            self._release([item for item in asked if item[0].number not in told])
            raise
        kept = self._within_budget(study, trials, pending, limit)
        # Past the limit, nothing takes the place of an infeasible proposal.
        return kept, infeasible if len(kept) == len(pending) else 0

    def _within_budget(
        self, study: optuna.Study, trials: list[FrozenTrial], pending: list[tuple[Asked, Any]], limit: int
    ) -> list[tuple[Asked, Any]]:
        """The pending trials that fit under ``limit`` claimed configs (the key's budget, or the end of
        its exploration); the rest are told as duplicates, unmeasured.

        Workers that read the same spare budget at once each ask for it. Of the claims running
        side by side, the older trial (lower number) keeps its place: a worker counts the other
        workers' running trials that are older than its own first pending one, so of two racing
        workers exactly one backs off, and the budget is never overshot by a race.
        """
        if not pending:
            return pending
        mine = {asked[0].number for asked, _ in pending}
        first = min(mine)
        claimed = {ident for ident, status in self.status.items() if status != PRUNED}
        for trial in trials:
            if trial.number in mine:
                continue
            if measured_outcome(trial) or (trial.state == TrialState.RUNNING and trial.number < first):
                ident = self._trial_ident(trial)
                if ident is not None:
                    claimed.add(ident)
        room = max(0, limit - len(claimed))
        for asked, _ in pending[room:]:
            self._tell(study, asked, DUPLICATE)
        return pending[:room]

    # ---- measuring ---------------------------------------------------------------------------

    def _measure(self, study: optuna.Study, bench: KeyBench, default: Any, pending: list[tuple[Asked, Any]]) -> int:
        told: set[int] = set()

        def tell(index: int, result: TrialOutcome) -> None:
            item = pending[index][0]
            value = result["ms"] if result["status"] == OK else None
            self._tell(study, item, result["status"], value)
            told.add(index)

        try:
            self._measure_batch(bench.ready(self, default), [config for _, config in pending], on_result=tell)
        except BaseException:
            # Left to another worker at once, rather than after the heartbeat's grace period.
            self._release([item for index, (item, _) in enumerate(pending) if index not in told])
            raise
        return len(pending)

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

    def _release(self, items: list[Asked]) -> None:
        if self.study is not None and items:
            self.backend.release(self.study, items)

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
            self._refresh_table()
            claimed = self._claimed(trials)
            exhausted = all(self._ident(c) in claimed or self._ident(c) in self.status for c in self.feasible)
            if stop == "budget" and len(claimed) < self.options.trials and not exhausted:
                # Trials counted while running were lost and are queued again: measure them first.
                return Visit(done=False, measured=measured)
            for trial in trials:
                ident = self._trial_ident(trial)
                if trial.state == TrialState.COMPLETE and trial.value is not None and ident is not None:
                    self.times[ident] = min(trial.value, self.times.get(ident, trial.value))
            # Results this process did not measure itself: stored by earlier runs or other workers.
            own = self.counts["measured"] + self.counts["failed"]
            self.counts["reused"] = max(0, len(self._results(trials)) - own)
            try:
                result = self._finish(bench.ready(self, default), default)
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
                },
            )
        return Visit(done=True, measured=measured, result=result)

    def _finish(self, bench: Bench, default: Any) -> KeyResult:
        """Re-time the best, the runner-up and the portable default; offer the fastest to the DB."""
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
            retimed = bench.retime([dict(ident) for ident in contenders], self.options.final_rounds)
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
        best = self.space.to_dict(self._config(winner))
        best_ms, portable_ms = timed[winner], timed[default_ident]
        record = WinnerRecord(
            kernel=self.spec.name,
            kernel_version=self.spec.version,
            gpu=self.device.slug,
            key=self.key_dict,
            config=best,
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
            config=best,
            best_ms=best_ms,
            portable_ms=portable_ms,
            measured=self.counts["measured"],
            reused=self.counts["reused"],
            failed=self.counts["failed"],
            pruned=self.counts["pruned"],
            notes=notes,
        )

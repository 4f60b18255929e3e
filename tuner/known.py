"""What is known of one key's configs, by field name: status, time and error, and the DB's record.

A config is known by its fields' names and values in the space's order (its ident), never by
position, so a space of paths (:class:`~tritune.search_spaces.base.UnionSpace`), whose configs hold
different fields, is known the same way as a flat one. The config DB's trials table is the record:
every trial is written there as soon as it is measured, and what others stored is read back.

A stored trial that timed out under a shorter trial timeout than this search's (``timed out after
N s``, e.g. from an online tune's short timeout) is not a verdict on the config: it is measured
again, and its new result replaces the stored row. So is a stored death of the worker by a signal
sent from outside (``worker died with exit code -9 (SIGKILL)``, the OOM killer's) that was not tried
again in a fresh worker (:func:`~.worker.external_death`; a candidate killed twice is a verdict).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tritune.configs_db.store import ConfigStore
from tritune.kernels.spec import KernelSpec

from .candidates import FAILED_RUNTIME, OK, PRUNED
from .studies import OUTCOME_ATTR, REUSED, WORKER_ATTR, measured_outcome
from .worker import external_death

__all__ = ["Ident", "Known", "OnTrial"]

#: A config as the study knows it: its fields by name, in the space's order.
Ident = tuple[tuple[str, Any], ...]
#: Called after each recorded trial with (kernel, config, status, ms).
OnTrial = Callable[[str, dict[str, Any], str, float | None], None]

#: How a worker's kill of a candidate that ran past the trial timeout reads in the trials table
#: (``tuner.worker``: "timed out after 120 s").
_TIMED_OUT = re.compile(r"timed out after ([0-9][0-9.e+-]*) s")


def timed_out_after(status: str, error: str | None) -> float | None:
    """The trial timeout a stored trial was killed at, in seconds; ``None`` for any other outcome."""
    if status != FAILED_RUNTIME or error is None:
        return None
    match = _TIMED_OUT.search(error)
    if match is None:
        return None
    try:
        return float(match.group(1))
    except ValueError:
        return None


class Known:
    """One key's configs as far as this process knows them (see the module docstring)."""

    def __init__(
        self,
        spec: KernelSpec[Any, Any],
        key_dict: dict[str, Any],
        store: ConfigStore,
        env_id: int,
        on_trial: OnTrial | None = None,
        *,
        trial_timeout_s: float | None = None,
    ) -> None:
        self.spec, self.space, self.key_dict = spec, spec.space, key_dict
        self.store, self.env_id, self.on_trial = store, env_id, on_trial
        #: This search's trial timeout (``None``: none): stored timeouts shorter than it are retried.
        self.trial_timeout_s = trial_timeout_s
        #: Configs whose stored row is a shorter timeout or an external kill: their new result replaces it.
        self.retried: set[Ident] = set()
        self.times: dict[Ident, float] = {}
        self.status: dict[Ident, str] = {}
        self.errors: dict[Ident, str] = {}
        #: Trials this process measured, found failed or pruned; and results it took from others.
        self.counts = {"measured": 0, "reused": 0, "failed": 0, "pruned": 0}
        #: The sampler's view: every field of the space with its choices.
        self.distributions: dict[str, optuna.distributions.BaseDistribution] = {
            name: optuna.distributions.CategoricalDistribution(list(options))
            for name, options in self.space.dimensions.items()
        }

    # ---- configs by name ---------------------------------------------------------------------

    def ident(self, config: Any) -> Ident:
        return tuple(self.space.to_dict(config).items())

    def config(self, ident: Ident) -> Any:
        return self.space.parse(dict(ident))

    def proposal(self, params: dict[str, Any]) -> Any | None:
        """The config a proposal stands for; ``None`` for one outside its path's choices."""
        try:
            return self.space.from_proposal(params)
        except (TypeError, ValueError, KeyError):
            return None

    def trial_ident(self, trial: FrozenTrial) -> Ident | None:
        """The config a trial stands for (an enqueued one carries it before its params are set)."""
        params = trial.params or trial.system_attrs.get("fixed_params")
        config = self.proposal(params) if params else None
        return None if config is None else self.ident(config)

    # ---- the record --------------------------------------------------------------------------

    def record(self, config: Any, status: str, ms: float | None, error: str | None) -> None:
        """Know a trial's outcome, and store it in the config DB at once (a killed run loses nothing)."""
        ident = self.ident(config)
        values = self.space.to_dict(config)
        self.status[ident] = status
        if ms is not None:
            self.times[ident] = ms
        if error is not None:
            self.errors[ident] = error
        spec = self.spec
        if ident in self.retried:
            self.retried.discard(ident)
            self._forget_timeout(values)
        self.store.record_trial(self.env_id, spec.name, spec.version, self.key_dict, values, status, ms, error)
        if status == OK:
            self.counts["measured"] += 1
        elif status == PRUNED:
            self.counts["pruned"] += 1
        else:
            self.counts["failed"] += 1
        if self.on_trial is not None:
            self.on_trial(spec.name, values, status, ms)

    def refresh(self) -> None:
        """Take in this key's trials stored in the config DB (this environment) by anyone, ever."""
        for row in self.store.measured_trials(self.env_id, self.spec.name, self.spec.version, self.key_dict):
            try:
                ident = self.ident(self.space.parse(row.config))
            except ValueError:
                continue
            if ident in self.status:
                continue
            if self._retryable(row.status, row.error):
                self.retried.add(ident)
                continue
            self.status[ident] = row.status
            if row.error is not None:
                self.errors[ident] = row.error
            if row.status == OK and row.time_ms is not None:
                self.times[ident] = row.time_ms

    def _retryable(self, status: str, error: str | None) -> bool:
        """Whether a stored trial timed out under a shorter trial timeout than this search's, or its
        worker was killed from outside once (both say little of the config)."""
        if status == FAILED_RUNTIME and error is not None and external_death(error):
            return True
        after = timed_out_after(status, error)
        return after is not None and (self.trial_timeout_s is None or after < self.trial_timeout_s)

    def _forget_timeout(self, values: dict[str, Any]) -> None:
        """Delete the stored timeout or kill of a config measured again (the trials table keeps one row per config)."""
        from sqlalchemy import delete

        from tritune.configs_db.models import Trial
        from tritune.configs_db.values import canonical_json

        spec = self.spec
        with self.store.engine.begin() as connection:
            connection.execute(
                delete(Trial).where(
                    Trial.environment_id == self.env_id,
                    Trial.kernel == spec.name,
                    Trial.kernel_version == spec.version,
                    Trial.key_json == canonical_json(self.key_dict),
                    Trial.config_json == canonical_json(values),
                    Trial.status == FAILED_RUNTIME,
                )
            )

    def add_stored(self, study: optuna.Study, trials: list[FrozenTrial]) -> None:
        """Add the measurements known from the config DB that the study lacks, as finished trials."""
        finished = {self.trial_ident(t) for t in trials if t.state == TrialState.COMPLETE}
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

    # ---- the budget --------------------------------------------------------------------------

    def results(self, trials: list[FrozenTrial]) -> set[Ident]:
        """Configs with a result: stored (measured or failed), or finished in the study with one."""
        found = {ident for ident, status in self.status.items() if status != PRUNED}
        for trial in trials:
            if measured_outcome(trial):
                ident = self.trial_ident(trial)
                if ident is not None:
                    found.add(ident)
        return found

    def claimed(self, trials: list[FrozenTrial]) -> set[Ident]:
        """Configs that count against the budget: those with a result, and those running."""
        claimed = self.results(trials)
        for trial in trials:
            if trial.state == TrialState.RUNNING:
                ident = self.trial_ident(trial)
                if ident is not None:
                    claimed.add(ident)
        return claimed

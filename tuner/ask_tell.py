"""Asking and telling: the study's proposals sorted out before anything is measured, and outcomes told back.

:class:`AskTell` is the half of :class:`~.search.KeySearch` that talks to the study trial by
trial (Optuna's ask-and-tell interface). A proposal is asked and signed by this process; before
anything is measured, what is known is answered from its result, a config another worker's
earlier trial holds is left to it, an infeasible proposal (or one outside its path's choices) is
pruned with the rule's reason, and what would overshoot the budget is told as a duplicate. The
order of these reads (the study before the trials table) and the start-time rule make sure that
of two workers asking one config at once exactly one measures it.
"""

from __future__ import annotations

import logging
import warnings
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tritune.kernels.spec import TuningKey
from tritune.search_spaces.base import SearchSpace, TargetLimits

from .backend import Asked, StudyBackend
from .candidates import PRUNED
from .known import Ident, Known
from .strategy import Strategy
from .studies import DUPLICATE, OUTCOME_ATTR, REUSED, measured_outcome

log = logging.getLogger("tritune.tuner")

Started = tuple[datetime, int]


def _started(trial: FrozenTrial) -> Started:
    """When a trial started, the trial number breaking ties: of two running trials of one config, the
    first keeps it. (Clocks of two hosts may disagree; then both may measure it, but never neither.)"""
    return trial.datetime_start or datetime.max, trial.number


class AskTell:
    """Asking the study for proposals, sorting them out and telling it outcomes.

    A base of :class:`~.search.KeySearch`, which sets the attributes annotated here.
    """

    known: Known
    backend: StudyBackend
    strategy: Strategy
    space: SearchSpace[Any, Any]
    key: TuningKey
    limits: TargetLimits
    #: The study's name, in log lines.
    name: str
    study: optuna.Study | None

    def _ask(self, study: optuna.Study) -> Asked:
        """A new trial with a proposal, held and signed by this process."""
        while True:
            with warnings.catch_warnings():
                # Optuna beats only inside optimize() and says so; shared workers beat themselves.
                warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used", UserWarning)
                trial = study.ask(self.known.distributions if self.strategy.members is None else None)
            try:
                if self.strategy.members is not None:
                    self.strategy.suggest(trial)
                trial_id = self.backend.sign(study, trial)
            except optuna.exceptions.UpdateFinishedTrialError:
                trial_id = None
            if trial_id is not None:
                return trial, trial_id
            # Released by another process before it was signed (taken for a dead worker's): not ours.
            log.warning("%s: trial %d was released before this worker signed it; asking another", self.name,
                        trial.number)  # fmt: skip

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
        self.known.refresh()
        finished: dict[Ident, float] = {}
        failed: set[Ident] = set()
        # Per config, when the first of the other workers' running trials of it started.
        running: dict[Ident, Started] = {}
        started = {trial.number: _started(trial) for trial in trials}
        for trial in trials:
            ident = self.known.trial_ident(trial)
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
                config = self.known.proposal(item[0].params)
                if config is None:
                    # A value outside the proposed path's choices: no config, so nothing to store.
                    self._tell(study, item, PRUNED)
                    self.known.counts["pruned"] += 1
                    infeasible += 1
                    told.add(item[0].number)
                    continue
                ident = self.known.ident(config)
                if ident in taken:
                    self._tell(study, item, DUPLICATE)
                elif ident in self.known.status or ident in finished or ident in failed:
                    self._tell(study, item, REUSED, self.known.times.get(ident, finished.get(ident)))
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
                    self.known.record(config, PRUNED, None, reason)
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
        claimed = {ident for ident, status in self.known.status.items() if status != PRUNED}
        for trial in trials:
            if trial.number in mine:
                continue
            if measured_outcome(trial) or (trial.state == TrialState.RUNNING and trial.number < first):
                ident = self.known.trial_ident(trial)
                if ident is not None:
                    claimed.add(ident)
        room = max(0, limit - len(claimed))
        for asked, _ in pending[room:]:
            self._tell(study, asked, DUPLICATE)
        return pending[:room]

    def _release(self, items: list[Asked]) -> None:
        if self.study is not None and items:
            self.backend.release(self.study, items)

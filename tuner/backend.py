"""What the search loop (:mod:`.search`) needs from where its study lives, and from its bench.

A :class:`StudyBackend` keeps one key's Optuna study: in this process's memory for a lone tuner
(:class:`.study.LocalStudy`), or in a storage several workers share, with heartbeats and a lock
across processes (:class:`.shared.SharedStudy`). The loop is the same over both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import optuna

from tritune.kernels.spec import KernelSpec, TuningKey

from .candidates import Bench, BenchError
from .options import KeyResult, TuningError

__all__ = ["Asked", "KeyBench", "StudyBackend", "Visit"]

#: A trial this process asked, with the id the backend holds it by (heartbeats).
Asked = tuple[optuna.trial.Trial, int]


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

    def ready(self, spec: KernelSpec[Any, Any], key: TuningKey, seed: int, default: dict[str, Any]) -> Bench:
        """The bench with ``key``'s problems built (``default``: the portable config, by name)."""
        wanted = (spec.name, spec.version, key)
        if self._open != wanted:
            self._open = None
            try:
                self.bench.open(spec, key, seed, default)
            except BenchError as exc:
                raise TuningError(f"{spec.name} {key}: cannot set up the problem ({exc})") from exc
            self._open = wanted
        return self.bench

    def close(self) -> None:
        self.bench.close()

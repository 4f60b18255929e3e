"""Which configs a key's search asks besides the sampler's own: seeds, stand-ins and the climb.

The search loop (:mod:`.search`) asks the sampler in batches; this module decides what goes
before and around its proposals:

- the seeds, enqueued before anything is proposed: the portable default, the key's stored winner
  (in the DB or the bundle shipped for this GPU; one tuned under other Triton or torch versions,
  which serves provisionally, counts), the winner at the spec's fallback key (an opt-in key's
  accurate twin, whose winner serves the key until it has its own), its winners under earlier
  kernel versions, the nearest other GPUs' bundled winners at this key where this GPU's bundle
  has none (:mod:`tritune.kernels.prior`), the winners of the nearest tuned buckets, the spec's
  starting configs, then a seeded sample of feasible configs (all of them when they fit the
  budget: an exhaustive sweep). The seeds are capped at the exploration share of the trials, so
  their order decides which a short tune measures: this key's winner on a GPU of the same kind
  comes before other keys' winners on this one (a path that wins on the other GPU, such as an
  opt-in key's fp8 path, would otherwise never be measured in a five-trial tune);
- a stand-in for each infeasible proposal: a random unseen feasible config;
- the climb: the last ``polish`` share of the budget goes to the unseen feasible neighbours of the
  best config so far (one field moved to the next choice). TPE's proposals depend on its seed; two
  tunes of one key that end near the same optimum should pick it, not two of its neighbours.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Collection, Hashable
from typing import Any

import optuna

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import prior, settings
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .known import Known
from .options import TuneOptions

__all__ = ["EARLIER_SEEDS", "NEIGHBOUR_SEEDS", "Strategy"]

#: Winners of this key under earlier kernel versions measured first after an edit (the fastest).
EARLIER_SEEDS = 2
#: Winners of the nearest other buckets measured first at a key (see ``Strategy.neighbour_winners``).
NEIGHBOUR_SEEDS = 3


class Strategy:
    """The seeds, stand-ins and climb of one key's search (see the module docstring)."""

    def __init__(
        self,
        spec: KernelSpec[Any, Any],
        key: TuningKey,
        device: DeviceInfo,
        store: ConfigStore,
        options: TuneOptions,
        known: Known,
    ) -> None:
        self.spec, self.key, self.device, self.store, self.options, self.known = (
            spec,
            key,
            device,
            store,
            options,
            known,
        )
        self.space = spec.space
        self.key_dict = key.to_dict()
        self.limits = spec.limits(device)
        self.feasible = self.space.feasible(key, self.limits)
        #: Every feasible config fits the budget: enqueue them all, and no climb.
        self.exhaustive = len(self.feasible) <= options.trials
        #: A space of paths (:class:`~tritune.search_spaces.base.UnionSpace`): path -> member space.
        self.members: dict[str, Any] | None = getattr(self.space, "members", None)

    def sampler(self, seed: int, shared: bool) -> optuna.samplers.BaseSampler:
        """Random over enqueued configs for an exhaustive sweep, else multivariate TPE.

        ``shared``: several workers ask the study at once, so TPE imagines the running trials'
        results (``constant_liar``) instead of proposing the same config to each of them. A space of
        paths: each trial holds its own path's fields, so TPE models the groups of fields that occur
        together (``group``).
        """
        if self.exhaustive:
            return optuna.samplers.RandomSampler(seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                multivariate=True,
                group=self.members is not None,
                seed=seed,
                n_startup_trials=min(10, self.options.trials // 3),
                constant_liar=shared,
            )

    def suggest(self, trial: optuna.trial.Trial) -> None:
        """A space of paths: the path first, then that path's fields only (each with the union's choices)."""
        assert self.members is not None
        discriminant = next(iter(self.space.dimensions))
        path = trial.suggest_categorical(discriminant, list(self.space.dimensions[discriminant]))
        for name in self.members[str(path)].dimensions:
            if name != discriminant:
                trial.suggest_categorical(name, list(self.space.dimensions[name]))

    # ---- the budget's phases -----------------------------------------------------------------

    def polish_from(self, exhaustive: bool) -> int:
        """Trials measured before the climb from the best config starts (never, in an exhaustive sweep)."""
        budget = self.options.trials
        return budget if exhaustive else budget - int(self.options.polish * budget)

    def room(self, spent: int, polish_from: int) -> int:
        """Trials the next batch may take: the exploration stops at the polish share, which is the climb's."""
        limit = polish_from if spent < polish_from else self.options.trials
        return max(0, min(self.options.batch_size, limit - spent))

    def neighbours_of_best(self) -> list[Any]:
        """Feasible configs not yet seen, one field away from the fastest measured config.

        A field moves to the choice next to its current one (the choices are ordered), so a
        climb from the incumbent tries the nearest tiles, warp counts and stage depths first.
        """
        times, status = self.known.times, self.known.status
        if not times:
            return []
        best = min(times, key=lambda ident: times[ident])
        found = []
        for config in self.space.neighbours(self.known.config(best)):
            if self.known.ident(config) in status:
                continue
            if self.space.infeasible_reason(config, self.key, self.limits) is None:
                found.append(config)
        return found

    def climb(self, slots: int, taken: Collection[Hashable] = ()) -> list[Any]:
        """The next ``slots`` configs of the climb: unseen neighbours of the best config, none in ``taken``."""
        return [c for c in self.neighbours_of_best() if self.known.ident(c) not in taken][:slots]

    def stand_in(self, rng: random.Random, taken: Collection[Hashable] = ()) -> Any | None:
        """A random unseen feasible config (none in ``taken``), asked in place of an infeasible proposal.

        TPE's proposals in a large space are often infeasible; each one's place goes to a feasible
        config, so the budget keeps measuring instead of asking the sampler over and over.
        """
        status, ident = self.known.status, self.known.ident
        unseen = [c for c in self.feasible if ident(c) not in status and ident(c) not in taken]
        return rng.choice(unseen) if unseen else None

    # ---- seeds -------------------------------------------------------------------------------

    def seeds(self, default: Any, feasible: list[Any], exhaustive: bool, rng: random.Random) -> list[dict[str, Any]]:
        """Configs enqueued before the sampler proposes any: portable default, stored winner (DB or
        shipped bundle, provisional ones included) and the kernel's variants of it, the winner at
        the spec's fallback key (what serves this key until it has its own), the key's winner under
        an earlier kernel version, other GPUs' winners at this key (the prior), the winners of the
        nearest tuned buckets (DB, then shipped bundle) and the spec's starting configs first."""
        seeds = [self.space.to_dict(default)]
        stored = self.store.winners(gpu=self.device.slug, kernel=self.spec.name)
        winners = [w for w in stored if w.kernel_version == self.spec.version]
        own = [w.config for w in winners if w.key == self.key_dict] + self.bundled_winner()
        seeds.extend(own)
        seeds.extend(self.winner_variants(own))
        seeds.extend(self.fallback_winners(winners))
        seeds.extend(self.earlier_winners(stored + self._shipped(any_version=True)))
        seeds.extend(prior.seed_configs(self.spec, self.key, self.device))
        seeds.extend(self.neighbour_winners(winners + self.bundled_winners(winners)))
        seeds.extend(self.space.to_dict(config) for config in self.spec.starting_configs(self.key, self.device))
        # Each seed once, and only feasible ones: a duplicate or an infeasible seed would take the
        # place of one of the sample's below the cap.
        seeds = self._usable(seeds)
        if exhaustive:
            seeds.extend(self.space.to_dict(config) for config in feasible)
            return seeds
        # TPE's random start-up draws from the whole product, mostly infeasible for large
        # spaces: start it from a seeded sample of feasible configs instead.
        wanted = max(1, self.options.trials // 3)
        # Drawn with room for the seeds it may meet, which it skips (the space may be large).
        drawn = map(self.space.to_dict, rng.sample(feasible, min(len(feasible), wanted + len(seeds))))
        seeds.extend([values for values in drawn if values not in seeds][:wanted])
        # Queued seeds are asked before anything else, the climb's configs included: at most the
        # exploration share of them (the portable default always), the random sample dropped first.
        return seeds[: max(1, self.polish_from(exhaustive))]

    def _usable(self, seeds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``seeds`` in order, each once (as the space writes it) and only those feasible at this key;
        the portable default stays first."""
        found: list[dict[str, Any]] = []
        for index, values in enumerate(seeds):
            try:
                config = self.space.parse(values)
            except (TypeError, ValueError):
                continue
            if index and self.space.infeasible_reason(config, self.key, self.limits) is not None:
                continue
            normal = self.space.to_dict(config)
            if normal not in found:
                found.append(normal)
        return found

    def winner_variants(self, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The kernel's variants of this key's stored winners (:meth:`KernelSpec.winner_variants`),
        feasible here: a re-tune seeded from the winners measures them before any sample."""
        found: list[dict[str, Any]] = []
        for values in own:
            try:
                config = self.space.parse(values)
            except (TypeError, ValueError):
                continue
            for variant in self.spec.winner_variants(config, self.key, self.device):
                if self.space.infeasible_reason(variant, self.key, self.limits) is None:
                    variant_values = self.space.to_dict(variant)
                    if variant_values not in found and variant_values not in own:
                        found.append(variant_values)
        return found

    def fallback_winners(self, winners: list[WinnerRecord]) -> list[dict[str, Any]]:
        """The winner stored (DB, then shipped bundle) at the spec's fallback key for this key, if
        it parses and is feasible here.

        The fallback key's winner is what serves a key without one of its own (an opt-in key's
        accurate twin: the accurate winner serves under the opt-in too), so a first tune of the
        key starts from the config it has to beat.
        """
        fallback = self.spec.fallback_key(self.key)
        if fallback is None or fallback == self.key:
            return []
        fallback_dict = fallback.to_dict()
        found: list[dict[str, Any]] = []
        candidates = [w.config for w in winners if w.key == fallback_dict] + self.bundled_winner(fallback_dict)
        for values in candidates:
            try:
                config = self.space.parse(values)
            except (TypeError, ValueError):
                continue
            values = self.space.to_dict(config)
            if values not in found and self.space.infeasible_reason(config, self.key, self.limits) is None:
                found.append(values)
        return found

    def bundled_winners(self, stored: list[WinnerRecord]) -> list[WinnerRecord]:
        """The shipped bundle's winners of this kernel version at keys ``stored`` (the DB's) has no
        winner for: a first tune into an empty DB still starts from the bundle's nearest buckets."""
        held = [w.key for w in stored]
        return [r for r in self._shipped() if r.key not in held]

    def _shipped(self, any_version: bool = False) -> list[WinnerRecord]:
        """This kernel's winners in the bundle shipped for this GPU, of this kernel version unless
        ``any_version``; none with bundles disabled."""
        if settings.settings().disable_bundles:
            return []
        records, _rejections = prior.shipped_records(self.device.slug)
        current = self.spec.version
        return [r for r in records if r.kernel == self.spec.name and (any_version or r.kernel_version == current)]

    def bundled_winner(self, key_dict: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The winner the bundle shipped for this GPU holds at this key (or ``key_dict``) and kernel
        version, if it parses and is feasible here: it serves (provisionally where its Triton or
        torch differ) until a tune stores one in the DB, so a re-tune starts from it."""
        key_dict = self.key_dict if key_dict is None else key_dict
        found: list[dict[str, Any]] = []
        for record in self._shipped():
            if record.key != key_dict:
                continue
            try:
                config = self.space.parse(record.config)
            except (TypeError, ValueError):
                continue
            if self.space.infeasible_reason(config, self.key, self.limits) is None:
                found.append(self.space.to_dict(config))
        return found

    def earlier_winners(self, stored: list[WinnerRecord]) -> list[dict[str, Any]]:
        """This key's winners stored (DB or shipped bundle) under other kernel versions that still
        parse and are feasible, fastest first, at most ``EARLIER_SEEDS`` distinct configs.

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

    def neighbour_winners(self, winners: list[WinnerRecord]) -> list[dict[str, Any]]:
        """Winners of the nearest other buckets of this key's group that are feasible here, nearest
        first (the DB's, and the shipped bundle's where the DB has none at a key).

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

"""The tuning loop on a small real kernel with a fake timer: gate, prune, store, resume."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import toy_kernel

from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.kernels.device import device_info
from tritune.tuner.study import KeyTuner, TuneOptions, TuningError, environment_id
from tritune.tuner.timing import FakeTimer

CPU = device_info("cpu")
SPEC = toy_kernel.SPEC


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")


def cost(config) -> float:
    """Bigger blocks are faster; two warps best; the broken config would be fastest of all."""
    if config.BROKEN:
        return 0.01
    return 10.0 / config.BLOCK + (0.0 if config.num_warps == 2 else 0.05)


def _tuner(store: ConfigStore, trials: int, timer: FakeTimer | None = None, n: int = 256) -> KeyTuner:
    key = SPEC.default_keys(CPU, n=[n])[0]
    return KeyTuner(
        SPEC,
        key,
        CPU,
        torch.device("cpu"),
        store,
        environment_id(store, CPU),
        timer or FakeTimer(cost),
        TuneOptions(trials=trials, seed=1, batch=4, final_rounds=1),
    )


def test_exhaustive_sweep_finds_best_correct_config(tmp_path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    result = _tuner(store, trials=40).run()
    assert result.config == {"BLOCK": 128, "BROKEN": False, "num_warps": 2}
    assert result.portable_ms == pytest.approx(cost(SPEC.space.default()))
    assert result.speedup == pytest.approx(cost(SPEC.space.default()) / cost(toy_kernel.ToyConfig(128, False, 2)))
    key = SPEC.default_keys(CPU, n=[256])[0].to_dict()
    rows = store.measured_trials(environment_id(store, CPU), SPEC.name, SPEC.version, key)
    statuses = {}
    for row in rows:
        statuses.setdefault(row.status, []).append(row)
    # Every broken config failed the correctness gate and none of them won.
    assert {r.config["BROKEN"] for r in statuses["failed-correctness"]} == {True}
    assert all("max error" in (r.error or "") for r in statuses["failed-correctness"])
    assert all(not r.config["BROKEN"] for r in statuses["ok"])
    # Exhaustive over the feasible space: each config measured exactly once.
    assert len(rows) == len({tuple(r.config.items()) for r in rows}) == len(SPEC.space.feasible(None, None))
    winners = store.winners(gpu=CPU.slug, kernel=SPEC.name)
    assert len(winners) == 1 and winners[0].config == result.config and winners[0].speedup > 1


def test_resume_does_not_measure_again(tmp_path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    first = FakeTimer(cost)
    _tuner(store, trials=6, timer=first).run()
    key = SPEC.default_keys(CPU, n=[256])[0].to_dict()
    env = environment_id(store, CPU)
    measured_before = {tuple(r.config.items()) for r in store.measured_trials(env, SPEC.name, SPEC.version, key)}
    assert 6 <= len(measured_before) < 22

    second = FakeTimer(cost)
    _tuner(store, trials=40, timer=second).run()
    rows = store.measured_trials(env, SPEC.name, SPEC.version, key)
    configs = [tuple(r.config.items()) for r in rows]
    assert len(configs) == len(set(configs)), "a config was measured twice"
    new_ok = [r for r in rows if r.status == "ok" and tuple(r.config.items()) not in measured_before]
    # The second run timed only new configs (plus the final re-timing of winner, runner-up and portable).
    assert second.calls <= len(new_ok) + 3


def test_trial_budget_with_tpe(tmp_path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    result = _tuner(store, trials=5).run()
    assert result.measured + result.failed <= 5
    assert result.portable_ms > 0


def test_failing_portable_default_is_an_error(tmp_path, monkeypatch):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    monkeypatch.setattr(SPEC, "default_config", lambda key: toy_kernel.ToyConfig(BROKEN=True))
    with pytest.raises(TuningError, match="portable default failed"):
        _tuner(store, trials=3).run()


def test_stored_pruned_trials_do_not_spend_the_budget(tmp_path):
    """A resumed study gets its whole budget of measurements, however many pruned rows it finds."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = SPEC.default_keys(CPU, n=[256])[0]
    env = environment_id(store, CPU)
    for broken in (False, True):
        infeasible = {"BLOCK": 128, "BROKEN": broken, "num_warps": 1}
        store.record_trial(env, SPEC.name, SPEC.version, key.to_dict(), infeasible, "pruned", None, "too big")
    result = _tuner(store, trials=6).run()
    assert result.reused == 0
    assert result.measured + result.failed == 6


def test_polish_measures_the_unseen_neighbours_of_the_best_config(tmp_path):
    """One field moved to the next choice, infeasible and already-seen configs left out."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    tuner = _tuner(store, trials=4)

    def ident(block: int, broken: bool, warps: int):
        return tuner.known.ident(toy_kernel.ToyConfig(block, broken, warps))

    best = ident(64, False, 1)
    assert best == (("BLOCK", 64), ("BROKEN", False), ("num_warps", 1)), "configs are known by field name"
    tuner.known.times = {best: 1.0, ident(32, False, 4): 2.0}
    tuner.known.status = {best: "ok", ident(32, False, 4): "ok", ident(32, False, 1): "failed-runtime"}
    neighbours = {(c.BLOCK, c.BROKEN, c.num_warps) for c in tuner.strategy.neighbours_of_best()}
    # BLOCK 32 was seen; BLOCK 128 with one warp is infeasible; num_warps has one neighbour of 1.
    assert neighbours == {(64, True, 1), (64, False, 2)}


@pytest.mark.parametrize("seed", range(12))
def test_polish_makes_seeds_agree_on_the_best_config(tmp_path, seed):
    """12 of 23 feasible configs: TPE alone ends away from the optimum for some of these seeds
    (3 of the 12 with Optuna 4-5); climbing from the incumbent for the last half reaches it."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = SPEC.default_keys(CPU, n=[256])[0]
    options = TuneOptions(trials=12, seed=seed, batch=2, final_rounds=1, polish=0.5)
    result = KeyTuner(
        SPEC, key, CPU, torch.device("cpu"), store, environment_id(store, CPU), FakeTimer(cost), options
    ).run()
    assert result.config == {"BLOCK": 128, "BROKEN": False, "num_warps": 2}


def _favouring(block: int, warps: int):
    """A fake cost with its optimum at one (BLOCK, num_warps), away from the portable default."""

    def fake(config) -> float:
        if config.BROKEN:
            return 0.01
        return 1.0 + abs(config.BLOCK - block) / 16 + abs(config.num_warps - warps)

    return fake


def test_nearest_buckets_winners_are_measured_first(tmp_path):
    """After the portable default: the winners of the nearest tuned buckets of the key's group,
    nearest first; a winner of another group (another dtype) is not one of them."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    options = TuneOptions(trials=40, seed=1, batch=4, final_rounds=1)  # exhaustive: exact winners
    near, far, other_group = (
        toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 128),
        toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 8192),
        toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float16", 512),
    )
    for key, block, warps in ((far, 64, 4), (near, 16, 1), (other_group, 128, 2)):
        timer = FakeTimer(_favouring(block, warps))
        KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, timer, options).run()
    winners = {(w.key["n_bucket"], w.key["dtype"]): w.config for w in store.winners(kernel=SPEC.name)}
    assert winners[(128, "float32")] == {"BLOCK": 16, "BROKEN": False, "num_warps": 1}
    assert winners[(8192, "float32")] == {"BLOCK": 64, "BROKEN": False, "num_warps": 4}

    seen: list[dict] = []
    target = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 512)
    quick = TuneOptions(trials=4, seed=1, batch=4, final_rounds=1)
    KeyTuner(
        SPEC, target, CPU, torch.device("cpu"), store, env, FakeTimer(cost), quick,
        on_trial=lambda kernel, config, status, ms: seen.append(config),
    ).run()  # fmt: skip
    assert seen[:3] == [
        SPEC.space.to_dict(SPEC.space.default()),
        winners[(128, "float32")],
        winners[(8192, "float32")],
    ]
    assert {"BLOCK": 128, "BROKEN": False, "num_warps": 2} not in seen[:3]


def test_a_neighbour_winner_equal_to_the_keys_own_takes_no_seed_slot(tmp_path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    options = TuneOptions(trials=40, seed=1, batch=4, final_rounds=1)  # exhaustive: exact winners
    target = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 512)
    for n_bucket, block, warps in ((128, 16, 1), (8192, 64, 4), (512, 16, 1)):
        key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket)
        KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, FakeTimer(_favouring(block, warps)), options).run()
    tuner = KeyTuner(SPEC, target, CPU, torch.device("cpu"), store, env, FakeTimer(cost), options)
    # The nearest bucket's winner is the key's own (seeded already): the next one comes instead.
    next_nearest = {"BLOCK": 64, "BROKEN": False, "num_warps": 4}
    assert tuner.strategy.neighbour_winners(store.winners(kernel=SPEC.name)) == [next_nearest]


def test_a_key_is_seeded_with_its_fallback_keys_winner(tmp_path, monkeypatch):
    """A key whose spec names a fallback key (an opt-in key's accurate twin) is measured from the
    fallback key's winner, which serves it until it has its own, right after the portable default;
    a key without a fallback is not."""
    monkeypatch.setattr(
        SPEC, "fallback_key", lambda key: dataclasses.replace(key, dtype="float32") if key.dtype != "float32" else None
    )
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    exhaustive = TuneOptions(trials=40, seed=1, batch=4, final_rounds=1)
    accurate = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 256)
    KeyTuner(SPEC, accurate, CPU, torch.device("cpu"), store, env, FakeTimer(_favouring(16, 1)), exhaustive).run()
    winner = {"BLOCK": 16, "BROKEN": False, "num_warps": 1}
    assert [w.config for w in store.winners(kernel=SPEC.name)] == [winner]

    seen: list[dict] = []
    quick = TuneOptions(trials=4, seed=1, batch=4, final_rounds=1)
    opt_in = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float16", 256)
    KeyTuner(
        SPEC, opt_in, CPU, torch.device("cpu"), store, env, FakeTimer(cost), quick,
        on_trial=lambda kernel, config, status, ms: seen.append(config),
    ).run()  # fmt: skip
    assert seen[:2] == [SPEC.space.to_dict(SPEC.space.default()), winner]
    # Another bucket of the accurate key's own group has no fallback: the winner reaches it as a
    # neighbour's, never as a fallback's.
    other = KeyTuner(SPEC, dataclasses.replace(accurate, n_bucket=512), CPU, torch.device("cpu"), store, env,
                     FakeTimer(cost), quick)  # fmt: skip
    assert other.strategy.fallback_winners(store.winners(kernel=SPEC.name)) == []


def test_a_stored_winners_variants_are_seeded_right_after_it(tmp_path, monkeypatch):
    """A re-tune seeded from the stored winner measures the kernel's variants of it (a new option's
    twin) next, before any sample; infeasible variants and the winner itself are not repeated."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 256)
    exhaustive = TuneOptions(trials=40, seed=1, batch=4, final_rounds=1)
    KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, FakeTimer(_favouring(16, 1)), exhaustive).run()
    winner = toy_kernel.ToyConfig(BLOCK=16, BROKEN=False, num_warps=1)
    monkeypatch.setattr(
        SPEC,
        "winner_variants",
        lambda config, key, device: [
            dataclasses.replace(config, num_warps=4),
            dataclasses.replace(config, BLOCK=256),  # infeasible here: never seeded
            config,
        ],
        raising=False,
    )
    monkeypatch.setattr(SPEC.space, "infeasible_reason", lambda c, k, lim: "too big" if c.BLOCK > 128 else None)
    tuner = KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, FakeTimer(cost), TuneOptions(trials=12, seed=1))
    default = SPEC.space.default()
    seeds = tuner.strategy.seeds(default, [default], exhaustive=False, rng=random.Random(0))
    as_dict = SPEC.space.to_dict
    assert seeds[:3] == [as_dict(default), as_dict(winner), {"BLOCK": 16, "BROKEN": False, "num_warps": 4}]
    assert {"BLOCK": 256, "BROKEN": False, "num_warps": 1} not in seeds


def test_seeds_leave_the_climb_its_share(tmp_path, monkeypatch):
    """Queued seeds are asked before the climb's configs: at most the exploration share of the budget,
    however many starting configs and neighbour winners there are (the portable default first)."""
    starts = [toy_kernel.ToyConfig(BLOCK=b, BROKEN=False, num_warps=w) for b in (16, 64) for w in (1, 2)]
    monkeypatch.setattr(SPEC, "starting_configs", lambda key, device: starts, raising=False)
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    for trials in (4, 10, 16):
        tuner = _tuner(store, trials)
        feasible = SPEC.space.feasible(tuner.key, tuner.limits)
        seeds = tuner.strategy.seeds(SPEC.space.default(), feasible, False, random.Random(0))
        assert 1 <= len(seeds) <= tuner.strategy.polish_from(False) < trials
        assert seeds[0] == SPEC.space.to_dict(SPEC.space.default())


def test_spec_starting_configs_are_measured_first(tmp_path, monkeypatch):
    """A spec's starting configs join the portable default at the front of the study."""
    start = toy_kernel.ToyConfig(BLOCK=16, BROKEN=False, num_warps=1)
    monkeypatch.setattr(SPEC, "starting_configs", lambda key, device: [start], raising=False)
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    seen: list[dict] = []
    key = SPEC.default_keys(CPU, n=[256])[0]
    options = TuneOptions(trials=3, seed=1, batch=2, final_rounds=1)
    KeyTuner(
        SPEC, key, CPU, torch.device("cpu"), store, environment_id(store, CPU), FakeTimer(cost), options,
        on_trial=lambda kernel, config, status, ms: seen.append(config),
    ).run()  # fmt: skip
    assert seen[:2] == [SPEC.space.to_dict(SPEC.space.default()), SPEC.space.to_dict(start)]


def test_a_winner_of_an_earlier_kernel_version_is_seeded_and_measured_again(tmp_path, monkeypatch):
    """After a kernel edit the key's old winner is tried second (after the portable default) and
    re-measured; until then it never serves, and it never enters as a neighbour of another key."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    key = SPEC.default_keys(CPU, n=[256])[0]
    exhaustive = TuneOptions(trials=40, seed=1, batch=4, final_rounds=1)
    KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, FakeTimer(_favouring(16, 1)), exhaustive).run()
    old = {"BLOCK": 16, "BROKEN": False, "num_warps": 1}
    assert [w.config for w in store.winners(kernel=SPEC.name)] == [old]

    monkeypatch.setattr(SPEC, "version", "edited0000000000")
    seen: list[dict] = []
    quick = TuneOptions(trials=4, seed=1, batch=4, final_rounds=1)
    KeyTuner(
        SPEC, key, CPU, torch.device("cpu"), store, env, FakeTimer(cost), quick,
        on_trial=lambda kernel, config, status, ms: seen.append(config),
    ).run()  # fmt: skip
    assert seen[:2] == [SPEC.space.to_dict(SPEC.space.default()), old]
    # Re-measured under the new version, the old winner lost to what this timer favours.
    (winner,) = [w for w in store.winners(kernel=SPEC.name) if w.kernel_version == "edited0000000000"]
    assert winner.config != old

    # Another key is seeded neither with the stale winner as its own nor as a neighbour's: only
    # winners of the running version reach the neighbour ranking.
    other = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 512)
    tuner = KeyTuner(SPEC, other, CPU, torch.device("cpu"), store, env, FakeTimer(cost), quick)
    assert tuner.strategy.earlier_winners(store.winners(kernel=SPEC.name)) == []
    ranked: list = []
    monkeypatch.setattr(tuner.strategy, "neighbour_winners", lambda winners: ranked.extend(winners) or [])
    tuner.strategy.seeds(SPEC.space.default(), SPEC.space.feasible(other, tuner.limits), False, random.Random(0))
    assert ranked and {w.kernel_version for w in ranked} == {"edited0000000000"}


def test_earlier_winners_are_capped_fastest_first_and_deduplicated(tmp_path):
    """However many edits a key's history holds, its earlier winners take at most EARLIER_SEEDS
    seed slots: the fastest distinct feasible configs, whatever order the DB lists them in."""
    from tritune.configs_db.records import WinnerRecord
    from tritune.tuner.strategy import EARLIER_SEEDS

    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    tuner = _tuner(store, trials=4)

    def record(version: str, block: int, warps: int, ms: float) -> WinnerRecord:
        return WinnerRecord(
            kernel=SPEC.name, kernel_version=version, gpu=CPU.slug, key=tuner.key_dict,
            config={"BLOCK": block, "BROKEN": False, "num_warps": warps}, time_ms=ms, portable_ms=1.0,
            speedup=1.0 / ms, trials=4, triton_version="3.6.0", torch_version="x", tritune_version="x",
        )  # fmt: skip

    stored = [
        record("v1", 16, 1, 0.9),
        record("v2", 64, 2, 0.5),
        record("v3", 64, 2, 0.4),  # the same config as v2, faster: one slot for both
        record("v4", 32, 4, 0.7),
        record("v5", 16, 2, 0.8),
        record(SPEC.version, 128, 2, 0.1),  # the running version's: not an earlier winner
    ]
    seeds = tuner.strategy.earlier_winners(stored)
    assert EARLIER_SEEDS == 2
    assert seeds == [{"BLOCK": 64, "BROKEN": False, "num_warps": 2}, {"BLOCK": 32, "BROKEN": False, "num_warps": 4}]


def test_a_space_of_paths_is_swept_by_field_name(tmp_path):
    """A ``UnionSpace``: each config holds its own path's fields only (stored, seeded and re-timed by
    name), and the exhaustive sweep measures every config of every path once."""
    spec = toy_kernel.PATHS
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = spec.default_keys(CPU, n=[256])[0]
    options = TuneOptions(trials=40, seed=1, batch=4, final_rounds=1)
    env = environment_id(store, CPU)
    timer = FakeTimer(toy_kernel.paths_cost)
    result = KeyTuner(spec, key, CPU, torch.device("cpu"), store, env, timer, options).run()
    assert result.config == {"path": "wide", "BLOCK": 256, "num_warps": 8, "BROKEN": False}
    rows = store.measured_trials(env, spec.name, spec.version, key.to_dict())
    stored = sorted(str(sorted(r.config.items())) for r in rows)
    assert stored == sorted(str(sorted(spec.space.to_dict(c).items())) for c in spec.space.grid())
    assert {r.status for r in rows if r.config.get("BROKEN")} == {"failed-correctness"}


@pytest.mark.parametrize("seed", range(3))
def test_a_space_of_paths_is_sampled_by_field_name(tmp_path, seed):
    """TPE over the paths' union of fields: a proposal with a value its path lacks is no config and is
    replaced by a feasible stand-in; the budget is spent on configs of the paths, and the climb stays on
    the best config's path."""
    spec = toy_kernel.PATHS
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = spec.default_keys(CPU, n=[256])[0]
    env = environment_id(store, CPU)
    options = TuneOptions(trials=10, seed=seed, batch=2, final_rounds=1, polish=0.5)
    timer = FakeTimer(toy_kernel.paths_cost)
    result = KeyTuner(spec, key, CPU, torch.device("cpu"), store, env, timer, options).run()
    assert result.measured + result.failed == 10
    rows = store.measured_trials(env, spec.name, spec.version, key.to_dict())
    assert len(rows) == 10 and all(spec.space.to_dict(spec.space.parse(r.config)) == r.config for r in rows), rows
    assert spec.space.parse(result.config) in spec.space.members[result.config["path"]].grid()

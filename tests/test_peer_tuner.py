"""The tuner times the kernel's peer beside the winner at every key and stores its time with it.

The toy kernel (``out = x * alpha``) gets a peer here, ``torch.mul``; fake timers give the peer a
time of its own. A peer that cannot be built, computes something else or raises is stored as NULL,
logged at INFO, and the key is tuned all the same, in this process and in a worker process alike.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import toy_kernel

from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.kernels.device import device_info
from tritune.kernels.spec import Peer, Problem
from tritune.tuner.local_bench import LocalBench
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id
from tritune.tuner.timing import FakeTimer
from tritune.tuner.worker import Worker

CPU = device_info("cpu")
#: The fake time of the peer (the toy's configs take 10 / BLOCK ms and more).
PEER_MS = 0.125


class PeeredToy(toy_kernel.ToySpec):
    """The toy kernel with a peer: ``torch.mul`` into a buffer allocated once."""

    name = "toy_peered"

    def peer(self, key: Any, problem: Problem) -> Peer | None:
        x, alpha = problem.args[0], problem.kwargs["alpha"]
        out = torch.empty_like(x)
        return Peer("torch.mul", lambda: torch.mul(x, alpha, out=out))


class RaisingPeer(PeeredToy):
    name = "toy_raising_peer"

    def peer(self, key: Any, problem: Problem) -> Peer | None:
        def fn() -> torch.Tensor:
            raise RuntimeError("no kernel image for this device")

        return Peer("torch.mul", fn)


class WrongPeer(PeeredToy):
    name = "toy_wrong_peer"

    def peer(self, key: Any, problem: Problem) -> Peer | None:
        x = problem.args[0]
        return Peer("torch.add", lambda: x + 1.0)


class BrokenPeerBuild(PeeredToy):
    name = "toy_broken_peer_build"

    def peer(self, key: Any, problem: Problem) -> Peer | None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (expanding KV heads)")


class MarkupPeerName(PeeredToy):
    name = "toy_markup_peer"

    def peer(self, key: Any, problem: Problem) -> Peer | None:
        peer = super().peer(key, problem)
        assert peer is not None
        return Peer("torch.mul\n\x1b[31mforged", peer.fn)


PEERED, RAISING, WRONG = PeeredToy(), RaisingPeer(), WrongPeer()
BROKEN_BUILD, MARKUP = BrokenPeerBuild(), MarkupPeerName()


def cost(config: object) -> float:
    """The peer's fixed time, else the toy's cost (bigger blocks faster, two warps best)."""
    return PEER_MS if isinstance(config, Peer) else toy_kernel.toy_cost(config)


class PeerCostTimer(toy_kernel.CostTimer):
    """:func:`cost` as a timer that pickles into a worker process."""

    def __call__(self, fn: Any, *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        fn()
        self.calls += 1
        return cost(config)


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    for attribute in ("PEERED", "RAISING", "WRONG", "BROKEN_BUILD", "MARKUP"):
        monkeypatch.setitem(registry._SPECS, globals()[attribute].name, f"{__name__}:{attribute}")


def _tune(spec: PeeredToy, tmp_path: Any, *, final_rounds: int = 2, trials: int = 6) -> tuple[ConfigStore, Any]:
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = spec.default_keys(CPU, n=[256])[0]
    options = TuneOptions(trials=trials, seed=1, batch=3, final_rounds=final_rounds)
    result = KeyTuner(spec, key, CPU, torch.device("cpu"), store, environment_id(store, CPU), FakeTimer(cost), options)
    return store, result.run()


@pytest.mark.interpreter
@pytest.mark.parametrize("final_rounds", [2, 0], ids=["interleaved", "no-final-rounds"])
def test_the_winner_is_stored_with_its_peer_time(final_rounds: int, tmp_path: Any) -> None:
    store, result = _tune(PEERED, tmp_path, final_rounds=final_rounds)
    [winner] = store.winners(gpu=CPU.slug, kernel=PEERED.name)
    assert winner.config == result.config
    assert (winner.peer_ms, winner.peer_name) == (PEER_MS, "torch.mul")


@pytest.mark.interpreter
def test_a_key_whose_only_contender_is_the_portable_default_times_its_peer_too(tmp_path: Any) -> None:
    store, _ = _tune(PEERED, tmp_path, trials=1)
    [winner] = store.winners(gpu=CPU.slug, kernel=PEERED.name)
    assert winner.config == PEERED.space.to_dict(PEERED.space.default())
    assert (winner.peer_ms, winner.peer_name) == (PEER_MS, "torch.mul")


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (RAISING, "RuntimeError: no kernel image for this device"),
        (WRONG, "torch.add differs from the portable output"),
        (BROKEN_BUILD, "OutOfMemoryError: CUDA out of memory"),
        (MARKUP, "peer_name is 'torch.mul\\n\\x1b[31mforged', which holds a control character"),
        (toy_kernel.SPEC, "the kernel names no peer at this key"),
    ],
    ids=["raises", "disagrees", "build-raises", "markup-name", "none"],
)
def test_a_failing_peer_is_stored_as_null_and_the_key_is_still_tuned(
    spec: PeeredToy, reason: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tritune.tuner"):
        store, result = _tune(spec, tmp_path)
    [winner] = store.winners(gpu=CPU.slug, kernel=spec.name)
    assert winner.config == result.config and result.speedup > 1
    assert (winner.peer_ms, winner.peer_name) == (None, None)
    logged = [r for r in caplog.records if "no peer time" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    assert reason in logged[0].getMessage()
    assert "\n" not in logged[0].getMessage() and "\x1b" not in logged[0].getMessage()


@pytest.mark.interpreter
@pytest.mark.parametrize(("spec", "peer"), [(PEERED, (PEER_MS, "torch.mul")), (RAISING, (None, None))])
def test_the_peer_runs_inside_the_worker_process(spec: PeeredToy, peer: tuple[Any, Any], tmp_path: Any) -> None:
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    key = spec.default_keys(CPU, n=[64])[0]
    timer = PeerCostTimer()
    options = TuneOptions(trials=4, batch=2, final_rounds=1, seed=0, isolate=True)
    with Worker("cpu", timer) as worker:
        KeyTuner(spec, key, CPU, torch.device("cpu"), store, env, timer, options, bench=worker).run()
        assert worker.starts == 1
    [winner] = store.winners(gpu=CPU.slug, kernel=spec.name)
    assert (winner.peer_ms, winner.peer_name) == peer


@pytest.mark.interpreter
def test_a_slower_offer_keeps_the_stored_winner_and_its_peer(tmp_path: Any) -> None:
    """The peer's time belongs to the run that measured the stored winner."""
    store, _ = _tune(PEERED, tmp_path)
    [first] = store.winners(gpu=CPU.slug, kernel=PEERED.name)
    slower = type(first)(**{**first.__dict__, "time_ms": first.time_ms * 2, "speedup": first.speedup / 2,
                            "peer_ms": 9.0, "peer_name": "other"})  # fmt: skip
    assert not store.offer_winner(slower, environment_id(store, CPU))
    faster = type(first)(**{**first.__dict__, "time_ms": first.time_ms / 2, "speedup": first.speedup * 2,
                            "peer_ms": None, "peer_name": None})  # fmt: skip
    assert store.offer_winner(faster, environment_id(store, CPU))
    [stored] = store.winners(gpu=CPU.slug, kernel=PEERED.name)
    assert stored.time_ms == faster.time_ms and (stored.peer_ms, stored.peer_name) == (None, None)


def test_the_store_refuses_a_malformed_peer(tmp_path: Any) -> None:
    store, _ = _tune(PEERED, tmp_path)
    [first] = store.winners(gpu=CPU.slug, kernel=PEERED.name)
    for peer_ms, peer_name, reason in [
        (-1.0, "torch.mul", "peer_ms is -1.0, expected a positive number"),
        (float("nan"), "torch.mul", "peer_ms is nan, not a finite number"),
        (1.0, None, "both or neither"),
        (1.0, "x" * 65, "peer_name is 65 characters long"),
    ]:
        record = type(first)(**{**first.__dict__, "time_ms": first.time_ms / 4, "speedup": first.speedup * 4,
                                "peer_ms": peer_ms, "peer_name": peer_name})  # fmt: skip
        with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
            store.offer_winner(record, environment_id(store, CPU))


class RecordingBench(LocalBench):
    """A bench whose final rounds fail where ``fails(configs, peer)`` says; it records each call."""

    def __init__(self, fails: Any = lambda configs, peer: False) -> None:
        super().__init__(torch.device("cpu"), FakeTimer(cost))
        self.fails, self.calls = fails, []

    def retime(self, configs: list[dict[str, Any]], rounds: int, peer: bool = False) -> Any:
        self.calls.append((len(configs), peer))
        return None if self.fails(configs, peer) else super().retime(configs, rounds, peer)


def _tune_on(bench: RecordingBench, tmp_path: Any, **options: Any) -> tuple[ConfigStore, Any]:
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = PEERED.default_keys(CPU, n=[256])[0]
    tuning = TuneOptions(trials=6, seed=1, batch=3, final_rounds=2, **options)
    env = environment_id(store, CPU)
    return store, KeyTuner(PEERED, key, CPU, torch.device("cpu"), store, env, bench.timer, tuning, bench=bench).run()


@pytest.mark.interpreter
def test_time_peer_off_times_no_peer(tmp_path: Any) -> None:
    bench = RecordingBench()
    store, result = _tune_on(bench, tmp_path, time_peer=False)
    assert [peer for _, peer in bench.calls] == [False]
    [winner] = store.winners(gpu=CPU.slug, kernel=PEERED.name)
    assert winner.config == result.config and (winner.peer_ms, winner.peer_name) == (None, None)


@pytest.mark.interpreter
def test_online_tuning_times_no_peer(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from tritune.tuner import jit as tuner_jit

    monkeypatch.setattr(tuner_jit, "TIMER", FakeTimer(cost))
    monkeypatch.setattr(tuner_jit, "ISOLATE", False)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    key = PEERED.default_keys(CPU, n=[256])[0]
    try:
        result = tuner_jit.tune_one_key(PEERED, "cpu", key, trials=4, seconds=30.0, db_url=url)
    finally:
        tuner_jit.close_benches()
    assert result.outcome == tuner_jit.TUNED and result.winner is not None
    assert (result.winner.peer_ms, result.winner.peer_name) == (None, None)


@pytest.mark.interpreter
def test_failed_rounds_are_repeated_without_the_peer_only_when_the_peer_fails_them(tmp_path: Any) -> None:
    # The contenders fail the rounds: the peer alone does not, so the rounds are not repeated.
    contenders = RecordingBench(lambda configs, peer: bool(configs))
    _, result = _tune_on(contenders, tmp_path / "contenders")
    assert contenders.calls == [(3, True), (0, True)]
    assert "final re-timing failed; the winner is chosen on the trial times" in result.notes
    # The peer fails the rounds (alone too): the contenders are re-timed without it.
    peer = RecordingBench(lambda configs, peer: peer)
    _, result = _tune_on(peer, tmp_path / "peer")
    assert peer.calls == [(3, True), (0, True), (3, False)]
    assert not any("final re-timing failed" in note for note in result.notes)


@pytest.mark.gpu
def test_a_gpu_tune_stores_the_sdpa_peer_time(tmp_path: Any) -> None:
    """One decode key on the GPU, a few trials: the winner is stored with an SDPA backend's time."""
    from tritune.tuner.timing import GpuTimer

    spec = registry.get_spec("splitk_decode")
    info = device_info(0)
    key = spec.default_keys(info)[0]
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    options = TuneOptions(trials=3, seed=0, batch=3, final_rounds=2)
    KeyTuner(spec, key, info, torch.device("cuda", 0), store, environment_id(store, info), GpuTimer(), options).run()
    [winner] = store.winners(gpu=info.slug, kernel=spec.name)
    assert winner.peer_name is not None and winner.peer_name.startswith("SDPA ")
    assert winner.peer_ms is not None and 0 < winner.peer_ms < 100

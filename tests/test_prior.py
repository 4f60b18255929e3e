"""A prior from other GPUs: the nearest GPUs' bundles seed tuning (and serve with TRITUNE_CROSS_GPU=serve)."""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import toy_kernel
import triton
from toy_records import ship, toy_record

from tritune.configs_db import bundles
from tritune.configs_db.bundles import write_bundle
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import prior, registry, settings
from tritune.kernels.device import DeviceInfo
from tritune.kernels.dispatcher import DISPATCHER
from tritune.search_spaces.base import SearchSpace, TargetLimits, choice
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id, tritune_version
from tritune.tuner.timing import FakeTimer

H200 = DeviceInfo("NVIDIA H200", "nvidia", (9, 0), 132, "sm90")
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", "nvidia", (9, 0), 132, "sm90")
H100_PCIE = DeviceInfo("NVIDIA H100 PCIe", "nvidia", (9, 0), 114, "sm90")
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", "nvidia", (8, 0), 108, "sm80")


@dataclass(frozen=True)
class SmemConfig:
    BLOCK: int = choice(32, (32, 64, 128))
    num_warps: int = choice(4, (2, 4))


def _smem_feasible(config: SmemConfig, key: toy_kernel.ToyKey, limits: TargetLimits) -> str | None:
    # 1500 bytes of shared memory per element of the block: BLOCK=128 fits Hopper's 227 KB, not Ampere's 163 KB.
    need = config.BLOCK * 1500
    return None if need <= limits.smem_bytes else f"{need} bytes of shared memory over {limits.smem_bytes}"


class SmemSpec(toy_kernel.ToySpec):
    """The toy kernel with a feasibility rule that depends on the GPU's shared memory."""

    name = "toy_smem"
    space = SearchSpace("toy_smem", SmemConfig, feasibility=_smem_feasible)  # type: ignore[assignment]

    def launch(self, config, x, *, alpha=2.0, out=None):
        return super().launch(toy_kernel.ToyConfig(BLOCK=32, num_warps=config.num_warps), x, alpha=alpha, out=out)


SMEM = SmemSpec()
#: On the H200: BLOCK=128 at n_bucket 256 (too big for an A100), BLOCK=64 at 1024.
H200_WINNERS = {256: {"BLOCK": 128, "num_warps": 2}, 1024: {"BLOCK": 64, "num_warps": 2}}
DEFAULT = {"BLOCK": 32, "num_warps": 4}


def key(device: DeviceInfo, n_bucket: int) -> toy_kernel.ToyKey:
    return toy_kernel.ToyKey(device.arch, device.sm_count, "float32", n_bucket)


@pytest.fixture(autouse=True)
def shipped(monkeypatch, tmp_path) -> Path:
    """Bundles on, read from a folder holding an H200 bundle of ``toy_smem`` (and an AMD one, never used)."""
    monkeypatch.setitem(registry._SPECS, "toy_smem", f"{__name__}:SMEM")
    folder = tmp_path / "bundles"
    monkeypatch.setattr(bundles, "shipped_bundle_dir", lambda: folder)
    monkeypatch.setenv("TRITUNE_DISABLE_BUNDLES", "0")
    settings.reload()
    provenance = {"cuda": "13.0", "driver": "", "torch": "2.11.0", "triton": triton.__version__, "tritune": "t"}
    for gpu, device in (("nvidia-h200-sm90-132sm", H200), ("amd-instinct-mi300x-gfx942-304sm", None)):
        sms = 132 if device is not None else 304
        arch = "sm90" if device is not None else "gfx942"
        records = [
            WinnerRecord(
                kernel="toy_smem",
                kernel_version=SMEM.version,
                gpu=gpu,
                key={"arch": arch, "sm_count": sms, "dtype": "float32", "n_bucket": n},
                config=config if device is not None else {"BLOCK": 32, "num_warps": 2},
                time_ms=1.0,
                portable_ms=2.0,
                speedup=2.0,
                trials=10,
                triton_version=provenance["triton"],
                torch_version=provenance["torch"],
                tritune_version="t",
            )
            for n, config in H200_WINNERS.items()
        ]
        write_bundle(records, folder / f"{gpu}.json", gpu, gpu, provenance)
    DISPATCHER.clear()
    yield folder
    DISPATCHER.clear()


# ---- the ranking ---------------------------------------------------------------------------------


def test_nearest_gpus_same_vendor_architecture_then_sms_then_bandwidth():
    slugs = [
        "nvidia-h200-sm90-132sm",
        "nvidia-h100-80gb-hbm3-sm90-132sm",
        "nvidia-a10-sm86-72sm",
        "nvidia-l40s-sm89-142sm",
        "amd-instinct-mi300x-gfx942-304sm",
        "nvidia-a100-sxm4-80gb-sm80-108sm",
    ]
    # The same major architecture first, the nearest minor first (sm86, then sm89), then the next
    # major; the two sm90 GPUs tie on SM count: the A100's bandwidth is nearer the H100's.
    assert prior.nearest_gpus(A100, slugs, limit=4) == [
        "nvidia-a10-sm86-72sm",
        "nvidia-l40s-sm89-142sm",
        "nvidia-h100-80gb-hbm3-sm90-132sm",
        "nvidia-h200-sm90-132sm",
    ]
    # Same architecture: the nearest SM count decides (114 is nearer 132 than 142 or 72).
    assert prior.nearest_gpus(H100_PCIE, slugs, limit=2) == [
        "nvidia-h100-80gb-hbm3-sm90-132sm",
        "nvidia-h200-sm90-132sm",
    ]
    # A GPU whose bandwidth is unknown ranks after one whose bandwidth is known, at equal distances.
    unknown = DeviceInfo("NVIDIA H800", "nvidia", (9, 0), 132, "sm90")
    assert prior.nearest_gpus(unknown, ["nvidia-h200-sm90-132sm", "nvidia-h100-80gb-hbm3-sm90-132sm"]) == [
        "nvidia-h100-80gb-hbm3-sm90-132sm",
        "nvidia-h200-sm90-132sm",
    ]
    assert prior.nearest_gpus(DeviceInfo("AMD Instinct MI250X", "amd", (9, 0), 220, "gfx90a"), slugs) == [
        "amd-instinct-mi300x-gfx942-304sm"
    ]


def test_slugs_are_read_for_capability_and_sms():
    assert prior.gpu_of_slug("nvidia-b200-sm100-148sm").capability == (10, 0)  # type: ignore[union-attr]
    assert prior.gpu_of_slug("amd-instinct-mi300x-gfx942-304sm").capability == (9, 4)  # type: ignore[union-attr]
    assert prior.gpu_of_slug("cpu-interpreter") is None
    assert prior.gpu_of_device(H200).bandwidth_gbps == 4800.0


# ---- seeding ----------------------------------------------------------------------------------------


def test_seeds_are_translated_and_only_feasible_here():
    # The A100 cannot run the H200's BLOCK=128 (shared memory): only BLOCK=64 at 1024 is lent.
    assert prior.seed_configs(SMEM, key(A100, 256), A100) == []
    assert prior.seed_configs(SMEM, key(A100, 1024), A100) == [H200_WINNERS[1024]]
    # An H100 PCIe (another SM count) has no bundle: the H200's keys are translated to its 114 SMs.
    assert prior.seed_configs(SMEM, key(H100_PCIE, 256), H100_PCIE) == [H200_WINNERS[256]]
    # The H200 has its own bundle: no prior there.
    assert prior.seed_configs(SMEM, key(H200, 256), H200) == []


def test_the_tuner_seeds_from_the_prior(tmp_path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    options = TuneOptions(trials=4, seed=0, batch=2, final_rounds=1)
    env = environment_id(store, H100_PCIE)
    tuner = KeyTuner(SMEM, key(H100_PCIE, 256), H100_PCIE, torch.device("cpu"), store, env, FakeTimer(len), options)
    seeds = tuner.strategy.seeds(SMEM.space.default(), tuner.strategy.feasible, False, random.Random(0))
    assert seeds[:2] == [DEFAULT, H200_WINNERS[256]]
    with settings.override(cross_gpu="off"):
        assert H200_WINNERS[256] not in tuner.strategy.seeds(
            SMEM.space.default(), [SMEM.space.default()], False, random.Random(0)
        )


def _record(device: DeviceInfo, n_bucket: int, config: dict, tritune: str | None = None) -> WinnerRecord:
    """A winner of ``toy_smem`` for ``device`` at ``n_bucket``: for the DB (this tritune), or for
    :func:`toy_records.ship` (``tritune="test"``)."""
    return toy_record(
        n_bucket, config, kernel="toy_smem", kernel_version=SMEM.version, gpu=device.slug,
        key=key(device, n_bucket).to_dict(), tritune_version=tritune or tritune_version(),
    )  # fmt: skip


def test_a_gpus_bundle_seeds_the_keys_it_holds_the_prior_those_it_lacks(shipped, monkeypatch):
    # The H100's bundle holds n_bucket 1024 only (a key added later, such as an opt-in one, is missing).
    mine = {"BLOCK": 64, "num_warps": 4}
    ship(shipped, monkeypatch, _record(H100, 1024, mine, tritune="test"), device=H100)
    assert prior.seed_configs(SMEM, key(H100, 1024), H100) == []
    assert prior.seed_configs(SMEM, key(H100, 256), H100) == [H200_WINNERS[256]]
    with settings.override(cross_gpu="off"):
        assert prior.seed_configs(SMEM, key(H100, 256), H100) == []
    # Served only when asked: by default its own nearest bucket lends n_bucket 256 its winner;
    # with ``serve`` the nearest GPU's winner at that very key serves, provisionally, and the keys
    # its own bundle holds keep its own winners.
    assert served(H100, 256) == mine
    with settings.override(cross_gpu="serve"):
        lent = {key.n_bucket: SMEM.space.to_dict(entry.config) for _kernel, key, entry in prior.serving_entries(H100)}
        assert lent == {256: H200_WINNERS[256]}
        assert served(H100, 256) == H200_WINNERS[256]
        assert DISPATCHER.table(H100).exact[("toy_smem", key(H100, 256))].provisional
        assert served(H100, 1024) == mine
        assert not DISPATCHER.table(H100).exact[("toy_smem", key(H100, 1024))].provisional


def test_a_stale_winner_of_this_gpus_bundle_does_not_hold_its_key(shipped, monkeypatch):
    """An entry of another kernel version is refused here: the key is one the bundle lacks."""
    stale = dataclasses.replace(_record(H100, 256, {"BLOCK": 64, "num_warps": 4}, tritune="test"), kernel_version="old")
    ship(shipped, monkeypatch, stale, device=H100)
    assert prior.seed_configs(SMEM, key(H100, 256), H100) == [H200_WINNERS[256]]
    with settings.override(cross_gpu="serve"):
        assert served(H100, 256) == H200_WINNERS[256]


def test_the_prior_is_seeded_before_the_neighbours_winners(tmp_path):
    """A short tune measures only the first seeds: this key's winner on the nearest GPU comes before
    the winner this GPU's DB holds at another bucket."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, H100_PCIE)
    neighbour = {"BLOCK": 64, "num_warps": 4}
    store.offer_winner(_record(H100_PCIE, 1024, neighbour), env)
    options = TuneOptions(trials=4, seed=0, batch=2, final_rounds=1)
    tuner = KeyTuner(SMEM, key(H100_PCIE, 256), H100_PCIE, torch.device("cpu"), store, env, FakeTimer(len), options)
    seeds = tuner.strategy.seeds(SMEM.space.default(), tuner.strategy.feasible, False, random.Random(0))
    assert seeds[:3] == [DEFAULT, H200_WINNERS[256], neighbour]


# ---- serving ----------------------------------------------------------------------------------------


def served(device: DeviceInfo, n_bucket: int) -> dict:
    return SMEM.space.to_dict(DISPATCHER.select(SMEM, device, key(device, n_bucket)))


@pytest.mark.parametrize("mode", ["off", "seed"])
def test_the_prior_serves_nothing_unless_asked(mode):
    with settings.override(cross_gpu=mode):
        assert served(A100, 1024) == DEFAULT
        assert served(H100_PCIE, 256) == DEFAULT


def test_serve_lends_feasible_configs_provisionally():
    with settings.override(cross_gpu="serve"):
        assert served(A100, 1024) == H200_WINNERS[1024]
        entry = DISPATCHER.table(A100).exact[("toy_smem", key(A100, 1024))]
        assert entry.provisional and entry.tuned_under.startswith("nvidia-h200-sm90-132sm, Triton ")
        # BLOCK=128 does not fit the A100: never admitted (the nearest bucket's feasible winner may lend).
        assert served(A100, 256) != H200_WINNERS[256]
        assert ("toy_smem", key(A100, 256)) not in DISPATCHER.table(A100).exact
        assert served(H100_PCIE, 256) == H200_WINNERS[256]
    with settings.override(cross_gpu="serve", disable_bundles=True):
        assert served(A100, 1024) == DEFAULT


def test_this_gpus_own_db_beats_the_prior():
    mine = {"BLOCK": 32, "num_warps": 2}
    record = _record(A100, 1024, mine)
    with ConfigStore(settings.settings().db_url) as store:
        env = environment_id(store, A100)
        store.offer_winner(record, env)
    with settings.override(cross_gpu="serve"):
        assert served(A100, 1024) == mine
        assert not DISPATCHER.table(A100).exact[("toy_smem", key(A100, 1024))].provisional


def test_a_broken_prior_is_skipped_with_one_warning(monkeypatch, caplog):
    def broken(device):
        raise RuntimeError("bundle folder unreadable")

    monkeypatch.setattr(prior, "prior_records", broken)
    with settings.override(cross_gpu="serve"), caplog.at_level(logging.WARNING, logger="tritune.dispatch"):
        assert served(A100, 1024) == DEFAULT
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "winners of other GPUs not used" in warning and "bundle folder unreadable" in warning


def test_a_bundle_is_parsed_once_per_version_of_its_file(monkeypatch, shipped, tmp_path):
    """``tune`` asks the prior and the shipped bundle at every key: the file is parsed once, and again
    only when it changes."""
    reads = []
    read_bundle = bundles.read_bundle

    def counting(path, expected_gpu=None):
        reads.append(Path(path).name)
        return read_bundle(path, expected_gpu)

    monkeypatch.setattr(bundles, "read_bundle", counting)
    for n in (256, 1024, 4096):
        prior.seed_configs(SMEM, key(A100, n), A100)
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    options = TuneOptions(trials=4, seed=0, batch=2, final_rounds=1)
    env = environment_id(store, H200)
    for n in (256, 1024):
        tuner = KeyTuner(SMEM, key(H200, n), H200, torch.device("cpu"), store, env, FakeTimer(len), options)
        assert tuner.strategy.bundled_winner() == [H200_WINNERS[n]]
    assert reads == ["nvidia-h200-sm90-132sm.json"]
    # A new version of the file is read again.
    records, _ = bundles.shipped_records("nvidia-h200-sm90-132sm")
    provenance = {"cuda": "13.0", "driver": "", "torch": "2.11.0", "triton": triton.__version__, "tritune": "t"}
    only_256 = [record for record in records if record.key["n_bucket"] == 256]
    write_bundle(only_256, shipped / "nvidia-h200-sm90-132sm.json", "nvidia-h200-sm90-132sm", "h200", provenance)
    assert prior.seed_configs(SMEM, key(A100, 1024), A100) == []

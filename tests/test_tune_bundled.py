"""``tune --bundled``: re-tune exactly the keys of the bundle shipped for this GPU, each seeded from its winner."""

from __future__ import annotations

import json

import pytest
import toy_kernel
from sqlalchemy import text
from toy_records import CPU, SPEC, ship, toy_record
from typer.testing import CliRunner

from tritune.configs_db import bundles
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.tuner.cli import app
from tritune.tuner.keys import parse_overrides
from tritune.tuner.plan import KeySource, plan_keys

#: A config the toy space admits that is neither its default nor TUNED: the seeds must carry it into the trials.
SHIPPED = {"BLOCK": 16, "BROKEN": False, "num_warps": 1}


pytestmark = pytest.mark.usefixtures("toy_dispatch")


def record(n_bucket: int, **changes) -> WinnerRecord:
    return toy_record(n_bucket, SHIPPED, **changes)


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """Ship the records given as this GPU's bundle (bundles enabled for the test)."""
    yield lambda *records: ship(tmp_path / "bundles", monkeypatch, *records)
    settings.reload()


def tune(*args: str) -> object:
    base = ["--device", "cpu", "--kernel", "toy_scale", "--trials", "2", "--no-isolate"]
    return CliRunner().invoke(app, [*base, *args], catch_exceptions=False)


def test_the_bundles_keys_are_tuned_and_nothing_else(shipped, tmp_path):
    # 1024 and 4096 are not toy default keys (64 and 256); an older kernel version's key is tuned too.
    shipped(record(1024), record(4096, kernel_version="0123456789abcdef"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = tune("--bundled", "--db", url)
    assert result.exit_code == 0, result.output
    stored = {w.key["n_bucket"] for w in ConfigStore(url).winners(kernel="toy_scale")}
    assert stored == {1024, 4096}


@pytest.mark.parametrize("version", ["current", "earlier"])
def test_each_key_measures_its_shipped_winner(shipped, tmp_path, version):
    """A shipped winner seeds its key's re-tune; one of an earlier kernel version (after a kernel
    edit) never serves, but seeds it too."""
    shipped(record(1024) if version == "current" else record(1024, kernel_version="0123456789abcdef"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert tune("--bundled", "--db", url).exit_code == 0
    with ConfigStore(url) as db, db.engine.connect() as connection:
        rows = connection.execute(text("SELECT key_json, config_json, status FROM trials")).all()
    at_key = [(json.loads(config), status) for key, config, status in rows if json.loads(key) == record(1024).key]
    assert (SHIPPED, "ok") in at_key, at_key


def test_plan_keeps_the_bundles_order_and_each_key_once(shipped):
    # One key under two kernel versions is tuned once.
    shipped(record(4096), record(1024), record(1024, kernel_version="0123456789abcdef"))
    plan = plan_keys([SPEC], KeySource(bundled=True), CPU)
    in_file = [r.key["n_bucket"] for r in bundles.shipped_records(CPU.slug)[0]]
    assert [key.n_bucket for _spec, key in plan] == list(dict.fromkeys(in_file))
    assert sorted(key.n_bucket for _spec, key in plan) == [1024, 4096]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bundled", "--missed"], "--missed and --bundled name two sets of keys"),
    ],
)
def test_conflicting_key_sources_are_refused(shipped, tmp_path, args, message):
    shipped(record(1024))
    result = tune(*args, "--db", str(tmp_path / "db.sqlite"))
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())


def test_key_values_narrow_the_bundles_keys(shipped, tmp_path):
    """``--key`` with ``--bundled`` tunes only the bundle keys holding one of its values (an alias
    transformed as for the default keys); values no bundle key holds are refused, naming the keys."""
    shipped(record(1024), record(4096), record(256))
    plan = plan_keys([SPEC], KeySource(overrides=parse_overrides(["n=4000,200"], {}), bundled=True), CPU)
    assert sorted(key.n_bucket for _spec, key in plan) == [256, 4096]
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = tune("--bundled", "--key", "n_bucket=1024", "--db", url)
    assert result.exit_code == 0, result.output
    assert {w.key["n_bucket"] for w in ConfigStore(url).winners(kernel="toy_scale")} == {1024}
    result = tune("--bundled", "--key", "n_bucket=64", "--db", str(tmp_path / "other.sqlite"))
    said = " ".join(result.output.split())
    assert result.exit_code == 1
    assert "--key n_bucket=64: none of the 3 keys --bundled takes matches" in said
    assert "n_bucket=1024" in said
    assert not (tmp_path / "other.sqlite").exists()


def test_without_a_shipped_bundle_it_says_so(shipped, tmp_path):
    shipped()  # a bundle file without entries
    result = tune("--bundled", "--db", str(tmp_path / "db.sqlite"))
    assert result.exit_code == 1
    assert f"no bundle with winners is shipped for {CPU.slug}" in " ".join(result.output.split())
    assert not (tmp_path / "db.sqlite").exists()


def test_with_bundles_disabled_it_says_so(shipped, tmp_path, monkeypatch):
    shipped(record(1024))
    monkeypatch.setenv("TRITUNE_DISABLE_BUNDLES", "1")
    settings.reload()
    result = tune("--bundled", "--db", str(tmp_path / "db.sqlite"))
    assert result.exit_code == 1
    assert "bundles are disabled here" in " ".join(result.output.split())


def test_a_gpu_without_a_bundle_tunes_the_nearest_gpus_keys(tmp_path, monkeypatch, capsys):
    """An A100 (no bundle of its own) takes the H200 bundle's keys, translated to its own
    architecture and SM count; with ``TRITUNE_CROSS_GPU=off`` it says that no bundle is shipped."""
    from tritune.kernels.device import DeviceInfo
    from tritune.tuner.failures import CommandError

    h200 = DeviceInfo("NVIDIA H200", "nvidia", (9, 0), 132, "sm90")
    a100 = DeviceInfo("NVIDIA A100-SXM4-80GB", "nvidia", (8, 0), 108, "sm80")
    keys = [toy_kernel.ToyKey(h200.arch, h200.sm_count, "float32", n).to_dict() for n in (4096, 1024)]
    ship(tmp_path / "bundles", monkeypatch, *(record(1024, gpu=h200.slug, key=key) for key in keys), device=h200)
    plan = plan_keys([SPEC], KeySource(bundled=True), a100)
    assert [(key.arch, key.sm_count, key.n_bucket) for _spec, key in plan] == [("sm80", 108, 1024), ("sm80", 108, 4096)]
    assert f"tuning the keys of {h200.slug}'s bundle" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setenv("TRITUNE_CROSS_GPU", "off")
    settings.reload()
    with pytest.raises(CommandError, match=f"no bundle with winners is shipped for {a100.slug}"):
        plan_keys([SPEC], KeySource(bundled=True), a100)
    settings.reload()

"""The shipped H200 bundle's ``splitk_decode`` winners under this source's kernel version.

The winners were tuned (2026-11-29) before ``KV_TMA`` existed; they launch pointer loads, whose
SASS is unchanged at every one of them (``tests/test_decode_sm90.py``), so they were re-stamped
with ``scripts/restamp_bundle.py --kernel splitk_decode --add KV_TMA=false`` rather than re-tuned.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tritune.configs_db.bundles import shipped_records
from tritune.kernels.decode.kernel import KERNEL
from tritune.kernels.device import DeviceInfo
from tritune.kernels.winners import Rejection, admit
from tritune.search_spaces.base import ConfigError
from tritune.search_spaces.splitk_decode import SPACE

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "configs_db" / "bundles" / "nvidia-h200-sm90-132sm.json"
H200 = DeviceInfo("NVIDIA H200", "nvidia", (9, 0), 132, "sm90")
#: Decode winners in the shipped H200 bundle: head dims 64 and 128 x 6 batches x 5 cache lengths.
SHIPPED_DECODE_WINNERS = 60


def test_shipped_decode_winners_are_admitted_under_this_version():
    """Every decode winner of the H200 bundle is stamped with this source's version, holds every
    field of the space (``KV_TMA`` false: what it was timed with), and the runtime loader admits
    it on an H200 (parsed, feasible)."""
    records, rejections = shipped_records(H200.slug)
    assert rejections == []
    decode = [r for r in records if r.kernel == KERNEL.name]
    assert len(decode) == SHIPPED_DECODE_WINNERS
    assert {r.kernel_version for r in decode} == {KERNEL.version}
    for record in decode:
        assert set(record.config) == set(SPACE.dimensions), record.config
        assert record.config["KV_TMA"] is False
        outcome = admit(record, H200)
        assert not isinstance(outcome, Rejection), outcome.reason
        assert SPACE.to_dict(outcome[2].config) == record.config


def _decode_without_kv_tma(stale_version: str) -> dict:
    """The shipped bundle with its decode entries as they were before ``KV_TMA``."""
    doc = json.loads(BUNDLE.read_text())
    for entry in doc["winners"]:
        if entry["kernel"] == KERNEL.name:
            del entry["config"]["KV_TMA"]
            entry["kernel_version"] = stale_version
    return doc


def test_restamp_adds_a_field_the_space_has_gained(restamp_bundle, tmp_path, capsys):
    """``--add KV_TMA=false`` turns the pre-KV_TMA entries into the shipped ones, byte for byte;
    without it the tool refuses them (their default might not be what they ran)."""
    path = tmp_path / BUNDLE.name
    path.write_text(restamp_bundle.document_text(_decode_without_kv_tma("76c8e2ee9253e531")))
    with pytest.raises(SystemExit, match="lacks \\['KV_TMA'\\]"):
        restamp_bundle.main([str(path), "--kernel", KERNEL.name])
    assert restamp_bundle.main([str(path), "--kernel", KERNEL.name, "--add", "KV_TMA=false"]) == 0
    out = capsys.readouterr().out
    assert out.count("76c8e2ee9253e531 -> ") == SHIPPED_DECODE_WINNERS
    assert out.count("added {'KV_TMA': False}") == SHIPPED_DECODE_WINNERS
    assert path.read_bytes() == BUNDLE.read_bytes()


def test_restamp_leaves_the_shipped_decode_entries_unchanged(restamp_bundle, tmp_path):
    """An entry that has the field keeps its value: ``--add`` fills only what is missing."""
    copy = tmp_path / BUNDLE.name
    shutil.copy(BUNDLE, copy)
    assert restamp_bundle.main([str(copy), "--kernel", KERNEL.name, "--add", "KV_TMA=true"]) == 0
    assert copy.read_bytes() == BUNDLE.read_bytes()


@pytest.mark.parametrize(
    "item, error, message",
    [
        ("KV_TMA", SystemExit, "expected FIELD=VALUE"),
        ("KV_TMA=False", SystemExit, "VALUE must be JSON"),
        ("KV_TMA=1", ConfigError, "KV_TMA=1 is not in the space"),
        ("NO_SUCH_FIELD=1", SystemExit, "space has no field \\['NO_SUCH_FIELD'\\]"),
    ],
    ids=["no-value", "python-literal", "wrong-type", "unknown-field"],
)
def test_restamp_refuses_a_bad_addition(restamp_bundle, tmp_path, item, error, message):
    path = tmp_path / BUNDLE.name
    before = restamp_bundle.document_text(_decode_without_kv_tma("76c8e2ee9253e531"))
    path.write_text(before)
    with pytest.raises(error, match=message):
        restamp_bundle.main([str(path), "--kernel", KERNEL.name, "--add", item])
    assert path.read_text() == before


@pytest.mark.parametrize("default_kept", [True, False], ids=["the-running-default", "another-default"])
def test_restamp_reshapes_the_portable_default_and_the_loader_checks_it(restamp_bundle, tmp_path, capsys, default_kept):
    """An entry's ``portable_config`` takes the added field as its config does; where the result is
    not the running default at the entry's key the loader would refuse it, and nothing is written."""
    doc = _decode_without_kv_tma("76c8e2ee9253e531")
    for entry in doc["winners"]:
        if entry["kernel"] == KERNEL.name:
            default = SPACE.to_dict(KERNEL.default_config(KERNEL.key_type.from_dict(entry["key"])))
            if not default_kept:
                default["BLOCK_N"] = 16 if default["BLOCK_N"] != 16 else 32
            entry["portable_config"] = {name: value for name, value in default.items() if name != "KV_TMA"}
    path = tmp_path / BUNDLE.name
    path.write_text(restamp_bundle.document_text(doc))
    status = restamp_bundle.main([str(path), "--kernel", KERNEL.name, "--add", "KV_TMA=false"])
    if not default_kept:
        assert status == 1 and "another portable default" in capsys.readouterr().err
        return
    assert status == 0
    restamped = json.loads(path.read_text())["winners"]
    portable = [e["portable_config"] for e in restamped if e["kernel"] == KERNEL.name]
    assert len(portable) == SHIPPED_DECODE_WINNERS
    assert all(p["KV_TMA"] is False and set(p) == set(SPACE.dimensions) for p in portable)

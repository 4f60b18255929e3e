"""The ``tma_prefill`` space as a union of per-path spaces, and the shipped H200 bundle under it.

Each path's config holds only the fields its launch reads, so the grid holds no two configs that
launch the same thing. The per-path feasible counts below were enumerated from the flat space this
union replaced (one dataclass with every field, held at neutral values off its path) with the
neutral-value duplicates left out: the union keeps exactly the configs the flat space kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tritune.configs_db.bundles import shipped_records
from tritune.kernels.device import DeviceInfo
from tritune.kernels.prefill.kernel import KERNEL, PrefillKey
from tritune.kernels.winners import Rejection, admit
from tritune.search_spaces.base import TargetLimits
from tritune.search_spaces.tma_prefill import SPACE, PortableConfig, TmaConfig, WsConfig

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "configs_db" / "bundles" / "nvidia-h200-sm90-132sm.json"
H200 = DeviceInfo("NVIDIA H200", "nvidia", (9, 0), 132, "sm90")
H200_LIMITS = TargetLimits()
SMALL_SMEM = TargetLimits(smem_bytes=99 * 1024)
INTERPRETER = TargetLimits(interpreter=True)
#: The fields each path's launch reads.
FIELDS = {
    "portable": {"path", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages"},
    "tma": {"path", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "PACK_GQA", "SPLIT_KV"},
    "ws": {"path", "BLOCK_M", "BLOCK_N", "num_stages", "CONSUMER_REGS", "PRODUCER_REGS"},
}
#: Prefill winners in the shipped H200 bundle: 34 at gqa_group=8 (tma path), 16 at gqa_group=4 (ws path).
SHIPPED_PREFILL_WINNERS = 50


def _key(arch: str, head_dim: int, group: int, causal: bool, lq: int, lkv: int) -> PrefillKey:
    return PrefillKey(arch, 132, "bf16", head_dim, group, causal, lq, lkv)


#: (key, limits) -> feasible configs per path, as the flat space counted them (2026-12-05).
COUNTS = {
    "h200-d128-lq512": (_key("sm90", 128, 8, True, 512, 16384), H200_LIMITS, (87, 456, 10)),
    "h200-d64-lq4096": (_key("sm90", 64, 8, True, 4096, 131072), H200_LIMITS, (96, 128, 18)),
    "h200-d256": (_key("sm90", 256, 8, True, 512, 16384), H200_LIMITS, (54, 256, 0)),
    "h200-d128-noncausal-gqa1": (_key("sm90", 128, 1, False, 512, 1024), H200_LIMITS, (87, 0, 10)),
    "h200-d64-noncausal": (_key("sm90", 64, 8, False, 512, 16384), H200_LIMITS, (96, 0, 18)),
    "h200-d80-gqa6": (_key("sm90", 80, 6, True, 512, 1024), H200_LIMITS, (87, 0, 0)),
    "h200-gqa16-tiny": (_key("sm90", 128, 16, True, 16, 64), H200_LIMITS, (87, 146, 10)),
    "sm90-99k-d64": (_key("sm90", 64, 2, True, 512, 1024), SMALL_SMEM, (85, 432, 12)),
    "sm80-99k": (_key("sm80", 128, 8, True, 512, 16384), SMALL_SMEM, (65, 0, 0)),
    "sm100": (_key("sm100", 128, 8, True, 4096, 16384), H200_LIMITS, (87, 114, 0)),
    "gfx942": (_key("gfx942", 128, 8, True, 512, 16384), H200_LIMITS, (87, 0, 0)),
    "interpreter": (_key("cpu-interpreter", 64, 2, True, 16, 64), INTERPRETER, (4, 12, 0)),
    "interpreter-lkv1024": (_key("cpu-interpreter", 64, 2, True, 16, 1024), INTERPRETER, (4, 32, 0)),
    "interpreter-noncausal": (_key("cpu-interpreter", 128, 2, False, 16, 64), INTERPRETER, (4, 0, 0)),
}


@pytest.mark.parametrize("key, limits, counts", list(COUNTS.values()), ids=list(COUNTS))
def test_feasible_configs_per_path_are_the_flat_spaces_less_its_duplicates(key, limits, counts):
    feasible = SPACE.feasible(key, limits)
    by_path = {path: [c for c in feasible if c.path == path] for path in FIELDS}
    assert tuple(len(by_path[path]) for path in FIELDS) == counts
    for path, configs in by_path.items():
        assert all(set(SPACE.to_dict(c)) == FIELDS[path] for c in configs), path
        assert len(set(configs)) == len(configs), path


def test_space_is_a_union_of_one_member_per_path():
    assert list(SPACE.members) == ["portable", "tma", "ws"]
    assert SPACE.config_types == (PortableConfig, TmaConfig, WsConfig)
    assert {path: set(m.dimensions) for path, m in SPACE.members.items()} == FIELDS
    # 4 x 4 tiles x 2 warps x 4 stages; x 2 packings x 4 splits; 4 x 4 tiles x 4 stages x 3 x 3 registers.
    assert [m.size() for m in SPACE.members.values()] == [128, 1024, 576]


def test_every_config_is_in_the_space_and_parses_back():
    for config in SPACE.grid():
        assert SPACE.parse(SPACE.to_dict(config)) == config
        assert SPACE.from_fields(SPACE.field_values(config)) == config


def test_nested_ops_carry_their_members_fields():
    """The TMA and ws ops take exactly their path's fields (the op's name says the path)."""
    for path in ("tma", "ws"):
        op = getattr(torch.ops.tritune, f"prefill_attention_{path}").default
        names = {a.name for a in op._schema.arguments if a.kwarg_only}
        assert names == FIELDS[path] - {"path"}, path


# ---- the shipped H200 bundle ----------------------------------------------------------------


def test_shipped_prefill_winners_are_admitted_under_this_version():
    """Every prefill winner of the H200 bundle is stamped with this source's version, holds its
    path's fields only, and the runtime loader admits it on an H200 (parsed, feasible)."""
    records, rejections = shipped_records(H200.slug)
    assert rejections == []
    prefill = [r for r in records if r.kernel == KERNEL.name]
    assert len(prefill) == SHIPPED_PREFILL_WINNERS
    assert {r.kernel_version for r in prefill} == {KERNEL.version}
    for record in prefill:
        assert set(record.config) == FIELDS[record.config["path"]], record.config
        outcome = admit(record, H200)
        assert not isinstance(outcome, Rejection), outcome.reason
        assert SPACE.to_dict(outcome[2].config) == record.config


def test_restamp_leaves_the_shipped_bundle_unchanged(restamp_bundle, tmp_path):
    """The shipped prefill entries are what the tool makes of them: nothing left to re-stamp."""
    copy = tmp_path / BUNDLE.name
    shutil.copy(BUNDLE, copy)
    assert restamp_bundle.main([str(copy), "--kernel", KERNEL.name]) == 0
    assert copy.read_bytes() == BUNDLE.read_bytes()


def test_restamp_rewrites_a_stale_entry_and_drops_fields_its_path_lacks(restamp_bundle, tmp_path, capsys):
    doc = json.loads(BUNDLE.read_text())
    prefill = [e for e in doc["winners"] if e["kernel"] == KERNEL.name and e["config"]["path"] == "tma"]
    prefill[0]["kernel_version"] = "0123456789abcdef"
    prefill[0]["config"] |= {"CONSUMER_REGS": 240, "PRODUCER_REGS": 24}
    stale = tmp_path / BUNDLE.name
    stale.write_text(restamp_bundle.document_text(doc))
    assert restamp_bundle.main([str(stale), "--kernel", KERNEL.name]) == 0
    assert "0123456789abcdef -> " in capsys.readouterr().out
    assert stale.read_bytes() == BUNDLE.read_bytes()


def test_restamp_writes_nothing_the_loader_would_refuse(restamp_bundle, tmp_path, capsys):
    doc = json.loads(BUNDLE.read_text())
    entry = next(e for e in doc["winners"] if e["kernel"] == KERNEL.name and e["config"]["path"] == "tma")
    entry["config"]["BLOCK_M"] = 16  # below the tma path's 64-row warpgroup MMA
    entry["kernel_version"] = "0123456789abcdef"
    path = tmp_path / BUNDLE.name
    before = restamp_bundle.document_text(doc)
    path.write_text(before)
    assert restamp_bundle.main([str(path), "--kernel", KERNEL.name]) == 1
    assert "config infeasible on this GPU" in capsys.readouterr().err
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == [BUNDLE.name]


def test_restamp_refuses_an_entry_missing_a_field_of_its_path(restamp_bundle, tmp_path):
    doc = json.loads(BUNDLE.read_text())
    entry = next(e for e in doc["winners"] if e["kernel"] == KERNEL.name and e["config"]["path"] == "tma")
    del entry["config"]["SPLIT_KV"]
    path = tmp_path / BUNDLE.name
    path.write_text(restamp_bundle.document_text(doc))
    with pytest.raises(SystemExit, match="lacks \\['SPLIT_KV'\\]"):
        restamp_bundle.main([str(path), "--kernel", KERNEL.name])


def test_a_kv_split_winner_is_followed_by_its_one_launch_twin():
    """A re-tune measures each stored TMA winner that splits the KV range beside its one-launch
    twin (SPLIT_KV=1), the likely eager choice; other winners have no variant."""
    from tritune.kernels.prefill.tuning import TUNING

    split = SPACE.parse({"path": "tma", "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "SPLIT_KV": 2})
    assert isinstance(split, TmaConfig)
    assert TUNING.winner_variants(split, None, None) == [SPACE.parse({**SPACE.to_dict(split), "SPLIT_KV": 1})]
    one = SPACE.parse({**SPACE.to_dict(split), "SPLIT_KV": 1})
    assert TUNING.winner_variants(one, None, None) == []
    assert TUNING.winner_variants(SPACE.parse({"path": "portable"}), None, None) == []

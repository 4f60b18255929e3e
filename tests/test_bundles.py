"""Bundles: deterministic JSON out, strict structural checks in, one reason per refusal."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tritune.configs_db import bundles
from tritune.configs_db.bundles import MAX_BUNDLE_BYTES, bundle_text, read_bundle, shipped_records, write_bundle
from tritune.configs_db.records import WinnerRecord

GPU = "nvidia-h200-sm90-132sm"
GPU_NAME = "NVIDIA H200"
PROVENANCE = {"torch": "2.13.0", "triton": "3.6.0", "cuda": "12.8", "driver": "570.86", "tritune": "0.1.0"}
CREATED = "2025-06-01T12:00:00+00:00"


def record(seqlen: int, kernel: str = "tma_prefill", **changes: Any) -> WinnerRecord:
    base = WinnerRecord(
        kernel=kernel,
        kernel_version="abc123",
        gpu=GPU,
        key={"arch": "sm90", "sm_count": 132, "head_dim": 128, "seqlen": seqlen, "causal": True},
        config={"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "path": "tma"},
        time_ms=0.125 * seqlen / 1024,
        portable_ms=0.2 * seqlen / 1024,
        speedup=1.6,
        trials=40,
        triton_version=PROVENANCE["triton"],
        torch_version=PROVENANCE["torch"],
        tritune_version=PROVENANCE["tritune"],
    )
    return replace(base, **changes)


RECORDS = [record(1024), record(4096), record(512, kernel="decode")]


def good_entry(seqlen: int = 1024) -> dict[str, Any]:
    return {
        "kernel": "tma_prefill",
        "kernel_version": "abc123",
        "key": {"arch": "sm90", "sm_count": 132, "seqlen": seqlen},
        "config": {"BLOCK_M": 64},
        "time_ms": 0.1,
        "portable_ms": 0.2,
        "speedup": 2.0,
        "trials": 12,
    }


def document(winners: Any = None, **changes: Any) -> dict[str, Any]:
    doc = {
        "schema": "tritune-bundle",
        "schema_version": 1,
        "gpu": GPU,
        "gpu_name": GPU_NAME,
        "created": CREATED,
        "provenance": dict(PROVENANCE),
        "winners": [good_entry()] if winners is None else winners,
    }
    doc.update(changes)
    return doc


def write_doc(path: Path, doc: Any) -> Path:
    # json.dumps writes float("nan") as the literal NaN, which is exactly what a broken file holds.
    path.write_text(json.dumps(doc, indent=2))
    return path


# ---- writing and round trip -------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    path = write_bundle(RECORDS, tmp_path / f"{GPU}.json", GPU, GPU_NAME, PROVENANCE, created=CREATED)
    records, rejections = read_bundle(path, expected_gpu=GPU)
    assert rejections == []
    extra = {"gpu_name": GPU_NAME, "cuda": "12.8", "driver": "570.86"}
    expected = [replace(r, source=f"bundle:{path}", extra=extra) for r in RECORDS]
    key = lambda r: (r.kernel, r.key["seqlen"])  # noqa: E731
    assert sorted(records, key=key) == sorted(expected, key=key)
    assert [type(r.time_ms) for r in records] == [float] * 3


def test_output_is_deterministic_and_reviewable(tmp_path: Path) -> None:
    text = bundle_text(RECORDS, GPU, GPU_NAME, PROVENANCE, created=CREATED)
    assert bundle_text(list(reversed(RECORDS)), GPU, GPU_NAME, PROVENANCE, created=CREATED) == text
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert '\n  "gpu": "nvidia-h200-sm90-132sm",\n' in text, "indent 2"
    doc = json.loads(text)
    assert list(doc) == sorted(doc)
    assert [(w["kernel"], w["key"]["seqlen"]) for w in doc["winners"]] == [
        ("decode", 512),
        ("tma_prefill", 1024),
        ("tma_prefill", 4096),
    ]
    path = write_bundle(RECORDS, tmp_path / "b.json", GPU, GPU_NAME, PROVENANCE, created=CREATED)
    assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"], "no temporary file is left behind"


def test_round_trip_keeps_the_peer_and_leaves_out_an_unknown_one(tmp_path: Path) -> None:
    peered = [record(1024, peer_ms=0.1875, peer_name="SDPA flash, KV heads expanded"), record(4096)]
    path = write_bundle(peered, tmp_path / f"{GPU}.json", GPU, GPU_NAME, PROVENANCE, created=CREATED)
    entries = {w["key"]["seqlen"]: w for w in json.loads(path.read_text())["winners"]}
    assert (entries[1024]["peer_ms"], entries[1024]["peer_name"]) == (0.1875, "SDPA flash, KV heads expanded")
    assert "peer_ms" not in entries[4096] and "peer_name" not in entries[4096]
    records, rejections = read_bundle(path, expected_gpu=GPU)
    assert rejections == []
    assert {r.key["seqlen"]: (r.peer_ms, r.peer_name) for r in records} == {
        1024: (0.1875, "SDPA flash, KV heads expanded"),
        4096: (None, None),
    }


def test_an_entry_without_peer_fields_reads_as_no_peer(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "b.json", document([good_entry(1024)]))
    (only,), rejections = read_bundle(path)
    assert rejections == [] and (only.peer_ms, only.peer_name) == (None, None)


def test_an_entry_with_null_peer_fields_reads_as_no_peer(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "b.json", document([{**good_entry(1024), "peer_ms": None, "peer_name": None}]))
    (only,), rejections = read_bundle(path)
    assert rejections == [] and (only.peer_ms, only.peer_name) == (None, None)


@pytest.mark.parametrize(
    "records, reason",
    [
        pytest.param([record(1024, peer_ms=-1.0, peer_name="SDPA flash")], "peer_ms is -1.0", id="negative-peer"),
        pytest.param([record(1024, peer_ms=0.1)], "both or neither", id="peer-without-name"),
        pytest.param([record(1024, gpu="nvidia-a100-sm80-108sm")], "gpu", id="other-gpu"),
        pytest.param([record(1024, triton_version="3.5.0")], "triton", id="other-triton"),
        pytest.param([record(1024), record(1024, time_ms=0.01)], "two records", id="duplicate-key"),
        pytest.param([record(1024, speedup=float("nan"))], "speedup is nan", id="nan-speedup"),
        pytest.param([record(1024, config={"BLOCK_M": [64]})], "config.BLOCK_M is a list", id="nested-config"),
    ],
)
def test_write_refuses_what_read_would_refuse(records: list[WinnerRecord], reason: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=reason):
        write_bundle(records, tmp_path / "b.json", GPU, GPU_NAME, PROVENANCE, created=CREATED)
    assert not (tmp_path / "b.json").exists()


# ---- shipped bundles ---------------------------------------------------------------------------


def test_shipped_bundle_dir_is_the_package_folder() -> None:
    assert bundles.shipped_bundle_dir() == Path(bundles.__file__).resolve().parent / "bundles"
    assert bundles.shipped_bundle_dir().is_dir()


def test_no_shipped_bundle_means_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bundles, "shipped_bundle_dir", lambda: tmp_path)
    assert shipped_records(GPU) == ([], [])


def test_shipped_records_checks_the_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bundles, "shipped_bundle_dir", lambda: tmp_path)
    write_bundle(RECORDS, tmp_path / f"{GPU}.json", GPU, GPU_NAME, PROVENANCE, created=CREATED)
    records, rejections = shipped_records(GPU)
    assert (len(records), rejections) == (3, [])
    # A file copied under another GPU's name is refused whole.
    (tmp_path / "nvidia-a100-sm80-108sm.json").write_text((tmp_path / f"{GPU}.json").read_text())
    records, [rejection] = shipped_records("nvidia-a100-sm80-108sm")
    assert records == []
    assert "bundle is for GPU nvidia-h200-sm90-132sm, expected nvidia-a100-sm80-108sm" in rejection.reason


def test_shipped_records_refuses_a_path_as_gpu() -> None:
    records, [rejection] = shipped_records("../../etc/passwd")
    assert records == [] and "not a GPU slug" in rejection.reason


# ---- refusing a whole file ---------------------------------------------------------------------


def _oversized(path: Path) -> None:
    with path.open("wb") as fh:
        fh.truncate(MAX_BUNDLE_BYTES + 1)


FILE_CASES = [
    pytest.param(lambda p: p.write_text('{"schema": "tritune-bundle", '), "broken JSON", id="broken-json"),
    pytest.param(
        lambda p: write_doc(p, document(winners=[{}] * 20_001)), "20001 winners, more than 20000", id="too-many-entries"
    ),
    pytest.param(
        lambda p: write_doc(p, document(gpu_name="H" * 129)),
        "gpu_name is 129 characters long, expected at most 128",
        id="gpu-name-wider-than-its-column",
    ),
    pytest.param(
        lambda p: write_doc(p, document(provenance={**PROVENANCE, "driver": "5" * 65})),
        "provenance.driver is 65 characters long, expected at most 64",
        id="provenance-wider-than-its-column",
    ),
    pytest.param(lambda p: write_doc(p, [document()]), "top level is a list, expected an object", id="not-an-object"),
    pytest.param(
        lambda p: write_doc(p, document(schema="vllm-configs")), "schema is 'vllm-configs'", id="wrong-schema-name"
    ),
    pytest.param(
        lambda p: write_doc(p, document(schema_version=2)), "unknown schema_version 2", id="unknown-schema-version"
    ),
    pytest.param(
        lambda p: write_doc(p, document(schema_version=True)),
        "unknown schema_version True",
        id="boolean-schema-version",
    ),
    pytest.param(_oversized, "over the limit of 8388608 bytes", id="oversized"),
    pytest.param(
        lambda p: write_doc(p, document(gpu="nvidia-a100-sm80-108sm")), "expected nvidia-h200", id="gpu-mismatch"
    ),
    pytest.param(lambda p: p.write_bytes(b'{"schema": "\xff"}'), "not UTF-8", id="not-utf8"),
    pytest.param(
        lambda p: p.write_text('{"schema": "tritune-bundle", "schema": "tritune-bundle"}'),
        "duplicate key 'schema'",
        id="duplicate-field",
    ),
    pytest.param(lambda p: p.write_text("[" * 200_000), "nested too deeply", id="deeply-nested"),
    pytest.param(
        lambda p: write_doc(p, {k: v for k, v in document().items() if k != "provenance"}),
        "missing field(s) provenance",
        id="missing-provenance",
    ),
    pytest.param(
        lambda p: write_doc(p, document(provenance={**PROVENANCE, "triton": 3.6})),
        "provenance.triton is a number",
        id="provenance-wrong-type",
    ),
    pytest.param(lambda p: write_doc(p, document(winners={"a": 1})), "winners is an object", id="winners-not-a-list"),
    pytest.param(lambda p: write_doc(p, document(created="yesterday")), "ISO 8601", id="bad-created"),
    pytest.param(lambda p: write_doc(p, document(signature="x")), "unknown field(s) signature", id="unknown-field"),
    pytest.param(lambda p: None, "cannot read", id="missing-file"),
]


def test_oversized_file_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "huge.json"
    _oversized(path)

    def no_reading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an oversized bundle must be refused before it is opened")

    monkeypatch.setattr(Path, "open", no_reading)
    records, [rejection] = read_bundle(path)
    assert records == [] and "over the limit" in rejection.reason


@pytest.mark.parametrize("make, reason", FILE_CASES)
def test_whole_file_refused_with_one_reason(make: Any, reason: str, tmp_path: Path) -> None:
    path = tmp_path / f"{GPU}.json"
    make(path)
    records, rejections = read_bundle(path, expected_gpu=GPU)
    assert records == []
    assert len(rejections) == 1
    assert reason in rejections[0].reason
    assert rejections[0].reason.startswith(str(path))
    assert rejections[0].source == f"bundle:{path}"


def test_any_gpu_is_accepted_when_none_is_expected(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "b.json", document(gpu="nvidia-a100-sm80-108sm"))
    records, rejections = read_bundle(path)
    assert rejections == [] and [r.gpu for r in records] == ["nvidia-a100-sm80-108sm"]


# ---- refusing single entries --------------------------------------------------------------------


def _without(name: str) -> dict[str, Any]:
    entry = good_entry(2048)
    del entry[name]
    return entry


ENTRY_CASES = [
    pytest.param(_without("time_ms"), "missing field(s) time_ms", id="missing-field"),
    pytest.param({**good_entry(2048), "key": ["sm90", 2048]}, "key is a list, expected an object", id="key-wrong-type"),
    pytest.param({**good_entry(2048), "time_ms": "0.1"}, "time_ms is a string", id="time-wrong-type"),
    pytest.param({**good_entry(2048), "kernel": ""}, "kernel is a string, expected a non-empty", id="empty-kernel"),
    pytest.param(
        {**good_entry(2048), "kernel_version": "v" * 65},
        "kernel_version is 65 characters long, expected at most 64",
        id="kernel-version-wider-than-its-column",
    ),
    pytest.param({**good_entry(2048), "speedup": float("nan")}, "speedup is NaN", id="nan-speedup"),
    pytest.param({**good_entry(2048), "speedup": float("inf")}, "speedup is Infinity", id="infinite-speedup"),
    pytest.param({**good_entry(2048), "time_ms": -0.1}, "time_ms is -0.1", id="negative-time"),
    pytest.param({**good_entry(2048), "speedup": 0}, "speedup is 0", id="speedup-zero"),
    pytest.param({**good_entry(2048), "speedup": 1500.0}, "measurement error", id="speedup-absurd"),
    pytest.param({**good_entry(2048), "trials": 0}, "trials is 0", id="trials-zero"),
    pytest.param({**good_entry(2048), "trials": True}, "trials is a boolean", id="trials-boolean"),
    pytest.param({**good_entry(2048), "config": {"BLOCK_M": None}}, "config.BLOCK_M is null", id="null-config-value"),
    pytest.param({**good_entry(2048), "config": {"BLOCK_M": {"v": 1}}}, "config.BLOCK_M is an object", id="nested"),
    pytest.param({**good_entry(2048), "note": "fast"}, "unknown field(s) note", id="unknown-field"),
    pytest.param("tma_prefill", "is a string, expected an object", id="not-an-object"),
    pytest.param(good_entry(1024), "same kernel, version and key as winners[0]", id="duplicate-entry"),
    pytest.param({**good_entry(2048), "peer_ms": 0.0, "peer_name": "SDPA flash"}, "peer_ms is 0.0", id="zero-peer"),
    pytest.param({**good_entry(2048), "peer_name": "SDPA flash"}, "one is missing", id="peer-name-alone"),
    pytest.param({**good_entry(2048), "peer_ms": 0.1, "peer_name": None}, "both or neither", id="null-peer-name"),
    pytest.param(
        {**good_entry(2048), "eager": {"config": {"BLOCK_M": 32}, "ms": 0.1}},
        "missing field(s) winner_ms",
        id="eager-without-winner-ms",
    ),
    pytest.param(
        {**good_entry(2048), "eager": {"config": [], "ms": 0.1, "winner_ms": 0.2}},
        "eager.config is a list",
        id="eager-config-a-list",
    ),
]


@pytest.mark.parametrize("bad, reason", ENTRY_CASES)
def test_bad_entry_refused_and_neighbours_kept(bad: Any, reason: str, tmp_path: Path) -> None:
    path = write_doc(tmp_path / "b.json", document([good_entry(1024), bad, good_entry(4096)]))
    records, rejections = read_bundle(path, expected_gpu=GPU)
    assert [r.key["seqlen"] for r in records] == [1024, 4096]
    assert len(rejections) == 1
    assert f"{path}: winners[1]" in rejections[0].reason
    assert reason in rejections[0].reason


def test_overflowing_number_is_not_finite(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    text = json.dumps(document([good_entry(1024), {**good_entry(2048), "time_ms": "@"}]))
    path.write_text(text.replace('"@"', "1e999"))
    records, [rejection] = read_bundle(path)
    assert len(records) == 1
    assert "time_ms is inf, not a finite number" in rejection.reason


#: Every bundle the package ships, one per GPU, each named after its GPU's slug.
SHIPPED_BUNDLES = sorted(bundles.shipped_bundle_dir().glob("*.json"))


def _bundle_device(document: dict[str, Any]) -> Any:
    """The NVIDIA device a shipped bundle was tuned on, from its GPU name and its slug's
    ``-smXY-Nsm`` tail (the slug the runtime computes for that device must be the bundle's)."""
    from tritune.kernels.device import DeviceInfo

    arch, sms = document["gpu"].rsplit("-", 2)[1:]
    capability = (int(arch[2:-1]), int(arch[-1]))
    return DeviceInfo(document["gpu_name"], "nvidia", capability, int(sms.removesuffix("sm")), arch)


def test_a_bundle_ships_for_the_h200_and_the_h100():
    assert [path.stem for path in SHIPPED_BUNDLES] == ["nvidia-h100-80gb-hbm3-sm90-132sm", "nvidia-h200-sm90-132sm"]


@pytest.mark.parametrize("path", SHIPPED_BUNDLES, ids=lambda path: path.stem)
def test_shipped_bundle_is_well_formed_and_current(path: Path) -> None:
    """Each committed bundle parses entry by entry and, tuned from this source, admits on its GPU.

    A kernel edit changes that kernel's version and makes its entries stale: the dispatcher then
    refuses them with one warning and serves the portable path. This test names which kernels'
    entries went stale, so the bundle is re-tuned (``scripts/gpu_suite.sh``) in the same change.
    """
    from tritune.kernels.winners import Rejection, admit

    device = _bundle_device(json.loads(path.read_text()))
    assert device.slug == path.stem, "the file is named after the slug of the GPU it was tuned on"
    records, rejections = shipped_records(device.slug)
    assert rejections == []
    assert len(records) >= 20
    refused = [outcome.reason for outcome in (admit(r, device) for r in records) if isinstance(outcome, Rejection)]
    assert refused == [], f"re-tune these kernels on {device.name} and commit the new bundle:\n" + "\n".join(refused)

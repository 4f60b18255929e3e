"""Hostile bundle files, through both readers: the runtime's loader (the dispatcher's shipped bundle)
and ``tune import``.

A hostile entry (console markup, a lone surrogate, a forged log line, an ANSI escape, an integer no
column holds) is refused alone with its reason, and the good entry beside it is still served and
imported. A path that is not a regular file (a FIFO, a directory, a device, a dangling link) is
refused with its reason and never blocks the reader. Nothing from a file reaches a log line or the
terminal unescaped.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_kernel
import triton
from typer.testing import CliRunner

from tritune.configs_db import bundles
from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry, settings
from tritune.kernels.dispatcher import dispatch_config
from tritune.tuner.cli import app

pytestmark = pytest.mark.usefixtures("toy_dispatch")

PORTABLE = {"BLOCK": 32, "BROKEN": False, "num_warps": 4}
TUNED = {"BLOCK": 128, "BROKEN": False, "num_warps": 2}
#: Stands for a literal written into the JSON text as is (json.dumps cannot write these).
HUGE = "@HUGE@"


def entry(n_bucket: int = 128, **changes: Any) -> dict[str, Any]:
    base = {
        "kernel": "toy_scale",
        "kernel_version": toy_kernel.SPEC.version,
        "key": {"arch": "cpu-interpreter", "sm_count": 1, "dtype": "float32", "n_bucket": n_bucket},
        "config": dict(TUNED),
        "time_ms": 0.1,
        "portable_ms": 0.2,
        "speedup": 2.0,
        "trials": 12,
    }
    base.update(changes)
    return base


def text(*entries: dict[str, Any], huge: str = "", **changes: Any) -> str:
    """A bundle of the ``cpu-interpreter`` pseudo-device holding ``entries``, as JSON text."""
    doc = {
        "schema": "tritune-bundle",
        "schema_version": 1,
        "gpu": "cpu-interpreter",
        "gpu_name": "cpu-interpreter",
        "created": "2025-06-01T12:00:00+00:00",
        "provenance": {
            "cuda": "",
            "driver": "",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "tritune": "0",
        },
        "winners": list(entries),
        **changes,
    }
    # ensure_ascii writes a lone surrogate as the escape "\ud800", as a hostile file would hold it.
    return json.dumps(doc, indent=2, ensure_ascii=True).replace(f'"{HUGE}"', huge)


def with_good(bad: dict[str, Any], huge: str = "") -> str:
    """The good entry at the key the tests dispatch, then the hostile one at another key."""
    return text(entry(128), bad, huge=huge)


#: name -> (bundle text, the reason its hostile entry is refused with, in both readers).
ENTRY_CASES: dict[str, tuple[str, str]] = {
    "markup-kernel": (with_good(entry(256, kernel="[/]")), "[/]: unknown kernel"),
    "markup-config": (with_good(entry(256, config={**TUNED, "BLOCK": "[bold]"})), "config outside the search space"),
    "surrogate-kernel": (
        with_good(entry(256, kernel="\ud800")),
        "kernel is '\\ud800', which holds a control character or a lone surrogate",
    ),
    "surrogate-key": (
        with_good(entry(256, key={**entry()["key"], "dtype": "float\udfff"})),
        "key.dtype is 'float\\udfff', which holds",
    ),
    "forged-log-line": (
        with_good(entry(256, kernel="toy_scale\nWARNING tritune: all good")),
        "kernel is 'toy_scale\\nWARNING tritune: all good', which holds",
    ),
    "ansi-escape": (
        with_good(entry(256, kernel_version="\x1b[2J\x1b[31mred")),
        "kernel_version is '\\x1b[2J\\x1b[31mred', which holds",
    ),
    "4000-digit-time": (
        with_good(entry(256, time_ms=HUGE), huge="1" * 4000),
        "time_ms is an integer of 4000 digits (outside the 64-bit range)",
    ),
    "5000-digit-time": (
        with_good(entry(256, time_ms=HUGE), huge="1" * 5000),
        "time_ms is an integer of 5000 digits (outside the 64-bit range)",
    ),
    "4000-digit-key": (
        with_good(entry(256, key={**entry()["key"], "n_bucket": HUGE}), huge="9" * 4000),
        "key.n_bucket is an integer of 4000 digits (outside the 64-bit range)",
    ),
    "2**63-trials": (
        with_good(entry(256, trials=2**63)),
        "trials is the integer 9223372036854775808 (outside the 64-bit range), expected a whole number",
    ),
    "2**31-trials": (with_good(entry(256, trials=2**31)), "trials is 2147483648, expected at most 2147483647"),
    # The peer's time and name (optional) are checked as time_ms and the other strings are.
    "negative-peer": (
        with_good(entry(256, peer_ms=-0.5, peer_name="SDPA flash")),
        "peer_ms is -0.5, expected a positive number",
    ),
    "nan-peer": (
        with_good(entry(256, peer_ms=HUGE, peer_name="SDPA flash"), huge="NaN"),
        "peer_ms is NaN (not a finite number), expected a number",
    ),
    "infinite-peer": (
        with_good(entry(256, peer_ms=HUGE, peer_name="SDPA flash"), huge="1e999"),
        "peer_ms is inf, not a finite number",
    ),
    "4000-digit-peer": (
        with_good(entry(256, peer_ms=HUGE, peer_name="SDPA flash"), huge="1" * 4000),
        "peer_ms is an integer of 4000 digits (outside the 64-bit range)",
    ),
    "string-peer": (
        with_good(entry(256, peer_ms="0.1", peer_name="SDPA flash")),
        "peer_ms is a string, expected a number",
    ),
    "boolean-peer": (
        with_good(entry(256, peer_ms=True, peer_name="SDPA flash")),
        "peer_ms is a boolean, expected a number",
    ),
    "peer-without-name": (with_good(entry(256, peer_ms=0.1)), "peer_ms and peer_name come together"),
    "markup-peer-name": (
        with_good(entry(256, peer_ms=0.1, peer_name="[bold red]SDPA[/]")),
        "peer_name is '[bold red]SDPA[/]', expected letters, digits, spaces and",
    ),
    "forged-peer-name": (
        with_good(entry(256, peer_ms=0.1, peer_name="SDPA\nWARNING tritune: all good")),
        "peer_name is 'SDPA\\nWARNING tritune: all good', which holds a control character",
    ),
    "ansi-peer-name": (
        with_good(entry(256, peer_ms=0.1, peer_name="\x1b[2JSDPA")),
        "peer_name is '\\x1b[2JSDPA', which holds",
    ),
    "long-peer-name": (
        with_good(entry(256, peer_ms=0.1, peer_name="SDPA " * 20)),
        "peer_name is 100 characters long, expected at most 64",
    ),
    "number-peer-name": (with_good(entry(256, peer_ms=0.1, peer_name=7)), "peer_name is a number, expected a"),
    # The eager alternative (optional) is checked for shape; a malformed one refuses its entry.
    "nan-eager": (
        with_good(entry(256, eager={"config": dict(TUNED), "ms": HUGE, "winner_ms": 0.1}), huge="NaN"),
        "eager.ms is NaN (not a finite number), expected a number",
    ),
    "forged-eager-config": (
        with_good(entry(256, eager={"config": {**TUNED, "BLOCK": "\x1b[2J"}, "ms": 0.05, "winner_ms": 0.1})),
        "eager.config.BLOCK is '\\x1b[2J', which holds a control character",
    ),
}


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "gone.json")


def _device(path: Path) -> None:
    path.symlink_to("/dev/zero")


#: name -> (what makes the path, the reason the whole file is refused with).
FILE_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "is a FIFO, not a regular file"),
    "directory": (lambda p: p.mkdir(), "is a directory, not a regular file"),
    "dangling-link": (_dangling, "dangling symbolic link (to "),
    "device": (_device, "is a character device, not a regular file"),
    "surrogate-gpu-name": (
        lambda p: p.write_text(text(entry(128), gpu_name="\ud800")),
        "gpu_name is '\\ud800', which holds a control character or a lone surrogate",
    ),
}


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the ``cpu-interpreter`` bundle is shipped: a temporary folder, bundles on."""
    folder = tmp_path / "bundles"
    folder.mkdir()
    monkeypatch.setattr(bundles, "shipped_bundle_dir", lambda: folder)
    monkeypatch.setenv("TRITUNE_DISABLE_BUNDLES", "0")
    settings.reload()
    return folder / "cpu-interpreter.json"


def served() -> dict[str, Any]:
    spec = toy_kernel.SPEC
    config = dispatch_config("toy_scale", "cpu", -1, tuple(spec.facts(torch.randn(100))))
    return dict(spec.space.to_dict(config))


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def clean(line: str) -> bool:
    """Nothing a file could use to forge or garble output: no control character, no lone surrogate."""
    return line.isprintable()


def import_(path: Path, db: Path) -> Any:
    return CliRunner().invoke(app, ["import", str(path), "--db", str(db)])


# ---- the runtime's loader ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENTRY_CASES))
def test_loader_refuses_the_entry_and_serves_its_neighbour(
    name: str, shipped: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tritune")
    bundle, reason = ENTRY_CASES[name]
    shipped.write_text(bundle)
    assert served() == TUNED
    messages = warnings(caplog)
    assert len(messages) == 1, messages
    assert reason in messages[0]
    assert all(clean(message) for message in messages), messages


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_loader_refuses_a_file_that_is_no_bundle_and_says_why(
    name: str, shipped: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tritune")
    make, reason = FILE_CASES[name]
    make(shipped)
    assert served() == PORTABLE
    messages = warnings(caplog)
    assert len(messages) == 1, messages
    assert reason in messages[0]


def test_loader_without_a_shipped_bundle_is_silent(shipped: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tritune")
    assert served() == PORTABLE
    assert warnings(caplog) == []


# ---- tune import -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENTRY_CASES))
def test_import_refuses_the_entry_and_keeps_its_neighbour(name: str, tmp_path: Path) -> None:
    bundle, reason = ENTRY_CASES[name]
    path = tmp_path / "b.json"
    path.write_text(bundle)
    db = tmp_path / "c.sqlite"
    result = import_(path, db)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert all(clean(line) for line in result.output.splitlines()), result.output
    output = " ".join(result.output.split())
    assert "imported 1 winner(s), kept 0 existing better one(s), refused 1 entry" in output
    assert reason in output
    (stored,) = ConfigStore(f"sqlite:///{db}").winners()
    assert stored.key["n_bucket"] == 128


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_import_refuses_a_file_that_is_no_bundle(name: str, tmp_path: Path) -> None:
    make, reason = FILE_CASES[name]
    path = tmp_path / "b.json"
    make(path)
    db = tmp_path / "c.sqlite"
    result = import_(path, db)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert reason in " ".join(result.output.split())
    assert "nothing was imported" in result.output
    assert not db.exists()


def test_import_of_an_oversized_file_names_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    with path.open("wb") as fh:
        fh.truncate(bundles.MAX_BUNDLE_BYTES + 1)
    result = import_(path, tmp_path / "c.sqlite")
    assert result.exit_code == 1, result.output
    assert f"over the limit of {bundles.MAX_BUNDLE_BYTES} bytes for a bundle (8 MiB)" in " ".join(result.output.split())


def test_path_with_markup_and_a_newline_is_printed_escaped(tmp_path: Path) -> None:
    folder = tmp_path / "[bold]x\n[red]"
    folder.mkdir()
    path = folder / "b.json"
    path.write_text(text(entry(128, kernel="[red]nope[/red]")))
    result = import_(path, tmp_path / "c.sqlite")
    assert result.exit_code == 1, result.output
    assert "[bold]x\\n[red]" in result.output
    assert "refused" in result.output and "[red]nope[/red]: unknown kernel" in result.output


def test_a_peer_time_and_name_are_imported_and_served_beside_their_entry(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(text(entry(128, peer_ms=0.25, peer_name="SDPA flash"), entry(256)))
    db = tmp_path / "c.sqlite"
    result = import_(path, db)
    assert result.exit_code == 0, result.output
    assert "imported 2 winner(s)" in result.output
    stored = {w.key["n_bucket"]: (w.peer_ms, w.peer_name) for w in ConfigStore(f"sqlite:///{db}").winners()}
    assert stored == {128: (0.25, "SDPA flash"), 256: (None, None)}


def test_numbers_past_every_range_are_named_not_raised() -> None:
    """Python ints too wide for a float once made ``math.isfinite`` raise ``OverflowError``."""
    from tritune.configs_db.values import check_flat, winner_numbers_problem

    assert (
        winner_numbers_problem(10**5000, 0.2, 2.0, 12)
        == "time_ms is an integer of about 5000 digits, outside the 64-bit range"
    )
    assert winner_numbers_problem(0.1, 0.2, 2.0, 2**63) == "trials is 9223372036854775808, expected at most 2147483647"
    with pytest.raises(ValueError, match=r"key\.n is an integer of about 5000 digits, outside the 64-bit range"):
        check_flat({"n": 10**5000}, "key")


def test_an_entry_whose_key_breaks_a_feasibility_rule_is_refused_and_the_rest_serve() -> None:
    """A decode key with zero (sequences x heads) makes the split rule divide by zero: that entry is
    refused with the reason, and the table of every other entry is still built."""
    import dataclasses

    from tritune.configs_db.records import Rejection
    from tritune.kernels.device import DeviceInfo
    from tritune.kernels.winners import admit, build_table

    h200 = DeviceInfo("NVIDIA H200", "nvidia", (9, 0), 132, "sm90")
    records, _ = bundles.shipped_records(h200.slug)
    decode = next(r for r in records if r.kernel == "splitk_decode")
    hostile = dataclasses.replace(decode, key={**decode.key, "bh_bucket": 0})
    outcome = admit(hostile, h200)
    assert isinstance(outcome, Rejection) and "ZeroDivisionError" in outcome.reason
    table = build_table([[hostile, *records]], h200)
    assert len(table) == len(records)


def test_import_refuses_an_entry_whose_key_breaks_a_feasibility_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    document = json.loads(bundles.bundle_path("nvidia-h200-sm90-132sm").read_text())
    decode = next(w for w in document["winners"] if w["kernel"] == "splitk_decode")
    document["winners"] = [decode, {**decode, "key": {**decode["key"], "lkv_bucket": decode["key"]["lkv_bucket"] * 2}}]
    path = tmp_path / "nvidia-h200-sm90-132sm.json"
    path.write_text(json.dumps(document))
    space = registry.get_spec("splitk_decode").space
    real = space.infeasible_reason

    def crashes_at_the_doubled_key(config: Any, key: Any, limits: Any) -> str | None:
        if key.lkv_bucket == decode["key"]["lkv_bucket"] * 2:
            raise ZeroDivisionError("division by zero")
        return real(config, key, limits)

    monkeypatch.setattr(space, "infeasible_reason", crashes_at_the_doubled_key)
    result = import_(path, tmp_path / "db.sqlite")
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "ZeroDivisionError" in output and "imported 1" in output, output


def test_import_refuses_a_key_no_call_resolves_to(tmp_path: Path) -> None:
    """A key the kernel's ``valid_key`` refuses (here a zero batch-heads bucket) could never be served."""
    document = json.loads(bundles.bundle_path("nvidia-h200-sm90-132sm").read_text())
    decode = next(w for w in document["winners"] if w["kernel"] == "splitk_decode")
    document["winners"] = [decode, {**decode, "key": {**decode["key"], "bh_bucket": 0}}]
    path = tmp_path / "nvidia-h200-sm90-132sm.json"
    path.write_text(json.dumps(document))
    result = import_(path, tmp_path / "db.sqlite")
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "a key this kernel never resolves a call to" in output and "imported 1" in output, output

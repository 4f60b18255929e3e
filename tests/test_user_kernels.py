"""Users' own kernels: declared in a file or a module, known by name, and served the winners stored for them,
even winners loaded before the kernel was declared."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import triton
from typer.testing import CliRunner

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry, settings
from tritune.kernels.device import interpreter_device
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.tuner.cli import app

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rmsnorm.py"
CPU = interpreter_device()


def copy_example(folder: Path, name: str, edit: Callable[[str], str] | None = None) -> Path:
    """The example declaration under another kernel name (each name can be declared once per process)."""
    text = EXAMPLE.read_text().replace('"example_rmsnorm"', f'"{name}"')
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(edit(text) if edit is not None else text)
    return path


def test_a_file_is_loaded_once_and_its_kernel_known_by_name(tmp_path):
    path = copy_example(tmp_path, "user_rmsnorm_file")
    spec = registry.load(f"{path}:RMSNORM")
    assert spec.name == "user_rmsnorm_file" and registry.get_spec("user_rmsnorm_file") is spec
    assert registry.load(f"{path}:RMSNORM") is spec
    assert registry.target_of(spec) == f"{path.resolve()}:RMSNORM"
    assert "user_rmsnorm_file" in registry.kernel_names()


def test_a_module_imported_under_two_names_is_one_kernel(tmp_path, monkeypatch):
    """Loaded by path, then imported by module name: the same name and version is the same kernel."""
    path = copy_example(tmp_path, "user_rmsnorm_twice")
    by_path = registry.load(f"{path}:RMSNORM")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.load("user_rmsnorm_twice:RMSNORM") is by_path
    module = sys.modules["user_rmsnorm_twice"]
    x, weight = torch.randn(3, 64), torch.rand(64)
    # The kernel computes in float32: float32's tolerances against the float64 reference.
    torch.testing.assert_close(module.rms_norm(x, weight), by_path.reference(x, weight).float())


def test_another_kernel_under_a_taken_name_is_refused_and_leaves_the_first_one_alone(tmp_path):
    first = registry.load(f"{copy_example(tmp_path, 'user_rmsnorm_clash')}:RMSNORM")
    edited = copy_example(tmp_path / "other", "user_rmsnorm_clash", lambda text: text.replace("+ eps)", "+ 2 * eps)"))
    with pytest.raises(ValueError, match="'user_rmsnorm_clash' is declared twice with different code"):
        registry.load(f"{edited}:RMSNORM")
    assert registry.get_spec("user_rmsnorm_clash") is first
    # The op still runs the first declaration's code (eps, not 2 * eps).
    x, weight, eps = torch.randn(2, 32), torch.rand(32), 0.5
    out = torch.empty_like(x)
    first.op(x, weight, eps, out, **first.space.field_values(first.space.default()))
    torch.testing.assert_close(out, first.reference(x, weight, eps).float())


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """An installed package's entry point in the group tritune.kernels, naming a declaration."""
    copy_example(tmp_path, "user_rmsnorm_installed")
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [
        importlib.metadata.EntryPoint("user_rmsnorm_installed", "user_rmsnorm_installed:RMSNORM", "tritune.kernels"),
        importlib.metadata.EntryPoint("misnamed", "user_rmsnorm_installed:RMSNORM", "tritune.kernels"),
    ]
    real = importlib.metadata.entry_points

    def entry_points(**selection):
        return points if selection.get("group") == "tritune.kernels" else real(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_an_installed_packages_kernel_is_known_by_name(installed):
    assert "user_rmsnorm_installed" in registry.kernel_names()
    assert not registry.known("user_rmsnorm_installed"), "serving code does not import it unasked"
    spec = registry.find("user_rmsnorm_installed")
    assert spec.name == "user_rmsnorm_installed" and registry.known("user_rmsnorm_installed")
    with pytest.raises(KeyError, match="declares a kernel named 'user_rmsnorm_installed', not 'misnamed'"):
        registry.find("misnamed")
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["list"])
    output = " ".join(result.output.split())
    assert f"user_rmsnorm_installed (version {spec.version}, protocol 1," in output
    assert "declared at user_rmsnorm_installed:RMSNORM" in output
    assert "misnamed: its declaration cannot be imported" in output


def test_winners_loaded_before_their_kernel_is_declared_serve_it_once_it_is(tmp_path, caplog):
    """The dispatcher loads a device's winners once. Those of a kernel not declared yet (a user's module
    imported after the first call of another kernel) are kept aside, and admitted when it is declared."""
    # The same code under another name has the same version (the name is not part of it).
    version = registry.load(f"{copy_example(tmp_path, 'user_rmsnorm_probe')}:RMSNORM").version
    tuned = {"BLOCK_N": 64, "num_warps": 1}
    record = WinnerRecord(
        kernel="user_rmsnorm_late", kernel_version=version, gpu=CPU.slug,
        key={"arch": CPU.arch, "sm_count": CPU.sm_count, "dtype": "fp32", "n_bucket": 64}, config=tuned,
        time_ms=1.0, portable_ms=2.0, speedup=2.0, trials=4, triton_version=triton.__version__,
        torch_version=torch.__version__, tritune_version="test",
    )  # fmt: skip
    with ConfigStore(settings.settings().db_url) as store:
        versions = {"torch_version": torch.__version__, "triton_version": triton.__version__}
        store.offer_winner(record, store.environment(gpu=CPU.slug, tritune_version="test", **versions))
    caplog.set_level(logging.WARNING, logger="tritune.dispatch")
    DISPATCHER.clear()
    try:
        table = DISPATCHER.table(CPU)
        assert [r.kernel for r in table.waiting["user_rmsnorm_late"]] == ["user_rmsnorm_late"]
        assert any("user_rmsnorm_late: unknown kernel (kept aside" in r.getMessage() for r in caplog.records)

        late = registry.load(f"{copy_example(tmp_path, 'user_rmsnorm_late')}:RMSNORM")
        facts = tuple(late.facts(torch.randn(4, 64), torch.rand(64)))
        assert dispatch_config("user_rmsnorm_late", "cpu", -1, facts) == late.space.parse(tuned)
        assert not table.waiting
    finally:
        DISPATCHER.clear()


@pytest.mark.parametrize("workers", ["isolated", "fleet"])
def test_a_file_declaration_is_tuned_in_worker_processes(tmp_path, workers):
    """Worker processes import the kernel from the file the coordinator named (a candidate worker, or one
    fleet process per entry of --device cpu --workers 2)."""
    path = copy_example(tmp_path, f"user_rmsnorm_{workers}")
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    mode = ["--workers", "2", "--no-isolate"] if workers == "fleet" else []
    args = ["--device", "cpu", "--kernel", f"{path}:RMSNORM", "--key", "n_bucket=64", "--trials", "3", *mode]
    result = CliRunner().invoke(app, [*args, "--db", db], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (winner,) = ConfigStore(db).winners(kernel=f"user_rmsnorm_{workers}")
    assert winner.key["n_bucket"] == 64 and winner.trials >= 3

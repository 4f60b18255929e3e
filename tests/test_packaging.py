"""What an install of tritune brings: the runtime alone, the tuner as an extra, every third-party import
declared, type hints shipped (PEP 561)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Installed package -> source folder (``[tool.setuptools] package-dir``).
PACKAGES = {"tritune.kernels": "kernels", "tritune.tuner": "tuner", "tritune.configs_db": "configs_db",
            "tritune.search_spaces": "search_spaces"}  # fmt: skip


def _distribution(requirement: str) -> str:
    """``"numpy>=1.24"`` -> ``"numpy"``, normalised as PEP 503 compares names."""
    name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules(folder: Path) -> set[str]:
    modules: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules


#: Source folder -> the extras whose packages it may import, where the feature needing them is used: the
#: config DB's schema upgrades (Alembic) are the tuner's, and reading GGUF files is Q4KWeight.from_gguf's.
EXTRAS_USED = {"kernels": ["gguf"], "search_spaces": [], "configs_db": ["tune"], "tuner": ["tune"]}
#: What the runtime must do without: the ``tune`` extra.
TUNER_ONLY = ("optuna", "alembic", "typer", "rich")


def _extra(name: str) -> set[str]:
    return {_distribution(r) for r in PYPROJECT["project"]["optional-dependencies"][name]}


def test_every_third_party_import_of_the_packages_is_a_declared_dependency():
    declared = {_distribution(r) for r in PYPROJECT["project"]["dependencies"]}
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for folder in PACKAGES.values():
        allowed = declared.union(*(_extra(name) for name in EXTRAS_USED[folder]))
        for module in _imported_modules(ROOT / folder):
            if module in sys.stdlib_module_names or module == "tritune":
                continue
            distributions = {_distribution(d) for d in owners.get(module, [module])}
            if not distributions & allowed:
                missing[f"{folder}: {module}"] = sorted(distributions)
    assert not missing, f"imported but neither a dependency nor an extra of its folder: {missing}"


def test_the_runtime_needs_none_of_the_tuners_packages_and_dev_installs_them():
    runtime = {_distribution(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not runtime & set(TUNER_ONLY) and "gguf" not in runtime
    assert set(TUNER_ONLY) <= _extra("tune")
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    assert "tritune[tune,gguf,postgres]" in dev
    assert {script: target for script, target in PYPROJECT["project"]["scripts"].items()} == {
        "tune": "tritune.tuner.entry:main",
        "tritune": "tritune.tuner.entry:main",
    }


#: Run first in the child processes below: the tuner's packages cannot be imported there.
BLOCK_TUNER = f"""
import sys
BLOCKED = {set(TUNER_ONLY)!r}


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Blocked())
"""

SERVE = """
import importlib, json, pkgutil
import torch
import tritune.configs_db, tritune.kernels, tritune.search_spaces
from tritune.kernels import registry
from tritune.kernels.dispatcher import dispatch_config

for package in (tritune.kernels, tritune.configs_db, tritune.search_spaces):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        # Alembic's scripts upgrade the DB's schema: the tuner's, which writes it.
        if ".migrations" not in module.name:
            importlib.import_module(module.name)
spec = registry.load(sys.argv[1])
x, weight = torch.randn(4, 64), torch.rand(64)
config = dispatch_config(spec.name, "cpu", -1, tuple(spec.facts(x, weight)))
error = float((spec(x, weight).double() - spec.reference(x, weight)).abs().max())
print(json.dumps({"config": spec.space.to_dict(config), "error": error}))
"""


def _child(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "TRITON_INTERPRET": "1", "TRITUNE_DISABLE_BUNDLES": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TUNER + code, *args], env=environment, capture_output=True, text=True, timeout=300
    )


def test_the_runtime_imports_and_serves_without_the_tuners_packages(tmp_path):
    """Every runtime module imports, and a kernel is served its stored winner from the user's DB, with
    optuna, alembic, typer and rich unimportable (what ``pip install tritune`` leaves out)."""
    import torch
    import triton

    from tritune.configs_db.records import WinnerRecord
    from tritune.configs_db.store import ConfigStore
    from tritune.kernels import registry
    from tritune.kernels.device import interpreter_device

    target = f"{ROOT / 'examples' / 'rmsnorm.py'}:RMSNORM"
    spec, cpu = registry.load(target), interpreter_device()
    tuned = {"BLOCK_N": 64, "num_warps": 1}
    db = f"sqlite:///{tmp_path / 'configs.sqlite'}"
    versions = {"torch_version": torch.__version__, "triton_version": triton.__version__, "tritune_version": "test"}
    with ConfigStore(db) as store:
        key = {"arch": cpu.arch, "sm_count": cpu.sm_count, "dtype": "fp32", "n_bucket": 64}
        store.offer_winner(
            WinnerRecord(kernel=spec.name, kernel_version=spec.version, gpu=cpu.slug, key=key, config=tuned,
                         time_ms=1.0, portable_ms=2.0, speedup=2.0, trials=3, **versions),
            store.environment(gpu=cpu.slug, **versions),
        )  # fmt: skip
    child = _child(SERVE, target, TRITUNE_DB=db)
    assert child.returncode == 0, child.stderr[-3000:]
    served = json.loads(child.stdout.strip().splitlines()[-1])
    assert served["config"] == tuned and served["error"] < 1e-5


def test_tune_without_its_extra_says_what_to_install_in_one_line():
    child = _child("from tritune.tuner.entry import main; sys.argv = ['tune', 'list']; main()")
    assert child.returncode == 1
    assert child.stderr.strip().splitlines() == [
        "error: tune needs optuna, alembic, typer, rich, not installed here: pip install 'tritune[tune]'"
    ]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_package_ships_py_typed(package):
    assert (ROOT / PACKAGES[package] / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"].get(package, [])

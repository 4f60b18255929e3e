"""What an install of tritune brings: every third-party import declared, type hints shipped (PEP 561)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
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


def test_every_third_party_import_of_the_packages_is_a_declared_dependency():
    declared = {_distribution(r) for r in PYPROJECT["project"]["dependencies"]}
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for folder in PACKAGES.values():
        for module in _imported_modules(ROOT / folder):
            if module in sys.stdlib_module_names or module == "tritune":
                continue
            distributions = {_distribution(d) for d in owners.get(module, [module])}
            if not distributions & declared:
                missing[module] = sorted(distributions)
    assert not missing, f"imported but not in [project] dependencies: {missing}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_package_ships_py_typed(package):
    assert (ROOT / PACKAGES[package] / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"].get(package, [])

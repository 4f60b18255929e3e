"""Kernel versions change when the generated code or the meaning of a stored time does, and only then."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tritune.kernels import registry
from tritune.kernels.versioning import jit_fingerprint, kernel_version, reached_functions, space_fingerprint
from tritune.search_spaces.base import SearchSpace, choice

KERNEL_SOURCE = """
import triton
import triton.language as tl

SCALE: tl.constexpr = tl.constexpr({scale})


@triton.jit
def _helper(x):
    return x * {helper_factor}


@triton.jit
def _double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    {docstring}
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n{comment}
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, _helper(x) * SCALE, mask=mask)
"""

BASE = {"scale": 2, "helper_factor": 1.0, "docstring": "", "comment": ""}


def _load(tmp_path: Path, name: str, prefix: str = "", **changes: object) -> ModuleType:
    """Write the kernel module with ``changes`` applied and import it under a fresh name."""
    values = {**BASE, **changes}
    path = tmp_path / f"{name}.py"
    path.write_text(prefix + textwrap.dedent(KERNEL_SOURCE.format(**values)))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _fingerprint(module: ModuleType) -> str:
    return jit_fingerprint([module._double_kernel])


def test_comments_docstrings_and_moved_lines_keep_the_fingerprint(tmp_path: Path) -> None:
    base = _fingerprint(_load(tmp_path, "kv_base"))
    documented = _load(
        tmp_path,
        "kv_documented",
        prefix='"""A module docstring that moves every line down."""\n\n\ndef host_helper() -> int:\n    return 1\n',
        docstring='"""Doubles x."""',
        comment="  # the tail of the last block",
    )
    assert _fingerprint(documented) == base


@pytest.mark.parametrize(
    "change",
    [{"helper_factor": 3.0}, {"scale": 4}],
    ids=["callee-edited", "constexpr-global-changed"],
)
def test_a_kernel_edit_changes_the_fingerprint(tmp_path: Path, change: dict[str, object]) -> None:
    base = _fingerprint(_load(tmp_path, "kv_base2"))
    edited = _load(tmp_path, f"kv_edit_{next(iter(change))}", **change)
    assert _fingerprint(edited) != base


@dataclasses.dataclass(frozen=True)
class _Config:
    BLOCK: int = choice(64, (32, 64))
    num_warps: int = choice(4, (4, 8))


@dataclasses.dataclass(frozen=True)
class _WiderConfig:
    BLOCK: int = choice(64, (32, 64, 128))
    num_warps: int = choice(4, (4, 8))


@dataclasses.dataclass(frozen=True)
class _Key:
    arch: str
    n_bucket: int


@dataclasses.dataclass(frozen=True)
class _WiderKey:
    arch: str
    n_bucket: int
    dtype: str


def test_space_and_key_structure_and_protocol_change_the_version(tmp_path: Path) -> None:
    module = _load(tmp_path, "kv_space")
    kernels = [module._double_kernel]
    space = SearchSpace("toy", _Config)
    base = kernel_version(kernels, space, _Key, 1)
    assert kernel_version(kernels, space, _Key, 1) == base
    assert kernel_version(kernels, SearchSpace("toy", _WiderConfig), _Key, 1) != base
    assert kernel_version(kernels, space, _WiderKey, 1) != base
    assert kernel_version(kernels, space, _Key, 2) != base
    assert space_fingerprint(SearchSpace("toy", _Config, feasibility=lambda c, k, lim: None), _Key) != (
        space_fingerprint(space, _Key)
    )


def _jit_functions(module: ModuleType) -> dict[str, object]:
    from triton.runtime.jit import KernelInterface

    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, KernelInterface) and getattr(value.fn, "__module__", None) == module.__name__
    }


@pytest.mark.parametrize("kernel", registry.builtin_names())
def test_every_triton_function_of_a_family_is_part_of_its_version(kernel: str) -> None:
    """A launched kernel missing from ``jit_kernels`` could change without staling its winners."""
    spec = registry.get_spec(kernel)
    # The family is the package its kernels live in (a declaration is a Kernel object of declare.py).
    family = sys.modules[spec.jit_kernels[0].fn.__module__].__package__
    assert family is not None
    modules = [m for name, m in sys.modules.items() if name.startswith(f"{family}._triton_")]
    assert modules, f"{kernel}: no _triton_* module loaded under {family}"
    defined = {name: fn for m in modules for name, fn in _jit_functions(m).items()}
    declared = {k.fn.__name__ for k in spec.jit_kernels}
    launchable = {name for name in defined if name.endswith("_kernel")}
    assert launchable <= declared, f"{kernel}: jit_kernels lacks {sorted(launchable - declared)}"
    # Every helper must be reached from a declared kernel: editing it must change the version.
    reached = reached_functions(spec.jit_kernels)
    unreached = sorted(n for n, fn in defined.items() if f"{fn.fn.__module__}.{fn.fn.__qualname__}" not in reached)
    assert not unreached, f"{kernel}: no kernel in jit_kernels calls {unreached}"


def test_versions_are_the_same_with_and_without_the_interpreter() -> None:
    """Winners tuned on a GPU must admit where the CPU tier checks them, and back."""
    here = {name: registry.get_spec(name).version for name in registry.builtin_names()}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import json; from tritune.kernels import registry; "
        "print(json.dumps({n: registry.get_spec(n).version for n in registry.builtin_names()}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == here


SPACE_SOURCE = """
import dataclasses

from tritune.search_spaces.base import SearchSpace, choice


@dataclasses.dataclass(frozen=True)
class Config:
    BLOCK: int = choice(64, (32, 64))


def fits(config, key, limits):
    return None


SPACE = SearchSpace("toy", Config, feasibility=fits)
"""


def test_the_same_space_loaded_under_two_module_names_has_one_fingerprint(tmp_path: Path) -> None:
    """A kernel tuned through its file (``tune --kernel file.py:NAME``) and served through its package
    import is one kernel: its feasibility rule is named without its module."""
    spaces = []
    for name in ("kv_rule_as_file", "package.kv_rule_imported"):
        path = tmp_path / f"{name.replace('.', '_')}.py"
        path.write_text(SPACE_SOURCE)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        spaces.append(module.SPACE)
    assert space_fingerprint(spaces[0], _Key) == space_fingerprint(spaces[1], _Key)

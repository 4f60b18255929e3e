"""Kernel name -> kernel: the built-in kernels, installed packages' kernels and those declared here.

A kernel is known by name in three ways, looked up in this order:

1. declared in this process: ``Kernel(...)`` registers itself when its module is imported (a
   user's module, a built-in family's, or a target :func:`load` imported);
2. built in (:data:`_SPECS`): imported on first use, so importing the package stays cheap;
3. an installed package's entry point in the group ``tritune.kernels`` (its name is the kernel's
   name, its value ``"module:ATTRIBUTE"``): the tuner's CLI imports it when it is named
   (:func:`find`); serving code never imports a package it was not asked to.

A module imported twice under two names (a file loaded by path and again as a package module, a
script run as ``__main__`` and imported by name) declares its kernel twice: the same name and the
same version (:mod:`.versioning`: code, space, key and protocol) is the same kernel, and the first
declaration stays; the same name with another version is refused. Nothing here resolves a name
read from a file (a bundle, the DB) to anything but a kernel already known by it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .spec import KernelSpec

log = logging.getLogger("tritune.kernels")

#: Kernel name -> "module:attribute" of its spec object.
_SPECS: dict[str, str] = {
    "tma_prefill": "tritune.kernels.prefill.kernel:KERNEL",
    "splitk_decode": "tritune.kernels.decode.kernel:KERNEL",
    "q4k_fp8_gemm": "tritune.kernels.q4k.kernel:KERNEL",
    "varlen_sdpa": "tritune.kernels.varlen.kernel:KERNEL",
}

#: Entry-point group through which installed packages make their kernels known by name.
ENTRY_POINT_GROUP = "tritune.kernels"

#: Kernels declared in this process (users' own, and built-ins once imported), by name.
_DECLARED: dict[str, KernelSpec[Any, Any]] = {}
#: Kernel name -> the target another process imports it from (see :func:`target_of`).
_TARGETS: dict[str, str] = {}
#: Module name -> the file it was loaded from, for modules :func:`load` loaded by path.
_FILES: dict[str, Path] = {}
#: Called with each kernel declared under a new name (the dispatcher admits its stored winners).
_LISTENERS: list[Callable[[KernelSpec[Any, Any]], None]] = []


def check_name(spec: KernelSpec[Any, Any]) -> None:
    """Refuse a declaration whose name another kernel of other code holds (before it registers its op)."""
    known = _DECLARED.get(spec.name)
    if known is not None and known is not spec and known.version != spec.version:
        raise ValueError(
            f"a kernel named {spec.name!r} is declared twice with different code (version {known.version} and "
            f"{spec.version}): give one of them another name"
        )


def register(spec: KernelSpec[Any, Any]) -> KernelSpec[Any, Any]:
    """Make a declared kernel known by name (``Kernel(...)`` calls this); the kernel the name stands for.

    A second declaration of the same name and version is the same kernel (its module was imported
    under another name): the first stays. Another version under the same name is refused.
    """
    known = _DECLARED.get(spec.name)
    if known is not None:
        check_name(spec)
        return known
    _DECLARED[spec.name] = spec
    for listener in list(_LISTENERS):
        listener(spec)
    return spec


def on_register(listener: Callable[[KernelSpec[Any, Any]], None]) -> None:
    """Call ``listener`` with every kernel declared under a new name from now on."""
    _LISTENERS.append(listener)


def builtin_names() -> list[str]:
    """The kernels tritune ships."""
    return list(_SPECS)


def known(name: str) -> bool:
    """Whether ``name`` is a built-in kernel or one declared in this process (nothing is imported)."""
    return name in _DECLARED or name in _SPECS


def entry_points() -> dict[str, str]:
    """Installed packages' kernels: name -> "module:ATTRIBUTE" (group ``tritune.kernels``)."""
    from importlib.metadata import entry_points as installed

    return {point.name: point.value for point in installed(group=ENTRY_POINT_GROUP)}


def kernel_names() -> list[str]:
    """The built-in kernels, then installed packages' kernels, then those declared in this process."""
    names = dict.fromkeys(_SPECS)
    names.update(dict.fromkeys(entry_points()))
    names.update(dict.fromkeys(_DECLARED))
    return list(names)


def get_spec(name: str) -> KernelSpec[Any, Any]:
    """The kernel called ``name``: declared in this process, or built in (imported on first use)."""
    declared = _DECLARED.get(name)
    if declared is not None:
        return declared
    target = _SPECS.get(name)
    if target is None:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(kernel_names())}")
    return _named(name, load(target), target)


def find(name: str) -> KernelSpec[Any, Any]:
    """:func:`get_spec`, or an installed package's kernel of that name (its entry point imported)."""
    if known(name):
        return get_spec(name)
    target = entry_points().get(name)
    if target is None:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(kernel_names())}")
    return _named(name, load(target), f"entry point {name} = {target}")


def _named(name: str, spec: KernelSpec[Any, Any], where: str) -> KernelSpec[Any, Any]:
    if spec.name != name:
        raise KeyError(f"{where} declares a kernel named {spec.name!r}, not {name!r}")
    return spec


def is_target(text: str) -> bool:
    """Whether ``text`` names a declaration by where it is ("module:ATTRIBUTE" or "path/file.py:ATTRIBUTE")."""
    module, _, attribute = text.rpartition(":")
    return bool(module) and attribute.isidentifier()


def load(target: str) -> KernelSpec[Any, Any]:
    """The kernel declared at ``target``: ``"package.module:ATTRIBUTE"`` or ``"path/to/file.py:ATTRIBUTE"``.

    Importing the module declares the kernel (it registers itself); a file is loaded as a module
    of its own, named after its path, so every process that loads the same file gets the same
    module. The target is remembered, so worker processes can import the kernel too.
    """
    where, _, attribute = target.rpartition(":")
    if not where or not attribute.isidentifier():
        raise KeyError(f"{target!r}: expected package.module:ATTRIBUTE or path/to/file.py:ATTRIBUTE")
    if is_path(where):
        path = Path(where).expanduser().resolve()
        module = _load_file(path)
        target = f"{path}:{attribute}"
    else:
        module = importlib.import_module(where)
    spec = getattr(module, attribute, None)
    if not isinstance(spec, KernelSpec):
        raise KeyError(f"{target!r}: {module.__name__} has no kernel declaration named {attribute!r}")
    _TARGETS.setdefault(spec.name, target)
    return _DECLARED.get(spec.name, spec)


def target_of(spec: KernelSpec[Any, Any]) -> str | None:
    """Where another process imports ``spec`` from ("module:ATTRIBUTE" or "path.py:ATTRIBUTE"), if known."""
    target = _SPECS.get(spec.name) or _TARGETS.get(spec.name) or entry_points().get(spec.name)
    if target is not None:
        return target
    # Declared by an import of a module: look for the module-level name that holds it.
    launch = getattr(spec, "_launch", None)
    first = [type(spec).__module__, getattr(launch, "__module__", None)]
    for module_name in [*first, *list(sys.modules)]:
        module = sys.modules.get(module_name) if module_name else None
        for attribute, value in list(vars(module).items()) if module is not None else ():
            if value is spec:
                return _module_target(module, attribute)
    return None


def _module_target(module: Any, attribute: str) -> str:
    path = _FILES.get(module.__name__)
    if path is None and module.__name__ in ("__main__", "__mp_main__") and getattr(module, "__file__", None):
        path = Path(module.__file__).resolve()
    return f"{path}:{attribute}" if path is not None else f"{module.__name__}:{attribute}"


def is_path(where: str) -> bool:
    """Whether the module part of a target is a file path rather than a module name."""
    return where.endswith(".py") or "/" in where or os.sep in where


def _load_file(path: Path) -> Any:
    """Import the Python file at ``path`` as a module named after the path (once per process)."""
    if not path.is_file():
        raise KeyError(f"{path}: no such Python file")
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_tritune_file_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    found = importlib.util.spec_from_file_location(name, path)
    if found is None or found.loader is None:
        raise KeyError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(found)
    # In sys.modules before it runs: dataclasses and pickling look a module up by name.
    sys.modules[name] = module
    _FILES[name] = path
    try:
        found.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        del _FILES[name]
        raise
    return module


def all_specs() -> list[KernelSpec[Any, Any]]:
    """The built-in kernels."""
    return [get_spec(n) for n in _SPECS]

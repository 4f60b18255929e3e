"""Name -> kernel spec, imported lazily so that importing the package stays cheap."""

from __future__ import annotations

import importlib
from typing import Any

from .spec import KernelSpec

#: Kernel name -> "module:attribute" of its spec object.
_SPECS: dict[str, str] = {
    "tma_prefill": "tritune.kernels.prefill.kernel:KERNEL",
    "splitk_decode": "tritune.kernels.decode.kernel:KERNEL",
    "q4k_fp8_gemm": "tritune.kernels.q4k.kernel:KERNEL",
    "varlen_sdpa": "tritune.kernels.varlen.kernel:KERNEL",
}


#: Kernels declared in this process (users' own, and built-ins once imported), by name.
_DECLARED: dict[str, KernelSpec[Any, Any]] = {}


def register(spec: KernelSpec[Any, Any]) -> None:
    """Make a declared kernel known by name (``Kernel(...)`` calls this); one declaration per name."""
    known = _DECLARED.get(spec.name)
    if known is not None and known is not spec:
        raise ValueError(f"a kernel named {spec.name!r} is declared twice ({known!r} and {spec!r})")
    _DECLARED[spec.name] = spec


def builtin_names() -> list[str]:
    """The kernels tritune ships."""
    return list(_SPECS)


def kernel_names() -> list[str]:
    """The built-in kernels, then those declared in this process."""
    return list(_SPECS) + [name for name in _DECLARED if name not in _SPECS]


def get_spec(name: str) -> KernelSpec[Any, Any]:
    """The kernel called ``name``, or the one at ``"module:ATTRIBUTE"`` (imported on first use)."""
    declared = _DECLARED.get(name)
    if declared is not None:
        return declared
    target = _SPECS.get(name)
    if target is None and ":" in name:
        target = name
    if target is None:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(kernel_names())}")
    module_name, attribute = target.split(":", 1)
    spec = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(spec, KernelSpec):
        raise KeyError(f"{name!r}: {module_name} has no kernel declaration named {attribute!r}")
    return spec


def all_specs() -> list[KernelSpec[Any, Any]]:
    return [get_spec(n) for n in _SPECS]

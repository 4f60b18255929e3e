"""Name -> kernel spec, imported lazily so that importing the package stays cheap."""

from __future__ import annotations

import importlib
from typing import Any

from .spec import KernelSpec

#: Kernel name -> "module:attribute" of its spec object.
_SPECS: dict[str, str] = {
    "tma_prefill": "tritune.kernels.prefill.spec:SPEC",
    "splitk_decode": "tritune.kernels.decode.spec:SPEC",
    "q4k_fp8_gemm": "tritune.kernels.q4k.spec:SPEC",
    "varlen_sdpa": "tritune.kernels.varlen.spec:SPEC",
}


def kernel_names() -> list[str]:
    return list(_SPECS)


def get_spec(name: str) -> KernelSpec[Any, Any]:
    """The spec of kernel ``name``; unknown names list the known ones."""
    target = _SPECS.get(name)
    if target is None:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(_SPECS)}")
    module_name, attribute = target.split(":")
    spec: KernelSpec[Any, Any] = getattr(importlib.import_module(module_name), attribute)
    return spec


def all_specs() -> list[KernelSpec[Any, Any]]:
    return [get_spec(n) for n in _SPECS]

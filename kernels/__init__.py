"""tritune's runtime: tuned Triton kernels for LLM inference behind one dispatcher.

Importing this package is cheap and touches no GPU: the public functions below are imported on
first use, and stored configs are loaded on the first dispatch for a device.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> module that defines it.
_EXPORTS: dict[str, str] = {
    "prefill_attention": "tritune.kernels.prefill.kernel",
    "decode_attention": "tritune.kernels.decode.kernel",
    "attention": "tritune.kernels.routing",
    "q4k_linear": "tritune.kernels.q4k.kernel",
    "Q4KWeight": "tritune.kernels.q4k.weight",
    "varlen_attention": "tritune.kernels.varlen.kernel",
    "validate_seq_info": "tritune.kernels.varlen.seq_info",
    "BatchedSequenceCache": "tritune.kernels.varlen.cache",
    "use_config": "tritune.kernels.pins",
    "reload_configs": "tritune.kernels.dispatcher",
    "device_info": "tritune.kernels.device",
    "get_spec": "tritune.kernels.registry",
    "kernel_names": "tritune.kernels.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tritune.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

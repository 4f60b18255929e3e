"""Registering tritune's public ops with ``torch.library``.

On a GPU each op is a ``triton_op`` whose body launches its kernels through ``wrap_triton``, so
``torch.compile`` sees (and can schedule around) the Triton kernels. Under the Triton interpreter
the kernels are ``InterpretedFunction`` objects that torch cannot trace, so the same body is
registered as an opaque ``custom_op`` with a fake implementation instead; every tritune op
mutates a preallocated ``out`` and returns nothing, so that fake has nothing to compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch.library import custom_op, triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["register_op", "wrap_triton"]


def register_op(
    name: str,
    body: Callable[..., None],
    *,
    mutates_args: Iterable[str],
    kernels: Iterable[Any],
    opaque: bool = False,
) -> Any:
    """Register ``body`` as op ``name`` ("tritune::..."), traceable where Triton allows it.

    ``opaque=True`` keeps the op a ``custom_op`` on the GPU too: torch cannot yet trace a
    ``triton_op`` body whose kernels take host-side tensor descriptors (it would bake them in).
    """
    mutates = tuple(mutates_args)
    if opaque or any(isinstance(k, InterpretedFunction) for k in kernels):
        op = custom_op(name, body, mutates_args=mutates)
        op.register_fake(lambda *args, **kwargs: None)
        return op
    return triton_op(name, body, mutates_args=mutates)

"""Registering tritune's public ops with ``torch.library``.

On a GPU each op is a ``triton_op`` whose body launches its kernels through ``wrap_triton``, so
``torch.compile`` sees (and can schedule around) the Triton kernels. Under the Triton interpreter
the kernels are ``InterpretedFunction`` objects that torch cannot trace, so the same body is
registered as an opaque ``custom_op`` with a fake implementation instead; every tritune op
mutates a preallocated ``out`` and returns nothing, so that fake has nothing to compute.

Going through ``torch.library`` costs tens of microseconds of Python per call (argument
normalisation, the autograd and ADInplaceOrView layers), more than the launch itself, and a decode
step pays it once per layer. So a declared kernel (``kernels/declare.py``) runs its launch
directly (:func:`run_unwrapped`) when nothing needs the op: plain tensors, no autograd, no
dispatch or function modes (:func:`no_modes`), not inside ``torch.compile``; and, as
``triton_op``'s own backend does, with ``wrap_triton`` switched off, so the launches reach the
bare Triton kernels.
Everything else (``torch.compile``, ``make_fx``, FakeTensor, tensors that require grad,
``opcheck``) goes through the registered op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch._library.triton as _torch_triton
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch.library import custom_op, triton_op
from torch.library import wrap_triton as _traceable

from ._fastlaunch import bound

__all__ = ["in_direct_body", "no_modes", "register_schema_op", "run_unwrapped", "wrap_triton"]

#: torch's thread-local ``wrap_triton`` switch. Flipping it directly costs a third of what the
#: ``set_wrap_triton_enabled`` context manager does (a generator per call); where a torch release
#: lacks it, the context manager serves.
_WRAP_SWITCH = getattr(_torch_triton, "wrap_triton_enabled", None)


def wrap_triton(kernel: Any) -> Any:
    """What an op body launches ``kernel`` through: torch's ``wrap_triton`` while a tracer runs the
    body, else the kernel's bound launcher (:func:`~._fastlaunch.bound`), which skips the per-call
    work of torch's wrapper and of ``JITFunction.run`` once the kernel is compiled."""
    if is_wrap_triton_enabled():
        return _traceable(kernel)
    return bound(kernel)


def in_direct_body() -> bool:
    """Whether an op body runs on plain tensors (called directly, or by triton_op's own backend).

    Both switch ``wrap_triton`` off; a tracer (``torch.compile``, ``make_fx``) runs the body with
    it on. A body that calls another op may then run that op's body directly as well, instead of
    paying the op's checks a second time.
    """
    return not is_wrap_triton_enabled()


def no_modes() -> bool:
    """No compiler, tracer, dispatch or function mode and no torch.func transform is active."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    # torch.func transforms (vmap, functionalize, grad) wrap plain-typed tensors, and
    # torch.jit.trace records ops: all of them must see the op, not raw kernel writes.
    return not (torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state() is not None)


def run_unwrapped(fn: Callable[..., None], args: tuple[Any, ...], mutated: Iterable[torch.Tensor | None]) -> None:
    """Run an op's launch directly on plain tensors, as the op would, and bump ``mutated``'s versions.

    As ``triton_op``'s own backend does: with ``wrap_triton`` switched off, the launch reaches the
    bare kernels instead of routing each one through the tracing machinery.
    """
    if _WRAP_SWITCH is None:
        with set_wrap_triton_enabled(False):
            fn(*args)
    else:
        previous = is_wrap_triton_enabled()
        _WRAP_SWITCH.value = False
        try:
            fn(*args)
        finally:
            _WRAP_SWITCH.value = previous
    for t in mutated:
        if t is not None:
            torch.autograd.graph.increment_version(t)


def register_schema_op(
    name: str, body: Callable[..., None], schema: str, *, mutated: tuple[int, ...], opaque: bool
) -> Any:
    """Register ``body`` as op ``name`` ("namespace::op") with an explicit schema; return the op.

    ``opaque=True`` registers a ``custom_op`` (the interpreter's kernels cannot be traced, and a
    body that builds host-side tensor descriptors cannot be yet); otherwise a ``triton_op``, whose
    body torch traces through ``wrap_triton``. ``mutated``: positions of the written tensors.
    """
    mutates = tuple(_schema_names(schema)[i] for i in mutated)
    if opaque:

        def backend(*args: Any, **kwargs: Any) -> None:
            with set_wrap_triton_enabled(False):
                body(*args, **kwargs)

        op = custom_op(name, backend, mutates_args=mutates, schema=schema)
        op.register_fake(lambda *args, **kwargs: None)
    else:
        # triton_op infers the schema from the function it is given (torch 2.13 does not use its
        # schema= argument), so the body, which takes *args and **fields, gets the schema's signature.
        triton_op(name, _with_signature(body, schema), mutates_args=mutates)
    namespace, op_name = name.split("::")
    return getattr(getattr(torch.ops, namespace), op_name).default


#: Schema type names -> the Python annotations torch's schema inference maps back to them.
_ANNOTATIONS: dict[str, Any] = {"Tensor": torch.Tensor, "int": int, "float": float, "bool": bool, "str": str}


def _with_signature(body: Callable[..., None], schema: str) -> Callable[..., None]:
    """A function calling ``body`` whose signature and annotations spell out ``schema``."""
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in (p.strip() for p in inner.split(",") if p.strip()):
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        type_text, name = part.rsplit(" ", 1)
        # "Tensor(a!)" (mutated: the caller passes mutates_args) and "int?" (optional) come back as written.
        annotation = _ANNOTATIONS[type_text.split("(")[0].rstrip("?")]
        params.append(inspect.Parameter(name, kind, annotation=annotation | None if "?" in type_text else annotation))

    def prototype(*args: Any, **kwargs: Any) -> None:
        body(*args, **kwargs)

    prototype.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    return prototype


def _schema_names(schema: str) -> list[str]:
    """Argument names of a schema string, in order (keyword-only ones included)."""
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    return [part.split()[-1].split("=")[0] for part in inner.split(",") if part.strip() and part.strip() != "*"]

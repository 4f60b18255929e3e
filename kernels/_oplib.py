"""Registering tritune's public ops with ``torch.library``.

On a GPU each op is a ``triton_op`` whose body launches its kernels through ``wrap_triton``, so
``torch.compile`` sees (and can schedule around) the Triton kernels. Under the Triton interpreter
the kernels are ``InterpretedFunction`` objects that torch cannot trace, so the same body is
registered as an opaque ``custom_op`` with a fake implementation instead; every tritune op
mutates a preallocated ``out`` and returns nothing, so that fake has nothing to compute.

Going through ``torch.library`` costs tens of microseconds of Python per call (argument
normalisation, the autograd and ADInplaceOrView layers), more than the launch itself, and a decode
step pays it once per layer. So :class:`TritonOp` calls the body directly when nothing needs the
op: plain tensors, no autograd, no dispatch or function modes, not inside ``torch.compile``; and,
as ``triton_op``'s own backend does, with ``wrap_triton`` switched off, so the body's launches
reach the bare Triton kernels.
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
from torch.library import custom_op, infer_schema, triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "TritonOp",
    "in_direct_body",
    "no_modes",
    "plain_tensors_call",
    "register_op",
    "register_schema_op",
    "run_unwrapped",
    "wrap_triton",
]

#: torch's thread-local ``wrap_triton`` switch. Flipping it directly costs a third of what the
#: ``set_wrap_triton_enabled`` context manager does (a generator per call); where a torch release
#: lacks it, the context manager serves.
_WRAP_SWITCH = getattr(_torch_triton, "wrap_triton_enabled", None)


class TritonOp:
    """A registered op, called directly in plain eager mode (see the module docstring)."""

    def __init__(self, op: Any, body: Callable[..., None], mutates: tuple[str, ...]) -> None:
        self.op = op
        self.body = body
        names = list(inspect.signature(body).parameters)
        #: Positions of the mutated arguments: their version counters move as the op's would.
        self.mutated = tuple(names.index(name) for name in mutates)

    def __call__(self, *args: Any) -> None:
        if _plain_eager(args):
            self.call_body(args)
            return
        self.op(*args)

    def call_body(self, args: tuple[Any, ...]) -> None:
        """Run the body on plain tensors, as the op would (the caller has checked that they are)."""
        # As triton_op's own backend does: with plain tensors, wrap_triton hands back the bare
        # kernels instead of routing each launch through its tracing machinery.
        if _WRAP_SWITCH is None:
            with set_wrap_triton_enabled(False):
                self.body(*args)
        else:
            previous = is_wrap_triton_enabled()
            _WRAP_SWITCH.value = False
            try:
                self.body(*args)
            finally:
                _WRAP_SWITCH.value = previous
        for index in self.mutated:
            if args[index] is not None:
                torch.autograd.graph.increment_version(args[index])


def in_direct_body() -> bool:
    """Whether an op body runs on plain tensors (called directly, or by triton_op's own backend).

    Both switch ``wrap_triton`` off; a tracer (``torch.compile``, ``make_fx``) runs the body with
    it on. A body that calls another op may then run that op's body directly as well, instead of
    paying the op's checks a second time.
    """
    return not is_wrap_triton_enabled()


def _plain_eager(args: tuple[Any, ...]) -> bool:
    """Whether calling an op's body directly is indistinguishable from calling the op."""
    if not no_modes():
        return False
    grad = torch.is_grad_enabled()
    for arg in args:
        if isinstance(arg, torch.Tensor) and (type(arg) is not torch.Tensor or (grad and arg.requires_grad)):
            return False
    return True


def no_modes() -> bool:
    """No compiler, tracer, dispatch or function mode and no torch.func transform is active."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    # torch.func transforms (vmap, functionalize, grad) wrap plain-typed tensors, and
    # torch.jit.trace records ops: all of them must see the op, not raw kernel writes.
    return not (torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state() is not None)


def plain_tensors_call(*tensors: torch.Tensor | None) -> bool:
    """:func:`_plain_eager` for a caller that has already seen that ``tensors`` are exactly
    ``torch.Tensor`` (or None) and that the op's other arguments are not tensors."""
    if not no_modes():
        return False
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return False
    return True


def register_op(
    name: str,
    body: Callable[..., None],
    *,
    mutates_args: Iterable[str],
    kernels: Iterable[Any],
    opaque: bool = False,
) -> TritonOp:
    """Register ``body`` as op ``name`` ("tritune::..."), traceable where Triton allows it.

    ``opaque=True`` keeps the op a ``custom_op`` on the GPU too: torch cannot yet trace a
    ``triton_op`` body whose kernels take host-side tensor descriptors (it would bake them in).
    """
    mutates = tuple(mutates_args)
    if opaque or any(isinstance(k, InterpretedFunction) for k in kernels):

        def backend(*args: Any, **kwargs: Any) -> None:
            # What triton_op's backend does: plain tensors reach the bare kernels.
            with set_wrap_triton_enabled(False):
                body(*args, **kwargs)

        op = custom_op(name, backend, mutates_args=mutates, schema=infer_schema(body, mutates_args=mutates))
        op.register_fake(lambda *args, **kwargs: None)
    else:
        op = triton_op(name, body, mutates_args=mutates)
    namespace, op_name = name.split("::")
    return TritonOp(getattr(getattr(torch.ops, namespace), op_name).default, body, mutates)


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

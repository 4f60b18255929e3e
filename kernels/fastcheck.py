"""The one-pass check of a plain eager call, generated from a kernel's argument declaration.

Every call pays its checks on the host before the launch, and a decode step makes dozens of
calls. Reading a tensor attribute costs 50-150 ns, so an interpreter looping over the
declaration (or the detailed checks of :mod:`.arguments`, which read attributes several times
and format nothing until they fail) costs several times what the launch does. This module
writes the straight-line function a careful engineer would write by hand for one declaration,
reading each attribute once, and compiles it once per kernel.

The generated function accepts a subset of what the detailed checks accept, never more: it
returns ``None`` for anything it does not recognise (a tensor subclass, an int where a float is
declared, ``torch.compile``, any error), and the caller then runs the detailed checks, which
either explain the error or serve the call. The tests hold the two to that contract.
``source`` of the result shows the generated text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._inline import inline_lambda
from ._launch import out_is_separate
from .arguments import Derived, Obj, Output, Rule, Scalar, Tensor, dtype_name

__all__ = ["FastCheck", "build_fast_check"]


class FastCheck:
    """A generated check: ``fn(*args) -> (facts, device, args) | None`` and its ``source``."""

    def __init__(self, fn: Callable[..., Any], source: str) -> None:
        self.fn = fn
        self.source = source


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {}
        self.bound: set[str] = set()
        #: Dims of a required tensor whose shape was read -> the name it is kept under.
        self.shapes: dict[tuple[str | int, ...], str] = {}

    def emit(self, line: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + line)

    def constant(self, prefix: str, value: Any) -> str:
        """A name in the generated function's globals bound to ``value``."""
        name = f"_{prefix}{len(self.names)}"
        self.names[name] = value
        return name


def _shape_checks(w: _Writer, expr: str, dims: tuple[str | int, ...], depth: int) -> str:
    """Bind or compare each dim of ``expr``'s shape; return None on any mismatch.

    Returns the name the shape is kept under: a later tensor of the same dims compares its whole
    shape with it (one C-level comparison), and a fixed rank unpacks in one step instead of one
    subscript per dim.
    """
    star = bool(dims) and isinstance(dims[0], str) and dims[0].startswith("*")
    fixed = dims[1:] if star else dims
    var = f"_s_{expr}"
    same = w.shapes.get(dims)
    if same is not None and not star:
        w.emit(f"{var} = {expr}.shape", depth)
        w.emit(f"if {var} != {same}: return None", depth)
        return var
    w.emit(f"{var} = {expr}.shape", depth)
    w.emit(f"if len({var}) {'<' if star else '!='} {len(fixed)}: return None", depth)
    if not star:
        if fixed:
            targets, compares = [], []
            for i, d in enumerate(fixed):
                if isinstance(d, str) and d not in w.bound:
                    targets.append(d)
                    w.bound.add(d)
                else:
                    targets.append(f"_d{i}")
                    compares.append(f"_d{i} != {d}")
            w.emit(f"{', '.join(targets)}{',' if len(targets) == 1 else ''} = {var}", depth)
            if compares:
                w.emit(f"if {' or '.join(compares)}: return None", depth)
        if depth == 1 and all(isinstance(d, str) for d in fixed):
            w.shapes[dims] = var
        return var
    offset = f"len({var}) - {len(fixed)}"
    for i, d in enumerate(fixed):
        index = f"{offset} + {i}"
        if isinstance(d, int) or d in w.bound:
            w.emit(f"if {var}[{index}] != {d}: return None", depth)
        else:
            w.emit(f"{d} = {var}[{index}]", depth)
            w.bound.add(d)
    name = dims[0][1:]  # type: ignore[index]
    lead = f"_lead_{name}"
    if name in w.bound:
        # Bound by an earlier tensor, whose leading dims an output takes (as the detailed check's).
        leading = f"{var}[:{offset}]"
        w.emit(f"if ({leading}[0] if len({leading}) == 1 else _prod({leading})) != {name}: return None", depth)
    else:
        w.emit(f"{lead} = {var}[:{offset}]", depth)
        w.emit(f"{name} = ({lead}[0] if len({lead}) == 1 else _prod({lead}))", depth)
        w.bound.add(name)
    return var


def _output_shape(arg: Output, shapes: dict[str, str]) -> str:
    """The expected shape of ``arg``: its ``like``'s, read once before where it was, or built from dims."""
    if arg.dims is None:
        return shapes.get(arg.like, f"{arg.like}.shape")
    parts = []
    for d in arg.dims:
        if isinstance(d, int):
            parts.append(str(d))
        elif d.startswith("*"):
            parts.append(f"*_lead_{d[1:]}")
        else:
            parts.append(d)
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _ranked(alternatives: tuple[tuple[str | int, ...], ...]) -> bool:
    """Whether every shape the alternatives allow has at least one dim (a last stride to read)."""
    return all(len(dims) - (1 if dims and isinstance(dims[0], str) and dims[0].startswith("*") else 0) > 0
               for dims in alternatives)  # fmt: skip


def _last_stride(name: str, ranked: bool) -> str:
    """The last dim's stride of ``name`` as an expression that is 1 for a 0-dim tensor (no last dim)."""
    return f"{name}.stride()[-1]" if ranked else f"({name}.stride(-1) if {name}.dim() else 1)"


def build_fast_check(
    arguments: Sequence[Tensor | Obj | Scalar | Output],
    rules: Sequence[Rule],
    derived: Sequence[Derived],
    facts: Sequence[str],
    cpu_allowed: bool,
) -> FastCheck:
    """Generate the one-pass check for a declaration (see the module docstring)."""
    w = _Writer()
    by_name = {a.name: a for a in arguments}
    params = [a.name for a in arguments]
    inputs = [a for a in arguments if isinstance(a, Tensor | Obj)]
    first = inputs[0]
    if not isinstance(first, Tensor) or first.optional:
        raise TypeError("the first input of a kernel must be a required tensor (its dtype and device lead)")
    w.names.update(
        _Tensor=torch.Tensor, _strided=torch.strided, _is_compiling=torch.compiler.is_compiling, _prod=math.prod
    )
    w.names.update(_empty=torch.empty, _empty_like=torch.empty_like, _separate=out_is_separate)
    w.lines.append(f"def fast_check({', '.join(params)}):")
    # Types first: everything below reads attributes that only plain tensors are known to have.
    required = " or ".join(f"type({a.name}) is not _Tensor" for a in inputs if isinstance(a, Tensor) and not a.optional)
    w.emit(f"if _is_compiling() or {required}: return None")
    for a in inputs:
        if isinstance(a, Obj):
            w.emit(f"if type({a.name}) is not {w.constant('type', a.type)}: return None")
    w.emit(f"_dtype = {first.name}.dtype")
    dtype_names = {d: dtype_name(d) for d in first.dtypes} if first.dtypes else None
    if dtype_names:
        w.emit(f"_dtype_name = {w.constant('dtypes', dtype_names)}.get(_dtype)")
        w.emit("if _dtype_name is None: return None")
    else:
        if first.floating:
            w.emit(f"if not {first.name}.is_floating_point(): return None")
        w.emit(f"_dtype_name = {w.constant('dtype_name', dtype_name)}(_dtype)")
    w.emit(f"_device = {first.name}.device")
    cuda_or_cpu = f"{first.name}.is_cuda" + (f" or {first.name}.is_cpu" if cpu_allowed else "")
    w.emit(f"if not ({cuda_or_cpu}): return None")
    #: Input name -> the variable its shape was read into (required inputs only).
    shape_vars: dict[str, str] = {}
    for a in inputs:
        depth = 1
        if isinstance(a, Tensor) and a.optional:
            w.emit(f"if {a.name} is not None:")
            depth = 2
            w.emit(f"if type({a.name}) is not _Tensor: return None", depth)
        if isinstance(a, Tensor):
            # A sparse (or other non-strided) tensor: the detailed checks name it.
            w.emit(f"if {a.name}.layout is not _strided: return None", depth)
            if a is not first:
                if a.dtype_of is not None:
                    # The first tensor's dtype was read once already.
                    other = "_dtype" if a.dtype_of == first.name else f"{a.dtype_of}.dtype"
                    w.emit(f"if {a.name}.dtype is not {other}: return None", depth)
                elif len(a.dtypes) == 1:
                    # dtypes are singletons: one identity test, no hash.
                    w.emit(f"if {a.name}.dtype is not {w.constant('dtype', a.dtypes[0])}: return None", depth)
                elif a.dtypes:
                    w.emit(f"if {a.name}.dtype not in {w.constant('allowed', frozenset(a.dtypes))}: return None", depth)
                elif a.floating:
                    w.emit(f"if not {a.name}.is_floating_point(): return None", depth)
                w.emit(f"if {a.name}.device != _device: return None", depth)
            if a.shapes:
                # Alternatives: only those that bind no new dim can be checked in one pass.
                options = []
                for dims in a.shapes:
                    if any(isinstance(d, str) and (d.startswith("*") or d not in w.bound) for d in dims):
                        raise TypeError(f"{a.name}: alternative shapes may only use dims bound before it")
                    options.append("(" + "".join(f"{d}, " for d in dims) + ")")
                w.emit(f"if {a.name}.shape not in ({', '.join(options)}): return None", depth)
            else:
                var = _shape_checks(w, a.name, a.dims, depth)
                if depth == 1:
                    shape_vars[a.name] = var
            if a.unit_inner_stride:
                w.emit(f"if {_last_stride(a.name, _ranked(a.alternatives()))} != 1: return None", depth)
        else:
            w.emit(f"if {a.name}.device != _device: return None", depth)
            shape_vars[a.name] = _shape_checks(w, a.name, a.dims, depth)
    for a in arguments:
        if not isinstance(a, Scalar):
            continue
        kind = {bool: "bool", int: "int", float: "float"}[a.type]
        low, high = a.limits()
        test = f"type({a.name}) is not {kind}"
        if low is not None:
            test += f" or not {a.name} >= {low!r}"
        if high is not None:
            test += f" or not {a.name} <= {high!r}"
        if low is None and high is None and a.type is float:
            test += f" or {a.name} != {a.name}"  # NaN, which the detailed check refuses
        if a.optional:
            w.emit(f"if {a.name} is not None and ({test}): return None")
        else:
            w.emit(f"if {test}: return None")
    for rule in rules:
        w.emit(f"if not {_applied(w, 'rule', rule.check, rule.params)}: return None")
    for a in arguments:
        if isinstance(a, Scalar) and a.resolve is not None:
            w.emit(f"if {a.name} is None: {a.name} = {_applied(w, 'resolve', a.resolve, _parameters(a.resolve))}")
    # Every tensor an output must not overlap: tensor inputs and each object's parts.
    tensor_inputs = [a.name if isinstance(a, Tensor) else f"*{w.constant('split', a.split)}({a.name})" for a in inputs]
    for a in arguments:
        if not isinstance(a, Output):
            continue
        like = by_name[a.like]
        assert isinstance(like, Tensor | Obj)
        shape = _output_shape(a, shape_vars)
        like_dtype = "_dtype" if a.like == first.name else f"{a.like}.dtype"
        w.emit(f"if {a.name} is None:")
        if a.keep_layout and a.dims is None:
            w.emit(f"{a.name} = _empty_like({a.like})", 2)
        else:
            w.emit(f"{a.name} = _empty({shape}, dtype={like_dtype}, device=_device)", 2)
        w.emit("else:")
        w.emit(
            f"if type({a.name}) is not _Tensor or {a.name}.layout is not _strided or {a.name}.dtype is not {like_dtype}"
            f" or {a.name}.device != _device"
            f" or {a.name}.shape != {shape}: return None",
            2,
        )
        if a.contiguous:
            w.emit(f"if not {a.name}.is_contiguous(): return None", 2)
        if a.unit_inner_stride:
            dims = (a.dims,) if a.dims is not None else (like.dims,) if isinstance(like, Obj) else like.alternatives()
            w.emit(f"if {_last_stride(a.name, _ranked(dims))} != 1: return None", 2)
        others = "(" + "".join(f"{n}, " for n in tensor_inputs) + ")"
        w.emit(f"if not _separate({a.name}, {others}): return None", 2)
    for d in derived:
        w.emit(f"{d.name} = {_applied(w, 'derived', d.compute, d.params)}")
    fact_exprs = []
    for fact in facts:
        if fact == "dtype":
            fact_exprs.append("_dtype_name")
        elif fact.startswith("has_") and fact[4:] in by_name:
            fact_exprs.append(f"{fact[4:]} is not None")
        else:
            fact_exprs.append(fact)
    w.emit(f"return ({', '.join(fact_exprs)},), _device, ({', '.join(params)},)")
    source = "\n".join(w.lines) + "\n"
    namespace = dict(w.names)
    code = compile(source, f"<tritune fast check: {', '.join(params)}>", "exec")
    exec(code, namespace)  # our own generated text, from a declaration in code: nothing read from a file
    return FastCheck(namespace["fast_check"], source)


def _applied(w: _Writer, prefix: str, fn: Callable[..., Any], params: Sequence[str]) -> str:
    """``fn`` applied to the locals named ``params``: its expression in place where it can be (a
    lambda over those names, see :mod:`._inline`), else a call (a Python call per check saved)."""
    inline = inline_lambda(fn, lambda value: w.constant("g", value))
    return inline if inline is not None else f"{w.constant(prefix, fn)}({', '.join(params)})"


def _parameters(fn: Callable[..., Any]) -> list[str]:
    import inspect

    return list(inspect.signature(fn).parameters)

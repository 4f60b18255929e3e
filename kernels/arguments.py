"""What a kernel's public call takes, declared once: tensors with named dims, scalars, outputs, rules.

A kernel declares its arguments as a list of :class:`Tensor`, :class:`Obj`, :class:`Scalar` and
:class:`Output` entries plus :class:`Rule` relations between them. Dims are named: every tensor
that names ``"D"`` must agree on it, and the first one to name it sets it, so shape relations
("k has q's batch and head dim") are written as the shapes themselves. From this one declaration
the framework derives the checks of a call (this module: every error names the argument and what
was expected), a generated one-pass check for plain eager calls (:mod:`.fastcheck`), the op
schema (:mod:`.declare`) and the call's facts.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DYNAMIC", "Derived", "Obj", "Output", "Rule", "Scalar", "Tensor", "dim_names", "dtype_name"]

#: A dim fact that is symbolic under ``torch.compile`` and declared dynamic: keys see 0 rather than guard on it.
DYNAMIC = 0

#: Short names of dtypes, as facts carry them.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.int8: "int8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name a fact carries for ``dtype`` (``torch.bfloat16`` -> ``"bf16"``)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


Dims = tuple[str | int, ...]


@dataclass(frozen=True)
class Tensor:
    """A tensor argument.

    ``dims`` names each dimension (a string binds or checks a dim, an int is a fixed size);
    ``"*M"`` first stands for any number of leading dims whose product is ``M``. ``shapes`` lists
    alternative dims (for example ``[(), ("B",)]`` for a length that is one scalar or one per
    sequence). ``dtypes`` lists the accepted dtypes, ``dtype_of`` names the argument whose dtype
    this one must have, ``floating`` accepts any floating dtype. ``unit_inner_stride`` refuses a
    last dim whose stride is not 1 (kernels that would otherwise need a copy of a large cache).
    """

    name: str
    dims: Dims = ()
    dtypes: tuple[torch.dtype, ...] = ()
    dtype_of: str | None = None
    floating: bool = False
    optional: bool = False
    unit_inner_stride: bool = False
    shapes: tuple[Dims, ...] = ()

    def alternatives(self) -> tuple[Dims, ...]:
        return self.shapes or (self.dims,)


@dataclass(frozen=True)
class Obj:
    """A non-tensor argument (such as a packed quantized weight) that has ``shape`` and ``device``.

    The op receives it as the tensors ``split(value)`` returns, one schema argument each
    (``<name>_<part>`` for each name in ``parts``), and its body rebuilds it with ``join(*tensors)``.
    """

    name: str
    type: type
    dims: Dims
    parts: tuple[str, ...]
    split: Callable[[Any], tuple[torch.Tensor, ...]]
    join: Callable[..., Any]


@dataclass(frozen=True)
class Scalar:
    """A Python scalar argument (bool, int or float), optionally ``None``.

    ``bounds`` (inclusive, ``None`` for an open end) refuses values outside them. ``resolve``
    turns ``None`` into a value from the call's dims (its parameters are named after dims), so
    the op always receives a number: ``softmax_scale=None`` becomes ``1 / sqrt(D)``.
    """

    name: str
    type: type
    default: Any = None
    optional: bool = False
    bounds: tuple[float | None, float | None] = (None, None)
    resolve: Callable[..., Any] | None = None
    #: Why the bounds exist, for the error message (for example "the kernels scale fp32 scores by it").
    why: str = ""

    def limits(self) -> tuple[float | None, float | None]:
        """``bounds`` as the checks apply them: an int's open ends closed at int64's range, which is
        what the op's schema and the kernels take (a bigger int would wrap or overflow there)."""
        low, high = self.bounds
        if self.type is int:
            low = INT64_MIN if low is None else max(low, INT64_MIN)
            high = INT64_MAX if high is None else min(high, INT64_MAX)
        return low, high


#: The range of a schema ``int`` (int64): every int scalar is held to it.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Output:
    """An output tensor the call writes, allocated when the caller passes ``None``.

    It takes the dtype and device of ``like``, and ``like``'s shape unless ``dims`` says
    otherwise. ``keep_layout`` allocates with ``torch.empty_like`` (``like``'s strides) instead of
    contiguously. A given output must be dense, must not overlap itself or any input, and must
    have the expected shape, dtype and device; ``contiguous`` also requires a contiguous one.
    """

    name: str
    like: str
    dims: Dims | None = None
    keep_layout: bool = False
    contiguous: bool = False
    unit_inner_stride: bool = False


@dataclass(frozen=True)
class Rule:
    """A relation the call must satisfy; ``check``'s parameters are named after dims or scalars.

    ``message`` is formatted with the same names and follows ``"<arg>: "`` in the error.
    """

    arg: str
    check: Callable[..., bool]
    message: str
    params: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(inspect.signature(self.check).parameters))


@dataclass(frozen=True)
class Derived:
    """A fact computed from the call's arguments (after outputs are allocated), such as a layout test.

    ``compute``'s parameters are named after arguments; it runs on every call, so keep it cheap.
    """

    name: str
    compute: Callable[..., Any]
    params: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(inspect.signature(self.compute).parameters))


Argument = Tensor | Obj | Scalar | Output


def dim_names(arguments: Sequence[Argument]) -> list[str]:
    """Every named dim, in order of first appearance (``"*M"`` as ``M``)."""
    names: list[str] = []
    for arg in arguments:
        if isinstance(arg, Tensor):
            alternatives = arg.alternatives()
        elif isinstance(arg, Obj) or (isinstance(arg, Output) and arg.dims is not None):
            alternatives = (arg.dims,)
        else:
            continue
        for dims in alternatives:
            for d in dims:
                if isinstance(d, str) and d.lstrip("*") not in names:
                    names.append(d.lstrip("*"))
    return names


def _shape_text(dims: Dims, values: dict[str, Any]) -> str:
    parts = []
    for d in dims:
        if isinstance(d, int):
            parts.append(str(d))
        elif d.startswith("*"):
            parts.append("...")
        elif d in values:
            parts.append(f"{d}={values[d]}")
        else:
            parts.append(d)
    return "[" + ", ".join(parts) + "]"


def _dtype_text(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class CheckedCall:
    """The detailed checks of one call: each failure raises a TypeError/ValueError naming the argument.

    ``values`` maps argument names to the call's values; ``names`` renames arguments in errors
    (a wrapper that calls a kernel under its own argument names). On success :attr:`dims` holds
    every dim's value and :attr:`device` the call's device.
    """

    def __init__(
        self,
        arguments: Sequence[Argument],
        rules: Sequence[Rule],
        values: dict[str, Any],
        names: dict[str, str] | None = None,
        cpu_allowed: bool = False,
    ) -> None:
        self.arguments = arguments
        self.values = values
        self.names = names or {}
        self.dims: dict[str, Any] = {}
        self.dim_source: dict[str, str] = {}
        self.device: torch.device | None = None
        self.first: str | None = None
        self.cpu_allowed = cpu_allowed
        for arg in arguments:
            if isinstance(arg, Tensor | Obj):
                self._check_input(arg)
        for arg in arguments:
            if isinstance(arg, Scalar):
                self._check_scalar(arg)
        for rule in rules:
            self._check_rule(rule)

    def label(self, name: str) -> str:
        return self.names.get(name, name)

    # ---- inputs ------------------------------------------------------------------------------

    def _check_input(self, arg: Tensor | Obj) -> None:
        value = self.values[arg.name]
        name = self.label(arg.name)
        if isinstance(arg, Tensor):
            if value is None and arg.optional:
                return
            if not isinstance(value, torch.Tensor):
                wanted = "a torch.Tensor or None" if arg.optional else "a torch.Tensor"
                raise TypeError(f"{name}: expected {wanted}, got {type(value).__name__}")
            _check_dense(value, name)
            self._check_dtype(arg, value, name)
            shape: tuple[Any, ...] = tuple(value.shape)
        else:
            if not isinstance(value, arg.type):
                raise TypeError(f"{name}: expected a {arg.type.__name__}, got {type(value).__name__}")
            shape = tuple(value.shape)
        self._check_device(arg.name, value.device, name)
        alternatives = arg.alternatives() if isinstance(arg, Tensor) else (arg.dims,)
        self._bind_shape(name, shape, alternatives)
        if isinstance(arg, Tensor) and arg.unit_inner_stride and value.dim() > 0 and value.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(value.stride())}")

    def _check_dtype(self, arg: Tensor, value: torch.Tensor, name: str) -> None:
        if arg.dtype_of is not None:
            other = self.values[arg.dtype_of]
            if value.dtype != other.dtype:
                raise TypeError(
                    f"{name}: expected dtype {other.dtype} (the dtype of {self.label(arg.dtype_of)}), got {value.dtype}"
                )
        elif arg.dtypes and value.dtype not in arg.dtypes:
            raise TypeError(f"{name}: expected dtype {_dtype_text(arg.dtypes)}, got {value.dtype}")
        elif arg.floating and not value.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype, got {value.dtype}")

    def _check_device(self, arg_name: str, device: torch.device, name: str) -> None:
        if self.device is None:
            self.device, self.first = device, arg_name
            if device.type == "cpu" and not self.cpu_allowed:
                raise ValueError(
                    f"{name}: CPU tensors run only on the Triton interpreter (set TRITON_INTERPRET=1 before "
                    "importing tritune); move the tensors to a GPU"
                )
            # Meta tensors pass: nothing launches on them unless a recorder stands in for Triton.
            if device.type not in ("cpu", "cuda", "meta"):
                raise ValueError(f"{name}: expected a CUDA device, got {device}")
        elif device != self.device:
            assert self.first is not None
            raise ValueError(
                f"{name}: expected device {self.device} (the device of {self.label(self.first)}), got {device}"
            )

    def _bind_shape(self, name: str, shape: tuple[Any, ...], alternatives: tuple[Dims, ...]) -> None:
        problems = []
        for dims in alternatives:
            why = self._match(shape, dims)
            if why is None:
                self._bind(name, shape, dims)
                return
            problems.append(why)
        wanted = " or ".join(_shape_text(dims, self.dims) for dims in alternatives)
        detail = f": {problems[0]}" if len(alternatives) == 1 else ""
        raise ValueError(f"{name}: expected shape {wanted}, got {tuple(shape)}{detail}")

    def _match(self, shape: tuple[Any, ...], dims: Dims) -> str | None:
        """Why ``shape`` does not fit ``dims`` with the dims bound so far, or None."""
        star = bool(dims) and isinstance(dims[0], str) and dims[0].startswith("*")
        fixed = dims[1:] if star else dims
        if (len(shape) < len(fixed)) if star else (len(shape) != len(fixed)):
            return f"{len(shape)} dims, expected {'at least ' if star else ''}{len(fixed)}"
        tail = shape[len(shape) - len(fixed) :]
        seen: dict[str, Any] = {}
        for d, n in zip(fixed, tail, strict=True):
            if isinstance(d, int):
                if n != d:
                    return f"a dim of {n} where {d} is required"
                continue
            expected = self.dims.get(d, seen.get(d))
            if expected is not None and n != expected:
                source = self.dim_source.get(d)
                origin = f"{self.label(source)} has" if source else "another dim of this tensor is"
                return f"{d} is {n} where {origin} {d}={expected}"
            seen[d] = n
        if star:
            lead = math.prod(shape[: len(shape) - len(fixed)])
            m = dims[0][1:]  # type: ignore[index]
            expected = self.dims.get(m)
            if expected is not None and lead != expected:
                return f"leading dims hold {lead} rows, expected {m}={expected}"
        return None

    def _bind(self, name: str, shape: tuple[Any, ...], dims: Dims) -> None:
        star = bool(dims) and isinstance(dims[0], str) and dims[0].startswith("*")
        fixed = dims[1:] if star else dims
        lead = shape[: len(shape) - len(fixed)]
        for d, n in zip(fixed, shape[len(lead) :], strict=True):
            if isinstance(d, str) and d not in self.dims:
                self.dims[d] = n
                self.dim_source[d] = name
        if star:
            m = dims[0][1:]  # type: ignore[index]
            if m not in self.dims:
                self.dims[m] = math.prod(lead)
                self.dims[f"*{m}"] = tuple(lead)
                self.dim_source[m] = name

    # ---- scalars and rules -------------------------------------------------------------------

    def _check_scalar(self, arg: Scalar) -> None:
        value = self.values[arg.name]
        name = self.label(arg.name)
        if value is None:
            if not arg.optional:
                raise TypeError(f"{name}: expected {_article(arg.type.__name__)}, got None")
            return
        wanted = arg.type.__name__ + (" or None" if arg.optional else "")
        if arg.type is bool:
            ok = isinstance(value, bool)
        elif arg.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            got = type(value).__name__
            if type(value).__module__ == "numpy":  # np.float32(0.5) is no Python float: the op takes one
                got = f"numpy.{got} (pass {arg.type.__name__}({arg.name}))"
            raise TypeError(f"{name}: expected {_article(wanted)}, got {got}")
        low, high = arg.limits()
        # Comparisons, not float(): an int too large for a float is refused, not an OverflowError.
        if (low is not None and not value >= low) or (high is not None and not value <= high) or value != value:
            raise ValueError(f"{name}: expected {_bounds_text(arg)}, got {value!r}")

    def _check_rule(self, rule: Rule) -> None:
        known = {**self.values, **self.dims}
        args = [known[p] for p in rule.params]
        if not rule.check(*args):
            raise ValueError(f"{self.label(rule.arg)}: {rule.message.format(**known)}")

    # ---- outputs -----------------------------------------------------------------------------

    def check_output(self, arg: Output, value: torch.Tensor | None, inputs: dict[str, Any]) -> None:
        """Refuse a given output of the wrong type, dtype, device or shape, or that overlaps.

        ``inputs``: the tensors it must not share memory with, by argument name.
        """
        from ._launch import check_out_memory

        if value is None:
            return
        name = self.label(arg.name)
        like = self.values[arg.like]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(value).__name__}")
        _check_dense(value, name)
        if value.dtype != like.dtype:
            raise TypeError(
                f"{name}: expected dtype {like.dtype} (the dtype of {self.label(arg.like)}), got {value.dtype}"
            )
        if value.device != self.device:
            raise ValueError(
                f"{name}: expected device {self.device} (the device of {self.label(arg.like)}), got {value.device}"
            )
        expected = self.output_shape(arg)
        if tuple(value.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected}, got {tuple(value.shape)}")
        if arg.contiguous and not value.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(value.stride())}")
        if arg.unit_inner_stride and value.dim() > 0 and value.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(value.stride())}")
        tensors = {self.label(n): t for n, t in inputs.items() if isinstance(t, torch.Tensor)}
        check_out_memory(value, tensors, name=name)

    def output_shape(self, arg: Output) -> tuple[Any, ...]:
        if arg.dims is None:
            return tuple(self.values[arg.like].shape)
        shape: list[Any] = []
        for d in arg.dims:
            if isinstance(d, int):
                shape.append(d)
            elif d.startswith("*"):
                shape.extend(self.dims[d])
            else:
                shape.append(self.dims[d])
        return tuple(shape)


def _article(noun: str) -> str:
    """``noun`` with its indefinite article: "an int", "a float or None"."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _bounds_text(arg: Scalar) -> str:
    low, high = arg.limits()
    kind = "a number" if arg.type is float else f"an {arg.type.__name__}"
    if low is None and high is None:
        return f"{kind} other than NaN" + (f" ({arg.why})" if arg.why else "")

    def show(v: float) -> str:
        return str(v) if arg.type is int else f"{v:g}"

    if low is not None and high is not None and low == -high:
        text = f"{kind} with |{arg.name}| <= {show(high)}"
    elif low is not None and high is not None:
        text = f"{kind} in [{show(low)}, {show(high)}]"
    elif low is not None:
        text = f"{kind} >= {show(low)}"
    else:
        assert high is not None
        text = f"{kind} <= {show(high)}"
    return text + (f" ({arg.why})" if arg.why else "")


def static_dim(n: Any, dynamic: bool) -> int:
    """A dim as a fact: a plain int, or :data:`DYNAMIC` for a symbolic dim declared dynamic."""
    if dynamic:
        from torch.fx.experimental.symbolic_shapes import has_static_value

        # operator.index, not int(): under dynamo a symbol whose range a guard fixed (one that duck
        # sizing shares with a dim that specialised) is still symbolic, and int() keeps it so.
        return operator.index(n) if has_static_value(n) else DYNAMIC
    return operator.index(n)


def _check_dense(value: torch.Tensor, name: str) -> None:
    """Refuse a tensor the kernels cannot address element by element: nested, sparse or another layout."""
    if value.is_nested:
        raise TypeError(f"{name}: expected a dense strided tensor, got a nested tensor")
    if value.layout is not torch.strided:
        raise TypeError(f"{name}: expected a dense strided tensor, got layout {value.layout}")

"""A declaration's ``torch.library`` op: its schema, its arguments flattened to tensors and scalars, its body.

The op (``tritune::<name>`` unless named otherwise) takes the call's tensors (an
:class:`~.arguments.Obj` split into its parts), outputs as mutated tensors and scalars, then the
config's fields by name as keyword arguments, so ``torch.compile(fullgraph=True)``, CUDA-graph
capture and ``opcheck`` see only plain values. Its body joins the parts again, rebuilds the config
from its fields (once per distinct config) and launches. :class:`KernelOp` is a base of
:class:`~.declare.Kernel`, which registers the op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._launch import prepare_interpreter
from .arguments import Obj, Output, Scalar, Tensor

_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


class KernelOp:
    """The op's side of a :class:`~.declare.Kernel`, which sets the attributes annotated here."""

    arguments: tuple[Tensor | Obj | Scalar | Output, ...]
    space: Any
    #: Whether CPU tensors may run: the kernels were decorated under TRITON_INTERPRET=1.
    cpu_allowed: bool
    #: The registered op (``register_schema_op``).
    op: Any
    _launch: Callable[..., None]
    _config_cache: dict[tuple[Any, ...], Any]

    def schema(self) -> str:
        """The op schema: inputs, outputs (mutated), scalars, then the config's fields by name."""
        parts: list[str] = []
        aliases = iter("abcdefghijklmnopqrstuvwxyz")
        for a in self.arguments:
            if isinstance(a, Tensor):
                parts.append(f"Tensor{'?' if a.optional else ''} {a.name}")
            elif isinstance(a, Obj):
                parts += [f"Tensor {a.name}_{part}" for part in a.parts]
            elif isinstance(a, Output):
                parts.append(f"Tensor({next(aliases)}!) {a.name}")
            else:
                optional = a.optional and a.resolve is None
                parts.append(f"{_SCHEMA_TYPES[a.type]}{'?' if optional else ''} {a.name}")
        config = [f"{_SCHEMA_TYPES[kind]} {field}" for field, kind in self.space.field_types.items()]
        return "(" + ", ".join(parts + (["*", *config] if config else [])) + ") -> ()"

    def _op_output_positions(self) -> tuple[int, ...]:
        positions, index = [], 0
        for a in self.arguments:
            if isinstance(a, Output):
                positions.append(index)
            index += len(a.parts) if isinstance(a, Obj) else 1
        return tuple(positions)

    def _op_args(self, args: tuple[Any, ...]) -> list[Any]:
        flat: list[Any] = []
        for a, value in zip(self.arguments, args, strict=True):
            if isinstance(a, Obj):
                flat.extend(a.split(value))
            else:
                flat.append(value)
        return flat

    def _call_op(self, config: Any, args: tuple[Any, ...]) -> None:
        self.op(*self._op_args(args), **self.space.field_values(config))

    def _op_body(self, *flat: Any, **fields: Any) -> None:
        args: list[Any] = []
        position = 0
        for a in self.arguments:
            if isinstance(a, Obj):
                args.append(a.join(*flat[position : position + len(a.parts)]))
                position += len(a.parts)
            else:
                args.append(flat[position])
                position += 1
        if self.cpu_allowed:  # an op call may be the process's first interpreted launch
            prepare_interpreter()
        self._launch(self.config_from_fields(fields), *args)

    def config_from_fields(self, fields: Mapping[str, Any]) -> Any:
        """The config an op call's keyword fields stand for (built once per distinct config)."""
        cache_key = tuple(fields.items())
        config = self._config_cache.get(cache_key)
        if config is None:
            config = self._config_cache[cache_key] = self.space.from_fields(dict(fields))
        return config

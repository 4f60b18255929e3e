"""The early key of a call: its raw arguments read before any check, by a function generated per layout.

A call whose layout replayed after its checks before (:mod:`._replay`) skips the checks; what
identifies the layout is read from the raw arguments: the current device and stream, then per
argument in the layout's order each tensor's shape, strides, dtype, device index and address
modulo 16 (None for an absent optional tensor or an output left to be allocated), each object's
tensors (its split) alike, and each scalar's type and value. The same read also gives each
tensor's address and the tensor itself, in that order (0 and None for an absent one), for the
replay.

There is no key (None: the checked way) where a tensor needs grad or is not a plain strided
tensor, a required tensor is None, an object is not of its declared type, or replay cannot run
now (off, a dispatch, function or compiler mode, a capture, a launch hook), an object with a
declared number of parts splits into another number, or a read raises. A passed output's
layout is keyed as an input's; that it shares no memory with the inputs is checked at each
replay (:meth:`._replay.LaunchPlans.replay_early`).

This is on every replayed call's path, so it is not a loop over the layout (a tuple unpacked and
branches on each argument's kind): a kernel's layout is fixed by its declaration, and this module
writes the straight-line function for it (each argument read by name, each attribute once, the
key one tuple display) and compiles it once per kernel, as :mod:`.fastcheck` does for the checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import _replay
from ._replay import OBJECT, OUTPUT, SCALAR

__all__ = ["EarlyKey", "build_early_key"]

EarlyKey = Callable[[tuple[Any, ...]], "tuple[tuple[Any, ...], list[int], list[torch.Tensor | None]] | None"]

_TENSOR_OK = "type({t}) is not _Tensor or {t}.requires_grad or {t}.layout is not _strided"


def _object_parts(parts: Iterable[Any]) -> tuple[tuple[Any, ...], list[int], list[torch.Tensor]] | None:
    """An object's tensors (its split) as key fields, addresses and tensors; None for a part the
    checks must see (not a plain strided tensor, or needing grad)."""
    key: list[Any] = []
    addresses: list[int] = []
    tensors: list[torch.Tensor] = []
    for t in parts:  # once: a split may return an iterator
        if type(t) is not torch.Tensor or t.requires_grad or t.layout is not torch.strided:
            return None
        address = t.data_ptr()
        addresses.append(address)
        tensors.append(t)
        key += (t.shape, t.stride(), t.dtype, t.get_device(), address & 15)
    return tuple(key), addresses, tensors


def build_early_key(layout: Sequence[tuple[int, int, Any]], optional: frozenset[int] = frozenset()) -> EarlyKey:
    """The function reading the early key of calls laid out as ``layout``: ``fn(args) -> (key,
    addresses, tensors) | None`` (see the module docstring).

    ``layout``: per argument, in the order of :meth:`._replay.LaunchPlans.run`'s tensors (inputs
    and outputs by position, then objects' parts, then scalars): (position, kind, and for ``OBJECT``
    the object's type, split and optionally its number of parts: given, the split must return a
    tuple or list of that many tensors, each read in line). ``optional``: positions of input
    tensors that may be None (the others are required: a None there returns None).
    """
    names: dict[str, Any] = {
        "_replay": _replay,
        "_Tensor": torch.Tensor,
        "_strided": torch.strided,
        "_object_parts": _object_parts,
    }
    lines = ["def early_key(args):"]

    def emit(line: str, depth: int = 1) -> None:
        lines.append("    " * depth + line)

    for i in sorted({i for i, _, _ in layout}):
        emit(f"a{i} = args[{i}]")
    # no_modes() before the capture query: under torch.compile it returns False, and the query is not traceable.
    emit(
        "if not _replay._replay_on() or not _replay.no_modes() or not _replay._fast_launch_on() "
        "or _replay._capturing() or _replay._launch_hooks_set():"
    )
    emit("return None", 2)
    emit("_active = _replay.driver.active")
    emit("_current = _active.get_current_device()")
    key = ["_current", "_active.get_current_stream(_current)"]
    addresses: list[str] = []
    tensors: list[str] = []

    def read_required(t: str) -> None:
        """A tensor that must be there: refused unless plain, then keyed and addressed."""
        emit(f"if {_TENSOR_OK.format(t=t)}:")
        emit("return None", 2)
        emit(f"_p_{t} = {t}.data_ptr()")
        key.extend([f"{t}.shape", f"{t}.stride()", f"{t}.dtype", f"{t}.get_device()", f"_p_{t} & 15"])
        addresses.append(f"_p_{t}")
        tensors.append(t)

    for i, kind, extra in layout:
        a = f"a{i}"
        if kind == SCALAR:
            key += [f"type({a})", a]
        elif kind == OBJECT:
            kind_type, split, *count = extra
            names[f"_type{i}"], names[f"_split{i}"] = kind_type, split
            emit(f"if type({a}) is not _type{i}:")
            emit("return None", 2)
            if count and count[0] > 0:
                # A declared number of parts: each read in line, as a required input is.
                parts = [f"{a}_{j}" for j in range(count[0])]
                emit(f"_s{i} = _split{i}({a})")
                emit(f"if not isinstance(_s{i}, (tuple, list)) or len(_s{i}) != {count[0]}:")
                emit("return None", 2)
                emit(f"{', '.join(parts)}, = _s{i}")
                for part in parts:
                    read_required(part)
            else:
                emit(f"_parts{i} = _object_parts(_split{i}({a}))")
                emit(f"if _parts{i} is None:")
                emit("return None", 2)
                emit(f"_k{i}, _p{i}, _t{i} = _parts{i}")
                key.append(f"*_k{i}")
                addresses.append(f"*_p{i}")
                tensors.append(f"*_t{i}")
        elif kind == OUTPUT or i in optional:
            # An optional input, or an output passed or left to the replay to allocate: None is a
            # layout of its own. A passed output's overlap with the inputs depends on the
            # addresses, which the replay checks per call.
            emit(f"if {a} is None:")
            emit(f"_k{i}, _p{i} = _NONE, 0", 2)
            emit("else:")
            emit(f"if {_TENSOR_OK.format(t=a)}:", 2)
            emit("return None", 3)
            emit(f"_p{i} = {a}.data_ptr()", 2)
            emit(f"_k{i} = ({a}.shape, {a}.stride(), {a}.dtype, {a}.get_device(), _p{i} & 15)", 2)
            names["_NONE"] = (None,)
            key.append(f"*_k{i}")
            addresses.append(f"_p{i}")
            tensors.append(a)
        else:
            read_required(a)
    emit(f"return ({', '.join(key)},), [{', '.join(addresses)}], [{', '.join(tensors)}]")
    # A tensor whose layout cannot be read (a nested one has no sizes) raises: no key either.
    body = ["    " + line for line in lines[1:]]
    lines = [lines[0], "    try:", *body, "    except Exception:", "        return None"]
    source = "\n".join(lines) + "\n"
    code = compile(source, "<tritune early key>", "exec")
    exec(code, names)  # our own generated text, from a declaration in code: nothing read from a file
    fn: EarlyKey = names["early_key"]
    fn.source = source  # type: ignore[attr-defined]
    return fn

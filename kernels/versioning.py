"""Kernel versions: a fingerprint of what decides the generated code and the meaning of a stored time.

A stored winner is only worth serving while it describes the code that runs. The version of a
kernel hashes exactly the things that can change that:

- the launched Triton kernels and every ``@triton.jit`` function they call, as a canonical form of
  their syntax tree (comments, docstrings, formatting and line numbers do not count; a changed
  expression does), plus the values of the module-level constants they read;
- the config space's structure (field names, their choices, the feasibility rule's identity) and
  the key type's fields, so a config or key stored under another shape of either is never read
  as if it meant the same;
- a protocol number the kernel's author bumps by hand when host-side launch geometry or the timing
  method changes (a grid rule, a workspace layout, graph-timed instead of eager-timed trials).

Host code (argument checks, error messages, docstrings, the dispatcher) is deliberately left out:
editing it must not stale a shipped bundle. The Triton version is left out too: whether a winner
tuned under another Triton still serves is the config loader's decision, not the version's.

The canonical tree form is written here rather than taken from ``ast.dump`` or Triton's
``JITFunction.cache_key``: the former changes its output across Python releases, the latter folds
in the function's starting line number, so a comment added above a kernel would stale it.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["jit_fingerprint", "kernel_version", "reached_functions", "space_fingerprint"]

#: Length of a version string (hex digits of a sha256).
VERSION_DIGITS = 16


def _python_function(kernel: Any) -> Any:
    """The plain Python function behind a Triton kernel (compiled, interpreted or autotuned)."""
    fn = kernel
    # JITFunction.fn and InterpretedFunction.fn are the Python function; an Autotuner's .fn is
    # the JITFunction it wraps.
    while not inspect.isfunction(fn):
        inner = getattr(fn, "fn", None)
        if inner is None:
            raise TypeError(f"{kernel!r} is not a Triton kernel or a Python function")
        fn = inner
    return fn


def _is_triton_kernel(value: Any) -> bool:
    """Whether ``value`` is a ``@triton.jit`` function, compiled or run by the interpreter."""
    from triton.runtime.jit import JITCallable, KernelInterface

    return isinstance(value, JITCallable | KernelInterface)


def _canonical(node: Any) -> str:
    """A Python-release-independent text of a syntax tree: node types and non-empty fields only."""
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                # Newer Pythons add fields (type_params, ...) that are empty in ordinary code.
                continue
            parts.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def _function_tree(fn: Any) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef):
        raise TypeError(f"{fn.__qualname__}: expected a function definition")
    body = definition.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        # The docstring: documentation, not code.
        definition.body = body[1:] or [ast.Pass()]
    return definition


def _referenced_names(definition: ast.FunctionDef) -> list[str]:
    names = {node.id for node in ast.walk(definition) if isinstance(node, ast.Name)}
    return sorted(names)


def _constant_text(value: Any) -> str | None:
    """The text a module-level constant contributes, or None for what is not a constant."""
    inner = getattr(value, "value", value) if type(value).__name__ == "constexpr" else value
    if isinstance(inner, bool | int | float | str) or inner is None:
        return repr(inner)
    if isinstance(inner, tuple) and all(isinstance(v, bool | int | float | str) for v in inner):
        return repr(inner)
    return None


def _walk(kernels: Iterable[Any]) -> Iterator[tuple[str, str]]:
    """(qualified name, canonical text) of ``kernels`` and every Triton function they call."""
    seen: set[str] = set()
    pending = [_python_function(k) for k in reversed(list(kernels))]
    while pending:
        fn = pending.pop()
        name = f"{fn.__module__}.{fn.__qualname__}"
        if name in seen:
            continue
        seen.add(name)
        definition = _function_tree(fn)
        # The module is left out: moving a kernel to another file does not change its code.
        entry = [fn.__qualname__, _canonical(definition)]
        scope = fn.__globals__
        callees = []
        for ref in _referenced_names(definition):
            if ref not in scope:
                continue
            value = scope[ref]
            if _is_triton_kernel(value):
                callees.append(_python_function(value))
                entry.append(f"calls {ref}")
                continue
            text = _constant_text(value)
            if text is not None:
                entry.append(f"{ref}={text}")
        pending.extend(reversed(callees))
        yield name, "\n".join(entry)


def reached_functions(kernels: Iterable[Any]) -> set[str]:
    """Qualified names of ``kernels`` and of every Triton function they call, transitively."""
    return {name for name, _ in _walk(kernels)}


def jit_fingerprint(kernels: Iterable[Any]) -> str:
    """Hash of ``kernels`` and every Triton function they call, transitively (see the module doc)."""
    digest = hashlib.sha256()
    for _, text in _walk(kernels):
        digest.update((text + "\n\n").encode())
    return digest.hexdigest()


def space_fingerprint(space: Any, key_type: type) -> str:
    """Hash of a config space's structure and a key type's fields (what stored values mean)."""
    lines = [f"space {type(space).__qualname__}", *space.fingerprint()]
    lines += [f"key {f.name}: {f.type}" for f in dataclasses.fields(key_type)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def kernel_version(kernels: Iterable[Any], space: Any, key_type: type, protocol: int) -> str:
    """The version stored with every trial and winner of a kernel (16 hex digits)."""
    digest = hashlib.sha256()
    digest.update(f"protocol {int(protocol)}\n".encode())
    digest.update(jit_fingerprint(kernels).encode())
    digest.update(space_fingerprint(space, key_type).encode())
    return digest.hexdigest()[:VERSION_DIGITS]

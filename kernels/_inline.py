"""The expression a small lambda returns, as source text that generated code can hold inline.

A declaration's rules and resolvers are lambdas over dim and argument names (``lambda Hq, Hkv:
Hq % Hkv == 0``), and the generated fast check (:mod:`.fastcheck`) has locals of exactly those
names. Calling each lambda costs a Python call per call of the kernel; writing its expression in
place costs nothing beyond the expression. :func:`inline_lambda` finds the lambda in its module's
syntax tree (the one lambda on its line with its parameters whose body holds the column span Python
3.11+ records for its instructions, and that reads the same names), and renames every other name
the expression reads (module globals, builtins) to a name the caller binds to the same object.
Anything it cannot do exactly (no source, older Pythons, defaults, closures, nested scopes) returns
None, and the caller calls the lambda.
"""

from __future__ import annotations

import ast
import builtins
import dis
import functools
import inspect
import linecache
import types
from collections.abc import Callable
from typing import Any

__all__ = ["inline_lambda"]

#: Expressions that open a scope of their own or bind names: their names are not the lambda's.
_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr, ast.Await)
#: Instructions that carry the lambda's own line rather than a part of its expression.
_FRAME = {"RESUME", "RETURN_VALUE", "RETURN_CONST"}


def inline_lambda(fn: Callable[..., Any], bind: Callable[[Any], str]) -> str | None:
    """``fn``'s returned expression over its parameter names, or None where it cannot be inlined exactly.

    ``bind(value)`` returns the name the generated code's globals hold ``value`` under; it is called
    for each global or builtin the expression reads.
    """
    code = getattr(fn, "__code__", None)
    if (
        code is None
        or getattr(fn, "__name__", "") != "<lambda>"
        or fn.__defaults__
        or fn.__kwdefaults__
        or code.co_freevars
        or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    ):
        return None
    params = code.co_varnames[: code.co_argcount]
    node = _lambda_node(code, params)
    if node is None or any(isinstance(n, _SCOPED) for n in ast.walk(node.body)) or not _compiles_to(node, code):
        return None
    body = ast.parse(ast.unparse(node.body), mode="eval")
    read = {n.id for n in ast.walk(body) if isinstance(n, ast.Name)} - set(params)
    attributes = {n.attr for n in ast.walk(body) if isinstance(n, ast.Attribute)}
    # The tree must read exactly the names the code does (a file edited since import would not).
    if read | attributes != set(code.co_names):
        return None
    renames = {}
    for name in sorted(read):
        if name in fn.__globals__:
            renames[name] = bind(fn.__globals__[name])
        elif hasattr(builtins, name):
            renames[name] = bind(getattr(builtins, name))
        else:
            return None
    for n in ast.walk(body):
        if isinstance(n, ast.Name) and n.id in renames:
            n.id = renames[n.id]
    return "(" + ast.unparse(body) + ")"


def _lambda_node(code: Any, params: tuple[str, ...]) -> ast.Lambda | None:
    """The one lambda of ``code``'s line with these parameters whose body spans its instructions."""
    spans = []
    for instruction in dis.get_instructions(code):
        positions = getattr(instruction, "positions", None)
        if instruction.opname in _FRAME or positions is None or None in positions:
            continue
        spans.append(positions)
    tree = _module_tree(code.co_filename)
    if not spans or tree is None:
        return None
    first = min((p.lineno, p.col_offset) for p in spans)
    last = max((p.end_lineno, p.end_col_offset) for p in spans)
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Lambda)
        and node.lineno == code.co_firstlineno
        and [a.arg for a in node.args.args] == list(params)
        and not (node.args.posonlyargs or node.args.kwonlyargs or node.args.vararg or node.args.kwarg)
        and (node.body.lineno, node.body.col_offset) <= first
        and last <= (node.body.end_lineno or 0, node.body.end_col_offset or 0)
    ]
    return found[0] if len(found) == 1 else None


def _compiles_to(node: ast.Lambda, code: Any) -> bool:
    """Whether the source found for the lambda compiles to the constants and names of the code that
    runs: a file edited after import can hold another lambda at the same place (``N <= 99`` where
    ``N <= 8`` was imported). The bytecode itself is not compared: the compiler may emit another
    form of the same call for a lambda compiled alone."""
    try:
        compiled = compile(ast.Expression(body=node), code.co_filename, "eval")
    except (SyntaxError, ValueError):
        return False
    found = [c for c in compiled.co_consts if isinstance(c, types.CodeType)]
    return len(found) == 1 and all(
        getattr(found[0], attr) == getattr(code, attr) for attr in ("co_consts", "co_names", "co_varnames")
    )


@functools.lru_cache(maxsize=64)
def _module_tree(filename: str) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None

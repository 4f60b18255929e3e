"""``inline_lambda``: a lambda's expression written in place, exactly, or None (and the caller calls it)."""

from __future__ import annotations

import math

import pytest

from tritune.kernels._inline import inline_lambda

LIMITS = (64, 128)


def _inline(fn):
    bound: dict[str, object] = {}

    def bind(value: object) -> str:
        name = f"_g{len(bound)}"
        bound[name] = value
        return name

    return inline_lambda(fn, bind), bound


def _k(k):
    return lambda x: x + k


@pytest.mark.parametrize(
    ("fn", "expected", "bound"),
    [
        (lambda D: D in LIMITS, "(D in _g0)", [LIMITS]),
        (lambda Hq, Hkv: Hkv > 0 and Hq % Hkv == 0, "(Hkv > 0 and Hq % Hkv == 0)", []),
        (
            lambda rows, cols: (
                rows >= 1  # a comment inside
                and cols >= 1
            ),
            "(rows >= 1 and cols >= 1)",
            [],
        ),
        (lambda D: 1.0 / math.sqrt(D), "(1.0 / _g0.sqrt(D))", [math]),
        (lambda n: len(n) == 2, "(_g0(n) == 2)", [len]),
    ],
    ids=["global", "params-only", "multi-line", "module-attribute", "builtin"],
)
def test_inlined_expressions_read_the_same_objects(fn, expected, bound):
    text, names = _inline(fn)
    assert text == expected
    assert list(names.values()) == bound
    # Evaluated over the same names (our own generated text, as the fast check compiles it), the
    # text gives what the lambda gives.
    args = {"D": 64, "Hq": 8, "Hkv": 2, "rows": 3, "cols": 0, "n": "ab"}
    params = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    assert eval(text, dict(names), args) == fn(*(args[p] for p in params))


@pytest.mark.parametrize(
    "fn",
    [lambda x, y=1: x + y, lambda *xs: xs, lambda x: [i for i in x], _k(2), math.sqrt, len],
    ids=["default", "varargs", "comprehension", "closure", "builtin-function", "not-a-lambda"],
)
def test_what_cannot_be_inlined_exactly_is_left_to_a_call(fn):
    assert _inline(fn)[0] is None


def test_two_lambdas_on_one_line_are_told_apart():
    first, second = (lambda a: a + 1), (lambda a: a * 2)
    assert _inline(first)[0] == "(a + 1)" and _inline(second)[0] == "(a * 2)"


def test_a_lambda_whose_file_was_edited_after_import_is_not_inlined(tmp_path, monkeypatch):
    """The source on disk is another lambda now (``N <= 99`` where ``N <= 8`` was imported): the
    generated check must call the running lambda, not inline the new text."""
    import importlib
    import linecache

    module = tmp_path / "edited_rules.py"
    module.write_text("RULE = lambda N: N <= 8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rule = importlib.import_module("edited_rules").RULE
    assert _inline(rule)[0] == "(N <= 8)"
    module.write_text("RULE = lambda N: N <= 99\n")
    linecache.checkcache(str(module))
    import tritune.kernels._inline as inline

    inline._module_tree.cache_clear()
    assert _inline(rule)[0] is None

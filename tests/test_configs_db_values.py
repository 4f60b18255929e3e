"""Canonical JSON of keys and configs: one text per value, and a strict parse back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritune.configs_db.values import canonical_json, parse_canonical_json, winner_numbers_problem

scalars = st.one_of(
    st.integers(min_value=-(2**53), max_value=2**53),
    st.booleans(),
    st.text(max_size=12),
    st.floats(allow_nan=False, allow_infinity=False),
)
flat_objects = st.dictionaries(st.text(min_size=1, max_size=12), scalars, max_size=8)


@given(flat_objects)
def test_canonical_json_round_trips(value: dict[str, object]) -> None:
    text = canonical_json(value)
    parsed = parse_canonical_json(text)
    assert parsed == value
    assert [type(v) for v in parsed.values()] == [type(value[k]) for k in parsed]
    assert canonical_json(parsed) == text


@given(flat_objects)
def test_canonical_json_ignores_insertion_order(value: dict[str, object]) -> None:
    reordered = dict(reversed(list(value.items())))
    assert canonical_json(reordered) == canonical_json(value)


def test_canonical_json_is_compact_and_sorted() -> None:
    assert canonical_json({"b": 1, "a": "x", "c": True}) == '{"a":"x","b":1,"c":true}'


@pytest.mark.parametrize(
    "text, reason",
    [
        pytest.param("[1, 2]", "expected an object", id="list"),
        pytest.param('{"a": {"b": 1}}', "value.a is an object", id="nested-object"),
        pytest.param('{"a": [1]}', "value.a is a list", id="nested-list"),
        pytest.param('{"a": null}', "value.a is null", id="null"),
        pytest.param('{"a": NaN}', "NaN", id="nan"),
        pytest.param('{"a": -Infinity}', "-Infinity", id="minus-infinity"),
        pytest.param('{"a": 1e999}', "not a finite number", id="overflowing-number"),
        pytest.param('{"a": 1, "a": 2}', "duplicate key 'a'", id="duplicate-key"),
        pytest.param('{"": 1}', "non-empty string", id="empty-field-name"),
        pytest.param('{"a": 1', "Expecting", id="truncated"),
        pytest.param("[" * 100_000, "nested too deeply", id="deeply-nested"),
    ],
)
def test_parse_is_strict(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_canonical_json(text)


@pytest.mark.parametrize(
    "numbers, reason",
    [
        pytest.param((1.0, 2.0, 2.0, 5), None, id="fine"),
        pytest.param((-1.0, 2.0, 2.0, 5), "time_ms is -1.0", id="negative-time"),
        pytest.param((1.0, 0.0, 2.0, 5), "portable_ms is 0.0", id="zero-portable"),
        pytest.param((1.0, 2.0, float("nan"), 5), "speedup is nan", id="nan-speedup"),
        pytest.param((1.0, 2.0, 1000.5, 5), "measurement error", id="absurd-speedup"),
        pytest.param((1.0, 2.0, 2.0, 0), "at least 1", id="no-trials"),
        pytest.param((1.0, 2.0, 2.0, True), "whole number", id="boolean-trials"),
        pytest.param((1.0, 2.0, 2.0, 2.5), "whole number", id="fractional-trials"),
        pytest.param(("1", 2.0, 2.0, 5), "time_ms is a string", id="string-time"),
        pytest.param((1e-300, 1e300, 2.0, 5), "disagrees with portable_ms / time_ms = inf", id="overflowing-ratio"),
    ],
)
def test_winner_numbers(numbers: tuple[object, object, object, object], reason: str | None) -> None:
    problem = winner_numbers_problem(*numbers)
    if reason is None:
        assert problem is None
    else:
        assert problem is not None and reason in problem

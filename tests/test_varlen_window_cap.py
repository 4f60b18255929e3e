"""Windows up to the declared maximum (2**31 - 1, a common "no window" sentinel) under split-K.

The kernels bound a tile's keys by ``TQ + window - 1`` (causal) or ``q_len + window - 1`` in int32;
the launch caps the window it passes at one past the store's rows (beyond which a window hides no
key), so those bounds cannot wrap and every query row is written. ``out`` starts as NaN: a row the
kernels skip shows up.
"""

from __future__ import annotations

import pytest
import torch
from varlen_cases import SPLIT, Mix, run_and_compare

from tritune.kernels import _launch

WINDOWS = [2**31 - 1, 2**31 - 200]

#: (q_start, q_len, col, kv_end) segments of each store kind: a decode token and a short chunk,
#: plus (non-causal) a chunk longer than 200 rows, whose ``q_len + window - 1`` wraps at 2**31 - 200.
#: Causal tiles span at most 128 tokens: there 2**31 - 200 does not wrap even uncapped.
CASES = {
    "flat-causal": Mix(((0, 1, 0, 200), (1, 2, 1, 150)), tokens=3, rows=200, cols=2),
    "flat-noncausal": Mix(((0, 1, 0, 200), (1, 208, 1, 210)), tokens=209, rows=224, cols=2, group=1, causal=False),
    # Rings of 64 rows holding the last 64 of 200 and 150 positions.
    "ring-causal": Mix(((0, 1, 0, 200), (1, 2, 1, 150)), tokens=3, rows=64, cols=2, ring=True),
    # Rings of 224 rows holding the last 224 of 300 and 400 positions.
    "ring-noncausal": Mix(
        ((0, 1, 0, 300), (1, 208, 1, 400)), tokens=209, rows=224, cols=2, group=1, causal=False, ring=True
    ),
}


@pytest.fixture(autouse=True)
def _four_sms(monkeypatch):
    """Plan splits as if the interpreter's device had 4 SMs, so the SPLIT config splits."""
    monkeypatch.setitem(_launch.SM_COUNTS, torch.device("cpu"), 4)


@pytest.mark.parametrize("window", WINDOWS, ids=["int32-max", "int32-max-minus-200"])
@pytest.mark.parametrize("case", list(CASES))
def test_window_near_int32_max_matches_the_reference(case, window):
    run_and_compare(CASES[case], SPLIT, window=window)


def test_window_near_int32_max_under_the_default_config():
    """The interpreter's default config splits a decode token over 200 keys."""
    mix = Mix(((0, 1, 0, 200),), tokens=1, rows=200, cols=1)
    run_and_compare(mix, window=2**31 - 1)

"""The tracing check the miss log and online tuning run on every miss: silent in a serving process."""

from __future__ import annotations

import logging
import warnings

import torch

from tritune.kernels.misses import in_capture_or_trace


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_tracing_check_logs_and_warns_nothing():
    # torch logs its deprecation of is_fx_tracing once per process: forget that it did. Its loggers
    # do not propagate to the root logger (caplog's), so the handler goes on torch's own.
    once = getattr(torch.fx._symbolic_trace, "is_fx_tracing_warning", None)
    if once is not None and hasattr(once, "cache_clear"):
        once.cache_clear()
    handler, logger = Records(), logging.getLogger("torch.fx._symbolic_trace")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert in_capture_or_trace() is False
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in handler.records if record.levelno >= logging.WARNING] == []


def test_fx_symbolic_tracing_still_counts_as_tracing():
    seen = []

    def body(x):
        seen.append(in_capture_or_trace())
        return x + 1

    torch.fx.symbolic_trace(body)
    assert seen == [True]

"""What the parts of ``scripts/bench_tuner.py`` share: their context and record, workers, re-timing, rendering.

A part runs in a process of its own (the script's child) and records what it learned in a
:class:`Record`, which rewrites the part's JSON after every step: a part stopped by its time cap
still leaves what it finished. The parent renders the sections from those JSON files.

Nothing here imports a kernel at import time: the script chooses the Triton interpreter first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tritune.bench")


@dataclass
class Context:
    """What every part is given: the device, its deadline and the knobs from the command line."""

    smoke: bool
    work: Path
    deadline: float
    args: Any

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.smoke else torch.device("cuda", 0)

    @property
    def worker_device(self) -> str:
        return "cpu" if self.smoke else "cuda:0"

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Record:
    """A part's findings, written to its JSON file after every step."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def keys_of(spec: Any, info: Any, **fields: list[int]) -> list[Any]:
    """``spec``'s default keys narrowed as ``tune --key NAME=VALUES`` would (``head_dim=[128]``, ``lkv=[...]``)."""
    from tritune.tuner.keys import KeyPlan, parse_overrides

    return KeyPlan([spec], parse_overrides([], fields)).keys(spec, info)


def check(name: str, passed: bool | None, detail: str = "") -> dict[str, Any]:
    """One line of a part's verdict; ``passed=None`` means not judged (``detail`` says why)."""
    return {"name": name, "passed": passed, "detail": detail}


# ---- tuning helpers ----------------------------------------------------------------------------------


def fresh_sqlite(path: Path) -> str:
    """The URL of an empty SQLite file at ``path`` (any earlier file and its WAL removed)."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return f"sqlite:///{path}"


def integrity(path: Path) -> list[str]:
    """SQLite's ``PRAGMA integrity_check`` of the file: ``["ok"]`` when sound."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [row[0] for row in conn.execute("PRAGMA integrity_check")]


def on_trial(kernel: str, config: dict[str, Any], status: str, ms: float | None) -> None:
    log.info("  %s %s: %s%s", kernel, short(config), status, "" if ms is None else f" {ms:.4g} ms")


@contextlib.contextmanager
def captured_warnings(into: list[str]) -> Iterator[None]:
    """Collect what the tuner logs at WARNING and above (worker deaths, batch fallbacks) while it runs."""

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("tritune.tuner")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def tune_options(ctx: Context, **values: Any) -> Any:
    """``TuneOptions`` as ``tune`` makes them (candidates isolated), with the script's batch and timeout."""
    from tritune.tuner.study import TuneOptions

    if ctx.args.batch is not None:
        values.setdefault("batch", ctx.args.batch)
    return TuneOptions(isolate=True, trial_timeout_s=ctx.args.trial_timeout, **values)


def make_worker(ctx: Context, timer: Any, options: Any) -> Any:
    """The crash-isolated bench process ``tune`` uses, for this part's device."""
    from tritune.tuner.worker import Worker

    return Worker(
        ctx.worker_device,
        timer,
        trial_timeout_s=options.trial_timeout_s,
        noise=options.noise,
        compile_workers=options.compile_workers,
    )


def retime(worker: Any, ctx: Context, spec: Any, key: Any, configs: list[dict[str, Any]]) -> list[float] | None:
    """Median times of ``configs`` at ``key`` over ``--rounds`` interleaved rounds, in the worker process."""
    worker.open(spec, key, ctx.args.retime_seed, spec.space.to_dict(spec.default_config(key)))
    result = worker.retime(configs, ctx.args.rounds)
    return None if result is None else list(result["ms"])


def ratio_check(ctx: Context, name: str, times: list[float] | None, same: bool) -> dict[str, Any]:
    """Whether re-timed ``times`` lie within ``--tolerance`` of each other (not judged in smoke mode)."""
    if times is None:
        return check(name, False, "re-timing failed")
    spread = max(times) / min(times) - 1.0
    detail = f"{spread * 100:.2f}% apart" + (" (one config, timed twice: the noise floor)" if same else "")
    if ctx.smoke:
        return check(name, None, f"{detail}; not judged in smoke mode (interpreter wall-clock)")
    return check(name, spread <= ctx.args.tolerance, detail)


def result_dict(result: Any) -> dict[str, Any]:
    """A tuner ``KeyResult`` as plain values."""
    names = ("config", "best_ms", "portable_ms", "measured", "reused", "failed", "pruned", "notes")
    return {name: getattr(result, name) for name in names}


# ---- rendering ---------------------------------------------------------------------------------------


def short(config: dict[str, Any] | None) -> str:
    return "-" if config is None else " ".join(f"{k}={v}" for k, v in config.items())


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def fmt_counts(values: dict[str, Any]) -> str:
    return ", ".join(f"{name} {value}" for name, value in sorted(values.items())) or "-"


def cell(text: Any, limit: int = 200) -> str:
    """One markdown table cell: no pipes, no line breaks, at most ``limit`` characters."""
    flat = " ".join(str(text).replace("|", "/").split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def verdict_word(item: dict[str, Any] | None) -> str:
    if item is None:
        return "-"
    return {True: "pass", False: "FAIL", None: "n/a"}[item["passed"]]


def render_checks(checks: list[dict[str, Any]]) -> list[str]:
    if not checks:
        return []
    lines = ["| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {item['name']} | {verdict_word(item)} | {cell(item['detail'], 300)} |" for item in checks]
    return [*lines, ""]


def render_warnings(warnings: list[str]) -> list[str]:
    if not warnings:
        return []
    return ["What the tuner logged:", "", *(f"- `{cell(w, 240)}`" for w in warnings), ""]

"""Processes that open one study storage at the same moment (imported by spawned children: keep it light).

Optuna creates its tables and stamps their version when an RDB storage is first opened, and
workers that do it at once fail on a unique constraint unless opening is serialized. A barrier
releases every process at once, after its imports, so the race is run rather than left to
start-up timing.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from tritune.tuner.studies import StudyStorage

#: How long any step may take: only reached on failure.
LIMIT_S = 120.0


def _open_at(where: StudyStorage, start: Any, errors: Any) -> None:
    start.wait(LIMIT_S)
    try:
        where.open()
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")


def open_together(where: StudyStorage, count: int = 4) -> tuple[list[int | None], list[str]]:
    """Open ``where`` in ``count`` fresh processes at once: their exit codes and the errors they met."""
    context = multiprocessing.get_context("spawn")
    start, errors = context.Barrier(count), context.Queue()
    processes = [context.Process(target=_open_at, args=(where, start, errors)) for _ in range(count)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(LIMIT_S)
        if process.is_alive():
            process.kill()
            process.join(LIMIT_S)
    found = []
    while not errors.empty():
        found.append(errors.get(timeout=5))
    return [process.exitcode for process in processes], found

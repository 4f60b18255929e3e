"""What a ``tune`` run prints when it ends: the summary table and the one last line scripts read."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from .app import console, plain, short_key

__all__ = ["config_text", "print_results", "report_stored", "stored_text"]


def report_stored(keys: int, failed: int, stored: int, seconds: float, where: str, kept: int = 0) -> None:
    """The run's last line; exit status 1 when a key failed (its error is printed above), as a fleet's run.

    Keys that did not fail store a winner (or were finalized by another worker of shared studies),
    unless the DB kept a faster one stored before (``kept`` of them, counted apart): a partial
    failure still stores the others, and says how many failed.
    """
    # One line however long the DB's path: scripts read the run's last line.
    if not failed:
        if kept:
            console.print(f"done in {seconds:.1f} s; {stored_text(stored, kept, where)}", soft_wrap=True)
        else:
            console.print(f"done in {seconds:.1f} s; winners stored in {plain(where)}", soft_wrap=True)
        return
    if stored:
        console.print(
            f"[red]{failed} of {keys} key(s) failed (see above)[/red]; done in {seconds:.1f} s; "
            f"{stored_text(stored, kept, where)}",
            soft_wrap=True,
        )
    else:
        console.print(f"[red]no winner stored: {failed} of {keys} key(s) failed (see above)[/red]")
    raise typer.Exit(1)


def stored_text(stored: int, kept: int, where: str) -> str:
    """How many keys' winners were stored, and how many kept a faster stored winner instead."""
    text = f"winners of {stored - kept} key(s) stored in {plain(where)}"
    return f"{text}; {kept} key(s) kept a faster stored winner" if kept else text


def print_results(results: list[Any]) -> None:
    """The summary table: each key's winner, its time against the portable default, and its trials."""
    table = Table(title="tuning summary")
    for column in ("kernel", "key", "winner", "time ms", "portable ms", "speedup", "trials"):
        table.add_column(column)
    for r in results:
        winner, best_ms, portable_ms, speedup = config_text(r.config), f"{r.best_ms:.4g}", r.portable_ms, r.speedup
        if not r.stored:
            # The DB kept a faster winner than this run's: the row shows the one it keeps.
            winner = "kept stored: " + ("(not readable)" if r.kept is None else config_text(r.kept.config))
            if r.kept is not None:
                best_ms = f"{r.kept.time_ms:.4g} (this run {r.best_ms:.4g})"
                portable_ms, speedup = r.kept.portable_ms, r.kept.speedup
        table.add_row(
            r.kernel,
            plain(short_key(r.key)),
            plain(winner),
            best_ms,
            f"{portable_ms:.4g}",
            f"{speedup:.3f}x",
            f"{r.measured}+{r.reused} ok/reused, {r.failed} failed, {r.pruned} pruned",
        )
    console.print(table)


def config_text(config: dict[str, Any]) -> str:
    """A config as ``FIELD=value`` pairs in its own order."""
    return " ".join(f"{k}={v}" for k, v in config.items())

"""The ``tune`` command's Typer app and console, and the helpers its commands share.

``cli.py`` adds the tuning command itself (the app's callback) and imports ``commands.py``, which
adds the commands that inspect and move stored results, so importing the CLI registers them all.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer
from rich.console import Console

# Without a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    no_args_is_help=False,
    help="Tune tritune's Triton kernels into a persistent config DB, and inspect or ship the results.",
)


def choose_device(device: str) -> Any:
    """Resolve --device, switching Triton to its interpreter before any kernel is defined."""
    import torch

    wanted = device.strip().lower()
    if wanted == "auto":
        wanted = "0" if torch.cuda.is_available() else "cpu"
    if wanted == "cpu":
        from tritune.kernels._interpreter import fix_interpreter_index

        os.environ["TRITON_INTERPRET"] = "1"
        fix_interpreter_index()
        console.print(
            "[yellow]No GPU selected: running on the Triton interpreter at tiny shapes. Times are CPU "
            "wall-clock and results are stored under the pseudo-device 'cpu-interpreter'.[/yellow]"
        )
        return torch.device("cpu")
    index = wanted.removeprefix("cuda:")
    if not index.isdigit():
        raise typer.BadParameter(f"--device {device!r}: expected auto, cpu, an index such as 0, or cuda:N")
    if not torch.cuda.is_available():
        raise typer.BadParameter(f"--device {device!r}: no CUDA GPU is visible (use --device cpu)")
    if int(index) >= torch.cuda.device_count():
        raise typer.BadParameter(f"--device {device!r}: only {torch.cuda.device_count()} GPU(s) visible")
    torch.cuda.set_device(int(index))
    return torch.device("cuda", int(index))


def db_url(db: str | None) -> str:
    from tritune.kernels import settings

    url: str = settings.db_url_from(db) if db else settings.settings().db_url
    return url


def short_key(key: Any) -> str:
    values = key.to_dict()
    return " ".join(f"{k}={v}" for k, v in values.items() if k not in ("arch", "sm_count"))

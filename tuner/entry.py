"""The ``tune`` console script: the tuner's own dependencies are an extra, so check them first.

``pip install tritune`` installs the runtime (kernels, dispatcher, reading the config DB);
``pip install 'tritune[tune]'`` adds what the command needs. Without it, ``tune`` says so in one
line, before anything imports Typer, Rich or Optuna.
"""

from __future__ import annotations

import importlib.util
import sys

#: Import names of what the ``tune`` extra installs.
TUNE_MODULES = ("optuna", "alembic", "typer", "rich")


def missing() -> list[str]:
    """The ``tune`` extra's modules this interpreter cannot import."""
    absent = []
    for name in TUNE_MODULES:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            absent.append(name)
    return absent


def main() -> None:
    absent = missing()
    if absent:
        sys.stderr.write(f"error: tune needs {', '.join(absent)}, not installed here: pip install 'tritune[tune]'\n")
        raise SystemExit(1)
    from .cli import main as tune

    tune()

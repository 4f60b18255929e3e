"""The ``tune`` console script: the tuner's own dependencies are an extra, so check them first.

``pip install tritune`` installs the runtime (kernels, dispatcher, reading the config DB);
``pip install 'tritune[tune]'`` adds what the command needs. Without it, ``tune`` says so in one
line, before anything imports Typer, Rich or Optuna. It also sets ``TRITON_INTERPRET=1`` when the
command runs on Triton's interpreter (``--device cpu``, or ``auto`` without a GPU), before anything
imports Triton.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

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


def device_argument(args: Sequence[str]) -> str:
    """The value of the last ``--device`` on the command line (click keeps the last), else ``auto``.

    Read before click parses the line: the command's modules import Triton, which must find
    ``TRITON_INTERPRET`` already set (:func:`needs_interpreter`).
    """
    value = "auto"
    end = list(args).index("--") if "--" in args else len(args)
    for index, arg in enumerate(args[:end]):
        if arg == "--device" and index + 1 < end:
            value = args[index + 1]
        elif arg.startswith("--device="):
            value = arg.partition("=")[2]
    return value


def needs_interpreter(device: str) -> bool:
    """Whether ``--device`` runs on Triton's interpreter: ``cpu`` (``cpu,cpu``), or ``auto`` without a CUDA GPU.

    ``torch.cuda.is_available()`` does not import Triton, so asking it is safe here.
    """
    entries = [part.strip().lower() for part in device.split(",") if part.strip()]
    if entries == ["auto"]:
        import torch

        return not torch.cuda.is_available()
    return bool(entries) and all(entry == "cpu" for entry in entries)


def main() -> None:
    absent = missing()
    if absent:
        sys.stderr.write(f"error: tune needs {', '.join(absent)}, not installed here: pip install 'tritune[tune]'\n")
        raise SystemExit(1)
    # Triton decides interpreter or compiler when a function is decorated, and its own library
    # (tl.sum, tl.max) is decorated when triton is first imported: the variable must come first.
    if needs_interpreter(device_argument(sys.argv[1:])):
        os.environ["TRITON_INTERPRET"] = "1"
    from .cli import main as tune

    tune()

"""Test tiers: without a CUDA GPU every kernel runs on the Triton interpreter at tiny shapes.

``TRITON_INTERPRET`` must be set before Triton decorates any kernel, so it is decided here, before
test modules import tritune. GPU-tier tests carry the ``gpu`` marker and are skipped on the CPU.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    from tritune.kernels._interpreter import fix_interpreter_index

    os.environ["TRITON_INTERPRET"] = "1"
    # The public ops prepare the interpreter themselves; tests also launch kernels below them.
    fix_interpreter_index()

# Tests must never read or write the developer's real config DB or shipped bundles implicitly.
os.environ.setdefault("TRITUNE_DISABLE_BUNDLES", "1")
# Nor log missed keys to a DB at exit: the miss log's own tests turn it on.
os.environ.setdefault("TRITUNE_MISS_LOG", "0")


@pytest.fixture(autouse=True)
def _isolated_settings(tmp_path, monkeypatch):
    """Each test gets its own empty config DB and freshly read settings."""
    from tritune.kernels import settings

    monkeypatch.setenv("TRITUNE_DB", str(tmp_path / "configs.sqlite"))
    settings.reload()
    yield
    monkeypatch.undo()
    settings.reload()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        # Tests of host logic that build CPU tensors for the interpreter: the CPU tier covers them.
        skip_interpreter = pytest.mark.skip(reason="CPU tier: runs its kernels on the Triton interpreter")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(skip_interpreter)
        return
    skip_gpu = pytest.mark.skip(reason="GPU tier: needs a CUDA GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def toy_dispatch(monkeypatch):
    """The toy kernel (``tests/toy_kernel.py``) declared as ``toy_scale``, with the dispatcher's
    tables cleared before and after the test (a module takes it with
    ``pytestmark = pytest.mark.usefixtures("toy_dispatch")``)."""
    import toy_kernel

    from tritune.kernels import registry
    from tritune.kernels.dispatcher import DISPATCHER

    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    DISPATCHER.clear()
    yield
    DISPATCHER.clear()


@pytest.fixture
def restamp_bundle(monkeypatch):
    """``scripts/restamp_bundle.py``, imported as the scripts import each other."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    import restamp_bundle

    yield restamp_bundle
    sys.modules.pop("restamp_bundle", None)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


#: Per entry point, the fuzz tests' counts: examples, refusals, matches, mismatches.
FUZZ_FIGURES = pytest.StashKey[dict[str, Counter[str]]]()


@pytest.fixture(scope="session")
def fuzz_figures(pytestconfig: pytest.Config) -> dict[str, Counter[str]]:
    """Where the fuzz tests count their examples; the run's summary prints the counts."""
    return pytestconfig.stash.setdefault(FUZZ_FIGURES, defaultdict(Counter))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    figures = config.stash.get(FUZZ_FIGURES, None)
    if not figures:
        return
    terminalreporter.section("fuzz figures")
    for entry, counts in sorted(figures.items()):
        line = (
            f"{entry}: {counts['examples']} examples, {counts['refusals']} refusals, "
            f"{counts['matches']} matches, {counts['mismatches']} mismatches"
        )
        terminalreporter.write_line(line)
        logging.getLogger("tritune.tests.fuzz").info(line)

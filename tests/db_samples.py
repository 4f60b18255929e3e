"""What the config-DB tests store: the H200 environment their sample records name, and a store
opened in memory or on file (both, for tests that take :func:`stores`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tritune.configs_db.store import ConfigStore

GPU = "nvidia-h200-sm90-132sm"
#: The environment row the sample winners are stored under.
ENV: dict[str, Any] = {
    "gpu": GPU,
    "gpu_name": "NVIDIA H200",
    "capability": "9.0",
    "sm_count": 132,
    "driver": "570.86",
    "cuda": "12.8",
    "torch_version": "2.13.0",
    "triton_version": "3.6.0",
    "tritune_version": "0.1.0",
}


def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ConfigStore]:
    """A fixture body: a store in memory (``request.param`` "memory") or in a file under ``tmp_path``."""
    url = "sqlite://" if request.param == "memory" else f"sqlite:///{tmp_path / 'store.sqlite'}"
    with ConfigStore(url) as opened:
        yield opened

"""Stored and shipped winners of the toy kernel (``toy_kernel.SPEC``) on the interpreter's pseudo-GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import toy_kernel
import triton

from tritune.configs_db import bundles
from tritune.configs_db.bundles import write_bundle
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo, device_info

CPU = device_info("cpu")
SPEC = toy_kernel.SPEC
#: A config the toy space admits that is not its default.
TUNED = {"BLOCK": 64, "BROKEN": False, "num_warps": 2}


def toy_key(n_bucket: int) -> toy_kernel.ToyKey:
    return toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket)


def toy_record(n_bucket: int, config: dict[str, Any] = TUNED, **changes: Any) -> WinnerRecord:
    """A winner of the running toy kernel version at ``n_bucket``, tuned under this Triton and torch."""
    fields: dict[str, Any] = dict(
        kernel=SPEC.name,
        kernel_version=SPEC.version,
        gpu=CPU.slug,
        key=toy_key(n_bucket).to_dict(),
        config=config,
        time_ms=1.0,
        portable_ms=1.5,
        speedup=1.5,
        trials=3,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        tritune_version="test",
    )
    fields.update(changes)
    return WinnerRecord(**fields)


def ship(
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    *records: WinnerRecord,
    triton_version: str | None = None,
    device: DeviceInfo = CPU,
) -> None:
    """Make ``records`` the bundle shipped for ``device`` (default the interpreter; from ``folder``;
    bundles enabled).

    The bundle states one provenance: every record must carry ``triton_version`` (default: the
    running Triton's), the running torch's and tritune version ``"test"``.
    """
    monkeypatch.setattr(bundles, "shipped_bundle_dir", lambda: folder)
    monkeypatch.setenv("TRITUNE_DISABLE_BUNDLES", "0")
    settings.reload()
    provenance = {
        "cuda": "",
        "driver": "",
        "torch": torch.__version__,
        "triton": triton_version or triton.__version__,
        "tritune": "test",
    }
    write_bundle(records, folder / f"{device.slug}.json", device.slug, device.name, provenance)


def offer(store: ConfigStore, record: WinnerRecord) -> bool:
    """Offer ``record`` to ``store`` under an environment row stamped with its own provenance."""
    env = store.environment(
        gpu=record.gpu,
        gpu_name=record.gpu,
        capability="0.0",
        sm_count=1,
        driver="",
        cuda="",
        torch_version=record.torch_version,
        triton_version=record.triton_version,
        tritune_version=record.tritune_version,
    )
    return store.offer_winner(record, env)

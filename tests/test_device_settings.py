"""GPU identity, architecture-list parsing and the settings module."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo, device_info, make_current, parse_arch_list, target_supports

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
A100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80")
MI300 = DeviceInfo(name="AMD Instinct MI300X", vendor="amd", capability=(9, 4), sm_count=304, arch="gfx942")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("9.0", [(9, 0)]),
        ("9.0a", [(9, 0)]),
        ("sm_90", [(9, 0)]),
        ("sm_90a", [(9, 0)]),
        ("9.0+PTX", [(9, 0)]),
        ("8.0;9.0", [(8, 0), (9, 0)]),
        ("8.0 8.6 9.0", [(8, 0), (8, 6), (9, 0)]),
        ("10.0,12.0", [(10, 0), (12, 0)]),
    ],
    ids=["plain", "arch-specific", "sm_form", "sm_form_a", "ptx", "semicolon", "spaces", "comma"],
)
def test_parse_arch_list(text, expected):
    assert parse_arch_list(text) == expected


def test_parse_arch_list_rejects_garbage():
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST entry 'hopper'"):
        parse_arch_list("9.0;hopper")


@pytest.mark.parametrize(
    "arch_list, device, expected",
    [
        (None, H200, True),
        (None, A100, False),
        ("8.0;9.0", H200, False),
        ("9.0a", H200, True),
        ("sm_90", H200, True),
        ("9.0+PTX", H200, True),
        ("9.0;10.0", H200, True),
        (None, MI300, False),
        ("not-an-arch", H200, False),
    ],
    ids=["h200", "a100", "mixed-list", "90a", "sm_90", "ptx", "90-and-100", "rocm", "garbage-list"],
)
def test_target_supports_sm90(monkeypatch, arch_list, device, expected):
    if arch_list is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    assert target_supports(device, (9, 0)) is expected


def test_slugs():
    assert H200.slug == "nvidia-h200-sm90-132sm"
    assert MI300.slug == "amd-instinct-mi300x-gfx942-304sm"
    assert device_info("cpu").slug == "cpu-interpreter"
    assert device_info("cpu").is_interpreter


def test_settings_read_lazily(monkeypatch):
    monkeypatch.setenv("TRITUNE_MARGIN", "0.1")
    monkeypatch.setenv("TRITUNE_ENABLE_TMA_CAUSAL_PREFILL", " ON ")
    monkeypatch.setenv("TRITUNE_DISABLE_TUNED", "yes")
    monkeypatch.setenv("TRITUNE_DB_READ_TIMEOUT", "0.5")
    current = settings.reload()
    assert current.margin == pytest.approx(0.1)
    assert current.enable_tma_causal_prefill == "on"
    assert current.disable_tuned is True
    assert current.db_read_timeout == 0.5


#: A bad value of each setting, the field it sets and the default that then serves.
BAD_VALUES = [
    ("TRITUNE_MARGIN", "abc", "margin", 0.03),
    ("TRITUNE_MARGIN", "1.5", "margin", 0.03),
    ("TRITUNE_MARGIN", "nan", "margin", 0.03),
    ("TRITUNE_DISABLE_TUNED", "yes please", "disable_tuned", False),
    ("TRITUNE_DISABLE_BUNDLES", "2", "disable_bundles", False),
    ("TRITUNE_LOG_LEVEL", "loud", "log_level", "WARNING"),
    ("TRITUNE_ENABLE_TMA_CAUSAL_PREFILL", "auto-ish", "enable_tma_causal_prefill", "auto"),
    ("TRITUNE_DB_READ_TIMEOUT", "-1", "db_read_timeout", 3.0),
    ("TRITUNE_DB_READ_TIMEOUT", "soon", "db_read_timeout", 3.0),
    ("TRITUNE_Q4K_FP8", "fast", "q4k_fp8", False),
    ("TRITUNE_JIT", "always", "jit", "off"),
    ("TRITUNE_JIT_TRIALS", "0", "jit_trials", 16),
    ("TRITUNE_JIT_TRIALS", "2.5", "jit_trials", 16),
    ("TRITUNE_JIT_KEY_SECONDS", "0", "jit_key_seconds", 4.0),
    ("TRITUNE_JIT_TOTAL_SECONDS", "forever", "jit_total_seconds", 120.0),
    ("TRITUNE_MISS_LOG", "maybe", "miss_log", True),
    ("TRITUNE_CROSS_GPU", "everywhere", "cross_gpu", "seed"),
]


@pytest.mark.parametrize(
    ("name", "raw", "field", "value"),
    [
        ("TRITUNE_Q4K_FP8", "On", "q4k_fp8", True),
        ("TRITUNE_JIT", " Background ", "jit", "background"),
        ("TRITUNE_JIT_TRIALS", "40", "jit_trials", 40),
        ("TRITUNE_CROSS_GPU", "serve", "cross_gpu", "serve"),
        ("TRITUNE_MISS_LOG", "0", "miss_log", False),
    ],
)
def test_new_settings_parse(monkeypatch, name, raw, field, value):
    monkeypatch.setenv(name, raw)
    assert getattr(settings.reload(), field) == value
    monkeypatch.delenv(name)
    settings.reload()


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Settings warnings captured, as if none had been given yet in this process."""
    monkeypatch.setattr(settings, "_warned", set(), raising=False)
    caplog.set_level(logging.WARNING, logger="tritune.settings")
    return caplog


@pytest.mark.parametrize("name, raw, field, default", BAD_VALUES, ids=[f"{n}={v}" for n, v, _, _ in BAD_VALUES])
def test_a_bad_value_warns_once_and_the_default_serves(monkeypatch, fresh_warnings, name, raw, field, default):
    monkeypatch.setenv(name, raw)
    assert getattr(settings.reload(), field) == default
    assert getattr(settings.reload(), field) == default
    messages = [r.getMessage() for r in fresh_warnings.records]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{name}='{raw}': expected ")
    assert messages[0].endswith(" is used") and "the default" in messages[0]


def test_a_bad_value_is_escaped_in_its_warning(monkeypatch, fresh_warnings):
    monkeypatch.setenv("TRITUNE_MARGIN", "0.1\n2026-01-01 CRITICAL forged\x1b[2J\u202e")
    assert settings.reload().margin == 0.03
    (message,) = [r.getMessage() for r in fresh_warnings.records]
    assert message.isprintable()
    assert "0.1\\n2026-01-01 CRITICAL forged\\x1b[2J\\u202e" in message


@pytest.mark.parametrize("name", sorted(settings.ENVIRONMENT))
@pytest.mark.parametrize("raw", ["", "  "], ids=["empty", "blank"])
def test_an_empty_value_is_unset(monkeypatch, fresh_warnings, name, raw):
    monkeypatch.delenv(name, raising=False)
    unset = settings.reload()
    monkeypatch.setenv(name, raw)
    assert settings.reload() == unset
    assert fresh_warnings.records == []


def test_strict_reading_refuses_bad_values(monkeypatch):
    monkeypatch.setenv("TRITUNE_MARGIN", "abc")
    monkeypatch.setenv("TRITUNE_DISABLE_TUNED", "yes please")
    problems = settings.validate_environment()
    assert [p.split("=", 1)[0] for p in problems] == ["TRITUNE_MARGIN", "TRITUNE_DISABLE_TUNED"]
    with pytest.raises(ValueError, match=r"TRITUNE_MARGIN='abc'.*TRITUNE_DISABLE_TUNED='yes please'"):
        settings.settings(strict=True)
    assert settings.validate_environment({"TRITUNE_MARGIN": "0.2"}) == []
    monkeypatch.delenv("TRITUNE_MARGIN")
    monkeypatch.delenv("TRITUNE_DISABLE_TUNED")
    assert settings.settings(strict=True) == settings.reload()


def test_override_restores(tmp_path):
    before = settings.settings()
    with settings.override(margin=0.5, db_url=str(tmp_path / "x.sqlite")) as inside:
        assert settings.settings().margin == 0.5
        assert inside.db_url.startswith("sqlite:///") and inside.db_url.endswith("x.sqlite")
    assert settings.settings() == before


def test_import_is_cheap_and_touches_no_gpu():
    """Importing the runtime must not import Optuna, create a CUDA context or read settings."""
    code = (
        "import sys, torch\n"
        "import tritune.kernels, tritune.configs_db, tritune.search_spaces\n"
        "import tritune.kernels.dispatcher, tritune.kernels.registry\n"
        "from tritune.kernels import settings\n"
        "assert 'optuna' not in sys.modules, 'optuna imported by the runtime'\n"
        "assert 'sqlalchemy' not in sys.modules, 'sqlalchemy imported at import time'\n"
        "assert settings._current is None, 'settings read at import'\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "capability, kib",
    [
        ((9, 0), 227),
        ((10, 0), 227),
        ((8, 0), 163),
        ((8, 6), 99),
        ((8, 9), 99),
        ((12, 0), 99),
        ((7, 5), 64),
        ((7, 0), 96),
        ((6, 1), 48),
    ],
    ids=["h100", "b200", "a100", "rtx30", "l40", "rtx50", "t4", "v100", "p40"],
)
def test_shared_memory_limits(capability, kib):
    from tritune.kernels.spec import smem_limit_bytes

    assert smem_limit_bytes(capability) == kib * 1024


@pytest.mark.parametrize("arch, kib", [("gfx942", 64), ("gfx90a", 64), ("gfx1100", 64), ("gfx950", 160)])
def test_rocm_lds_limits(arch, kib):
    """A workgroup's LDS by AMD target; a ROCm device's limits come from it, not from its capability."""
    from tritune.kernels.spec import KernelSpec, lds_limit_bytes

    assert lds_limit_bytes(arch) == kib * 1024
    device = DeviceInfo(name="AMD GPU", vendor="amd", capability=(9, 4), sm_count=304, arch=arch)
    assert KernelSpec.limits(None, device).smem_bytes == kib * 1024  # type: ignore[arg-type]
    assert KernelSpec.limits(None, MI300).smem_bytes == 64 * 1024  # type: ignore[arg-type]


def test_nvml_numbering_trusted_only_when_it_matches_cuda(monkeypatch):
    from tritune.kernels import device

    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert device._nvml_order_is_cuda_order()
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert device._nvml_order_is_cuda_order()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    assert not device._nvml_order_is_cuda_order()
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    assert device._nvml_order_is_cuda_order()


@pytest.mark.parametrize("name", ["x%41.sqlite", "a?b.sqlite", "with space.sqlite"])
def test_a_db_path_names_its_own_file_whatever_its_characters(tmp_path, name):
    """A path is not a URL: its "%" or "?" stays in the file name the DB is written to."""
    from tritune.configs_db.store import ConfigStore
    from tritune.configs_db.urls import sqlite_file

    url = settings.db_url_from(str(tmp_path / name))
    assert sqlite_file(url) == tmp_path / name
    with ConfigStore(url) as store:
        store.environment(gpu="g", torch_version="t", triton_version="3", tritune_version="0")
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".sqlite"] == [name]


def test_make_current_switches_only_to_another_cuda_device(monkeypatch):
    """A CUDA device other than the current one gets a context making it current; the current
    device, a CPU or meta device, and no CUDA device at all get None (nothing to switch)."""
    import torch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert make_current(torch.device("cpu")) is None
    assert make_current(torch.device("meta")) is None
    assert make_current(torch.device("cuda", 1)) is None
    other = make_current(torch.device("cuda", 2))
    assert isinstance(other, torch.cuda.device) and other.idx == 2

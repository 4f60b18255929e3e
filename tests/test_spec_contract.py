"""Every registered kernel honours the spec seam the dispatcher and the tuner rely on."""

from __future__ import annotations

import pytest
import torch

from tritune.kernels.device import device_info
from tritune.kernels.registry import builtin_names, get_spec

CPU = device_info("cpu")


@pytest.fixture(params=builtin_names())
def spec(request):
    return get_spec(request.param)


def test_portable_default_is_feasible_and_in_space(spec):
    for key in spec.default_keys(CPU):
        default = spec.default_config(key)
        assert spec.space.contains(default)
        assert spec.space.infeasible_reason(default, key, spec.limits(CPU)) is None


def test_keys_round_trip_through_dicts(spec):
    for key in spec.default_keys(CPU):
        assert spec.key_type.from_dict(key.to_dict()) == key


def test_launch_writes_every_output_element_through_out(spec, device):
    """The tuner's correctness gate: NaN-poisoned ``out``, default config, reference check."""
    if device != "cpu":
        pytest.skip("CPU-tier contract (the GPU tier checks the same through the tuner)")
    key = spec.default_keys(CPU)[0]
    problem = spec.make_problem(key, torch.device("cpu"), seed=3)
    first = spec.launch(spec.default_config(key), *problem.args, **problem.kwargs)
    out = torch.full_like(first, float("nan"))
    returned = spec.launch(spec.default_config(key), *problem.args, **{**problem.kwargs, "out": out})
    assert returned.data_ptr() == out.data_ptr()
    expected = spec.reference(*problem.args, **problem.kwargs)
    assert spec.check(out, expected, problem) is None
    # The check can fail: a corrupted output is refused.
    broken = out.clone()
    broken.view(-1)[0] = float("nan")
    assert spec.check(broken, expected, problem) is not None


def test_version_is_a_source_hash(spec):
    assert len(spec.version) == 16
    int(spec.version, 16)


@pytest.mark.parametrize("m", [1 << i for i in range(14)])
def test_q4k_default_feasible_at_every_m_bucket(m):
    """Every M bucket's portable default must be tunable (a regression: 65..128 was not)."""
    from tritune.kernels.device import DeviceInfo

    h200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
    spec = get_spec("q4k_fp8_gemm")
    for k, n in ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144), (4096, 28672)):
        key = spec.key_type(arch="sm90", sm_count=132, dtype="bfloat16", m_bucket=m, n=n, k=k)
        default = spec.default_config(key)
        assert spec.space.infeasible_reason(default, key, spec.limits(h200)) is None, (m, k, n)


def test_q4k_gate_holds_each_path_to_its_floor():
    """The tuner passes the config to ``check``: portable candidates face the 40 dB floor."""
    spec = get_spec("q4k_fp8_gemm")
    key = spec.default_keys(CPU)[0]
    problem = spec.make_problem(key, torch.device("cpu"), seed=5)
    expected = spec.reference(*problem.args, **problem.kwargs)
    # Noise at about 30 dB SQNR: good enough for fp8, not for the portable path.
    noisy = expected + expected.std() * 0.03 * torch.randn_like(expected)
    portable = spec.space.parse({"path": "portable"})
    fp8 = spec.space.parse({"path": "fp8"})
    assert spec.check(noisy, expected, problem, fp8) is None
    assert "portable" in spec.check(noisy, expected, problem, portable)

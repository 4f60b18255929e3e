"""``TRITUNE_Q4K_FP8``: which stored ``q4k_fp8_gemm`` winners serve with the opt-in and without it.

Without the opt-in a call's key has ``fp8=False``: a stored fp8, staged or int8 winner there is
infeasible (never served) and the accurate winner or the portable default serves. With it the
key has ``fp8=True``: its own winner serves, and where it has none the accurate key's winner
does. A path the device or call cannot run is replaced by the key's portable default either way.
Dispatch runs through the real dispatcher against the test's config DB on the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import triton

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import Q4KWeight, q4k_linear, settings
from tritune.kernels.device import DeviceInfo, device_info
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.kernels.q4k.kernel import KERNEL, key_for
from tritune.kernels.q4k.reference import GGML_MAX_NMSE, nmse
from tritune.search_spaces.q4k_fp8_gemm import SPACE, Fp8Config, GemvConfig, Int8Config, PortableConfig, StagedConfig

CPU = device_info("cpu")
M, N, K = 16, 64, 256
FACTS = KERNEL.Facts(M, N, K, "bf16")
#: Tiles the interpreter runs, one stored winner of each opt-in path and one of each accurate one.
OPT_IN = {
    "fp8": Fp8Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_stages=1, SCALE_FOLD=True, SWAP_AB=True),
    "staged": StagedConfig(BLOCK_N=32, BLOCK_K=64, CHUNK_N=32),
    "int8": Int8Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_stages=1),
}
ACCURATE = {
    "portable": PortableConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_stages=1),
    "gemv": GemvConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2),
}


@pytest.fixture(autouse=True)
def fresh_dispatcher():
    DISPATCHER.clear()
    yield
    DISPATCHER.clear()


def _key(fp8: bool) -> dict[str, object]:
    with settings.override(q4k_fp8=fp8):
        return key_for(CPU, FACTS).to_dict()


def _store(config: object, *, fp8: bool) -> None:
    """A winner for the test's key (with the opt-in or without), 1.5x the portable default."""
    store = ConfigStore(settings.settings().db_url)
    record = WinnerRecord(
        kernel=KERNEL.name,
        kernel_version=KERNEL.version,
        gpu=CPU.slug,
        key=_key(fp8),
        config=SPACE.to_dict(config),
        time_ms=1.0,
        portable_ms=1.5,
        speedup=1.5,
        trials=5,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        tritune_version="test",
    )
    env = store.environment(
        gpu=record.gpu, gpu_name=record.gpu, capability="0.0", sm_count=1, driver="", cuda="",
        torch_version=record.torch_version, triton_version=record.triton_version, tritune_version="test",
    )  # fmt: skip
    assert store.offer_winner(record, env)


def _served() -> object:
    return dispatch_config(KERNEL.name, "cpu", -1, tuple(FACTS))


def _portable_default() -> object:
    return KERNEL.default_config(key_for(CPU, FACTS))


@pytest.mark.parametrize("path", list(OPT_IN))
def test_without_the_opt_in_a_stored_8_bit_winner_never_serves(path):
    """Stored at the call's own key (as a bundle tuned before the opt-in existed would hold it), or
    at the opt-in key: the portable default serves, and a real call meets ggml's bound."""
    _store(OPT_IN[path], fp8=False)
    _store(OPT_IN[path], fp8=True)
    assert _served() == _portable_default()
    generator = torch.Generator().manual_seed(1)
    weight = Q4KWeight.quantize(torch.randn(N, K, generator=generator) * 0.02)
    x = torch.randn(M, K, generator=generator).to(torch.bfloat16)
    error = nmse(q4k_linear(x, weight), x.double() @ weight.dequantize().double().t())
    assert error <= GGML_MAX_NMSE


@pytest.mark.parametrize("path", list(ACCURATE))
def test_without_the_opt_in_the_accurate_winner_serves(path):
    _store(ACCURATE[path], fp8=False)
    assert _served() == ACCURATE[path]


@pytest.mark.parametrize("path", list(OPT_IN))
def test_with_the_opt_in_its_winner_serves(path):
    _store(ACCURATE["portable"], fp8=False)
    _store(OPT_IN[path], fp8=True)
    with settings.override(q4k_fp8=True):
        assert _served() == OPT_IN[path]
    # The same store, the opt-in off again: the accurate key's winner.
    assert _served() == ACCURATE["portable"]


@pytest.mark.parametrize("path", list(ACCURATE))
def test_with_the_opt_in_and_no_winner_of_its_own_the_accurate_winner_serves(path):
    _store(ACCURATE[path], fp8=False)
    with settings.override(q4k_fp8=True):
        assert _served() == ACCURATE[path]
        with settings.override(disable_tuned=True):
            assert _served() == _portable_default()


A100 = DeviceInfo(name="NVIDIA A100", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80")
H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
T4 = DeviceInfo(name="NVIDIA T4", vendor="nvidia", capability=(7, 5), sm_count=40, arch="sm75")


@pytest.mark.parametrize(
    ("path", "device", "facts"),
    [
        ("fp8", A100, KERNEL.Facts(4096, 4096, 4096, "bf16")),
        ("staged", A100, KERNEL.Facts(4096, 4096, 4096, "bf16")),
        ("staged", H200, KERNEL.Facts(4096, 4096, 4096, "fp16")),
        ("staged", H200, KERNEL.Facts(4096, 4088, 4096, "bf16")),
        ("int8", T4, KERNEL.Facts(4096, 4096, 4096, "bf16")),
    ],
    ids=["fp8-sm80", "staged-sm80", "staged-fp16", "staged-n4088", "int8-sm75"],
)
def test_with_the_opt_in_a_path_the_call_cannot_run_gives_way_to_an_accurate_one(path, device, facts):
    """fp8 needs SM89+, staged SM90+, bf16 and N, K multiples of 16, int8 SM80+."""
    with settings.override(q4k_fp8=True):
        served = KERNEL.serveable(OPT_IN[path], device, tuple(facts))
        # M=4096: the default there is the dequant path, accurate and runnable on every GPU.
        assert served == KERNEL.default_config(key_for(device, facts)) and served.path == "dequant"
        # Where the call can run it, it serves.
        fine = KERNEL.Facts(4096, 4096, 4096, "bf16")
        assert KERNEL.serveable(OPT_IN[path], H200, tuple(fine)) == OPT_IN[path]

"""Every ``q4k_fp8_gemm`` path against ggml's Q4_K accuracy bound, on the Triton interpreter.

ggml's bound for a Q4_K mul_mat (llama.cpp's test-backend-ops) is an NMSE of at most 5e-4
against the product of the exactly dequantized weight (SQNR >= 33 dB); here that product is
computed in float64. The accurate paths (portable, GEMV, dequant) must meet it at every M; the fp8,
staged and int8 paths (the ``TRITUNE_Q4K_FP8`` opt-in) their own floors. Gaussian data at the
smallest shape that still averages over enough outputs: K=256 (one super-block), N=32.
"""

from __future__ import annotations

import random

import pytest
import torch

from tritune.kernels import Q4KWeight, settings
from tritune.kernels.device import interpreter_device
from tritune.kernels.q4k.kernel import KERNEL, key_for
from tritune.kernels.q4k.reference import (
    ACCURATE_PATHS,
    GGML_MAX_NMSE,
    MIN_SQNR_DB,
    _round_once,
    nmse,
    packed_dequantized,
    sqnr_db,
)
from tritune.search_spaces.q4k_fp8_gemm import SPACE

N, K = 32, 256
MS = (1, 2, 3, 16, 17, 64, 257, 512)
#: (name, pin) of each kernel the GEMM can run; tiles come from :func:`_config`.
PATHS = {
    "portable": {"path": "portable"},
    "gemv": {"path": "gemv"},
    # The GEMV in fewer launches: quantizing x itself, reducing its splits itself, and both.
    "gemv-fuse-quant": {"path": "gemv", "FUSE_QUANT": True},
    "gemv-fused-reduce": {"path": "gemv", "SPLIT_K": 2, "FUSED_REDUCE": True},
    "gemv-one-launch": {"path": "gemv", "SPLIT_K": 2, "FUSE_QUANT": True, "FUSED_REDUCE": True},
    "fp8": {"path": "fp8"},
    "fp8-fold": {"path": "fp8", "SCALE_FOLD": True},
    "fp8-fold-swap": {"path": "fp8", "SCALE_FOLD": True, "SWAP_AB": True},
    "staged": {"path": "staged"},
    "int8": {"path": "int8"},
    "int8-swap": {"path": "int8", "SWAP_AB": True},
    "dequant": {"path": "dequant"},
}
#: The GEMV multiplies up to 8 rows per program and is tried at one row on a GPU: small M only.
GEMV_MAX_TESTED_M = 17


@pytest.fixture(scope="module")
def weight() -> Q4KWeight:
    generator = torch.Generator().manual_seed(0)
    return Q4KWeight.quantize(torch.randn(N, K, generator=generator) * 0.02)


def _config(pin: dict[str, object], m: int) -> object:
    """The pinned path at tiles the interpreter runs (16 or 32 rows of x, 32 weight rows)."""
    path = str(pin["path"])
    tiles: dict[str, object] = {"BLOCK_N": 32, "BLOCK_K": 128}
    if path in ("staged", "dequant"):
        tiles.update(BLOCK_K=64, CHUNK_N=32)
    elif path != "gemv":
        tiles.update(BLOCK_M=16 if m <= 16 else 32, GROUP_M=1, num_stages=1)
    return SPACE.parse({**pin, **tiles})


def _measure(config: object, x: torch.Tensor, weight: Q4KWeight) -> tuple[float, float]:
    expected = x.double() @ weight.dequantize().double().t()
    out = KERNEL.launch(config, x, weight)
    return sqnr_db(out, expected), nmse(out, expected)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", list(PATHS))
def test_each_path_against_ggmls_bound(name, m, weight, record_property):
    """Accurate paths: NMSE <= 5e-4 at every M. The opt-in paths: their own SQNR floors."""
    if name.startswith("gemv") and m > GEMV_MAX_TESTED_M:
        pytest.skip("the GEMV serves decode-sized M")
    pin = PATHS[name]
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    with settings.override(q4k_fp8=True):
        sqnr, error = _measure(_config(pin, m), x, weight)
    record_property("sqnr_db", round(sqnr, 2))
    record_property("nmse", f"{error:.3g}")
    path = str(pin["path"])
    if path in ACCURATE_PATHS:
        assert error <= GGML_MAX_NMSE, f"{name} at M={m}: NMSE {error:.3g} ({sqnr:.1f} dB)"
    assert sqnr >= MIN_SQNR_DB[path], f"{name} at M={m}: {sqnr:.1f} dB"


def test_every_path_feasible_without_the_opt_in_meets_the_bound(weight):
    """At a key without the opt-in (the interpreter's tuning key) every feasible path is one that
    meets ggml's bound, measured here: two configs of each, drawn with a fixed seed."""
    device = interpreter_device()
    facts = KERNEL.Facts(16, N, K, "bf16")
    key = key_for(device, facts)
    assert key.fp8 is False
    feasible = SPACE.feasible(key, KERNEL.limits(device))
    by_path: dict[str, list[object]] = {}
    for config in feasible:
        by_path.setdefault(config.path, []).append(config)
    # The tma path is Gluon, which the interpreter cannot run: its bound is checked on the GPU tier
    # (tests/test_q4k_tma.py).
    assert set(by_path) == set(ACCURATE_PATHS) - {"tma"}, sorted(by_path)
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rng = random.Random(0)
    for _path, configs in sorted(by_path.items()):
        for config in rng.sample(configs, 2):
            served = KERNEL.serveable(config, device, tuple(facts))
            sqnr, error = _measure(served, x, weight)
            assert error <= GGML_MAX_NMSE, f"{config}: NMSE {error:.3g} ({sqnr:.1f} dB)"


#: Weight rows of the dequant path's own cases: two chunks of 32 rows, the last one 16 rows short.
CHUNKED_N = 48


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m", MS)
def test_dequant_path_in_chunks_meets_the_bound(m, bias, dtype, record_property):
    """The dequant path with chunks that do not divide N, a bias and a NaN-poisoned ``out=``, in
    bf16 and fp16: ggml's bound at every M, and every element of ``out`` written."""
    generator = torch.Generator().manual_seed(100 + m)
    weight = Q4KWeight.quantize(torch.randn(CHUNKED_N, K, generator=generator) * 0.02)
    x = torch.randn(m, K, generator=generator).to(dtype)
    b = torch.randn(CHUNKED_N, generator=generator) if bias else None
    out = torch.full((m, CHUNKED_N), float("nan"), dtype=dtype)
    config = SPACE.parse({"path": "dequant", "BLOCK_N": 32, "BLOCK_K": 64, "CHUNK_N": 32})
    assert KERNEL.launch(config, x, weight, b, out=out) is out
    expected = x.double() @ weight.dequantize().double().t() + (b.double() if b is not None else 0.0)
    sqnr, error = sqnr_db(out, expected), nmse(out, expected)
    record_property("sqnr_db", round(sqnr, 2))
    assert not torch.isnan(out).any(), "some outputs were never written"
    assert error <= GGML_MAX_NMSE, f"M={m}: NMSE {error:.3g} ({sqnr:.1f} dB)"
    assert sqnr >= MIN_SQNR_DB["dequant"], f"M={m}: {sqnr:.1f} dB"
    # The dense weight is gguf's float32 weight rounded once to x's dtype: the product of exactly
    # that weight, as x's dtype holds it, is what the GEMM computes.
    dense = x.float() @ weight.dequantize().to(dtype).float().t() + (b.to(dtype).float() if b is not None else 0.0)
    torch.testing.assert_close(out.float(), dense.to(dtype).float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize(("dtype", "low", "high"), [(torch.bfloat16, 42.0, 49.0), (torch.float16, 59.0, 67.0)])
def test_packed_dequantized_weights_stay_inside_the_bound(weight, dtype, low, high):
    """The tma path's ``PACKED_DEQUANT`` weights (each group's scale and min rounded to x's dtype,
    then one rounding a weight): about 45 dB against the exact product in bf16 and 63 in fp16,
    below exact weights rounded once, and far inside ggml's bound."""
    x = torch.randn(33, K, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = x @ weight.dequantize().double().t()
    packed = x @ packed_dequantized(weight, dtype).double().t()
    rounded_once = x @ weight.dequantize().to(dtype).double().t()
    assert low < sqnr_db(packed, expected) < high < sqnr_db(rounded_once, expected)
    assert nmse(packed, expected) <= GGML_MAX_NMSE
    # Where every group's scale and min are exact in the dtype (d, dmin powers of two: d*sc and
    # dmin*m have at most 6 significant bits), each weight is the exact one rounded once.
    powers = torch.tensor([2.0**-7, 2.0**-9], dtype=torch.float16).expand_as(weight.super_scales).contiguous()
    exact_scales = Q4KWeight(weight.qs, weight.scales, weight.mins, powers)
    assert torch.equal(packed_dequantized(exact_scales, dtype), exact_scales.dequantize().to(dtype))
    assert not torch.equal(packed_dequantized(weight, dtype), weight.dequantize().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_reference_rounds_float64_once(dtype):
    """Halfway between two ``dtype`` values plus a little below float32's precision: rounding
    through float32 first lands on the tie and rounds to even (down); rounding once goes up."""
    ulp = torch.finfo(dtype).eps
    exact = torch.tensor([1 + ulp / 2 + 2.0**-40, -(1 + ulp / 2 + 2.0**-40), 1 + ulp / 2], dtype=torch.float64)
    assert _round_once(exact, dtype).tolist() == [1 + ulp, -(1 + ulp), 1.0]
    assert exact.to(dtype).tolist()[0] == 1.0  # torch's own conversion rounds twice here

"""``Q4KWeight`` at its edges: an empty weight (N = 0), parts of the wrong kind, rank or range, and
weights the quantizer cannot code (pure PyTorch, no kernel runs)."""

from __future__ import annotations

import re

import pytest
import torch

from tritune.kernels import Q4KWeight
from tritune.kernels.q4k import format as q4k_format
from tritune.kernels.q4k.reference import q4k_linear_reference

K = 512


def _empty(device: str = "cpu") -> Q4KWeight:
    return Q4KWeight(
        torch.empty(0, K // 2, dtype=torch.uint8, device=device),
        torch.empty(0, K // 32, dtype=torch.uint8, device=device),
        torch.empty(0, K // 32, dtype=torch.uint8, device=device),
        torch.empty(0, K // 256, 2, dtype=torch.float16, device=device),
    )


# ---- N = 0 -----------------------------------------------------------------------------------


def test_an_empty_weight_round_trips():
    """N = 0 is a weight like any other: its blocks, values and product are empty, not an error."""
    raw = torch.empty(0, K // 256 * 144, dtype=torch.uint8)
    weight = Q4KWeight.from_blocks(raw, (0, K))
    assert weight.shape == (0, K)
    assert tuple(weight.dequantize().shape) == (0, K)
    assert tuple(q4k_format.dequantize_q4k_blocks(raw).shape) == (0, K)
    blocks = _empty().to_blocks()
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == tuple(raw.shape)
    assert Q4KWeight.from_blocks(blocks, (0, K)).shape == (0, K)
    quantized = Q4KWeight.quantize(torch.empty(0, K))
    assert quantized.shape == (0, K) and quantized.to_blocks().shape == raw.shape
    x = torch.randn(3, K, dtype=torch.bfloat16)
    out = q4k_linear_reference(x, weight)
    assert out.dtype == torch.float32 and tuple(out.shape) == (3, 0)


def test_an_empty_weight_is_made_on_the_input_device():
    """The empty results are created where the input lives (here the meta device, which holds no
    data: as a GPU tensor would, it shows whether anything fell back to the CPU)."""
    raw = q4k_format.quantize_q4_k(torch.empty(0, K, device="meta"))
    assert raw.device.type == "meta" and tuple(raw.shape) == (0, K // 256 * 144)
    assert q4k_format.dequantize_q4k_blocks(raw).device.type == "meta"
    weight = _empty("meta")
    assert weight.dequantize().device.type == "meta"
    assert weight.to_blocks().device.type == "meta"


# ---- the parts of Q4KWeight(...) -------------------------------------------------------------


def _parts() -> list[torch.Tensor]:
    return list(Q4KWeight.quantize(torch.randn(8, K)).tensors())


@pytest.mark.parametrize(
    ("index", "change", "error", "message"),
    [
        (0, lambda t: t.reshape(-1), ValueError, "qs: expected a 2-D torch.Tensor of uint8 [N, K/2], got a 1-D"),
        (0, lambda t: t.reshape(8, 2, -1), ValueError, "qs: expected a 2-D torch.Tensor of uint8 [N, K/2], got a 3-D"),
        (0, lambda t: None, TypeError, "qs: expected a 2-D torch.Tensor of uint8 [N, K/2], got NoneType"),
        (1, lambda t: t.tolist(), TypeError, "scales: expected a 2-D torch.Tensor of uint8 [N, K/32], got list"),
        (2, lambda t: t[0], ValueError, "mins: expected a 2-D torch.Tensor of uint8 [N, K/32], got a 1-D"),
        (3, lambda t: t[..., 0], ValueError, "super_scales: expected a 3-D torch.Tensor of float16 [N, K/256, 2]"),
    ],
    ids=["qs-1d", "qs-3d", "qs-none", "scales-list", "mins-1d", "super-scales-2d"],
)
def test_a_part_of_the_wrong_kind_or_rank_is_named(index, change, error, message):
    parts = _parts()
    parts[index] = change(parts[index])
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        Q4KWeight(*parts)


@pytest.mark.parametrize("index", range(4))
def test_a_numpy_part_is_told_to_convert(index):
    parts = _parts()
    name = ("qs", "scales", "mins", "super_scales")[index]
    parts[index] = parts[index].numpy()
    advice = rf"got a numpy.ndarray; convert it with torch.from_numpy\({name}\)"
    with pytest.raises(TypeError, match=rf"^{name}: .* {advice}"):
        Q4KWeight(*parts)


@pytest.mark.parametrize("index", [1, 2], ids=["scales", "mins"])
def test_codes_past_six_bits_are_refused(index):
    """to_blocks() keeps six bits of each code: a 64 would come back as 0, silently."""
    parts = _parts()
    parts[index] = parts[index].clone()
    parts[index][3, 5] = 64
    name = ("qs", "scales", "mins")[index]
    with pytest.raises(ValueError, match=rf"^{name}: expected 6-bit codes \(values below 64\), got a value of 64"):
        Q4KWeight(*parts)
    parts[index][3, 5] = 63
    weight = Q4KWeight(*parts)
    assert Q4KWeight.from_blocks(weight.to_blocks(), weight.shape).tensors()[index].equal(parts[index])


# ---- weights the quantizer cannot code ---------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_the_quantizer_refuses_non_finite_weights(bad):
    w = torch.randn(4, K)
    w[1, 7] = bad
    w[2, 300] = bad
    for quantize in (q4k_format.quantize_q4_k, Q4KWeight.quantize):
        with pytest.raises(ValueError, match=rf"^weight: 2 of its {4 * K} values are not finite"):
            quantize(w)


@pytest.mark.parametrize("magnitude", [-1e7, 1e9, -1e30], ids=["-1e7", "1e9", "-1e30"])
def test_the_quantizer_refuses_weights_whose_block_scales_overflow_fp16(magnitude):
    """A weight of -1e7 takes dmin past fp16's 65504 (1e9 takes d): refused, naming the largest
    magnitude, rather than coded as blocks that decode to NaN."""
    w = torch.randn(4, K)
    w[3, 100] = magnitude
    pattern = rf"^weight: its largest magnitude {re.escape(f'{abs(magnitude):.4g}')} .* fp16's largest value 65504"
    for quantize in (q4k_format.quantize_q4_k, Q4KWeight.quantize):
        with pytest.raises(ValueError, match=pattern):
            quantize(w)
    # Large but codable weights still quantize to finite values.
    w[3, 100] = -4e6 if magnitude < 0 else 5e7
    assert torch.isfinite(Q4KWeight.quantize(w).dequantize()).all()

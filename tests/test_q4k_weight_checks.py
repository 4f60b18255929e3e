"""``Q4KWeight`` at its edges: an empty weight (N = 0), parts of the wrong kind, rank or range, and
weights the quantizer cannot code (pure PyTorch, no kernel runs)."""

from __future__ import annotations

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

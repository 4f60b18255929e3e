"""Q4_K weights: the block format against gguf's, the repacked layout, GGUF files and the quantizer.

Pure PyTorch and numpy (no kernel runs): the GEMM paths are ``test_q4k.py``'s.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tritune.kernels import Q4KWeight
from tritune.kernels.q4k import format as q4k_format

Q4_K = gguf.GGMLQuantizationType.Q4_K


def _random_blocks(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random Q4_K rows whose d and dmin are finite fp16 values (everything else random bytes)."""
    raw = rng.integers(0, 256, size=(n, k // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(n, -1, 144)
    halves = (rng.standard_normal((n, blocks.shape[1], 2)) * 0.01).astype(np.float16)
    blocks[..., 0:4] = halves.view(np.uint8).reshape(n, -1, 4)
    return raw


def _gguf_values(raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, Q4_K).astype(np.float32)


def _assert_bitwise(ours: torch.Tensor, theirs: np.ndarray) -> None:
    assert ours.dtype == torch.float32 and tuple(ours.shape) == theirs.shape
    np.testing.assert_array_equal(ours.numpy().view(np.int32), theirs.view(np.int32))


# ---- the block format ------------------------------------------------------------------------


def test_decode_matches_gguf_on_random_blocks():
    raw = _random_blocks(np.random.default_rng(0), 6, 1024)
    _assert_bitwise(q4k_format.dequantize_q4k_blocks(torch.from_numpy(raw)), _gguf_values(raw))


def test_decode_matches_gguf_on_every_scale_and_min_pattern():
    # 64 super-blocks: sub-block j of block b gets scale (b + 9j) % 64 and min (5b + 3j + 1) % 64,
    # so every sub-block position sees all 64 six-bit values of both, with varied partners.
    rng = np.random.default_rng(1)
    b = np.arange(64)[:, None]
    j = np.arange(8)[None, :]
    sc = torch.from_numpy(((b + 9 * j) % 64).astype(np.uint8)).reshape(1, -1)
    m = torch.from_numpy(((5 * b + 3 * j + 1) % 64).astype(np.uint8)).reshape(1, -1)
    q = torch.from_numpy(rng.integers(0, 16, size=(1, 64 * 256), dtype=np.uint8))
    d = torch.from_numpy(rng.uniform(0.001, 0.01, size=(1, 64)).astype(np.float16))
    dmin = torch.from_numpy(rng.uniform(0.001, 0.01, size=(1, 64)).astype(np.float16))
    raw = q4k_format.pack_blocks(d, dmin, sc, m, q).numpy()

    # gguf's own unpacking of our bytes gives back exactly the codes we meant.
    scales = raw.reshape(64, 144)[:, 4:16]
    gguf_sc, gguf_m = gguf.quants.Q4_K.get_scale_min(scales)
    np.testing.assert_array_equal(gguf_sc.reshape(1, -1), sc.numpy())
    np.testing.assert_array_equal(gguf_m.reshape(1, -1), m.numpy())
    _assert_bitwise(q4k_format.dequantize_q4k_blocks(torch.from_numpy(raw)), _gguf_values(raw))


def test_repack_is_lossless():
    raw = _random_blocks(np.random.default_rng(2), 5, 768)
    weight = Q4KWeight.from_blocks(raw, (5, 768))
    assert weight.shape == (5, 768)
    assert weight.qs.shape == (5, 384) and weight.scales.shape == (5, 24) and weight.super_scales.shape == (5, 3, 2)
    _assert_bitwise(weight.dequantize(), _gguf_values(raw))
    np.testing.assert_array_equal(weight.to_blocks().numpy(), raw)


def test_weight_is_immutable_and_moves():
    weight = Q4KWeight.from_blocks(_random_blocks(np.random.default_rng(3), 2, 256), (2, 256))
    with pytest.raises(AttributeError, match="immutable"):
        weight.qs = weight.qs  # type: ignore[misc]
    moved = weight.to("cpu")
    assert moved is not weight and moved.shape == weight.shape
    assert torch.equal(moved.dequantize(), weight.dequantize())


def test_from_parts_takes_the_tensors_as_they_are():
    """The op's body rebuilds the weight from the tensors a checked call split (fake ones under
    torch.compile): no copy, no check, the same immutable weight."""
    weight = Q4KWeight.from_blocks(_random_blocks(np.random.default_rng(3), 4, 512), (4, 512))
    again = Q4KWeight.from_parts(*weight.tensors())
    assert again.shape == (4, 512)
    assert all(a is b for a, b in zip(again.tensors(), weight.tensors(), strict=True))
    with pytest.raises(AttributeError, match="immutable"):
        again.qs = weight.qs  # type: ignore[misc]


def test_gguf_file_round_trip(tmp_path):
    raw = _random_blocks(np.random.default_rng(4), 7, 512)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=Q4_K)
    writer.add_tensor("output_norm.weight", np.ones(512, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    weight = Q4KWeight.from_gguf(path, "blk.0.ffn_down.weight")
    assert weight.shape == (7, 512)
    np.testing.assert_array_equal(weight.to_blocks().numpy(), raw)
    _assert_bitwise(weight.dequantize(), _gguf_values(raw))
    with pytest.raises(KeyError, match="tensor_name: no tensor 'missing'"):
        Q4KWeight.from_gguf(path, "missing")
    with pytest.raises(ValueError, match="stored as F32, not Q4_K"):
        Q4KWeight.from_gguf(path, "output_norm.weight")


def test_from_blocks_rejects_bad_input():
    raw = _random_blocks(np.random.default_rng(5), 2, 256)
    with pytest.raises(ValueError, match="K=300"):
        Q4KWeight.from_blocks(raw, (2, 300))
    with pytest.raises(TypeError, match="raw: expected uint8"):
        Q4KWeight.from_blocks(torch.from_numpy(raw).to(torch.int16), (2, 256))
    with pytest.raises(ValueError, match=r"raw: a Q4_K weight of shape \(2, 512\)"):
        Q4KWeight.from_blocks(raw, (2, 512))
    with pytest.raises(ValueError, match="K=100"):
        Q4KWeight.quantize(torch.randn(4, 100))


# ---- the quantizer ---------------------------------------------------------------------------


def test_quantizer_error_on_gaussian_data():
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(6))
    raw = q4k_format.quantize_q4_k(w)
    assert raw.dtype == torch.uint8 and tuple(raw.shape) == (64, 4 * 144)
    values = torch.from_numpy(_gguf_values(raw.numpy()))
    rel_rms = ((values - w).square().mean() / w.square().mean()).sqrt().item()
    assert rel_rms <= 0.075, f"relative RMS error {rel_rms:.4f} (ggml's Q4_K reaches about 0.07)"


def test_quantizer_degenerate_rows():
    w = torch.zeros(3, 256)
    w[1] = 0.5  # constant positive: min clamps to zero
    w[2, ::2] = -1.0  # two levels
    values = Q4KWeight.quantize(w).dequantize()
    assert torch.isfinite(values).all()
    torch.testing.assert_close(values, w, atol=0.02, rtol=0)

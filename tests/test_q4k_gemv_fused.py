"""The Q4_K GEMV in fewer launches (``FUSE_QUANT``, ``FUSED_REDUCE``) and with its lanes along K
(``K_LANES``): the same bits as the pre-pass, GEMV and reduce launches it replaces.

CPU tier: the kernels on the Triton interpreter at N=64, K=512 (bias, ``out=`` poisoned with NaN,
bf16 and fp16 x, one, two and four splits), the default tiles of a GPU key at one to four rows,
repeated calls (the arrival counters go back to zero) and the launches each variant makes. GPU
tier (``gpu``): the Llama-3-8B shapes of the shipped GEMV winners eagerly, each with and without
``K_LANES``, a captured CUDA graph replayed with new x, and ``K_LANES`` at two to four rows. The
sm_90 builds (no spills, the atomics, the reductions' and loads' layouts) are
``test_sm90_build.py``'s."""

from __future__ import annotations

import dataclasses

import pytest
import sm90_build
import torch

from tritune.kernels import Q4KWeight, _launch
from tritune.kernels.q4k.kernel import KERNEL, Q4KKey, gemv_default
from tritune.kernels.q4k.reference import check_path, q4k_linear_reference
from tritune.search_spaces.q4k_fp8_gemm import GemvConfig

N, K = 64, 512
#: (name, FUSE_QUANT, FUSED_REDUCE) of each variant that saves a launch.
VARIANTS = [("fuse-quant", True, False), ("fused-reduce", False, True), ("one-launch", True, True)]
CASES = [
    (name, quant, reduce, split)
    for name, quant, reduce in VARIANTS
    for split in (1, 2, 4)
    # FUSED_REDUCE alone without a split is the unfused launch (the space prunes it).
    if not (split == 1 and quant is False)
]


def _ids(case: tuple[str, bool, bool, int]) -> str:
    return f"{case[0]}-split{case[3]}"


def _unfused(config: GemvConfig) -> GemvConfig:
    return dataclasses.replace(config, FUSE_QUANT=False, FUSED_REDUCE=False, K_LANES=False)


def _problem(device: str, dtype: torch.dtype, seed: int, m: int = 1, n: int = N, k: int = K):
    gen = torch.Generator().manual_seed(seed)
    weight = Q4KWeight.quantize((torch.randn(n, k, generator=gen) * 0.05).to(device))
    x = (torch.randn(m, k, generator=gen) * 2.0).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(device)
    return x, weight, bias


def _run(config: GemvConfig, x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    assert KERNEL.launch(config, x, weight, bias, out=out) is out
    return out


def _agrees(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The one-launch result against the unfused launches': the same bits on the interpreter; on a
    GPU each element within one unit in the last place, or within one unit of the row's typical
    magnitude (see ``test_gpu_one_launch_agrees_with_the_unfused_launches``)."""
    if a.device.type == "cpu":
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return bool((_ulps_apart_each(a, b) <= 1).logical_or((a.float() - b.float()).abs() <= _row_unit(b)).all())


def _row_unit(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each row's RMS value, as a column: what float sums added in
    another order move a result by, whatever its own size (an output near zero is made of terms as
    large as the row's others, so its error is theirs, many of its own units)."""
    rms = t.float().pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.finfo(t.dtype).eps * torch.exp2(torch.floor(torch.log2(rms)))


def _ulps_apart_each(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between matching elements of two 16-bit float tensors (their bit
    patterns mapped to one ordered integer line, so +0 and -0 are 0 apart)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits + 32768), bits)

    return (ordered(a) - ordered(b)).abs()


def _counters_are_zero(device: torch.device) -> bool:
    return all(not buffer.any() for (where, _), buffer in _launch.COUNTERS.items() if where == device)


@pytest.mark.parametrize("lanes", [False, True], ids=["", "k-lanes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fused_variants_give_the_unfused_bits(case, dtype, lanes, device):
    """Each variant, with its lanes along K or not, writes every element of a NaN-poisoned
    ``out=`` with exactly the bits of the pre-pass, GEMV and reduce launches (with a bias, which
    the reduce or the last split adds)."""
    _name, quant, reduce, split = case
    x, weight, bias = _problem(device, dtype, seed=split)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=split, FUSE_QUANT=quant, FUSED_REDUCE=reduce, K_LANES=lanes)
    expected = _run(_unfused(config), x, weight, bias)
    out = _run(config, x, weight, bias)
    assert not torch.isnan(out).any(), "some outputs were never written"
    assert _agrees(out, expected), (out - expected).abs().max()
    assert check_path(out.float(), q4k_linear_reference(x, weight, bias), "gemv") is None


@pytest.mark.parametrize("block_k", [64, 256, 512], ids=lambda v: f"bk{v}")
@pytest.mark.parametrize("split", [1, 2])
def test_k_lanes_alone_gives_the_unfused_bits(block_k, split, device):
    """``K_LANES`` without the other two fields: the pre-pass, the one-launch kernel reading its
    words, and the reduce launch where split; K tiles of a quarter, one and two super-blocks (each
    super-block's (d, dmin) read as one word, shared by a tile's sub-blocks)."""
    x, weight, bias = _problem(device, torch.bfloat16, seed=11 * split + block_k, k=2 * K)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=block_k, SPLIT_K=split, K_LANES=True)
    out = _run(config, x, weight, bias)
    assert not torch.isnan(out).any(), "some outputs were never written"
    assert _agrees(out, _run(_unfused(config), x, weight, bias)), (
        (out - _run(_unfused(config), x, weight, bias)).abs().max()
    )
    assert check_path(out.float(), q4k_linear_reference(x, weight, bias), "gemv") is None


@pytest.mark.parametrize("lanes", [False, True], ids=["", "k-lanes"])
def test_fuse_quant_gives_the_unfused_bits_with_several_rows(lanes, device):
    """Three rows of x in one program (4 rows of the tile, one masked) and no bias."""
    x, weight, _ = _problem(device, torch.bfloat16, seed=5, m=3)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, FUSE_QUANT=True, FUSED_REDUCE=True, K_LANES=lanes)
    assert _agrees(_run(config, x, weight, None), _run(_unfused(config), x, weight, None))


@pytest.mark.parametrize(("m", "n"), [(1, 64), (3, 64), (4, 128)])
def test_the_default_tiles_of_a_gpu_key_give_the_unfused_bits(m, n, device):
    """The GEMV default of an SM90 key (its lanes along K, one launch, split where K allows)
    computes the unfused launches' bits and meets the GEMV's floor, at one, three (a masked fourth)
    and four rows."""
    key = Q4KKey(
        arch="sm90", sm_count=132, dtype="bfloat16", m_bucket=1 << (m - 1).bit_length(), n=n, k=2 * K, fp8=False
    )
    config = gemv_default(key)
    assert config is not None and config.K_LANES and config.FUSE_QUANT and config.FUSED_REDUCE
    # So few weight rows never make three programs an SM: the most programs, 32-row tiles split
    # over K's two 512-deep tiles (at one row) or four 256-deep ones (from three rows).
    tiles = (config.BLOCK_N, config.BLOCK_K, config.SPLIT_K)
    assert tiles == ((32, 512, 2) if m == 1 else (32, 256, 4))
    x, weight, bias = _problem(device, torch.bfloat16, seed=31 * m, m=m, n=n, k=2 * K)
    out = _run(config, x, weight, bias)
    assert not torch.isnan(out).any(), "some outputs were never written"
    assert _agrees(out, _run(_unfused(config), x, weight, bias))
    assert check_path(out.float(), q4k_linear_reference(x, weight, bias), "gemv") is None


@pytest.mark.parametrize("quant", [False, True], ids=["fused-reduce", "one-launch"])
def test_fused_reduce_adds_the_splits_in_split_order(quant, device):
    """Partials that cancel: splits 0 and 1 are exact opposites 2**20 times larger than splits 2
    and 3 (the same codes against x and -x), so ``((p0 + p1) + p2) + p3`` keeps the small splits
    and any other order loses their low bits; whichever program arrives last, the reduce adds in
    split order, as the reduce launch does."""
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(N, K, generator=gen) * 0.05
    w[:, 128:256] = w[:, :128]
    weight = Q4KWeight.quantize(w.to(device))
    assert torch.equal(weight.qs[:, 64:128], weight.qs[:, :64])
    x = torch.randn(1, K, generator=gen)
    x[:, :128] *= 2.0**20
    x[:, 128:256] = -x[:, :128]
    x = x.to(torch.bfloat16).to(device)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, FUSE_QUANT=quant, FUSED_REDUCE=True)
    out = _run(config, x, weight, None)
    assert _agrees(out, _run(_unfused(config), x, weight, None))
    # The large splits cancel exactly: what is left is the small splits' product.
    small = x.float().clone()
    small[:, :256] = 0
    assert check_path(out.float(), q4k_linear_reference(small.to(x.dtype), weight, None), "gemv") is None


@pytest.mark.parametrize(("split", "quant"), [(4, True), (2, False)], ids=["one-launch-split4", "fused-reduce-split2"])
def test_repeated_calls_reset_the_arrival_counters(split, quant, device):
    """Three calls in a row with new x: each reduces once all its splits have counted, so each
    gives the unfused bits, and the counters are back at zero after every call."""
    x, weight, bias = _problem(device, torch.bfloat16, seed=9)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=split, FUSE_QUANT=quant, FUSED_REDUCE=True)
    for call in range(3):
        x = (x.float().roll(7 * call + 1, dims=1) * (1.5 - call)).to(x.dtype)
        out = _run(config, x, weight, bias)
        assert _agrees(out, _run(_unfused(config), x, weight, bias)), f"call {call}"
        assert _counters_are_zero(x.device), f"call {call} left counters set"


@pytest.mark.parametrize(
    ("quant", "reduce", "split", "lanes", "launched"),
    [
        (False, False, 2, False, ["_quantize_rows_gemv_kernel", "_q4k_gemv_kernel", "_splitk_reduce_kernel"]),
        (True, False, 2, False, ["_q4k_gemv_fused_kernel", "_splitk_reduce_kernel"]),
        (False, True, 2, False, ["_quantize_rows_gemv_kernel", "_q4k_gemv_fused_kernel"]),
        (True, True, 2, False, ["_q4k_gemv_fused_kernel"]),
        (True, False, 1, False, ["_q4k_gemv_fused_kernel"]),
        (False, False, 1, False, ["_quantize_rows_gemv_kernel", "_q4k_gemv_kernel"]),
        (False, False, 2, True, ["_quantize_rows_gemv_kernel", "_q4k_gemv_fused_kernel", "_splitk_reduce_kernel"]),
        (True, True, 2, True, ["_q4k_gemv_fused_kernel"]),
    ],
    ids=[
        "unfused-split", "fuse-quant-split", "fused-reduce", "one-launch-split", "fuse-quant", "unfused",
        "k-lanes-split", "k-lanes-one-launch-split",
    ],
)  # fmt: skip
def test_each_variant_launches_what_it_does_not_fuse(quant, reduce, split, lanes, launched, device):
    """With both fields (or FUSE_QUANT without a split) a call is one kernel launch; ``K_LANES``
    runs the one-launch kernel with whatever launches the other two fields leave."""
    x, weight, bias = _problem(device, torch.bfloat16, seed=3)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=split, FUSE_QUANT=quant, FUSED_REDUCE=reduce, K_LANES=lanes)
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    with sm90_build.record_launches() as recorder:
        KERNEL.launch(config, x, weight, bias, out=out)
    assert [launch.kernel.fn.__name__ for launch in recorder.launches] == launched


# ---- GPU tier ------------------------------------------------------------------------------------

#: (K, N, SPLIT_K) of the shipped H200 GEMV winners (BLOCK_N 32, BLOCK_K 256, 4 warps).
WINNER_SHAPES = [(14336, 4096, 4), (4096, 14336, 1), (4096, 4096, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("lanes", [False, True], ids=["", "k-lanes"])
@pytest.mark.parametrize(("k", "n", "split"), WINNER_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_one_launch_agrees_with_the_unfused_launches(k, n, split, dtype, lanes):
    """On sm_90 the one launch rounds as the unfused launches do to within one unit in the last
    place (or one unit of the row's RMS, for outputs near zero), three calls in a row, and meets
    the GEMV's floor against the reference.

    Not bit for bit, unlike on the interpreter: on an H200 the results differ, at SPLIT_K 1 (no
    fused reduce) too, as float sums added in another order would (an output near zero by many of
    its own units, never by more than one unit of its row's magnitude); which operation rounds
    differently on sm_90 is not located."""
    x, weight, bias = _problem("cuda", dtype, seed=k + n, n=n, k=k)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=256, SPLIT_K=split, FUSE_QUANT=True, FUSED_REDUCE=split > 1, K_LANES=lanes)
    for call in range(3):
        x = (x.float().roll(call + 1, dims=1) * 0.5 * (call + 1)).to(dtype)
        for with_bias in (bias, None):
            out = _run(config, x, weight, with_bias)
            expected = _run(_unfused(config), x, weight, with_bias)
            assert _agrees(out, expected), (call, with_bias is not None, (out - expected).abs().max())
    assert check_path(out.float(), q4k_linear_reference(x, weight, None), "gemv") is None


@pytest.mark.gpu
@pytest.mark.parametrize("lanes", [False, True], ids=["", "k-lanes"])
@pytest.mark.parametrize(("k", "n", "split"), WINNER_SHAPES, ids=lambda v: str(v))
def test_gpu_graph_replays_of_the_one_launch_gemv(k, n, split, lanes):
    """A captured one-launch call replayed three times with new x: each replay agrees with the
    unfused launches as in the eager test above and meets the GEMV's floor against the reference."""
    x, weight, bias = _problem("cuda", torch.bfloat16, seed=k, n=n, k=k)
    config = GemvConfig(BLOCK_N=32, BLOCK_K=256, SPLIT_K=split, FUSE_QUANT=True, FUSED_REDUCE=split > 1, K_LANES=lanes)
    out = torch.empty((1, n), dtype=x.dtype, device="cuda")
    # Compiles, and sizes the counters a capture uses, outside the capture.
    KERNEL.launch(config, x, weight, bias, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        KERNEL.launch(config, x, weight, bias, out=out)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for replay in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda") * (replay + 1))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = _run(_unfused(config), x, weight, bias)
        assert _agrees(out, expected), (replay, (out - expected).abs().max())
        assert check_path(out.float(), q4k_linear_reference(x, weight, bias), "gemv") is None, replay


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize(("k", "n", "split"), WINNER_SHAPES, ids=lambda v: str(v))
def test_gpu_k_lanes_takes_several_rows(k, n, split, m):
    """Two to four rows of x (three: a masked fourth row of the tile) through the one launch with
    its lanes along K, the form the space admits there: each call agrees with the unfused launches
    as above and meets the GEMV's floor against the reference, with and without a bias."""
    x, weight, bias = _problem("cuda", torch.bfloat16, seed=k + m, m=m, n=n, k=k)
    config = GemvConfig(BLOCK_N=64, BLOCK_K=256, SPLIT_K=split, FUSE_QUANT=True, FUSED_REDUCE=split > 1, K_LANES=True)
    for with_bias in (bias, None):
        out = _run(config, x, weight, with_bias)
        assert not torch.isnan(out).any(), "some outputs were never written"
        expected = _run(_unfused(config), x, weight, with_bias)
        assert _agrees(out, expected), (with_bias is not None, (out - expected).abs().max())
        reference = q4k_linear_reference(x, weight, with_bias)
        assert check_path(out.float(), reference, "gemv") is None, with_bias is not None

"""The ``q4k_fp8_gemm`` kernels and ``q4k_linear``: every GEMM path against the reference, the op.

CPU tier: the kernels run on the Triton interpreter at tiny shapes. GPU tier (``gpu`` marker): the
same checks over larger K and the Llama-3-8B shapes. The weight format is ``test_q4k_format.py``'s,
the config space, defaults and tuning half ``test_q4k_space.py``'s, the argument checks
``test_q4k_checks.py``'s, each path against ggml's accuracy bound and the fp8 opt-in
``test_q4k_accuracy.py``'s and ``test_q4k_opt_in.py``'s.

Every test here runs with the fp8 opt-in (``TRITUNE_Q4K_FP8``): they pin every path, the fp8 and
staged ones included, which serve only with it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tritune.kernels import Q4KWeight, q4k_linear, settings, use_config
from tritune.kernels.device import device_info
from tritune.kernels.q4k import launch as q4k_launch
from tritune.kernels.q4k.kernel import DEQUANT_DEFAULT_MIN_M, KERNEL, Q4KKey, portable_default
from tritune.kernels.q4k.reference import MIN_SQNR_DB, check_path, q4k_linear_reference, sqnr_db
from tritune.search_spaces.q4k_fp8_gemm import (
    SPACE,
    DequantConfig,
    Fp8Config,
    PortableConfig,
    StagedConfig,
    TmaConfig,
)


@pytest.fixture(autouse=True)
def fp8_opt_in():
    with settings.override(q4k_fp8=True):
        yield


# ---- the GEMM --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    path: str
    m: int
    k: int
    n: int
    split_k: int = 1
    block_k: int = 64
    bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    fold: bool = False
    swap: bool = False
    #: Staged and dequant paths only: weight rows dequantized per chunk.
    chunk: int = 32
    #: Row tiles per group of the swizzled tile order (1: plain row-major order).
    group_m: int = 1

    def __str__(self) -> str:
        dt = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        path = ("fp8-fold-swap" if self.swap else "fp8-fold") if self.fold else self.path
        if self.path == "int8" and self.swap:
            path = "int8-swap"
        if self.path in ("staged", "dequant"):
            path = f"{self.path}-chunk{self.chunk}"
        return (
            f"{path}-M{self.m}-K{self.k}-N{self.n}-split{self.split_k}-bk{self.block_k}-{dt}"
            + ("-bias" if self.bias else "")
            + (f"-group{self.group_m}" if self.group_m > 1 else "")
        )


CPU_CASES = [
    Case("portable", 1, 256, 37),
    Case("portable", 3, 768, 37, bias=True),
    Case("portable", 16, 768, 37, split_k=4),
    # A split over several row tiles (the default splits up to M=256 where big tiles idle SMs).
    Case("portable", 100, 768, 37, split_k=2, bias=True),
    Case("portable", 64, 256, 64, block_k=128),
    Case("portable", 257, 256, 37),
    Case("portable", 5, 512, 33, dtype=torch.float16, bias=True),
    Case("fp8", 1, 256, 37),
    Case("fp8", 3, 768, 37, bias=True),
    Case("fp8", 16, 768, 37, split_k=2, block_k=128),
    Case("fp8", 64, 768, 64, block_k=32),
    Case("fp8", 257, 256, 37),
    Case("fp8", 5, 512, 33, dtype=torch.float16, bias=True),
    Case("fp8", 1, 256, 37, fold=True),
    Case("fp8", 3, 768, 37, bias=True, fold=True),
    # Four splits of 192: two of them straddle a super-block boundary.
    Case("fp8", 16, 768, 37, split_k=4, fold=True),
    Case("fp8", 64, 768, 64, block_k=128, fold=True),
    Case("fp8", 257, 256, 37, block_k=32, fold=True),
    Case("fp8", 5, 512, 33, dtype=torch.float16, bias=True, fold=True),
    # The swapped kernel: the same cases; odd M and N leave part of both tile sides unused.
    Case("fp8", 1, 256, 37, fold=True, swap=True),
    Case("fp8", 3, 768, 37, bias=True, fold=True, swap=True),
    Case("fp8", 16, 768, 37, split_k=4, fold=True, swap=True),
    # The staged path: one chunk, several chunks with a short last one, and a chunk wider than N.
    Case("staged", 5, 512, 96, bias=True, block_k=128),
    Case("staged", 33, 768, 48, chunk=32),
    Case("staged", 1, 256, 64, chunk=1024, block_k=32),
    Case("fp8", 17, 768, 65, split_k=2, block_k=128, bias=True, fold=True, swap=True),
    Case("fp8", 64, 768, 64, block_k=128, fold=True, swap=True),
    Case("fp8", 257, 256, 37, block_k=32, fold=True, swap=True),
    Case("fp8", 5, 512, 33, dtype=torch.float16, bias=True, fold=True, swap=True),
    # Grouped tile order: nine row tiles of 32 in groups of four, the last group short.
    Case("portable", 257, 256, 70, group_m=4),
    Case("fp8", 257, 256, 70, group_m=4),
    Case("fp8", 257, 256, 70, group_m=4, fold=True),
    Case("fp8", 257, 256, 70, group_m=4, fold=True, swap=True),
    # The GEMV path: one row, three with bias, four splits, 17 rows (three row groups of 8, the
    # last one row deep), fp16 and 32-wide K tiles; the interpreter runs its dp4a as shifts.
    Case("gemv", 1, 256, 37),
    Case("gemv", 3, 768, 37, bias=True),
    Case("gemv", 8, 1024, 37, split_k=4),
    Case("gemv", 17, 1024, 65, split_k=2, bias=True, block_k=128),
    Case("gemv", 5, 512, 33, dtype=torch.float16, bias=True, block_k=32),
    # The int8 path, plain and swapped: bias, splits straddling super-blocks, odd M and N, fp16,
    # grouped tile order.
    Case("int8", 1, 256, 37),
    Case("int8", 3, 768, 37, bias=True, swap=True),
    Case("int8", 16, 768, 37, split_k=4),
    Case("int8", 17, 768, 65, split_k=2, block_k=128, bias=True, swap=True),
    Case("int8", 64, 768, 64, block_k=32),
    Case("int8", 257, 256, 37, block_k=128, swap=True),
    Case("int8", 5, 512, 33, dtype=torch.float16, bias=True),
    Case("int8", 257, 256, 70, group_m=4, swap=True),
    # The dequant path: chunks with a short last one, bias, one chunk wider than N, fp16 with an
    # odd N, and 32-wide K tiles.
    Case("dequant", 5, 512, 96, bias=True, block_k=128),
    Case("dequant", 33, 768, 48, chunk=32),
    Case("dequant", 1, 256, 64, chunk=1024, block_k=32),
    Case("dequant", 5, 512, 33, dtype=torch.float16, bias=True),
    Case("dequant", 257, 256, 70, chunk=1024, bias=True),
]

# (path, SCALE_FOLD, SWAP_AB) of each kernel the GEMM can run.
MODES = [
    ("portable", False, False),
    ("fp8", False, False),
    ("fp8", True, False),
    ("fp8", True, True),
    ("gemv", False, False),
    ("int8", False, False),
    ("int8", False, True),
]
MODE_IDS = ["portable", "fp8", "fp8-fold", "fp8-fold-swap", "gemv", "int8", "int8-swap"]

GPU_CASES = [
    Case(path, m, k, n, split_k=split, block_k=bk, bias=bias, fold=fold, swap=swap)
    for path, fold, swap in MODES
    for m in (1, 3, 16, 64, 257)
    for (k, n, split, bk, bias) in ((256, 129, 1, 64, False), (768, 1001, 1, 128, True), (4096, 4095, 1, 128, False))
] + [
    Case("portable", 1, 4096, 4096, split_k=8, block_k=128),
    Case("fp8", 16, 4096, 4096, split_k=4, block_k=256),
    Case("fp8", 16, 4096, 4096, split_k=4, block_k=256, fold=True),
    Case("fp8", 16, 4096, 4096, split_k=4, block_k=256, fold=True, swap=True),
    Case("fp8", 128, 4096, 4096, block_k=256, fold=True),
    Case("fp8", 128, 4096, 4096, block_k=256, fold=True, swap=True),
    Case("portable", 9, 4096, 1000, dtype=torch.float16, bias=True),
    Case("fp8", 9, 4096, 1000, dtype=torch.float16, bias=True),
    Case("fp8", 9, 4096, 1000, dtype=torch.float16, bias=True, fold=True),
    Case("fp8", 9, 4096, 1000, dtype=torch.float16, bias=True, fold=True, swap=True),
    # The staged path: chunks of 1024 with a short last one, and bias.
    Case("staged", 257, 4096, 4000, block_k=128, chunk=1024, bias=True),
    # The dequant path: chunks with a short last one and bias, the whole weight at once, fp16.
    Case("dequant", 257, 4096, 4000, block_k=128, chunk=1024, bias=True),
    Case("dequant", 64, 14336, 4096, block_k=256, chunk=4096),
    Case("dequant", 300, 4096, 1000, dtype=torch.float16, bias=True, chunk=1024),
    Case("staged", 64, 768, 2048, block_k=256, chunk=1024),
    Case("staged", 3, 14336, 1024, block_k=64, chunk=1024),
    Case("gemv", 1, 4096, 14336, block_k=256),
    Case("gemv", 4, 14336, 4096, split_k=4, block_k=256),
    Case("gemv", 9, 4096, 1000, dtype=torch.float16, bias=True, block_k=256),
]


def _config(case: Case, device: str) -> dict[str, object]:
    small = device == "cpu"
    if case.path in ("staged", "dequant"):
        return {"path": case.path, "BLOCK_N": 32, "BLOCK_K": case.block_k, "num_warps": 4, "CHUNK_N": case.chunk}
    block_m = 16 if case.m <= 16 or small else 64
    return _pin(
        case.path,
        BLOCK_M=block_m if not small or case.m <= 16 else 32,
        BLOCK_N=32 if small else 64,
        BLOCK_K=case.block_k,
        GROUP_M=case.group_m if small else 4,
        num_warps=4,
        num_stages=1 if small else 3,
        SPLIT_K=case.split_k,
        SCALE_FOLD=case.fold,
        SWAP_AB=case.swap,
    )


def _pin(path: str, **fields: object) -> dict[str, object]:
    """A ``use_config`` pin of ``path`` with those of ``fields`` its config has (a pin that sets a
    field its path does not read is refused)."""
    member = SPACE.members[path].dimensions
    return {"path": path, **{name: value for name, value in fields.items() if name in member}}


#: Quantized test weights by (N, K, seed, device): quantizing on the CPU costs seconds at the Llama
#: shapes (4.3 s for 4095 x 4096 on two cores), and the GPU tier asks for the same few weights many
#: times; it quantizes on the GPU (the reference dequantizes whatever weight the test holds).
_WEIGHTS: dict[tuple[int, int, int, str], Q4KWeight] = {}


def _problem(case: Case, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # Drawn every time: x and the bias come from the same generator, after the weight.
    w = torch.randn(case.n, case.k, generator=gen) * 0.05
    key = (case.n, case.k, seed, device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = Q4KWeight.quantize(w.to(device))
    weight = _WEIGHTS[key]
    x = (torch.randn(case.m, case.k, generator=gen) * 2.0).to(case.dtype).to(device)
    bias = torch.randn(case.n, generator=gen).to(device) if case.bias else None
    return x, weight, bias


class _Launch:
    """``kernel[grid](...)`` through the real wrapper, recording the kernel's name at the call (the
    folded kernel's name says whether SWAP_AB was set)."""

    def __init__(self, wrapped, name: str, ran: list[str]) -> None:
        self.wrapped, self.name, self.ran = wrapped, name, ran

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.ran.append(self.name + ("-swap" if kwargs.get("SWAP_AB") else ""))
            return self.wrapped[grid](*args, **kwargs)

        return call


class _KernelSpy:
    """Records the kernels an eager ``q4k_linear`` launches (the real kernels still run)."""

    def __init__(self, monkeypatch):
        self.ran: list[str] = []
        names = {
            q4k_launch._quantize_rows_fp8_kernel: "quantize",
            q4k_launch._quantize_rows_gemv_kernel: "quantize-gemv",
            q4k_launch._q4k_gemv_kernel: "gemv",
            q4k_launch._q4k_gemv_fused_kernel: "gemv-fused",
            q4k_launch._q4k_gemm_fp8_kernel: "fp8",
            q4k_launch._q4k_gemm_fp8_fold_kernel: "fp8-fold",
            q4k_launch._q4k_gemm_portable_kernel: "portable",
            q4k_launch._splitk_reduce_kernel: "reduce",
            q4k_launch._staged_prepass_kernel: "prepass",
            q4k_launch._q4k_dequant_fp8_kernel: "dequant",
            q4k_launch._int8_prepass_kernel: "quantize-int8",
            q4k_launch._q4k_gemm_int8_kernel: "int8",
            q4k_launch._q4k_dequant_kernel: "dequant-dense",
            # Launched directly (a Gluon kernel is not wrapped for tracing): never recorded here.
            q4k_launch._q4k_gemm_tma_kernel: "tma",
            q4k_launch._q4k_gemm_tma_loader_kernel: "tma-loader",
            q4k_launch._q4k_gemm_tma_rs_kernel: "tma-registers",
        }
        assert set(names) == set(q4k_launch.JIT_KERNELS)

        wrap = q4k_launch.wrap_triton

        def launcher(kernel):
            # The real wrapper: a bare kernel in eager mode, a traceable one under torch.compile
            # (where a bare kernel would be launched on fake tensors).
            return _Launch(wrap(kernel), names[kernel], self.ran)

        monkeypatch.setattr(q4k_launch, "wrap_triton", launcher)

    @staticmethod
    def expected(path: str, split_k: int, fold: bool = False, swap: bool = False, chunks: int = 1) -> list[str]:
        if path == "staged":
            # The GEMM of each chunk is cuBLASLt's (torch._scaled_mm), not a Triton launch.
            return ["prepass"] + ["dequant"] * chunks
        if path == "dequant":
            # Each chunk's GEMM is cuBLAS's (torch.mm / torch.addmm).
            return ["dequant-dense"] * chunks
        fp8 = ("fp8-fold-swap" if swap else "fp8-fold") if fold else "fp8"
        int8 = "int8-swap" if swap else "int8"
        gemm = {"fp8": ["quantize", fp8], "gemv": ["quantize-gemv", "gemv"], "int8": ["quantize-int8", int8]}
        gemm = gemm.get(path, ["portable"])
        return gemm + (["reduce"] if split_k > 1 else [])


@pytest.fixture
def kernel_spy(monkeypatch):
    return _KernelSpy(monkeypatch)


def _served_as_pinned(pin: object, x: torch.Tensor, weight: Q4KWeight, bias, out: torch.Tensor) -> bool:
    """Whether ``q4k_linear`` serves ``pin`` as given at this call. On a GPU the space's rule at the
    call's key (for example the GEMV path above one row, the fp8 paths below the opt-in's M) and
    the kernel's serve hook may replace it; on the interpreter every pin runs."""
    info = device_info(x.device)
    facts = tuple(KERNEL.facts(x, weight, bias, out=out))
    key = KERNEL.key_for(info, facts)
    if not info.is_interpreter and KERNEL.space.infeasible_reason(pin, key, KERNEL.limits(info)) is not None:
        return False
    return KERNEL.serve_with_reason(pin, info, facts)[0] == pin


def _run_case(case: Case, device: str, record_property, spy: _KernelSpy) -> None:
    """One case: through ``q4k_linear`` under ``use_config`` where the pin serves the call, else (a
    GPU case the dispatcher would not serve as pinned) through the kernel's launch, so that every
    path's numerics are checked at every case."""
    x, weight, bias = _problem(case, device)
    out = torch.full((case.m, case.n), float("nan"), dtype=case.dtype, device=device)
    pin = KERNEL.pinned_config(_config(case, device))
    if _served_as_pinned(pin, x, weight, bias, out):
        with use_config("q4k_fp8_gemm", _config(case, device)):
            result = q4k_linear(x, weight, bias, out=out)
    else:
        assert device != "cpu", f"{case}: the interpreter serves every pin"
        result = KERNEL.launch(pin, x, weight, bias, out=out)
    assert result is out
    # The pinned path and split ran, not a stand-in the dispatcher chose.
    chunks = -(-case.n // case.chunk)
    assert spy.ran == spy.expected(case.path, case.split_k, case.fold, case.swap, chunks)
    expected = q4k_linear_reference(x, weight, bias)
    sqnr = sqnr_db(out.float(), expected)
    record_property("sqnr_db", round(sqnr, 2))
    assert not torch.isnan(out).any(), "some outputs were never written"
    assert check_path(out.float(), expected, case.path) is None, f"{case}: SQNR {sqnr:.1f} dB"
    _assert_no_bad_row_or_column(out.float(), expected, case)


#: An fp16 result of the portable path keeps its dequantized weights' full precision (about 72 dB
#: measured): the 40 dB floor, set by bf16, would let a scale error of 1% through.
FP16_PORTABLE_FLOOR_DB = 60.0
#: A row or column of the output may fall this far below the path's floor, no further: a single
#: unwritten or misplaced row or column barely moves the global SQNR of a large output.
LOCAL_SLACK_DB = 10.0


def _assert_no_bad_row_or_column(out: torch.Tensor, expected: torch.Tensor, case: Case) -> None:
    floor = MIN_SQNR_DB[case.path]
    if case.path == "portable" and case.dtype == torch.float16:
        floor = FP16_PORTABLE_FLOOR_DB
        assert sqnr_db(out, expected) >= floor, f"{case}: SQNR {sqnr_db(out, expected):.1f} dB"
    # Sixteen values or more per row (column), so that one rounding near a zero does not decide it.
    if out.shape[1] >= 16:
        rows = [sqnr_db(out[i], expected[i]) for i in range(out.shape[0])]
        assert min(rows) >= floor - LOCAL_SLACK_DB, f"{case}: row {rows.index(min(rows))} at {min(rows):.1f} dB"
    if out.shape[0] >= 16:
        cols = [sqnr_db(out[:, j], expected[:, j]) for j in range(out.shape[1])]
        assert min(cols) >= floor - LOCAL_SLACK_DB, f"{case}: column {cols.index(min(cols))} at {min(cols):.1f} dB"


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_gemm_matches_reference(case, device, record_property, kernel_spy):
    _run_case(case, device, record_property, kernel_spy)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gemm_matches_reference_gpu(case, record_property, kernel_spy):
    _run_case(case, "cuda", record_property, kernel_spy)


@pytest.mark.gpu
@pytest.mark.parametrize(("path", "fold", "swap"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("m", [1, 16, 256, 4096])
def test_llama_shapes_gpu(path, fold, swap, m, record_property):
    """The dispatcher's default (portable), the fp8 and int8 paths' defaults and the GEMV (pinned at
    every M: beyond one row it spills but must stay correct) on the Llama-3-8B MLP shape."""
    case = Case(path, m, 4096, 14336, fold=fold, swap=swap)
    x, weight, _ = _problem(case, "cuda")
    config = {"path": path, "SCALE_FOLD": fold, "SWAP_AB": swap} if path == "fp8" else {}
    if path == "int8":
        config = {"path": "int8", "SWAP_AB": swap}
    if path == "gemv":
        config = {"path": "gemv", "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1}
    if config:
        with use_config("q4k_fp8_gemm", config):
            out = q4k_linear(x, weight)
    else:
        out = q4k_linear(x, weight)
    expected = q4k_linear_reference(x, weight)
    record_property("sqnr_db", round(sqnr_db(out.float(), expected), 2))
    assert check_path(out.float(), expected, path) is None


def _nan_out(shape: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)


@pytest.mark.parametrize(("path", "fold", "swap"), MODES, ids=MODE_IDS)
def test_split_k_agrees_with_one_split(path, fold, swap, device, kernel_spy):
    x, weight, bias = _problem(Case(path, 2, 1024, 40), device, seed=7)
    expected = q4k_linear_reference(x, weight, bias)
    outs = []
    for split in (1, 4):
        config = _pin(
            path, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, SPLIT_K=split, SCALE_FOLD=fold, SWAP_AB=swap
        )
        kernel_spy.ran.clear()
        with use_config("q4k_fp8_gemm", config):
            out = q4k_linear(x, weight, bias, out=_nan_out((2, 40), x))
        assert kernel_spy.ran == kernel_spy.expected(path, split, fold, swap)
        assert check_path(out.float(), expected, path) is None, f"SPLIT_K={split}"
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("path", "fold", "swap"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("split", [1, 2], ids=["one-split", "split2"])
def test_bias_view_is_read_through_its_stride(path, fold, swap, split, device):
    """``b[::2]``: every kernel that adds the bias must step over the values in between."""
    x, weight, bias = _problem(Case(path, 3, 512, 24, bias=True), device, seed=12)
    interleaved = torch.stack([bias, torch.full_like(bias, 1e3)], dim=1).reshape(-1)[::2]
    assert interleaved.stride(0) == 2 and torch.equal(interleaved, bias)
    config = _pin(path, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, SPLIT_K=split, SCALE_FOLD=fold, SWAP_AB=swap)
    with use_config("q4k_fp8_gemm", config):
        out = q4k_linear(x, weight, interleaved, out=_nan_out((3, 24), x))
    assert check_path(out.float(), q4k_linear_reference(x, weight, bias), path) is None


def test_staged_bias_view_and_chunks_agree(device, kernel_spy):
    """The staged path adds a strided bias once, and every chunk size gives the same product."""
    x, weight, bias = _problem(Case("staged", 3, 512, 96, bias=True), device, seed=12)
    interleaved = torch.stack([bias, torch.full_like(bias, 1e3)], dim=1).reshape(-1)[::2]
    expected = q4k_linear_reference(x, weight, bias)
    outs = []
    for chunk in (32, 1024):
        kernel_spy.ran.clear()
        config = {"path": "staged", "BLOCK_N": 32, "BLOCK_K": 128, "CHUNK_N": chunk}
        with use_config("q4k_fp8_gemm", config):
            out = q4k_linear(x, weight, interleaved, out=_nan_out((3, 96), x))
        assert kernel_spy.ran == kernel_spy.expected("staged", 1, chunks=-(-96 // chunk))
        assert check_path(out.float(), expected, "staged") is None, f"CHUNK_N={chunk}"
        outs.append(out)
    # Chunks only decide which rows share a scratch: the same e4m3 operands, the same sums.
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_staged_uses_the_fold_kernels_weights(device):
    """The staged path multiplies exactly the folded e4m3 weights the SCALE_FOLD kernels make."""
    x, weight, _ = _problem(Case("staged", 4, 512, 64), device, seed=21)
    with use_config("q4k_fp8_gemm", {"path": "staged", "BLOCK_N": 32, "BLOCK_K": 64, "CHUNK_N": 32}):
        out = q4k_linear(x, weight, out=_nan_out((4, 64), x))
    # One split: the fold kernel's power of two spans the whole of K, as the staged path's does.
    fold = {"path": "fp8", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SCALE_FOLD": True}
    with use_config("q4k_fp8_gemm", fold):
        twin = q4k_linear(x, weight, out=_nan_out((4, 64), x))
    # The same e4m3 products summed in another order, each rounded once to bf16: one bf16 step apart
    # at most (a different weight rounding would move whole outputs by e4m3 steps, 2**-3 relative).
    scale = float(twin.float().abs().max())
    torch.testing.assert_close(out.float(), twin.float(), rtol=2**-7, atol=2**-7 * scale)


@pytest.mark.gpu
def test_staged_opcheck_and_compile_gpu():
    """On a GPU the op is a triton_op whose body torch.compile traces on fake tensors: the staged
    path's _scaled_mm out= calls must trace (static shapes here; dynamic ones are not covered)."""
    x, weight, bias = _problem(Case("staged", 64, 512, 2048, bias=True), "cuda", seed=13)
    config = StagedConfig(BLOCK_N=32, CHUNK_N=1024)
    out = torch.empty(64, 2048, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(KERNEL.op, (x, *weight.tensors(), bias, out), SPACE.field_values(config))

    def layer(inp: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        return q4k_linear(inp, weight, bias, out=dest) * 2

    with use_config("q4k_fp8_gemm", SPACE.to_dict(config)):
        compiled = torch.compile(layer, fullgraph=True)
        dest = _nan_out((64, 2048), x)
        result = compiled(x, dest)
    assert check_path(dest.float(), q4k_linear_reference(x, weight, bias), "staged") is None
    torch.testing.assert_close(result, dest * 2, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [256, 4096])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["accum", "fast-accum"])
def test_staged_llama_shape_gpu(m, fast_accum, record_property):
    """The staged path's pinned default on the Llama-3-8B MLP shape: seven 2048-row chunks."""
    x, weight, _ = _problem(Case("staged", m, 4096, 14336), "cuda")
    with use_config("q4k_fp8_gemm", {"path": "staged", "FAST_ACCUM": fast_accum}):
        out = q4k_linear(x, weight, out=_nan_out((m, 14336), x))
    expected = q4k_linear_reference(x, weight)
    record_property("sqnr_db", round(sqnr_db(out.float(), expected), 2))
    assert check_path(out.float(), expected, "staged") is None


# ---- the folded fp8 kernel -------------------------------------------------------------------


def _fold_emulation(x: torch.Tensor, weight: Q4KWeight) -> torch.Tensor:
    """What ``SCALE_FOLD`` computes, in PyTorch: e4m3 rows of x against e4m3 ``f * W``, with ``f``
    the largest power of two per column keeping ``f * (945|d| + 63|dmin|)`` within 448."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    row_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    xq = (xf / row_scale).to(torch.float8_e4m3fn).float() * row_scale
    d, dmin = weight.super_scales.float().unbind(-1)
    bound = (945 * d.abs() + 63 * dmin.abs()).amax(dim=1, keepdim=True)
    fold = torch.exp2(torch.floor(torch.log2(448 / bound)))
    w = (weight.dequantize() * fold).to(torch.float8_e4m3fn).float() / fold
    return xq @ w.t()


@pytest.mark.parametrize("swap", [False, True], ids=["fold", "fold-swap"])
@pytest.mark.parametrize("block_k", [64, 128])
def test_fold_rounds_exactly_the_scaled_weights(block_k, swap, device):
    """Each weight reaches the tensor cores as ``e4m3(f * (d*sc*q - dmin*m))``, nothing else, in
    both folded kernels (the swapped one scales its transposed accumulator: ``f`` along its rows).

    fp16 output, so the comparison sees errors far below the e4m3 rounding a wrong fold causes.
    """
    x, weight, bias = _problem(Case("fp8", 5, 768, 33, dtype=torch.float16, bias=True), device, seed=14)
    config = {
        "path": "fp8", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "GROUP_M": 1, "SCALE_FOLD": True,
        "SWAP_AB": swap,
    }  # fmt: skip
    with use_config("q4k_fp8_gemm", config):
        out = q4k_linear(x, weight, bias, out=_nan_out((5, 33), x))
    expected = _fold_emulation(x.cpu(), weight.to("cpu")) + bias.float().cpu()
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())


def _centred_emulation(x: torch.Tensor, weight: Q4KWeight) -> torch.Tensor:
    """What the unfolded fp8 kernel computes: the row-scaled e4m3 x times the centred weights
    ``s * (q - 8)``, plus the exact x times each sub-block's centre ``8s - o``."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    row_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    xq = (xf / row_scale).to(torch.float8_e4m3fn).float() * row_scale
    d, dmin = weight.super_scales.float().unbind(-1)  # [N, K/256]
    s = d.repeat_interleave(8, dim=1) * weight.scales.float()  # [N, K/32]
    o = dmin.repeat_interleave(8, dim=1) * weight.mins.float()
    centre = (8 * s - o).repeat_interleave(32, dim=1)  # [N, K]
    return xq @ (weight.dequantize() - centre).t() + xf @ centre.t()


@pytest.mark.parametrize("split", [1, 2], ids=["one-split", "split2"])
@pytest.mark.parametrize("block_k", [32, 128])
def test_centred_fp8_kernel_matches_its_emulation(block_k, split, device):
    """The unfolded fp8 kernel, term by term: a scale, centre or row-sum error of a few percent
    stays above its 25 dB floor (the kernel reaches about 30 dB), but not within this tolerance.

    fp16 output, so the comparison sees errors far below the e4m3 rounding of x.
    """
    x, weight, bias = _problem(Case("fp8", 5, 768, 33, dtype=torch.float16, bias=True), device, seed=16)
    config = {"path": "fp8", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "GROUP_M": 1, "SPLIT_K": split}
    with use_config("q4k_fp8_gemm", config):
        out = q4k_linear(x, weight, bias, out=_nan_out((5, 33), x))
    expected = _centred_emulation(x.cpu(), weight.to("cpu")) + bias.float().cpu()
    # The GPU adds the centre term through tf32 operands (about 55 dB on that term): the absolute
    # slack covers it, and a 1% error at the largest outputs still exceeds it.
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-3, atol=4e-3 * expected.abs().max().item())


def _int8_subblocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded as the GEMV pre-pass rounds it: int8 values (ties to even) and their float32
    scales ``amax / 127``, one per 32-wide sub-block of a row."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(xf / scale).clamp(-127, 127).reshape(x.shape), scale.squeeze(2)


def test_gemv_prepass_packs_words_in_nibble_order(device):
    """Row m's words: first x's positions 8i, 8i+2, 8i+4, 8i+6 as the bytes of word i, then the odd
    positions; per sub-block the scale, what its sum lost to the rounding and its exact sum."""
    # K=768: 24 sub-blocks, two programs a row (16 and a partial 8).
    x, _, _ = _problem(Case("gemv", 3, 768, 8), device, seed=18)
    words, scales, lost, sums = (t.cpu() for t in q4k_launch.quantize_rows_gemv(x))
    xr, expected_scales = _int8_subblocks(x.cpu())
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    as_bytes = words.view(torch.int8).reshape(3, 2, -1, 4).float()  # [M, parity, word, byte] (little-endian)
    pairs = xr.reshape(3, -1, 4, 2)  # [M, word, byte, parity]
    assert torch.equal(as_bytes[:, 0], pairs[..., 0]) and torch.equal(as_bytes[:, 1], pairs[..., 1])
    xf = x.cpu().float()
    torch.testing.assert_close(sums, xf.reshape(3, -1, 32).sum(2), rtol=1e-6, atol=1e-5)
    rounded = (xr * expected_scales.repeat_interleave(32, dim=1)).reshape(3, -1, 32)
    torch.testing.assert_close(lost, (xf.reshape(3, -1, 32) - rounded).sum(2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("block_k", "split"), [(128, 1), (128, 2), (512, 1), (512, 2), (1024, 1)], ids=lambda v: str(v)
)
def test_gemv_kernel_matches_its_emulation(block_k, split, device):
    """The GEMV, term by term: x rounded per sub-block times the centred weights ``s * (q - 8)``,
    plus the exact x times each sub-block's centre ``8s - o``. A 1% error in a scale, a centre or a
    sum passes the 30 dB floor but not this tolerance (fp16 output). K tiles of 512 and 1024 span
    several super-blocks, whose scales here differ by up to 1000x: a tile that read one
    super-block's ``d`` for all of them would be far off."""
    gen = torch.Generator().manual_seed(19)
    n, k = 33, 2048
    spread = 10.0 ** torch.linspace(-1.5, 1.5, k // 256).repeat_interleave(256)  # per super-block
    weight = Q4KWeight.quantize((torch.randn(n, k, generator=gen) * 0.05 * spread).to(device))
    x = (torch.randn(5, k, generator=gen) * 2.0).to(torch.float16).to(device)
    bias = torch.randn(n, generator=gen).to(device)
    config = {"path": "gemv", "BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": split}
    with use_config("q4k_fp8_gemm", config):
        out = q4k_linear(x, weight, bias, out=_nan_out((5, n), x))
    xr, scales = _int8_subblocks(x.cpu())
    xq = xr * scales.repeat_interleave(32, dim=1)
    w = weight.to("cpu")
    d, dmin = w.super_scales.float().unbind(-1)
    s = d.repeat_interleave(8, dim=1) * w.scales.float()
    o = dmin.repeat_interleave(8, dim=1) * w.mins.float()
    centre = (8 * s - o).repeat_interleave(32, dim=1)
    expected = xq @ (w.dequantize() - centre).t() + x.cpu().float() @ centre.t() + bias.float().cpu()
    torch.testing.assert_close(out.float().cpu(), expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def test_column_folds_are_the_largest_safe_powers_of_two(device):
    """Each column's fold is exactly the largest power of two ``f`` with ``f * bound <= 448``: one
    2-4x too small still passes every SQNR floor (e4m3 is relative), so it is checked directly."""
    x, weight, _ = _problem(Case("staged", 3, 768, 40), device, seed=17)
    _, _, inv_fold = q4k_launch.staged_prepass(x, weight.super_scales, interpreted=device == "cpu")
    d, dmin = weight.super_scales.float().unbind(-1)
    bound = (945.0 * d.abs() + 63.0 * dmin.abs()).amax(dim=1)
    _, exponent = torch.frexp(448.0 / bound)  # 448 / bound = m * 2**exponent, 0.5 <= m < 1
    expected = torch.exp2(1.0 - exponent.float())  # 1 / 2**(exponent - 1)
    torch.testing.assert_close(inv_fold.view(-1).cpu(), expected.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("swap", [False, True], ids=["fold", "fold-swap"])
def test_fold_keeps_every_column_in_e4m3_range(swap, device, record_property):
    """Columns 2^12 apart in magnitude, super-blocks 2^8 apart within a column: each column's power
    of two keeps its weights clear of e4m3's subnormals (unscaled, the small ones would flush)."""
    gen = torch.Generator().manual_seed(15)
    m, n, k = 64, 32, 768
    column_exp = (torch.arange(n) % 13 - 6).float()  # 2^-6 .. 2^6
    block_exp = torch.tensor([-4.0, 0.0, 4.0]).repeat_interleave(256)
    w = torch.randn(n, k, generator=gen) * 0.05 * torch.exp2(column_exp)[:, None] * torch.exp2(block_exp)[None, :]
    weight = Q4KWeight.quantize(w).to(device)
    # Every super-block contributes alike to the output.
    x = (torch.randn(m, k, generator=gen) * torch.exp2(-block_exp)).to(torch.bfloat16).to(device)
    config = {
        "path": "fp8", "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "SCALE_FOLD": True,
        "SWAP_AB": swap,
    }  # fmt: skip
    with use_config("q4k_fp8_gemm", config):
        out = q4k_linear(x, weight, out=_nan_out((m, n), x))
    expected = q4k_linear_reference(x, weight)
    per_column = [sqnr_db(out[:, j].float(), expected[:, j]) for j in range(n)]
    record_property("min_column_sqnr_db", round(min(per_column), 2))
    assert min(per_column) >= MIN_SQNR_DB["fp8"], per_column


def _activations(kind: str, m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen)
    if kind == "outlier-channels":
        # A few hidden channels about 20x the rest, as in a transformer's residual stream.
        x[:, torch.randperm(k, generator=gen)[: k // 64]] *= 20.0
    elif kind == "silu-gated":
        # The input of an MLP's down projection: silu(gate) * up, heavy-tailed.
        x = torch.nn.functional.silu(x) * torch.randn(m, k, generator=gen)
    return x


@pytest.mark.parametrize("kind", ["gaussian", "outlier-channels", "silu-gated"])
@pytest.mark.parametrize(("path", "fold", "swap"), MODES[1:], ids=MODE_IDS[1:])
def test_quantized_modes_on_realistic_activations(kind, path, fold, swap, device, record_property):
    """Gaussian Q4_K weights against activations shaped like a model's: every fp8 mode, the GEMV
    (int8 x per sub-block) and the int8 path (int8 x per row) hold their floors."""
    gen = torch.Generator().manual_seed(16)
    m, n, k = 16, 64, 768
    weight = Q4KWeight.quantize(torch.randn(n, k, generator=gen) * 0.02).to(device)
    x = _activations(kind, m, k, gen).to(torch.bfloat16).to(device)
    config = _pin(path, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, SCALE_FOLD=fold, SWAP_AB=swap)
    with use_config("q4k_fp8_gemm", config):
        out = q4k_linear(x, weight, out=_nan_out((m, n), x))
    expected = q4k_linear_reference(x, weight)
    record_property("sqnr_db", round(sqnr_db(out.float(), expected), 2))
    assert check_path(out.float(), expected, path) is None


def test_batched_input_matches_rows(device):
    x, weight, bias = _problem(Case("portable", 6, 256, 24), device, seed=8)
    x3 = x.reshape(2, 3, 256)
    out = q4k_linear(x3, weight, bias, out=_nan_out((2, 3, 24), x))
    assert out.shape == (2, 3, 24) and out.dtype == x.dtype
    assert check_path(out.reshape(6, 24).float(), q4k_linear_reference(x, weight, bias), "portable") is None
    rows = torch.stack([q4k_linear(x[i], weight, bias, out=_nan_out((24,), x)) for i in range(6)])
    torch.testing.assert_close(out.reshape(6, 24), rows, rtol=0, atol=0)


def test_empty_batch(device):
    _, weight, _ = _problem(Case("portable", 1, 256, 8), device)
    out = q4k_linear(torch.empty(0, 256, dtype=torch.bfloat16, device=device), weight)
    assert out.shape == (0, 8)


# ---- argument checks -------------------------------------------------------------------------


def test_bad_inputs_name_the_argument(device):
    # On the test's device: on a GPU machine a CPU tensor is refused first (it needs the interpreter).
    x, weight, _ = _problem(Case("portable", 2, 256, 8), device)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., K=256\] to match the weight, got K=512"):
        q4k_linear(torch.zeros(2, 512, dtype=torch.bfloat16, device=device), weight)
    with pytest.raises(TypeError, match="x: expected dtype"):
        q4k_linear(x.float(), weight)
    with pytest.raises(TypeError, match="weight: expected a Q4KWeight"):
        q4k_linear(x, weight.dequantize())
    with pytest.raises(ValueError, match=r"bias: expected shape \[N=8\]"):
        q4k_linear(x, weight, torch.zeros(9, device=device))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8\)"):
        q4k_linear(x, weight, out=torch.empty(2, 9, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match=r"out: expected dtype torch\.bfloat16"):
        q4k_linear(x, weight, out=torch.empty(2, 8, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match=rf"weight: expected device meta \(the device of x\), got {device}"):
        q4k_linear(torch.empty(2, 256, dtype=torch.bfloat16, device="meta"), weight)


def test_config_outside_the_space_is_refused():
    from tritune.search_spaces.base import ConfigError

    with pytest.raises(ConfigError, match="BLOCK_K=48"), use_config("q4k_fp8_gemm", {"BLOCK_K": 48}):
        pass


# ---- torch.library ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fold", "swap"),
    [*MODES, ("staged", False, False), ("dequant", False, False)],
    ids=[*MODE_IDS, "staged", "dequant"],
)
def test_opcheck(path, fold, swap, device):
    # The dequant path in two chunks (32 rows, then 16): each GEMM writes a strided column slice of out.
    n = 48 if path == "dequant" else 16
    x, weight, bias = _problem(Case(path, 3, 256, n), device, seed=9)
    out = torch.empty(3, n, dtype=torch.bfloat16, device=device)
    config = KERNEL.pinned_config(
        _pin(path, BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_stages=1, SPLIT_K=2, SCALE_FOLD=fold, SWAP_AB=swap)
    )
    if path == "staged":
        config = StagedConfig(BLOCK_N=32, CHUNK_N=32)
    if path == "dequant":
        config = DequantConfig(BLOCK_N=32, BLOCK_K=64, CHUNK_N=32)
    assert KERNEL.op is torch.ops.tritune.q4k_linear.default
    torch.library.opcheck(KERNEL.op, (x, *weight.tensors(), bias, out), SPACE.field_values(config))


def test_torch_compile_fullgraph(device):
    x, weight, bias = _problem(Case("fp8", 4, 256, 16), device, seed=10)

    def layer(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return q4k_linear(inp, weight, bias, out=out) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = _nan_out((4, 16), x)
    result = compiled(x, out)
    # The dispatcher's default for this key (the portable path) ran inside the graph.
    assert check_path(out.float(), q4k_linear_reference(x, weight, bias), "portable") is None
    torch.testing.assert_close(result, out * 2, rtol=0, atol=0)
    torch.testing.assert_close(result, layer(x, _nan_out((4, 16), x)), rtol=0, atol=0)


def test_a_first_call_under_torch_compile(device, monkeypatch):
    """A process whose first call is traced: the generated fast check is not built inside the trace."""
    monkeypatch.setattr(KERNEL, "_fast", None)
    x, weight, bias = _problem(Case("portable", 4, 256, 16), device, seed=10)
    compiled = torch.compile(lambda inp: q4k_linear(inp, weight, bias), fullgraph=True, backend="aot_eager")
    assert check_path(compiled(x).float(), q4k_linear_reference(x, weight, bias), "portable") is None


def test_torch_compile_fullgraph_staged(device, kernel_spy):
    """A pinned staged config traced by torch.compile: on a GPU the triton_op body runs on fake
    tensors, through _scaled_mm's out= overload into a column slice of out."""
    x, weight, bias = _problem(Case("staged", 4, 256, 64, bias=True), device, seed=11)

    def layer(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return q4k_linear(inp, weight, bias, out=out) * 2

    config = {"path": "staged", "BLOCK_N": 32, "BLOCK_K": 64, "CHUNK_N": 32}
    with use_config("q4k_fp8_gemm", config):
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        out = _nan_out((4, 64), x)
        result = compiled(x, out)
    assert check_path(out.float(), q4k_linear_reference(x, weight, bias), "staged") is None
    torch.testing.assert_close(result, out * 2, rtol=0, atol=0)
    # The staged path ran (its two chunks' dequantizations), not a stand-in the dispatcher chose.
    # On a GPU the body is also traced (fake tensors, then functionalized): each pass records one
    # pre-pass and two dequantizations.
    passes = kernel_spy.ran.count("prepass")
    assert passes >= 1 and kernel_spy.ran == ["prepass", "dequant", "dequant"] * passes, kernel_spy.ran


def test_torch_compile_fullgraph_dequant(device, kernel_spy):
    """A pinned dequant config traced by torch.compile: on a GPU the triton_op body runs on fake
    tensors, through addmm's out= overload into a column slice of out."""
    x, weight, bias = _problem(Case("dequant", 4, 256, 48, bias=True), device, seed=11)

    def layer(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return q4k_linear(inp, weight, bias, out=out) * 2

    config = {"path": "dequant", "BLOCK_N": 32, "BLOCK_K": 64, "CHUNK_N": 32}
    with use_config("q4k_fp8_gemm", config):
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        out = _nan_out((4, 48), x)
        result = compiled(x, out)
    assert check_path(out.float(), q4k_linear_reference(x, weight, bias), "dequant") is None
    torch.testing.assert_close(result, out * 2, rtol=0, atol=0)
    # Two chunks, each one dequantization (per pass: on a GPU the body is also traced).
    passes = kernel_spy.ran.count("dequant-dense") // 2
    assert passes >= 1 and kernel_spy.ran == ["dequant-dense", "dequant-dense"] * passes, kernel_spy.ran


def test_dequant_chunks_agree_with_the_whole_weight(device):
    """Chunks only decide which rows share the scratch: the same dense weights, the same GEMM
    per output column; a strided bias is read through its stride."""
    x, weight, bias = _problem(Case("dequant", 3, 512, 96, bias=True), device, seed=12)
    interleaved = torch.stack([bias, torch.full_like(bias, 1e3)], dim=1).reshape(-1)[::2]
    expected = q4k_linear_reference(x, weight, bias)
    outs = []
    for chunk in (32, 1024):
        config = {"path": "dequant", "BLOCK_N": 32, "BLOCK_K": 128, "CHUNK_N": chunk}
        with use_config("q4k_fp8_gemm", config):
            out = q4k_linear(x, weight, interleaved, out=_nan_out((3, 96), x))
        assert check_path(out.float(), expected, "dequant") is None, f"CHUNK_N={chunk}"
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [256, 1024, 4096])
@pytest.mark.parametrize(("k", "n"), [(4096, 14336), (14336, 4096)], ids=["up", "down"])
def test_dequant_llama_shapes_gpu(k, n, m, record_property):
    """The dequant path at its starting chunks on the Llama-3-8B MLP shapes: ggml's bound, eager
    and in CUDA-graph replay (the scratch comes from the graph's pool).

    Its speed against cuBLAS on the pre-dequantized weight and against the portable default is
    recorded as test properties, not asserted: GPU tests share the GPU with each other, and
    ``scripts/bench_q4k.py`` is where speed is measured."""
    import triton

    from tritune.kernels.q4k.tuning import TUNING

    x, weight, _ = _problem(Case("dequant", m, k, n), "cuda")
    expected = q4k_linear_reference(x, weight)
    dense = weight.dequantize().to(x.dtype)
    cublas_ms = triton.testing.do_bench(lambda: x @ dense.t())
    info = device_info("cuda")
    key = KERNEL.key_for(info, tuple(KERNEL.facts(x, weight, None)))
    starts = [c for c in TUNING.starting_configs(key, info) if isinstance(c, DequantConfig)]
    assert starts, key
    out = _nan_out((m, n), x)
    with use_config("q4k_fp8_gemm", SPACE.to_dict(KERNEL.default_config(key))):
        portable_ms = triton.testing.do_bench(lambda: q4k_linear(x, weight, out=out))
    best = math.inf
    for config in starts:
        out = _nan_out((m, n), x)
        with use_config("q4k_fp8_gemm", SPACE.to_dict(config)):
            q4k_linear(x, weight, out=out)
            assert check_path(out.float(), expected, "dequant") is None, config
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                q4k_linear(x, weight, out=out)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert check_path(out.float(), expected, "dequant") is None, f"{config}, graph replay"
            ms = triton.testing.do_bench(lambda out=out: q4k_linear(x, weight, out=out))
        record_property(f"chunk{config.CHUNK_N}_vs_cublas", round(cublas_ms / ms, 3))
        best = min(best, ms)
    record_property("sqnr_db", round(sqnr_db(out.float(), expected), 2))
    record_property("vs_cublas", round(cublas_ms / best, 3))
    record_property("vs_portable_default", round(portable_ms / best, 3))


# ---- the tuning half -------------------------------------------------------------------------


def test_tuning_problems_launch_and_pass_the_gate(device):
    info = device_info(device)
    # On a GPU, the smallest M buckets of the real keys (the large ones are the tuner's work).
    keys = [k for k in KERNEL.default_keys(info) if info.is_interpreter or k.m_bucket in (1, 16)][:2]
    assert keys and all(isinstance(k, Q4KKey) for k in keys)
    limits = KERNEL.limits(info)
    for key in keys:
        config = KERNEL.default_config(key)
        assert config.path == "portable"
        assert SPACE.infeasible_reason(config, key, limits) is None
        problem = KERNEL.make_problem(key, torch.device(device), seed=0)
        x = problem.args[0]
        out = KERNEL.launch(config, *problem.args, **problem.kwargs, out=_nan_out((x.shape[0], key.n), x))
        expected = KERNEL.reference(*problem.args, **problem.kwargs)
        assert KERNEL.check(out.float(), expected, problem, config) is None
    tiles = {name: value for name, value in SPACE.to_dict(KERNEL.default_config(keys[0])).items() if name != "path"}
    fp8 = KERNEL.launch(Fp8Config(**tiles), *problem.args)
    assert check_path(fp8.float(), KERNEL.reference(*problem.args), "fp8") is None


def test_weight_views_off_alignment_are_copied_and_still_exact(device):
    """The kernels read the packed codes as 16/32-bit words; a weight built from views that start
    at an odd byte must be copied to aligned storage, not read misaligned."""
    weight = Q4KWeight.quantize(torch.randn(64, 256, device=device) * 0.02)
    shifted = []
    for t in weight.tensors():
        flat = torch.empty(t.numel() * t.element_size() + 1, dtype=torch.uint8, device=device)
        view = flat[1:].view(t.dtype).view(t.shape) if t.element_size() == 1 else None
        if view is None:
            shifted.append(t)
            continue
        view.copy_(t)
        assert view.data_ptr() % 2 == 1
        shifted.append(view)
    moved = Q4KWeight(*shifted)
    assert all(t.data_ptr() % 16 == 0 for t in moved.tensors())
    x = torch.randn(3, 256, dtype=torch.bfloat16, device=device)
    out = torch.full((3, 64), float("nan"), dtype=torch.bfloat16, device=device)
    q4k_linear(x, moved, out=out)
    expected = q4k_linear_reference(x, weight)
    assert check_path(out, expected, "portable") is None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [100, 200])
@pytest.mark.parametrize(("k", "n"), [(14336, 4096), (4096, 4096), (4096, 6144)], ids=lambda v: str(v))
def test_gpu_portable_default_between_64_and_256_rows(k, n, m):
    """Where 128x128 tiles would leave most SMs idle (N=4096 and N=6144 at M=128), the portable
    default splits 64-row tiles along K; from M=256 up the default is the dequant path (on SM90 the
    tma path up to M=256). Whichever it picks, it serves the call, poisoned output, against the
    reference at that path's floor."""
    with settings.override(q4k_fp8=False):
        x, weight, bias = _problem(Case("portable", m, k, n, bias=True), "cuda", seed=m)
        out = _nan_out((m, n), x)
        key = KERNEL.key_for(device_info("cuda"), tuple(KERNEL.facts(x, weight, bias, out=out)))
        default = KERNEL.default_config(key)
        if key.arch == "sm90":
            # SM90 serves M=32..256 through the tma path (tests/test_q4k_tma.py); the portable rules here.
            assert isinstance(default, TmaConfig), default
            default = portable_default(key)
            idle = 2 * -(-n // 128) * -(-key.m_bucket // 128) < device_info("cuda").sm_count
            assert (default.BLOCK_M == 64) == idle, default
        elif key.m_bucket >= DEQUANT_DEFAULT_MIN_M:
            assert isinstance(default, DequantConfig), default
        else:
            idle = 2 * -(-n // 128) * -(-key.m_bucket // 128) < device_info("cuda").sm_count
            assert isinstance(default, PortableConfig) and (default.BLOCK_M == 64) == idle, default
        with use_config("q4k_fp8_gemm", SPACE.to_dict(default)):
            assert q4k_linear(x, weight, bias, out=out) is out
        assert not torch.isnan(out).any()
        assert check_path(out.float(), q4k_linear_reference(x, weight, bias), default.path) is None, default

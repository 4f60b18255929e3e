"""The Llama example's glue (``examples/llama/glue.py``): each Triton op against float64 formulas.

Residual add and RMSNorm (all rows and a row subset), RoPE with the split of the fused Q/K/V
projection, and SwiGLU, on fresh random inputs at power-of-two and other widths (head dims and
head counts whose tiles are padded), with every output NaN-filled before the kernel writes it. The
Triton ops run on the interpreter here and on the GPU tier when one is present; the PyTorch ops
(``TorchGlue``) face the same checks, so the two implementations answer to one yardstick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

from llama import glue as glue_module  # noqa: E402
from llama.layers import Rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Half a bf16 ulp, relative, plus float32 noise: one rounding of an exact float64 value.
BF16_ROUND = 2.0**-8


class _RopeShape:
    """What :class:`Rope` reads from a config."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.rope_theta = 500000.0
        self.rope_linear_factor = 2.0


#: (query heads, KV heads, head dim, hidden width, MLP width): a Llama-like shape, and one with no
#: power of two in any of them (every tile padded; an MLP row spans two SwiGLU programs, the
#: second one partial).
SHAPES = [(4, 2, 64, 256, 320), (5, 1, 48, 200, 1100)]


@pytest.fixture(autouse=True)
def _nan_outputs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every output the Triton ops allocate starts as NaN: an element a kernel skips stays NaN."""
    allocate = glue_module._output

    def poisoned(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return allocate(shape, like, dtype).fill_(float("nan"))

    monkeypatch.setattr(glue_module, "_output", poisoned)
    yield


def _glues(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> list[glue_module.GlueShape]:
    """Both glues at ``shape``: Triton's first, then PyTorch's."""
    heads, kv_heads, head_dim, _, _ = shape
    rope = Rope(_RopeShape(head_dim), None, 64, torch.device(DEVICE))  # type: ignore[arg-type]
    kinds = (glue_module.TritonGlue, glue_module.TorchGlue)
    return [kind(heads, kv_heads, head_dim, 1e-5, rope, dtype) for kind in kinds]


#: Half an ulp, relative, of each output dtype the tests use.
HALF_ULP = {torch.bfloat16: BF16_ROUND, torch.float16: 2.0**-11}


def _assert_rounded(got: torch.Tensor, want: torch.Tensor, name: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """``got`` (``dtype``) is ``want`` (float64) rounded once, give or take float32 arithmetic."""
    assert got.dtype == dtype and got.shape == want.shape, f"{name}: {got.dtype} {tuple(got.shape)}"
    got64 = got.double().cpu()
    assert torch.isfinite(got64).all(), f"{name}: non-finite (an unwritten element?)"
    bound = HALF_ULP[dtype] * want.abs() + 1e-6 * want.abs().max()
    worst = float(((got64 - want).abs() - bound).max())
    assert worst <= 0, f"{name}: off by more than a bf16 rounding ({worst:.3g} past the bound)"


def _rms_norm64(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h, weight = h.double().cpu(), weight.double().cpu()
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["pow2", "padded"])
def test_add_norm_and_norm_round_the_float64_values_once(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    width, tokens = shape[3], 9
    h = torch.randn(tokens, width, device=DEVICE) * 3
    delta = torch.randn(tokens, width, device=DEVICE).to(dtype)
    weight = torch.randn(width, device=DEVICE)
    # Every other entry of a longer index: rows with a stride.
    rows = torch.tensor([7, 5, 0, 5, 3, 1], device=DEVICE)[::2]
    added = h + delta.float()
    for glue in _glues(shape, dtype):
        name = type(glue).__name__
        _assert_rounded(glue.norm(h, weight), _rms_norm64(h, weight, 1e-5), f"{name}.norm", dtype)
        _assert_rounded(glue.norm(h, weight, rows), _rms_norm64(h[rows], weight, 1e-5), f"{name}.norm(rows)", dtype)
        h_new, x = glue.add_norm(h, delta, weight)
        assert h_new is not None and h_new.dtype == torch.float32
        assert torch.equal(h_new, added), f"{name}.add_norm: the float32 residual is not h + delta"
        _assert_rounded(x, _rms_norm64(added, weight, 1e-5), f"{name}.add_norm", dtype)
        h_none, x_rows = glue.add_norm(h, delta, weight, rows)
        assert h_none is None
        _assert_rounded(x_rows, _rms_norm64(added[rows], weight, 1e-5), f"{name}.add_norm(rows)", dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=["pow2", "padded"])
def test_rope_qkv_rotates_adjacent_pairs_of_q_and_k_and_copies_v(shape: tuple[int, ...]) -> None:
    heads, kv_heads, d, _, _ = shape
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=DEVICE).bfloat16()
    positions = torch.tensor([0, 1, 2, 17, 40, 63], device=DEVICE)
    for glue in _glues(shape):
        name = type(glue).__name__
        cos = glue.rope.cos.double().cpu()[positions.cpu()][:, None]  # [T, 1, D/2]
        sin = glue.rope.sin.double().cpu()[positions.cpu()][:, None]
        q, k, v = glue.rope_qkv(qkv, positions)
        exact = qkv.double().cpu()
        for got, first, count, label in ((q, 0, heads, "q"), (k, heads, kv_heads, "k")):
            heads_in = exact[:, first * d : (first + count) * d].view(tokens, count, d // 2, 2)
            even, odd = heads_in[..., 0], heads_in[..., 1]
            want = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
            assert got.is_contiguous()
            _assert_rounded(got, want, f"{name}.rope_qkv {label}")
        assert v.shape == (tokens, kv_heads, d)
        assert torch.equal(v.cpu(), qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d).cpu())


@pytest.mark.parametrize("shape", SHAPES, ids=["pow2", "padded"])
def test_swiglu_is_silu_of_the_gate_half_times_the_up_half(shape: tuple[int, ...]) -> None:
    ffn, tokens = shape[4], 5
    gate_up = (torch.randn(tokens, 2 * ffn, device=DEVICE) * 4).bfloat16()
    exact = gate_up.double().cpu()
    gate, up = exact[:, :ffn], exact[:, ffn:]
    want = gate * torch.sigmoid(gate) * up
    for glue in _glues(shape):
        _assert_rounded(glue.swiglu(gate_up), want, f"{type(glue).__name__}.swiglu")


def test_no_rows_launch_nothing_and_return_empty_outputs() -> None:
    glue = _glues(SHAPES[0])[0]
    weight = torch.ones(256, device=DEVICE)
    h = torch.randn(0, 256, device=DEVICE)
    h_new, x = glue.add_norm(h, h.bfloat16(), weight)
    assert h_new is not None and h_new.shape == (0, 256) and x.shape == (0, 256)
    assert glue.norm(h, weight).shape == (0, 256)
    some = torch.randn(3, 256, device=DEVICE)
    no_rows = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert glue.add_norm(some, some.bfloat16(), weight, no_rows)[1].shape == (0, 256)
    q, k, v = glue.rope_qkv(torch.empty(0, 512, device=DEVICE, dtype=torch.bfloat16), no_rows)
    assert q.shape == (0, 4, 64) and k.shape == v.shape == (0, 2, 64)
    assert glue.swiglu(torch.empty(0, 640, device=DEVICE, dtype=torch.bfloat16)).shape == (0, 320)


def test_the_triton_ops_build_for_sm90_at_the_llama3_8b_shape(tmp_path: Path) -> None:
    """The interpreter never sees what Triton's compiler refuses: build each op's launch for an
    H200 (32 query and 8 KV heads of 128, hidden 4096, MLP 14336) with Triton's own ptxas."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import sm90_build

    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    meta = torch.device("meta")
    rope = Rope(_RopeShape(128), None, 8192, meta)  # type: ignore[arg-type]
    glue = glue_module.TritonGlue(32, 8, 128, 1e-5, rope, torch.bfloat16)
    tokens = 2048
    h = torch.empty(tokens, 4096, device=meta)
    weight = torch.empty(4096, device=meta)
    with sm90_build.record_launches() as recorder:
        glue.norm(h, weight)
        glue.add_norm(h, torch.empty(tokens, 4096, device=meta, dtype=torch.bfloat16), weight)
        glue.add_norm(h, h.bfloat16(), weight, torch.empty(1, device=meta, dtype=torch.int64))
        glue.rope_qkv(
            torch.empty(tokens, 6144, device=meta, dtype=torch.bfloat16),
            torch.empty(tokens, device=meta, dtype=torch.int64),
        )
        glue.swiglu(torch.empty(tokens, 2 * 14336, device=meta, dtype=torch.bfloat16))
    records = [{**sm90_build.specialize(launch), "id": i} for i, launch in enumerate(recorder.launches)]
    assert len(records) == 5
    (tmp_path / "records.json").write_text(json.dumps(records))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), env.get("PYTHONPATH", "")])
    script = ROOT / "tests" / "sm90_build.py"
    run = subprocess.run([sys.executable, str(script), "--records", str(tmp_path / "records.json")],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(records)
    failed = {records[r["id"]]["kernel"]: r["error"] for r in results if r["error"]}
    assert not failed, failed

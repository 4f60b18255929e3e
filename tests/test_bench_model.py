"""``scripts/bench_model.py``, the end-to-end Llama benchmark: its code paths run, and its report says what it must.

The smoke run goes through every phase (file, correctness check, prefill and decode at each length,
batched serving, profile) on the Triton interpreter with a one-layer tiny model; the GPU run is the
same code at the Llama-3-8B shape. The report must never show a speedup for a model whose logits
failed their check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT / "examples", ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import _bench_model_check  # noqa: E402
import _bench_model_report as rep  # noqa: E402
import bench_model  # noqa: E402
from llama.step_profile import _union_us, classify  # noqa: E402


@pytest.mark.interpreter
def test_smoke_run_goes_through_every_phase(tmp_path: Path) -> None:
    out, js = tmp_path / "model.md", tmp_path / "model.json"
    argv = [
        "--smoke", "--layers", "1", "--lengths", "10", "--check-prompts", "1", "--serve-seqs", "2", "--profile",
        "--gguf", str(tmp_path / "tiny.gguf"), "--out", str(out), "--json", str(js),
    ]  # fmt: skip
    assert bench_model.main(argv) == 0
    text = out.read_text()
    for section in ("## Correctness", "## Prefill and decode, one sequence", "## GPU memory", "## Batched serving",
                    "## Profile: tritune", "## Profile: PyTorch bf16"):  # fmt: skip
        assert section in text, section
    assert "Command: `python" in text and "torch " in text and "triton " in text
    assert "| tritune | " in text and "| PyTorch bf16 | " in text and "\n| 10 | " in text
    record = json.loads(js.read_text())["rows"][0]
    assert [c["impl"] for c in record["checks"]] == ["tritune", "PyTorch bf16"]
    assert {(r["impl"], r["length"]) for r in record["lengths"]} == {("tritune", 10), ("PyTorch bf16", 10)}
    # A fraction of the greedy tokens (NaN or a count would fail): bf16 near-ties of random weights may differ.
    assert record["serving"]["sequences"] == 2 and 0.0 <= record["serving"]["same_tokens"] <= 1.0
    assert record["config"]["layers"] == 1
    baseline = next(r for r in record["lengths"] if r["impl"] == "PyTorch bf16")
    assert baseline["note"].startswith("decode SDPA: ")


def _results(ok: bool) -> rep.Results:
    env = {"gpu": "G", "sm_count": None, "torch": "t", "triton": "tr", "cuda": "c", "cudnn": None, "python": "p",
           "date_utc": "d", "command": "python x", "smoke": False, "q4k_fp8": False, "db": "default"}  # fmt: skip
    args = {"chunk_size": 2048, "decode_steps": 32, "run_seconds": 10.0, "check_prompts": 4}
    results = rep.Results(env=env, args=args)
    results.config = {"layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128,
                      "vocab": 32768}  # fmt: skip
    results.checks = {
        "tritune": rep.Check("tritune", 0.012 if ok else 0.5, 0.015, 1.0, 0.95, 0.9, 128),
        "PyTorch bf16": rep.Check("PyTorch bf16", 0.013, 0.015, 1.0, 0.95, 0.9, 128),
    }
    results.lengths = [
        rep.LengthRow("tritune", 512, prefill_ms=100.0, decode_ms_per_token=5.0, kv_bytes=1 << 30),
        rep.LengthRow("PyTorch bf16", 512, prefill_ms=50.0, decode_ms_per_token=10.0, kv_bytes=1 << 30),
    ]
    results.weights = {"tritune": 5 << 30, "PyTorch bf16": 15 << 30}
    return results


def test_ratios_are_tritune_over_pytorch_throughput() -> None:
    text = rep.report(_results(ok=True))
    # prefill 5120 vs 10240 tokens/s: 0.50x; decode 200 vs 100 tokens/s: 2.00x.
    assert "| 512 | 5120 | 10240 | 0.50x | 200.0 | 100.0 | 2.00x |" in text
    assert "| tritune | Q4_K (4.625 bits) | 5.00 GiB | 128.0 KiB |" in text


def test_no_ratio_is_reported_when_a_check_failed() -> None:
    text = rep.report(_results(ok=False))
    assert "x |" not in text.split("## Prefill and decode")[1].split("## GPU memory")[0]
    assert "- (check FAILED)" in text and "| tritune | 0.5000 | 0.0150 | 1.000 | 0.950 | 0.900 | 128 | FAILED |" in text


def test_a_check_takes_top1_agreement_within_bf16s_sampling_noise() -> None:
    """Relative error within twice bf16's and top-1 agreement at least the floor pass; either short fails."""
    assert rep.Check("tritune", 0.0531, 0.0626, 0.898, 0.930, 0.862, 128).ok
    assert not rep.Check("tritune", 0.0531, 0.0626, 0.850, 0.930, 0.862, 128).ok
    assert not rep.Check("tritune", 0.1300, 0.0626, 0.950, 0.930, 0.862, 128).ok


def test_tritunes_floor_follows_the_lower_of_the_two_bf16_forwards() -> None:
    """The H200 run of 2026-12-05: the reference's bf16 forward agreed on 0.961, the PyTorch bf16
    model on 0.930; tritune's 0.898 passes against the lower, not the higher."""
    from llama import top1_floor

    ours = rep.Check("tritune", 0.0552, 0.0626, 0.898, 0.961, top1_floor(0.961, 128), 128)
    peer = rep.Check("PyTorch bf16", 0.0519, 0.0626, 0.930, 0.961, top1_floor(0.961, 128), 128)
    assert not ours.ok
    rep.settle_floors({"tritune": ours}, top1_floor)
    assert not ours.ok  # without the PyTorch model's check nothing changes
    rep.settle_floors({"tritune": ours, "PyTorch bf16": peer}, top1_floor)
    assert ours.top1_floor == pytest.approx(top1_floor(0.930, 128)) and ours.ok
    assert peer.top1_floor == top1_floor(0.961, 128)
    # A PyTorch model that failed its own check is no yardstick.
    failing = rep.Check("PyTorch bf16", 0.5, 0.0626, 0.930, 0.961, top1_floor(0.961, 128), 128)
    ours.top1_floor = top1_floor(0.961, 128)
    rep.settle_floors({"tritune": ours, "PyTorch bf16": failing}, top1_floor)
    assert not ours.ok
    # A PyTorch model agreeing more than the reference's bf16 forward lowers nothing.
    high = rep.Check("PyTorch bf16", 0.05, 0.0626, 0.99, 0.961, 0.9, 128)
    ours.top1_floor = top1_floor(0.961, 128)
    rep.settle_floors({"tritune": ours, "PyTorch bf16": high}, top1_floor)
    assert not ours.ok


def test_the_report_names_the_rows_off_the_references_top1() -> None:
    results = _results(ok=True)
    results.checks["tritune"].misses = ["0:3", "1:31d"]
    results.checks["tritune"].bf16_misses = ["0:3"]
    text = rep.report(results)
    assert "- tritune: rows off the reference's top-1 (prompt:position, d = decoded): 0:3, 1:31d; " in text
    assert "PyTorch bf16 forward's: 0:3 (1 shared)" in text


def test_the_report_and_the_generators_follow_no_prefill_graphs() -> None:
    """tritune's chunks replay graphs unless ``--no-prefill-graphs``; PyTorch's chunks always run eagerly."""
    results = _results(ok=True)
    text = rep.report(results)
    assert "each chunk of 2048 tokens replays one CUDA graph" in text
    assert "chunks run eagerly as SDPA needs the cache's length on the host" in text
    results.args["no_prefill_graphs"] = True
    text = rep.report(results)
    assert "every chunk eager (--no-prefill-graphs)" in text and "replays one CUDA graph" not in text
    assert bench_model.prefill_graphs(bench_model.parser().parse_args([])) == {}
    off = bench_model.parser().parse_args(["--no-prefill-graphs"])
    assert bench_model.prefill_graphs(off) == {"prefill_graphs": False}


def test_check_rows_are_named_by_prompt_and_position_decoded_rows_marked() -> None:
    reference = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    names = _bench_model_check.row_names([[5, 6, 7], [8, 9, 10, 11]])
    assert names == ["0:0", "0:1d", "0:2d", "1:0", "1:1", "1:2d", "1:3d"]
    assert _bench_model_check.missed_rows(logits, reference, ["0:0", "0:1", "0:2d"]) == ["0:1", "0:2d"]


@pytest.mark.parametrize("text", ["1", "x,2", ""], ids=["too-short", "not-a-number", "empty"])
def test_lengths_option_refuses_what_is_not_prompt_lengths(text: str) -> None:
    with pytest.raises(SystemExit):
        bench_model.parser().parse_args(["--lengths", text])


@pytest.mark.parametrize(
    ("kernel", "group"),
    [
        ("_q4k_gemm_portable_kernel", "q4k_linear"),
        ("_quantize_rows_fp8_kernel", "q4k_linear"),
        ("_prefill_tma_kernel", "attention"),
        ("_decode_split_kernel", "attention"),
        ("_varlen_fwd_kernel", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "cuBLAS linear"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "cuBLAS linear"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "norms/rope/other"),
    ],
    ids=["q4k", "q4k-quantize", "prefill", "decode", "varlen", "flash", "efficient", "cublas", "nvjet", "elementwise"],
)
def test_profile_groups_kernels_by_name(kernel: str, group: str) -> None:
    assert classify(kernel) == group


def test_profile_busy_time_counts_overlaps_once() -> None:
    assert _union_us([(0.0, 10.0), (5.0, 12.0), (20.0, 25.0), (21.0, 22.0)]) == 17.0


# ---- the PyTorch baseline's decode layout ----------------------------------------------------------


@pytest.fixture(scope="module")
def torch_baseline(tmp_path_factory: pytest.TempPathFactory):
    import llama
    import make_llama_gguf as maker

    path = maker.make_llama_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", maker.PRESETS["tiny"], seed=0)
    return llama.TorchLlamaModel(*llama.load_gguf(path, device="cpu"), max_positions=64)


def test_torch_baseline_decode_chooses_layout_and_backend(torch_baseline) -> None:
    """The baseline decode tries [B, Hq, 1, D] with enable_gqa beside the folded layout, each checked on the other."""
    import llama
    from llama.torch_model import DECODE_LAYOUTS, DEFAULT_DECODE

    prompt = [5, 17, 300, 2, 99, 45, 7]
    folded = llama.TorchGenerator(torch_baseline, max_len=32, graphs=False)
    assert folded.decode_backend == DEFAULT_DECODE
    expected = folded.generate(prompt, 4)

    chosen = llama.TorchGenerator(torch_baseline, max_len=32, graphs=False)
    chosen.prefill(prompt)
    # A stand-in clock: every pair takes as long, so the first that runs and is right wins.
    results = chosen.choose_decode_backend(lambda fn: (fn(), 1.0)[1])
    assert {name.split("/")[0] for name in results} == set(DECODE_LAYOUTS)
    assert isinstance(results["gqa/math"], float) and isinstance(results["folded/math"], float)
    assert chosen.decode_backend in results and chosen.decode_backend.startswith("gqa/")

    gqa = llama.TorchGenerator(torch_baseline, max_len=32, graphs=False)
    gqa.decode_backend = "gqa/math"
    assert gqa.generate(prompt, 4) == expected
    with pytest.raises(ValueError, match="decode choice 'rows/math'"):
        llama.torch_model.decode_choice("rows/math")

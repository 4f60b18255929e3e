"""The Llama example (``examples/llama``) against a plain PyTorch forward of the same weights.

A tiny random Llama file (``scripts/make_llama_gguf.py``'s ``tiny`` preset: 2 layers, hidden 256,
4 query and 2 KV heads of 64, Llama-3 RoPE scaling) is loaded and run through tritune's kernels:
prefill in one and in several chunks, greedy decode steps, and batched steps that mix prefill
chunks with decode tokens while sequences are admitted, cloned and removed. Every logit is compared
with ``reference_logits`` in float64 over the same exactly dequantized weights.

The bound is the one the kernel tests use for attention: no more than twice the error of PyTorch's
own bf16 forward (``reference_logits(dtype=torch.bfloat16)``) against float64. Both lose about the
same: bf16 rounding of every activation at a kernel's input and output (2^-9 relative), and the
portable Q4_K path's bf16 dot products (at least 40 dB SQNR, about 1% relative per linear, well
inside ggml's NMSE <= 5e-4); the example keeps its residual stream in float32, PyTorch's recipe
keeps it in bf16. Measured 2026-12-04 on the interpreter: 1.5-1.9% for the model against 1.5-1.8%
for PyTorch's bf16, and on an H200 1.2-1.4% against 1.5-1.8%; top-1 agreement 100% on both.

Corrupt files are refused with a ValueError naming the tensor or key.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT / "examples", ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import llama  # noqa: E402
import make_llama_gguf as maker  # noqa: E402

from tritune.kernels import use_config  # noqa: E402

log = logging.getLogger(__name__)

#: The kernels run on a GPU when there is one (the tests below pass ``graphs=False`` to compare
#: eager steps; the GPU tier checks the captured ones), else on the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: The interpreter runs a launch's programs one after another in Python, so fewer, larger Q4_K
#: tiles run the same portable kernel in a fraction of the default tiles' time.
FAST_Q4K = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128}
PROMPT = [5, 17, 300, 2, 99, 45, 7, 8, 9, 120, 444]


@pytest.fixture(autouse=True)
def _fast_q4k_tiles() -> Iterator[None]:
    if DEVICE == "cuda":
        yield
        return
    with use_config("q4k_fp8_gemm", FAST_Q4K):
        yield


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return maker.make_llama_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", maker.PRESETS["tiny"], seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_file: Path) -> tuple[llama.LlamaConfig, llama.LlamaWeights]:
    return llama.load_gguf(tiny_file, device=DEVICE)


@pytest.fixture(scope="module")
def model(loaded: tuple[llama.LlamaConfig, llama.LlamaWeights]) -> llama.LlamaModel:
    return llama.LlamaModel(*loaded, max_positions=64)


@pytest.fixture(scope="module")
def reference(loaded: tuple[llama.LlamaConfig, llama.LlamaWeights]) -> Callable[..., torch.Tensor]:
    cache: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def logits(tokens: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        key = (tuple(tokens), dtype)
        if key not in cache:
            cache[key] = llama.reference_logits(*loaded, tokens, dtype=dtype)
        return cache[key]

    return logits


def _check(
    name: str, got: list[torch.Tensor], rows: list[tuple[list[int], slice]], reference: Callable[..., torch.Tensor]
) -> None:
    """Compare each of ``got`` with the reference rows of its ``(tokens, positions)``, all together."""
    ours = torch.cat([g.double().cpu() for g in got])
    exact = torch.cat([reference(tokens)[positions] for tokens, positions in rows])
    bf16 = torch.cat([reference(tokens, torch.bfloat16)[positions].double() for tokens, positions in rows])
    err, bf16_err = _rel(ours, exact), _rel(bf16, exact)
    top1 = float((ours.argmax(-1) == exact.argmax(-1)).double().mean())
    bf16_top1 = float((bf16.argmax(-1) == exact.argmax(-1)).double().mean())
    floor = llama.top1_floor(bf16_top1, len(ours))
    log.info("%s: rel. error %.4f (PyTorch bf16 %.4f), top-1 agreement %.3f (PyTorch bf16 %.3f) over %d rows",
             name, err, bf16_err, top1, bf16_top1, len(ours))  # fmt: skip
    assert torch.isfinite(ours).all()
    assert err <= 2 * bf16_err, f"{name}: relative error {err:.4f} exceeds twice PyTorch bf16's {bf16_err:.4f}"
    assert top1 >= floor, f"{name}: top-1 agreement {top1:.3f}, below {floor:.3f} (PyTorch bf16 {bf16_top1:.3f})"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


# ---- the file and the loader ---------------------------------------------------------------------


def test_top1_floor_is_bf16s_agreement_less_sampling_noise() -> None:
    """0.9, or PyTorch bf16's own agreement less three binomial standard errors where that is lower."""
    assert llama.top1_floor(1.0, 128) == 0.9
    assert llama.top1_floor(0.95, 100_000) == 0.9
    assert llama.top1_floor(0.93, 128) == pytest.approx(0.93 - 3 * (0.93 * 0.07 / 128) ** 0.5)
    assert 0.86 < llama.top1_floor(0.93, 128) < 0.87
    assert llama.top1_floor(0.5, 4) < 0.0  # four rows say nothing


def test_loader_reads_the_tiny_preset(loaded: tuple[llama.LlamaConfig, llama.LlamaWeights]) -> None:
    config, weights = loaded
    shape = maker.PRESETS["tiny"]
    assert (config.layers, config.hidden, config.ffn, config.heads, config.kv_heads, config.head_dim, config.vocab) == (
        shape.layers, shape.hidden, shape.ffn, shape.heads, shape.kv_heads, shape.dim, shape.vocab,
    )  # fmt: skip
    assert (config.context, config.rope_theta, config.rope_linear_factor) == (shape.context, shape.rope_theta, 1.0)
    assert config.rms_eps == pytest.approx(shape.rms_eps)
    layer = weights.layers[1]
    assert layer.attn_q.shape == (256, 256) and layer.attn_k.shape == (128, 256) and layer.ffn_down.shape == (256, 512)
    assert weights.token_embd.shape == (512, 256) and weights.token_embd.dtype == torch.float32
    assert weights.device.type == DEVICE
    assert isinstance(weights.output, llama.loader.Q4KWeight) and weights.output.shape == (512, 256)
    # Llama-3 scaling: the highest frequencies kept, the lowest divided by the full factor, a blend between.
    factors = None if weights.rope_freq_factors is None else weights.rope_freq_factors.cpu()
    assert factors is not None and factors.shape == (32,)
    assert factors[0] == 1.0 and factors[-1] == shape.rope_factor and bool((factors.diff() >= 0).all())
    assert 1.0 < float(factors[factors < shape.rope_factor].max()) < shape.rope_factor


def test_script_options_override_the_preset(tmp_path: Path) -> None:
    out = tmp_path / "small.gguf"
    maker.main(["--out", str(out), "--layers", "1", "--ffn", "256", "--vocab", "64", "--rope-scaling", "linear",
                "--rope-factor", "2", "--output-type", "f32", "--embedding-type", "f32", "--seed", "3"])  # fmt: skip
    config, weights = llama.load_gguf(out)
    assert (config.layers, config.ffn, config.vocab, config.rope_linear_factor) == (1, 256, 64, 2.0)
    assert weights.rope_freq_factors is None
    assert isinstance(weights.output, torch.Tensor) and weights.output.shape == (64, 256)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("hidden", 200, "hidden"), ("kv_heads", 3, "kv_heads"), ("rope_scaling", "yarn", "rope_scaling")],
    ids=["hidden-not-q4k", "gqa", "rope-scaling"],
)
def test_script_refuses_shapes_a_file_cannot_have(field: str, value: Any, named: str) -> None:
    import dataclasses

    with pytest.raises(ValueError, match=named):
        maker.llama_tensors(dataclasses.replace(maker.PRESETS["tiny"], **{field: value}))


def _rewrite(
    src: Path,
    dst: Path,
    *,
    metadata: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    tensors: dict[str, maker.TensorPlan] | None = None,
    extra: tuple[maker.TensorPlan, ...] = (),
) -> Path:
    """A copy of ``src`` with metadata entries set (None: dropped), tensors dropped, replaced or added."""
    reader = GGUFReader(src)
    meta: maker.Metadata = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            types = field.types
            meta[key] = (field.contents(), types[0]) if len(types) == 1 else (field.contents(), types[0], types[-1])
    for key, entry in (metadata or {}).items():
        if entry is None:
            del meta[key]
        else:
            meta[key] = entry
    plans = []
    for t in reader.tensors:
        if t.name in drop:
            continue
        if tensors and t.name in tensors:
            plans.append(tensors[t.name])
            continue
        data = np.array(t.data)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        plans.append(maker.TensorPlan(t.name, shape, t.tensor_type, lambda data=data: data))
    return maker.write_gguf(dst, meta, [*plans, *extra])


def _f32(name: str, shape: tuple[int, ...]) -> maker.TensorPlan:
    return maker.TensorPlan(name, shape, GGMLQuantizationType.F32, lambda: np.zeros(shape, dtype=np.float32))


def _q4k_rows(src: Path, name: str, as_name: str) -> maker.TensorPlan:
    tensor = next(t for t in GGUFReader(src).tensors if t.name == name)
    data = np.array(tensor.data)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return maker.TensorPlan(as_name, shape, GGMLQuantizationType.Q4_K, lambda: data)


BAD_FILES: dict[str, tuple[dict[str, Any], str]] = {
    "missing-tensor": ({"drop": ("blk.1.ffn_up.weight",)}, r"blk\.1\.ffn_up\.weight: missing"),
    # Named as the tensor, not as llama.vocab_size, which would fall back to its rows.
    "missing-embedding": (
        {"drop": ("token_embd.weight",), "metadata": {"llama.vocab_size": None}},
        r"token_embd\.weight: missing",
    ),
    # llama.cpp adds attention biases where a file has them: dropping them would run another model.
    "attention-bias": (
        {"extra": (_f32("blk.0.attn_q.bias", (256,)), _f32("blk.0.attn_k.bias", (128,)))},
        r"blk\.0\.attn_q\.bias: attention biases are not supported",
    ),
    # llama.cpp refuses a file with more tensors than its block count uses.
    "blocks-past-block-count": (
        {"metadata": {"llama.block_count": (1, GGUFValueType.UINT32)}},
        r"blk\.1\.attn_norm\.weight: block 1 is past llama\.block_count=1",
    ),
    "linear-not-q4k": (
        {"tensors": {"blk.0.attn_q.weight": _f32("blk.0.attn_q.weight", (256, 256))}},
        r"blk\.0\.attn_q\.weight: stored as F32, expected Q4_K",
    ),
    "norm-not-float": ({"q4k_norm": "output_norm.weight"}, r"output_norm\.weight: stored as Q4_K, expected one of F32"),
    "wrong-shape": ({"q4k_as": ("blk.0.attn_q.weight", "blk.0.attn_k.weight")}, r"blk\.0\.attn_k\.weight: shape"),
    "unknown-architecture": (
        {"metadata": {"general.architecture": ("gpt2", GGUFValueType.STRING)}},
        "general.architecture",
    ),
    "missing-key": ({"metadata": {"llama.block_count": None}}, r"llama\.block_count: missing"),
    "key-of-wrong-type": (
        {"metadata": {"llama.block_count": ("2", GGUFValueType.STRING)}},
        r"llama\.block_count: expected a positive integer",
    ),
    "moe": ({"metadata": {"llama.expert_count": (8, GGUFValueType.UINT32)}}, r"llama\.expert_count"),
    "unsupported-rope-scaling": (
        {"metadata": {"llama.rope.scaling.type": ("yarn", GGUFValueType.STRING)}},
        r"llama\.rope\.scaling\.type",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES), ids=list(BAD_FILES))
def test_bad_files_are_refused_naming_the_tensor_or_key(case: str, tiny_file: Path, tmp_path: Path) -> None:
    edits, message = BAD_FILES[case]
    edits = dict(edits)
    if "q4k_as" in edits:
        name, as_name = edits.pop("q4k_as")
        edits["tensors"] = {as_name: _q4k_rows(tiny_file, name, as_name)}
    if "q4k_norm" in edits:
        # One Q4_K row of 256 values: a norm of the right length in a type norms never have.
        name = edits.pop("q4k_norm")
        row = _q4k_rows(tiny_file, "blk.0.attn_q.weight", name).make()[0]
        edits["tensors"] = {name: maker.TensorPlan(name, (256,), GGMLQuantizationType.Q4_K, lambda: row)}
    bad = _rewrite(tiny_file, tmp_path / f"{case}.gguf", **edits)
    with pytest.raises(ValueError, match=message):
        llama.load_gguf(bad)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        llama.load_gguf(path)


def test_a_header_that_ends_early_is_refused_naming_the_file(tmp_path: Path) -> None:
    # GGUF v3 announcing one tensor and no metadata, then nothing: gguf's reader indexes past the end.
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 0))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: not a readable GGUF file"):
        llama.load_gguf(path)


def _config_of(tmp_path: Path, edits: dict[str, Any], shape: maker.LlamaShape | None = None) -> llama.LlamaConfig:
    """The config read from ``shape``'s metadata (default: the tiny preset's) with ``edits`` (None: dropped)."""
    meta = maker.llama_metadata(shape or maker.PRESETS["tiny"])
    for key, entry in edits.items():
        if entry is None:
            meta.pop(key, None)
        else:
            meta[key] = entry
    path = maker.write_gguf(tmp_path / "meta.gguf", meta, [])
    return llama.config_from_gguf(GGUFReader(path))


def test_optional_entries_fall_back_as_llama_cpp_does(tiny_file: Path, tmp_path: Path) -> None:
    # No output.weight: the head is the embedding. No llama.vocab_size: the embedding's rows.
    lean = _rewrite(tiny_file, tmp_path / "lean.gguf", drop=("output.weight",), metadata={"llama.vocab_size": None})
    config, weights = llama.load_gguf(lean)
    assert config.vocab == 512
    assert weights.output is weights.token_embd
    # No head_count_kv: as many KV heads as query heads. No rope.freq_base: 10000.
    shape = dataclasses.replace(maker.PRESETS["tiny"], kv_heads=4, rope_theta=500000.0)
    config = _config_of(tmp_path, {"llama.attention.head_count_kv": None, "llama.rope.freq_base": None}, shape)
    assert (config.heads, config.kv_heads, config.rope_theta) == (4, 4, 10000.0)


def test_a_dense_file_may_record_zero_experts(tmp_path: Path) -> None:
    u32 = GGUFValueType.UINT32
    config = _config_of(tmp_path, {"llama.expert_count": (0, u32), "llama.expert_used_count": (0, u32)})
    assert config.layers == 2


F32 = GGUFValueType.FLOAT32
ROPE_SCALING_CASES: dict[str, tuple[dict[str, Any], float]] = {
    "typed-linear": (
        {"llama.rope.scaling.type": ("linear", GGUFValueType.STRING), "llama.rope.scaling.factor": (4.0, F32)},
        4.0,
    ),
    "untyped-factor": ({"llama.rope.scaling.factor": (4.0, F32)}, 4.0),
    "older-scale-linear": ({"llama.rope.scale_linear": (4.0, F32)}, 4.0),
    "factor-before-older-key": ({"llama.rope.scaling.factor": (4.0, F32), "llama.rope.scale_linear": (2.0, F32)}, 4.0),
    "linear-without-factor": ({"llama.rope.scaling.type": ("linear", GGUFValueType.STRING)}, 1.0),
    "zero-factor": ({"llama.rope.scaling.factor": (0.0, F32)}, 1.0),
    "none-ignores-factor": (
        {"llama.rope.scaling.type": ("none", GGUFValueType.STRING), "llama.rope.scaling.factor": (4.0, F32)},
        1.0,
    ),
    "nothing": ({}, 1.0),
}


@pytest.mark.parametrize("case", list(ROPE_SCALING_CASES), ids=list(ROPE_SCALING_CASES))
def test_rope_scaling_reads_as_llama_cpp_does(case: str, tmp_path: Path) -> None:
    """A missing type is "linear"; the factor is rope.scaling.factor, else rope.scale_linear, else (or 0) none."""
    edits, factor = ROPE_SCALING_CASES[case]
    assert _config_of(tmp_path, edits).rope_linear_factor == factor


def test_a_negative_rope_factor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"llama\.rope\.scale_linear: expected a positive"):
        _config_of(tmp_path, {"llama.rope.scale_linear": (-2.0, F32)})


# ---- the model against the reference -------------------------------------------------------------


def test_prefill_in_one_chunk_then_greedy_decode_steps(model: llama.LlamaModel, reference: Any) -> None:
    generator = llama.Generator(model, max_len=32, chunk_size=32, graphs=False)
    prefill = generator.prefill(PROMPT, all_logits=True)
    assert prefill.shape == (len(PROMPT), 512) and generator.length == len(PROMPT)
    tokens = [*PROMPT, int(prefill[-1].argmax())]
    steps = []
    for _ in range(3):
        steps.append(generator.decode(tokens[-1] if len(steps) == 0 else None).clone())
        # The step's greedy choice stays on the device as the next step's input.
        assert int(generator.next_token) == int(steps[-1].argmax())
        tokens.append(int(generator.next_token))
    assert generator.length == len(PROMPT) + 3
    full = tokens[:-1]
    _check("prefill, one chunk", [prefill], [(PROMPT, slice(None))], reference)
    _check("decode steps", steps, [(full, slice(len(PROMPT) + i, len(PROMPT) + i + 1)) for i in range(3)], reference)


def test_pytorch_glue_serves_the_same_model_and_an_unknown_glue_is_refused(
    loaded: tuple[llama.LlamaConfig, llama.LlamaWeights], model: llama.LlamaModel, reference: Any
) -> None:
    with pytest.raises(ValueError, match="glue: expected one of"):
        llama.LlamaModel(*loaded, max_positions=64, glue="numpy")
    torch_glue = llama.LlamaModel(*loaded, max_positions=64, glue="torch")
    assert type(model.glue) is llama.TritonGlue and type(torch_glue.glue) is llama.TorchGlue
    logits = {}
    for name, candidate in (("triton glue", model), ("torch glue", torch_glue)):
        generator = llama.Generator(candidate, max_len=32, chunk_size=8, graphs=False)
        logits[name] = generator.prefill(PROMPT, all_logits=True)
        _check(f"prefill, {name}", [logits[name]], [(PROMPT, slice(None))], reference)
    # The two glues compute the same float32 formulas: their logits differ by rounding order only.
    assert _rel(logits["triton glue"].double().cpu(), logits["torch glue"].double().cpu()) < 1e-2


def test_prefill_in_chunks_over_a_growing_cache(model: llama.LlamaModel, reference: Any) -> None:
    generator = llama.Generator(model, max_len=32, chunk_size=4, graphs=False)
    logits = generator.prefill(PROMPT, all_logits=True)
    assert logits.shape == (len(PROMPT), 512)
    _check("prefill, chunks of 4", [logits], [(PROMPT, slice(None))], reference)


#: Past every attention kernel's KV tile (at most 128 positions) and past the tiny preset's original
#: RoPE context (64), where Llama-3 scaling changes the low frequencies' rotations.
LONG_PROMPT = np.random.default_rng(3).integers(0, 512, 150).tolist()


def test_a_context_over_several_kv_tiles(loaded: tuple[llama.LlamaConfig, llama.LlamaWeights], reference: Any) -> None:
    """Chunked prefill of 150 positions, then decode steps that attend over all of them."""
    model = llama.LlamaModel(*loaded, max_positions=160)
    generator = llama.Generator(model, max_len=160, chunk_size=64, graphs=False)
    prefill = generator.prefill(LONG_PROMPT, all_logits=True)
    tokens = [*LONG_PROMPT, int(prefill[-1].argmax())]
    steps = []
    for _ in range(3):
        steps.append(generator.decode(tokens[-1] if not steps else None).clone())
        tokens.append(int(generator.next_token))
    assert generator.length == len(LONG_PROMPT) + 3
    full, start = tokens[:-1], len(LONG_PROMPT)
    rows = [(full, slice(0, start)), *[(full, slice(start + i, start + i + 1)) for i in range(3)]]
    _check("150 positions, chunks of 64, then decode", [prefill, *steps], rows, reference)


def test_batched_steps_admit_clone_and_remove_sequences(model: llama.LlamaModel, reference: Any) -> None:
    server = llama.BatchedServer(model, max_seqs=4, capacity=32, max_step=6, graphs=False)
    a_tokens, b_tokens, c_tokens = PROMPT, [3, 1, 4, 1, 5], [200, 100, 50, 25, 12, 6]
    a, b = server.add(), server.add()
    got, rows = [], []

    # A prefill chunk next to a shorter one (9 tokens in a 16-wide step).
    # Each step's logits are views of its width's static buffer: keep copies.
    first = server.step([(a, a_tokens[:6]), (b, b_tokens[:3])], all_logits=True)
    got += [logits.clone() for logits in first]
    rows += [(a_tokens, slice(0, 6)), (b_tokens, slice(0, 3))]
    # A's last chunk, B decodes one token, C is admitted with its first chunk.
    c = server.add()
    second = server.step([(a, a_tokens[6:]), (b, b_tokens[3:4]), (c, c_tokens[:4])], all_logits=True)
    got += [logits.clone() for logits in second]
    rows += [(a_tokens, slice(6, None)), (b_tokens, slice(3, 4)), (c_tokens, slice(0, 4))]
    assert [server.length(s) for s in (a, b, c)] == [11, 4, 4]
    # D forks A; B leaves. A and D continue differently, C decodes: last-token logits only.
    d = server.clone(a)
    server.remove(b)
    third = server.step([(c, c_tokens[4:5]), (a, [7]), (d, [8])])
    assert [t.shape for t in third] == [(1, 512)] * 3
    got += third
    rows += [(c_tokens[:5], slice(4, 5)), ([*a_tokens, 7], slice(11, 12)), ([*a_tokens, 8], slice(11, 12))]
    _check("batched steps", got, rows, reference)
    assert sorted(server.cache.seqs()) == sorted([a, c, d])


def test_last_token_steps_run_the_head_on_no_more_rows_than_the_step(
    model: llama.LlamaModel, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of width ``w`` has at most ``w`` last tokens: the head runs on ``min(w, max_seqs)`` rows."""
    head_rows: list[int] = []
    forward = model.forward

    def spy(*args: Any, logit_rows: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        head_rows.append(-1 if logit_rows is None else len(logit_rows))
        return forward(*args, logit_rows=logit_rows, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    server = llama.BatchedServer(model, max_seqs=8, capacity=32, max_step=4, graphs=False)
    a, b = server.add(), server.add()
    whole = server.step([(a, PROMPT[:4])], all_logits=True)[0].clone()
    last = server.step([(b, PROMPT[:4])])[0].clone()
    decode = server.step([(a, [PROMPT[4]])])[0].clone()
    pair = [t.clone() for t in server.step([(a, [PROMPT[5]]), (b, [PROMPT[4]])])]
    assert head_rows == [4, 4, 1, 2]
    # The same rows as with all logits, and as the reference's.
    assert torch.equal(last, whole[-1:])
    assert torch.equal(pair[1], decode)
    rows = [(PROMPT, slice(0, 4)), (PROMPT, slice(4, 5)), (PROMPT, slice(5, 6))]
    _check("last-token steps", [whole, decode, pair[0]], rows, reference)


def test_serve_greedy_continues_each_prompt_as_the_reference_does(model: llama.LlamaModel, reference: Any) -> None:
    server = llama.BatchedServer(model, max_seqs=2, capacity=16, max_step=8, graphs=False)
    prompts = [[11, 22, 33], [40, 41, 42, 43, 44, 45, 46]]
    outputs = llama.serve_greedy(server, prompts, max_new_tokens=2)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out) == 2
        for i, token in enumerate(out):
            # Each choice is the reference's best, up to a near tie: the model's logits are bf16
            # (steps of 1/64 at 3.5), so it may pick a token within PyTorch bf16's own logit error
            # of the best.
            prefix = [*prompt, *out[:i]]
            exact, bf16 = reference(prefix)[-1], reference(prefix, torch.bfloat16)[-1].double()
            slack = 2 * float((bf16 - exact).abs().max())
            assert float(exact[token]) >= float(exact.max()) - slack, f"{prompt}: token {i} is {token}"
    assert server.cache.seqs() == []


# ---- the plain PyTorch baseline ------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_model(loaded: tuple[llama.LlamaConfig, llama.LlamaWeights]) -> llama.TorchLlamaModel:
    return llama.TorchLlamaModel(*loaded, max_positions=64)


def test_torch_baseline_runs_dense_bf16_weights(torch_model: llama.TorchLlamaModel, model: llama.LlamaModel) -> None:
    block = torch_model.blocks[0]
    assert all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in block.weights())
    assert block.qkv.shape == (256 + 2 * 128, 256) and block.gate_up.shape == (2 * 512, 256)
    assert isinstance(torch_model.head, torch.Tensor) and torch_model.head.dtype == torch.bfloat16
    # 16 bits a linear weight against Q4_K's 4.625; the float32 embedding and the norms are shared.
    linears = sum(w.numel() for block in torch_model.blocks for w in block.weights()) + torch_model.head.numel()
    assert torch_model.weight_bytes() - model.weight_bytes() == pytest.approx(linears * (2 - 4.625 / 8))


def test_torch_baseline_prefill_and_decode_match_the_reference(
    torch_model: llama.TorchLlamaModel, reference: Any
) -> None:
    whole = llama.TorchGenerator(torch_model, max_len=32, chunk_size=32, graphs=False)
    chunked = llama.TorchGenerator(torch_model, max_len=32, chunk_size=4, graphs=False)
    prefill = whole.prefill(PROMPT, all_logits=True)
    prefill_chunks = chunked.prefill(PROMPT, all_logits=True)
    tokens = [*PROMPT, int(prefill[-1].argmax())]
    steps = []
    for _ in range(3):
        steps.append(whole.decode(tokens[-1] if not steps else None).clone())
        tokens.append(int(whole.next_token))
    full = tokens[:-1]
    _check("baseline prefill, one chunk", [prefill], [(PROMPT, slice(None))], reference)
    _check("baseline prefill, chunks of 4", [prefill_chunks], [(PROMPT, slice(None))], reference)
    _check("baseline decode", steps, [(full, slice(len(PROMPT) + i, len(PROMPT) + i + 1)) for i in range(3)], reference)


def test_truncate_replays_decode_steps_at_the_same_context(model: llama.LlamaModel) -> None:
    generator = llama.Generator(model, max_len=32, chunk_size=32, graphs=False)
    generator.prefill(PROMPT)
    first = generator.decode(7).clone()
    generator.truncate(len(PROMPT))
    assert generator.length == len(PROMPT)
    assert torch.equal(generator.decode(7), first)
    with pytest.raises(ValueError, match="length"):
        generator.truncate(len(PROMPT) + 5)


# ---- prefill chunks replayed from graphs (the capture faked on the CPU) ---------------------------


class _FakeGraph:
    """A captured step as the CPU can have one: ``replay()`` runs the step again on its static buffers."""

    def __init__(self, step: Callable[[], None]) -> None:
        self.step = step

    def replay(self) -> None:
        self.step()


#: Each capture as it happens: the forward's token count, whether it ran the head on every row,
#: and the memory pool the capture was given.
Captures = list[tuple[int, bool, object]]


@pytest.fixture
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> Callable[[llama.LlamaModel], Captures]:
    """Stand in for ``run_then_capture`` (the step runs once, as the real one's first run does) and
    record what ``model``'s captured steps run."""

    def install(model: llama.LlamaModel) -> Captures:
        pool, forwards, captures = object(), [], []
        forward = model.forward

        def spy(tokens: torch.Tensor, *args: Any, logit_rows: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
            forwards.append((tokens.shape[0], logit_rows is None))
            return forward(tokens, *args, logit_rows=logit_rows, **kw)

        def capture(step: Callable[[], None], device: torch.device, pool: object = None) -> _FakeGraph:
            step()
            captures.append((*forwards[-1], pool))
            return _FakeGraph(step)

        monkeypatch.setattr(model, "forward", spy)
        monkeypatch.setattr(llama.generate, "run_then_capture", capture)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pool)
        return captures

    return install


def _poison_free_positions(generator: llama.Generator) -> None:
    """NaN in every cache position past ``length``: a chunk that reads past its ``kv_len`` shows it."""
    for t in (*generator.cache.k, *generator.cache.v):
        t[:, :, generator.length :] = float("nan")


def test_prefill_graphs_replay_full_chunks_at_any_start(
    model: llama.LlamaModel, fake_capture: Callable[[llama.LlamaModel], Captures]
) -> None:
    """Chunks of three prompts in a row (the later ones starting mid-cache, off the chunk grid)
    replay one graph per (graph length, logits mode) and give the eager chunks' logits and cache;
    a 3-token tail replays the 4-token graph, padded."""
    captures = fake_capture(model)
    graphed = llama.Generator(model, max_len=40, chunk_size=4, graphs=True)
    eager = llama.Generator(model, max_len=40, chunk_size=4, graphs=False)
    assert graphed.prefill_graphs and not eager.prefill_graphs
    rng = np.random.default_rng(5)
    prompts = [(PROMPT, True), (rng.integers(0, 512, 9).tolist(), False), (rng.integers(0, 512, 10).tolist(), True)]
    for prompt, all_logits in prompts:
        got = []
        for generator in (graphed, eager):
            _poison_free_positions(generator)
            got.append(generator.prefill(prompt, all_logits=all_logits).clone())
        assert got[0].shape == (len(prompt) if all_logits else 1, 512) and torch.isfinite(got[0]).all()
        assert torch.equal(got[0], got[1]), f"logits of a {len(prompt)}-token prefill ending at {eager.length}"
    assert graphed.length == eager.length == 30
    for layer in range(model.config.layers):
        assert torch.equal(graphed.cache.k[layer][:, :, :30], eager.cache.k[layer][:, :, :30])
        assert torch.equal(graphed.cache.v[layer][:, :, :30], eager.cache.v[layer][:, :, :30])
    steps = [(graphed.decode(7).clone(), eager.decode(7).clone()), (graphed.decode().clone(), eager.decode().clone())]
    assert all(torch.equal(a, b) for a, b in steps)
    # One graph per (graph length, all_logits): the 11-token prompt's tail of 3 padded to 4, the
    # 9-token one's tail of 1 and the 10-token one's of 2 at their own lengths; then the decode step.
    # All in one memory pool.
    assert [capture[:2] for capture in captures] == [(4, True), (4, False), (1, False), (2, True), (1, True)]
    assert len({id(capture[2]) for capture in captures}) == 1 and captures[0][2] is not None


@pytest.mark.parametrize(
    "count, start, length",
    [(16, 0, 16), (1, 0, 1), (3, 0, 4), (4, 5, 4), (5, 0, 8), (9, 0, 12), (13, 0, 16), (15, 40, 16), (15, 41, None)],
)
def test_graph_length_pads_a_short_chunk_within_the_cache(
    model: llama.LlamaModel,
    fake_capture: Callable[[llama.LlamaModel], Captures],
    count: int,
    start: int,
    length: int | None,
) -> None:
    """Powers of two up to ``graph_multiple``, its multiples above (at most ``chunk_size``), and
    eager where the padding would run past the cache's ``max_len``."""
    fake_capture(model)
    generator = llama.Generator(model, max_len=56, chunk_size=16, graphs=True, graph_multiple=4)
    assert generator.graph_length(count, start) == length
    generator.prefill_graphs = False
    assert generator.graph_length(count, start) is None


def test_padded_chunks_match_the_eager_ones_and_leave_the_cache_past_length_unread(
    model: llama.LlamaModel, fake_capture: Callable[[llama.LlamaModel], Captures]
) -> None:
    """Tails padded to 8 and 12 tokens (graph_multiple 4, chunk 12) give the eager logits; the
    padding's cache writes past ``length`` are overwritten before anything reads them (NaN
    poisoned in between), and a tail whose padding would pass ``max_len`` runs eagerly."""
    captures = fake_capture(model)
    graphed = llama.Generator(model, max_len=30, chunk_size=12, graphs=True, graph_multiple=4)
    eager = llama.Generator(model, max_len=30, chunk_size=12, graphs=False)
    rng = np.random.default_rng(11)
    # 7 tokens (padded to 8), 9 (to 12) from position 7, then 13 more from 16: a full chunk of 12
    # and one token at 28 whose graph length (1) fits; a decode step reads every position before it.
    for count, all_logits in ((7, False), (9, True), (13, False)):
        prompt = rng.integers(0, 512, count).tolist()
        got = []
        for generator in (graphed, eager):
            _poison_free_positions(generator)
            got.append(generator.prefill(prompt, all_logits=all_logits).clone())
        assert torch.isfinite(got[0]).all() and got[0].shape == got[1].shape
        torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-5)
    assert graphed.length == eager.length == 29
    torch.testing.assert_close(graphed.decode(3).clone(), eager.decode(3).clone(), rtol=1e-5, atol=1e-5)
    assert [capture[:2] for capture in captures] == [(8, False), (12, True), (12, False), (1, False), (1, True)]
    # The padded graphs replayed with other counts at other starts: 5 tokens in the 8-token graph
    # from position 3, then 10 in the 12-token graph (every row) from 8.
    for count, all_logits in ((5, False), (10, True)):
        prompt = rng.integers(0, 512, count).tolist()
        got = []
        for generator in (graphed, eager):
            if count == 5:
                generator.truncate(3)
            _poison_free_positions(generator)
            got.append(generator.prefill(prompt, all_logits=all_logits).clone())
        assert torch.isfinite(got[0]).all() and got[0].shape == got[1].shape
        torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-5)
    assert len(captures) == 5
    # Nine more tokens fill the cache to 27 (the 12-token graph again); then three free positions:
    # a 3-token tail's graph length (4) would pass max_len, so it runs eagerly.
    graphed.prefill(rng.integers(0, 512, 9).tolist())
    assert graphed.length == 27 and graphed.graph_length(3, 27) is None
    graphed.prefill([1, 2, 3])
    assert len(captures) == 5 and graphed.length == 30


def test_torch_baseline_never_captures_prefill_chunks(
    torch_model: llama.TorchLlamaModel, fake_capture: Callable[[llama.LlamaModel], Captures]
) -> None:
    """Its SDPA slices the cache to a host length: a replayed chunk would keep the capture's."""
    captures = fake_capture(torch_model)
    with pytest.raises(ValueError, match="prefill_graphs"):
        llama.TorchGenerator(torch_model, max_len=32, chunk_size=4, graphs=True, prefill_graphs=True)
    generator = llama.TorchGenerator(torch_model, max_len=32, chunk_size=4, graphs=True)
    assert not generator.prefill_graphs
    generator.prefill(PROMPT)
    generator.prefill(PROMPT[:8], all_logits=True)
    assert captures == []
    # The decode step alone is captured.
    generator.decode(3)
    assert [capture[:2] for capture in captures] == [(1, True)]


# ---- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--chunk-size", "--max-step"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_cli_refuses_a_count_below_one_in_one_line(
    flag: str, value: str, tiny_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both modes alike, before the file is loaded: an argparse error, not a traceback or an empty answer."""
    from llama.__main__ import main

    for mode in ([], ["--batched"]):
        with pytest.raises(SystemExit) as exit_info:
            main([str(tiny_file), "--device", "cpu", "--tokens", "1,2,3", *mode, flag, value])
        assert exit_info.value.code == 2
        assert f"{flag}: expected a positive integer, got" in capsys.readouterr().err


# ---- CUDA graphs (GPU tier) ----------------------------------------------------------------------


@pytest.mark.gpu
def test_decode_graph_replays_match_eager_steps(model: llama.LlamaModel) -> None:
    eager = llama.Generator(model, max_len=64, graphs=False)
    graphed = llama.Generator(model, max_len=64, graphs=True)
    assert graphed.generate(PROMPT, 6) == eager.generate(PROMPT, 6)
    assert graphed.captured
    # The captured step serves a new sequence: static buffers, lengths on the device.
    assert graphed.generate(PROMPT[:5], 4) == eager.generate(PROMPT[:5], 4)
    graphed.reset()
    prefill = graphed.prefill([1, 2, 3])
    token = int(prefill.argmax())
    logits = [graphed.decode(token).clone(), graphed.decode().clone()]
    eager.reset()
    eager.prefill([1, 2, 3])
    assert torch.equal(logits[0], eager.decode(token)) and torch.equal(logits[1], eager.decode())


@pytest.mark.gpu
def test_prefill_graph_replays_match_eager_chunks(model: llama.LlamaModel) -> None:
    """Captured chunks replayed at other starts (later prompts start mid-cache) give the eager
    logits and cache: full chunks bit for bit, 3-token tails padded to the 4-token graph within
    bf16 rounding of the logits' scale (their linears run at another M, so another config may serve)."""
    graphed = llama.Generator(model, max_len=64, chunk_size=8, graphs=True, graph_multiple=4)
    eager = llama.Generator(model, max_len=64, chunk_size=8, graphs=False)
    for prompt, all_logits in ((PROMPT, True), (PROMPT[:9], False), (PROMPT[::-1], True)):
        got = []
        for generator in (graphed, eager):
            _poison_free_positions(generator)
            got.append(generator.prefill(prompt, all_logits=all_logits).clone())
        assert torch.isfinite(got[0]).all() and got[0].shape == got[1].shape
        if all_logits:  # the first 8 rows came from a full chunk
            assert torch.equal(got[0][:8], got[1][:8])
        scale = got[1].abs().max().item()
        assert (got[0] - got[1]).abs().max().item() <= 2e-2 * scale
    assert graphed.length == 31 and graphed.graph_length(3, 20) == 4
    for layer in range(model.config.layers):
        k, ref = graphed.cache.k[layer][:, :, :31].float(), eager.cache.k[layer][:, :, :31].float()
        assert (k - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    step = graphed.decode(7)
    ref = eager.decode(7)
    assert graphed.captured and (step - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


@pytest.mark.gpu
def test_batched_graph_replays_match_eager_steps(model: llama.LlamaModel) -> None:
    prompts = [PROMPT, [3, 1, 4, 1, 5], [200, 100, 50, 25, 12, 6, 3, 2, 1]]
    results = []
    for graphs in (False, True):
        server = llama.BatchedServer(model, max_seqs=3, capacity=64, max_step=4, graphs=graphs)
        results.append(llama.serve_greedy(server, prompts, max_new_tokens=8))
    assert results[0] == results[1]


@pytest.mark.gpu
def test_torch_baseline_decode_graph_replays_match_eager_steps(torch_model: llama.TorchLlamaModel) -> None:
    eager = llama.TorchGenerator(torch_model, max_len=64, graphs=False)
    graphed = llama.TorchGenerator(torch_model, max_len=64, graphs=True)
    assert graphed.generate(PROMPT, 6) == eager.generate(PROMPT, 6)
    assert graphed.captured


# ---- the Llama-3-8B shape (GPU tier) -------------------------------------------------------------

#: Llama-3-8B's widths, heads and RoPE with 4 of its 32 layers and a cut vocabulary: what the
#: end-to-end benchmark runs, small enough to generate in seconds on the GPU.
L3_8B_SHAPE = dataclasses.replace(
    maker.PRESETS["llama3-8b"], layers=4, vocab=32768, context=131072, rope_scaling="llama3"
)


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory: pytest.TempPathFactory) -> tuple[llama.LlamaConfig, llama.LlamaWeights]:
    path = maker.make_llama_gguf(tmp_path_factory.mktemp("l3") / "l3-4l.gguf", L3_8B_SHAPE, seed=1, device="cuda")
    return llama.load_gguf(path, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["tritune", "torch"])
def test_llama3_8b_shape_matches_the_reference(
    llama3_8b: tuple[llama.LlamaConfig, llama.LlamaWeights], impl: str
) -> None:
    """Prefill in chunks over a growing cache, then graph-replayed decode steps, at the 8B shape."""
    import triton.testing

    config, weights = llama3_8b
    model_type, generator_type = (
        (llama.LlamaModel, llama.Generator) if impl == "tritune" else (llama.TorchLlamaModel, llama.TorchGenerator)
    )
    model = model_type(config, weights, max_positions=128)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, config.vocab, 40).tolist() for _ in range(3)]
    cache: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def reference(tokens: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        key = (tuple(tokens), dtype)
        if key not in cache:
            cache[key] = llama.reference_logits(config, weights, tokens, dtype=dtype, device="cuda").cpu()
        return cache[key]

    got, rows = [], []
    for prompt in prompts:
        generator = generator_type(model, max_len=64, chunk_size=16, graphs=True)
        got.append(generator.prefill(prompt[:-3], all_logits=True).clone())
        if isinstance(generator, llama.TorchGenerator):
            times = generator.choose_decode_backend(lambda fn: float(triton.testing.do_bench(fn, warmup=5, rep=20)))
            assert generator.decode_backend in times
        got += [generator.decode(token).clone() for token in prompt[-3:]]
        assert generator.captured
        rows += [(prompt, slice(0, len(prompt) - 3))]
        rows += [(prompt, slice(i, i + 1)) for i in range(len(prompt) - 3, len(prompt))]
    _check(f"Llama-3-8B shape, 4 layers, {impl}", got, rows, reference)

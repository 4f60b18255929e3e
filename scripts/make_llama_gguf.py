"""Write a random-weight Llama-3-architecture GGUF file with Q4_K linear layers.

    python scripts/make_llama_gguf.py --preset tiny --out /tmp/llama-tiny.gguf
    python scripts/make_llama_gguf.py --preset llama3-8b --vocab 32768 --device cuda --out /tmp/llama3-8b.gguf

The file follows llama.cpp's conventions for ``general.architecture = "llama"``: its metadata keys
(``llama.block_count``, ``llama.attention.head_count_kv``, ...) and tensor names
(``blk.N.attn_q.weight``, ...), every linear layer a GGML Q4_K tensor, norms in F32, the token
embedding in F16 or F32, ``output.weight`` in Q4_K, F16 or F32 or left out (tied to the embedding),
and Llama-3 RoPE scaling as llama.cpp's converter writes it: a ``rope_freqs.weight`` F32 tensor of
per-frequency divisors. No tokenizer is written; prompts are token ids.

Weights are Gaussian, norm weights near 1. The default std is Llama's initialisation (0.02) at
Llama-3-8B's width and ``0.02 * sqrt(4096 / hidden)`` at others, so that every projection of a
normalised activation has the std it has in Llama-3-8B (1.28) at any width: attention as peaked and
logits as spread as in the large model, everything O(1) through the layers. ``--init-std`` sets it.
Each tensor is drawn from its own seeded generator (the seed and the tensor's index), quantized with
tritune's quantizer (``Q4KWeight.quantize(...).to_blocks()``) and streamed to the file one at a
time: memory holds one tensor, never the model. Quantizing Llama-3-8B's 7 billion weights takes
hours on a few CPU cores and minutes on a GPU: pass ``--device cuda``.

Tests build files through :func:`make_llama_gguf`, or through :func:`llama_metadata`,
:func:`llama_tensors` and :func:`write_gguf` to write deliberately broken ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger("tritune.make_llama_gguf")

ARCH = "llama"
#: How each supported GGML type stores a float tensor (Q4_K is written as raw blocks).
FLOAT_TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16}
OUTPUT_TYPES = ("q4_k", "f16", "f32", "tied")
ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclass(frozen=True)
class LlamaShape:
    """Every shape and hyper-parameter a Llama-3-architecture file records."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    #: "none", "linear" (positions divided by ``rope_factor``) or "llama3" (a ``rope_freqs`` tensor).
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192

    @property
    def dim(self) -> int:
        """The head dimension: ``head_dim`` when given, else ``hidden / heads`` as in Llama."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    def check(self) -> None:
        """Raise ValueError naming the first field a Llama file with Q4_K linears cannot have."""
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "context", "rope_original_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"heads: hidden={self.hidden} is not a multiple of heads={self.heads}; give head_dim")
        if self.dim < 2 or self.dim % 2:
            raise ValueError(f"head_dim: expected an even head dimension, got {self.dim}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: heads={self.heads} is not a multiple of kv_heads={self.kv_heads} (GQA)")
        # Q4_K packs 256 weights per row block: every linear's input width must be a multiple of 256.
        for name, width in (("hidden", self.hidden), ("ffn", self.ffn), ("heads * head_dim", self.heads * self.dim)):
            if width % 256:
                raise ValueError(f"{name}: {width} is not a multiple of 256, which Q4_K rows need")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling: expected one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        if not (self.rope_theta > 0 and self.rms_eps > 0 and self.rope_factor > 0):
            raise ValueError("rope_theta, rms_eps and rope_factor must be positive")
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError("rope_high_freq_factor must exceed rope_low_freq_factor")


PRESETS: dict[str, LlamaShape] = {
    # For the CPU tests: every Llama feature at the smallest Q4_K-compatible widths, Llama-3 RoPE
    # scaling included (an original context of 64 makes most frequencies scaled or smoothed).
    "tiny": LlamaShape(
        layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=512, context=256, rope_theta=10000.0,
        rope_scaling="llama3", rope_original_context=64,
    ),
    # Meta-Llama-3-8B's shapes and hyper-parameters (Llama 3.1 adds --rope-scaling llama3 --context 131072).
    "llama3-8b": LlamaShape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, context=8192),
}  # fmt: skip


def llama3_rope_factors(shape: LlamaShape) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as ``rope_freqs.weight`` for Llama-3 scaling.

    Frequencies whose wavelength is short against the original context keep 1, long ones the full
    ``rope_factor``, and those between a smooth blend (Meta's ``apply_scaling``).
    """
    dim = shape.dim
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    low, high = shape.rope_low_freq_factor, shape.rope_high_freq_factor
    smooth = (shape.rope_original_context / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / shape.rope_factor + smooth)
    factors = np.where(
        wavelen < shape.rope_original_context / high,
        1.0,
        np.where(wavelen > shape.rope_original_context / low, shape.rope_factor, blended),
    )
    return factors.astype(np.float32)


def default_init_std(shape: LlamaShape) -> float:
    """Llama's 0.02 at hidden 4096, scaled by ``1/sqrt(hidden)``: Llama-3-8B's activation scales at any width."""
    return 0.02 * math.sqrt(4096 / shape.hidden)


#: A metadata entry: its value and GGUF value type (arrays: the element type second).
Metadata = dict[str, tuple[Any, GGUFValueType] | tuple[Any, GGUFValueType, GGUFValueType]]


def llama_metadata(shape: LlamaShape) -> Metadata:
    """The file's key-value metadata, llama.cpp's keys for ``general.architecture = "llama"``."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    meta: Metadata = {
        "general.architecture": (ARCH, GGUFValueType.STRING),
        "general.name": ("random llama", GGUFValueType.STRING),
        "general.quantization_version": (2, u32),
        f"{ARCH}.block_count": (shape.layers, u32),
        f"{ARCH}.context_length": (shape.context, u32),
        f"{ARCH}.embedding_length": (shape.hidden, u32),
        f"{ARCH}.feed_forward_length": (shape.ffn, u32),
        f"{ARCH}.attention.head_count": (shape.heads, u32),
        f"{ARCH}.attention.head_count_kv": (shape.kv_heads, u32),
        f"{ARCH}.attention.layer_norm_rms_epsilon": (shape.rms_eps, f32),
        f"{ARCH}.rope.freq_base": (shape.rope_theta, f32),
        f"{ARCH}.rope.dimension_count": (shape.dim, u32),
        f"{ARCH}.vocab_size": (shape.vocab, u32),
    }
    if shape.head_dim is not None:
        meta[f"{ARCH}.attention.key_length"] = (shape.dim, u32)
        meta[f"{ARCH}.attention.value_length"] = (shape.dim, u32)
    if shape.rope_scaling == "linear":
        meta[f"{ARCH}.rope.scaling.type"] = ("linear", GGUFValueType.STRING)
        meta[f"{ARCH}.rope.scaling.factor"] = (shape.rope_factor, f32)
    return meta


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its name, how it is stored, and how to make its data when written.

    ``shape`` is the logical shape in PyTorch order (``[rows, cols]`` of a linear weight, ``[N, K]``);
    ``make`` returns the stored array: raw uint8 blocks ``[N, K/256*144]`` for Q4_K, else float
    values of ``shape``.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    make: Callable[[], np.ndarray]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if self.ggml_type == GGMLQuantizationType.Q4_K:
            return (*self.shape[:-1], self.shape[-1] // 256 * 144)
        return self.shape

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return np.dtype({GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(
            self.ggml_type, np.uint8
        ))  # fmt: skip

    @property
    def nbytes(self) -> int:
        return math.prod(self.stored_shape) * self.numpy_dtype.itemsize


def llama_tensors(
    shape: LlamaShape,
    *,
    seed: int = 0,
    init_std: float | None = None,
    embedding_type: str = "f16",
    output_type: str = "q4_k",
    device: str | torch.device = "cpu",
) -> list[TensorPlan]:
    """The file's tensors, in llama.cpp's order, each made (drawn and quantized) only when written.

    ``init_std`` defaults to :func:`default_init_std` of the shape.
    """
    shape.check()
    if init_std is None:
        init_std = default_init_std(shape)
    if embedding_type not in FLOAT_TYPES:
        raise ValueError(f"embedding_type: expected one of {tuple(FLOAT_TYPES)}, got {embedding_type!r}")
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type: expected one of {OUTPUT_TYPES}, got {output_type!r}")
    if not init_std > 0:
        raise ValueError(f"init_std: expected a positive float, got {init_std!r}")
    q4k = GGMLQuantizationType.Q4_K
    plans: list[TensorPlan] = []

    def gaussian(index: int, rows_cols: tuple[int, ...], mean: float, std: float) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
        values = torch.randn(rows_cols, generator=generator, device=device, dtype=torch.float32)
        return values.mul_(std).add_(mean)

    def add(name: str, rows_cols: tuple[int, ...], ggml_type: GGMLQuantizationType, mean: float, std: float) -> None:
        index = len(plans)

        def make() -> np.ndarray:
            from tritune.kernels import Q4KWeight

            values = gaussian(index, rows_cols, mean, std)
            if ggml_type == q4k:
                return Q4KWeight.quantize(values).to_blocks().cpu().numpy()
            dtype = np.float16 if ggml_type == GGMLQuantizationType.F16 else np.float32
            return values.cpu().numpy().astype(dtype)

        plans.append(TensorPlan(name, rows_cols, ggml_type, make))

    f32 = GGMLQuantizationType.F32
    q_width, kv_width = shape.heads * shape.dim, shape.kv_heads * shape.dim
    add("token_embd.weight", (shape.vocab, shape.hidden), FLOAT_TYPES[embedding_type], 0.0, init_std)
    if shape.rope_scaling == "llama3":
        factors = llama3_rope_factors(shape)
        plans.append(TensorPlan("rope_freqs.weight", factors.shape, f32, lambda: factors))
    for i in range(shape.layers):
        add(f"blk.{i}.attn_norm.weight", (shape.hidden,), f32, 1.0, 0.1)
        add(f"blk.{i}.attn_q.weight", (q_width, shape.hidden), q4k, 0.0, init_std)
        add(f"blk.{i}.attn_k.weight", (kv_width, shape.hidden), q4k, 0.0, init_std)
        add(f"blk.{i}.attn_v.weight", (kv_width, shape.hidden), q4k, 0.0, init_std)
        add(f"blk.{i}.attn_output.weight", (shape.hidden, q_width), q4k, 0.0, init_std)
        add(f"blk.{i}.ffn_norm.weight", (shape.hidden,), f32, 1.0, 0.1)
        add(f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden), q4k, 0.0, init_std)
        add(f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden), q4k, 0.0, init_std)
        add(f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn), q4k, 0.0, init_std)
    add("output_norm.weight", (shape.hidden,), f32, 1.0, 0.1)
    if output_type != "tied":
        add("output.weight", (shape.vocab, shape.hidden), q4k if output_type == "q4_k" else FLOAT_TYPES[output_type],
            0.0, init_std)  # fmt: skip
    return plans


def write_gguf(path: str | os.PathLike[str], metadata: Metadata, tensors: Sequence[TensorPlan]) -> Path:
    """Write ``metadata`` and ``tensors`` as a GGUF file, making and writing one tensor at a time.

    The architecture named by ``metadata["general.architecture"]`` (default "llama") is what
    ``GGUFWriter`` records; the other entries are written as given, so a test can leave any of
    them out or give them any type.
    """
    path = Path(path)
    meta = dict(metadata)
    arch = meta.pop("general.architecture", (ARCH, GGUFValueType.STRING))[0]
    writer = GGUFWriter(path, arch=str(arch))
    for key, (value, vtype, *sub) in meta.items():
        writer.add_key_value(key, value, vtype, sub[0] if sub else None)
    for plan in tensors:
        raw = plan.ggml_type if plan.ggml_type == GGMLQuantizationType.Q4_K else None
        writer.add_tensor_info(plan.name, plan.stored_shape, plan.numpy_dtype, plan.nbytes, raw_dtype=raw)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(plan.nbytes for plan in tensors)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # The bar only shows up for files that take a while (tests write tiny ones).
    with Progress(*columns, transient=True, disable=total < 256 << 20) as progress:
        task = progress.add_task(f"writing {path.name}", total=len(tensors))
        for plan in tensors:
            data = np.ascontiguousarray(plan.make())
            if tuple(data.shape) != plan.stored_shape or data.dtype != plan.numpy_dtype:
                made, expected = f"{data.dtype} {tuple(data.shape)}", f"{plan.numpy_dtype} {plan.stored_shape}"
                raise ValueError(f"{plan.name}: made {made}, expected {expected}")
            writer.write_tensor_data(data)
            progress.advance(task)
    writer.close()
    return path


def make_llama_gguf(
    path: str | os.PathLike[str],
    shape: LlamaShape,
    *,
    seed: int = 0,
    init_std: float | None = None,
    embedding_type: str = "f16",
    output_type: str = "q4_k",
    device: str | torch.device = "cpu",
) -> Path:
    """Write a random-weight Llama GGUF of ``shape`` to ``path`` and return the path."""
    tensors = llama_tensors(
        shape, seed=seed, init_std=init_std, embedding_type=embedding_type, output_type=output_type, device=device
    )
    out = write_gguf(path, llama_metadata(shape), tensors)
    params = sum(math.prod(plan.shape) for plan in tensors)
    log.info("wrote %s: %d tensors, %.3g parameters, %.3g GB", out, len(tensors), params, out.stat().st_size / 1e9)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the GGUF file to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="shape to start from")
    # Every shape field can override the preset's value (--layers, --hidden, --rope-theta, ...).
    for field in dataclasses.fields(LlamaShape):
        kind = {"float": float, "str": str}.get(str(field.type), int)
        flag = "--" + field.name.replace("_", "-")
        choices = ROPE_SCALINGS if field.name == "rope_scaling" else None
        help_text = f"override the preset's {field.name}"
        parser.add_argument(flag, dest=field.name, type=kind, choices=choices, help=help_text)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        "--init-std",
        type=float,
        default=None,
        help="std of the linear and embedding weights (default: 0.02 at hidden 4096)",
    )
    parser.add_argument("--embedding-type", choices=sorted(FLOAT_TYPES), default="f16")
    parser.add_argument("--output-type", choices=OUTPUT_TYPES, default="q4_k", help="'tied': no output.weight")
    parser.add_argument("--device", default="cpu", help="where to draw and quantize the weights (cuda is far faster)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(LlamaShape)}
    overrides = {name: value for name, value in given.items() if value is not None}
    shape = dataclasses.replace(PRESETS[args.preset], **overrides)
    make_llama_gguf(
        args.out, shape, seed=args.seed, init_std=args.init_std, embedding_type=args.embedding_type,
        output_type=args.output_type, device=args.device,
    )  # fmt: skip


if __name__ == "__main__":
    main()

"""Read a Llama GGUF file into a :class:`LlamaConfig` and :class:`LlamaWeights`.

Tensors use llama.cpp's names and layout. GGUF lists a tensor's dimensions innermost first, so a
linear weight of PyTorch shape ``[N, K]`` (``N`` outputs) is recorded as ``(K, N)``;
``gguf.GGUFReader`` hands its data back in row-major order, ``[N, K]`` for float types and
``[N, K/256*144]`` bytes for Q4_K, which is exactly what ``Q4KWeight.from_blocks`` takes.

- Linear layers (``attn_q/k/v/output``, ``ffn_gate/up/down``) must be Q4_K: they run through
  ``q4k_linear``. Files quantized with llama.cpp's mixed recipes (Q4_K_M stores some ``attn_v``
  and ``ffn_down`` in Q6_K) are refused, naming the tensor; ``llama-quantize --pure`` gives
  an all-Q4_K file.
- ``token_embd.weight`` and ``output.weight`` may be any type ``gguf`` can dequantize (F32, F16,
  BF16, Q8_0, Q6_K, ...); ``output.weight`` in Q4_K stays a :class:`Q4KWeight`, and without
  ``output.weight`` the head is tied to the embedding.
- Norms are F32, F16 or BF16 vectors. ``rope_freqs.weight`` (optional, F32 ``[head_dim/2]``) holds
  Llama-3's RoPE scaling as llama.cpp's converter writes it: each frequency is divided by its factor.

llama.cpp permutes the rows of ``attn_q`` and ``attn_k`` when it converts Hugging Face checkpoints,
so that its RoPE rotates adjacent pairs ``(x[2i], x[2i+1])``; this model rotates adjacent pairs too
and uses the rows as stored. Every missing tensor, wrong type or wrong shape is refused with a
ValueError naming the tensor. So are tensors llama.cpp would use or count that this model has no
place for: any ``.bias`` (attention biases) and any ``blk.N.*`` past ``llama.block_count``. Other
tensors the model does not use are ignored (logged at DEBUG).
"""

from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from tritune.kernels import Q4KWeight

from .config import LlamaConfig, architecture, config_from_gguf

log = logging.getLogger("llama.loader")

Q4_K = GGMLQuantizationType.Q4_K
_NORM_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block as the file stores it (the model fuses projections itself)."""

    attn_norm: torch.Tensor
    attn_q: Q4KWeight
    attn_k: Q4KWeight
    attn_v: Q4KWeight
    attn_output: Q4KWeight
    ffn_norm: torch.Tensor
    ffn_gate: Q4KWeight
    ffn_up: Q4KWeight
    ffn_down: Q4KWeight


@dataclass(frozen=True)
class LlamaWeights:
    """Every tensor the decoder needs, on one device. Float tensors are float32."""

    #: ``[vocab, hidden]``.
    token_embd: torch.Tensor
    layers: tuple[LayerWeights, ...]
    output_norm: torch.Tensor
    #: ``[vocab, hidden]``: a Q4_K weight, or float32 (the embedding itself when tied).
    output: Q4KWeight | torch.Tensor
    #: Llama-3 RoPE scaling: float32 ``[head_dim / 2]`` divisors of the frequencies, or None.
    rope_freq_factors: torch.Tensor | None

    @property
    def device(self) -> torch.device:
        return self.token_embd.device


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """A reader over ``path``, with a ValueError when it is not a readable GGUF file."""
    try:
        return GGUFReader(path)
    # A corrupt header makes gguf's reader index past the file's end or look up unknown enums:
    # IndexError, KeyError, ... as well as ValueError.
    except (OSError, ValueError, IndexError, KeyError, OverflowError, TypeError, struct.error) as exc:
        raise ValueError(f"{os.fspath(path)}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


class _Tensors:
    """The file's tensors by name, each checked for type and shape when taken."""

    def __init__(self, reader: GGUFReader, device: torch.device) -> None:
        self._by_name = {t.name: t for t in reader.tensors}
        self._taken: set[str] = set()
        self.device = device

    def rows(self, name: str) -> int | None:
        """The outer (row) dimension of ``name``, or None when the file lacks it."""
        tensor = self._by_name.get(name)
        return None if tensor is None else int(tensor.shape[-1])

    def _get(self, name: str, shape: tuple[int, ...]) -> ReaderTensor:
        tensor = self._by_name.get(name)
        if tensor is None:
            raise ValueError(f"{name}: missing from the file")
        # GGUF dims are innermost first; reversed they are the PyTorch shape.
        stored = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if stored != shape:
            raise ValueError(f"{name}: shape {list(stored)}, expected {list(shape)} from the file's metadata")
        self._taken.add(name)
        return tensor

    def has(self, name: str) -> bool:
        return name in self._by_name

    def is_q4k(self, name: str) -> bool:
        return self._by_name[name].tensor_type == Q4_K

    def q4k(self, name: str, shape: tuple[int, int]) -> Q4KWeight:
        tensor = self._get(name, shape)
        if tensor.tensor_type != Q4_K:
            raise ValueError(f"{name}: stored as {tensor.tensor_type.name}, expected Q4_K (linears run on q4k_linear)")
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).to(self.device)
        return Q4KWeight.from_blocks(raw, shape)

    def dense(
        self, name: str, shape: tuple[int, ...], types: tuple[GGMLQuantizationType, ...] | None = None
    ) -> torch.Tensor:
        tensor = self._get(name, shape)
        if types is not None and tensor.tensor_type not in types:
            expected = ", ".join(t.name for t in types)
            raise ValueError(f"{name}: stored as {tensor.tensor_type.name}, expected one of {expected}")
        if tensor.tensor_type == Q4_K:
            return Q4KWeight.from_blocks(np.asarray(tensor.data), shape).to(self.device).dequantize()
        try:
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"{name}: stored as {tensor.tensor_type.name}, which gguf cannot dequantize") from exc
        # A copy: the reader's arrays map the file read-only.
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape)).to(self.device)

    def ignored(self) -> list[str]:
        return [name for name in self._by_name if name not in self._taken]

    def refuse_unsupported(self, layers: int) -> None:
        """Refuse the first tensor llama.cpp would run (a bias) or count against the file (a block past ``layers``).

        Dropping either would run a different model than the file's without a word.
        """
        for name in self._by_name:
            if name.endswith(".bias"):
                what = "attention biases" if ".attn_" in name else "biases"
                raise ValueError(f"{name}: {what} are not supported by this model")
            block = _BLOCK.match(name)
            if block is not None and int(block.group(1)) >= layers:
                raise ValueError(f"{name}: block {block.group(1)} is past llama.block_count={layers}")


def load_gguf(path: str | os.PathLike[str], *, device: torch.device | str = "cpu") -> tuple[LlamaConfig, LlamaWeights]:
    """The config and weights of the Llama GGUF file at ``path``, on ``device``."""
    reader = open_gguf(path)
    tensors = _Tensors(reader, torch.empty(0, device=device).device)
    architecture(reader)
    # Named before llama.vocab_size, which falls back to its rows.
    if not tensors.has("token_embd.weight"):
        raise ValueError("token_embd.weight: missing from the file")
    config = config_from_gguf(reader, embedding_rows=tensors.rows("token_embd.weight"))
    tensors.refuse_unsupported(config.layers)
    hidden, ffn, q_width, kv_width = config.hidden, config.ffn, config.q_width, config.kv_width
    embedding = tensors.dense("token_embd.weight", (config.vocab, hidden))
    layers = []
    for i in range(config.layers):
        blk = f"blk.{i}"
        layers.append(
            LayerWeights(
                attn_norm=tensors.dense(f"{blk}.attn_norm.weight", (hidden,), _NORM_TYPES),
                attn_q=tensors.q4k(f"{blk}.attn_q.weight", (q_width, hidden)),
                attn_k=tensors.q4k(f"{blk}.attn_k.weight", (kv_width, hidden)),
                attn_v=tensors.q4k(f"{blk}.attn_v.weight", (kv_width, hidden)),
                attn_output=tensors.q4k(f"{blk}.attn_output.weight", (hidden, q_width)),
                ffn_norm=tensors.dense(f"{blk}.ffn_norm.weight", (hidden,), _NORM_TYPES),
                ffn_gate=tensors.q4k(f"{blk}.ffn_gate.weight", (ffn, hidden)),
                ffn_up=tensors.q4k(f"{blk}.ffn_up.weight", (ffn, hidden)),
                ffn_down=tensors.q4k(f"{blk}.ffn_down.weight", (hidden, ffn)),
            )
        )
    output_norm = tensors.dense("output_norm.weight", (hidden,), _NORM_TYPES)
    output: Q4KWeight | torch.Tensor = embedding
    if tensors.has("output.weight"):
        shape = (config.vocab, hidden)
        q4k = tensors.is_q4k("output.weight")
        output = tensors.q4k("output.weight", shape) if q4k else tensors.dense("output.weight", shape)
    factors = None
    if tensors.has("rope_freqs.weight"):
        factors = tensors.dense("rope_freqs.weight", (config.head_dim // 2,), (GGMLQuantizationType.F32,))
        if not bool(torch.all(factors > 0)):
            raise ValueError("rope_freqs.weight: expected positive frequency factors")
    if ignored := tensors.ignored():
        log.debug("ignored tensors the decoder does not use: %s", ", ".join(ignored))
    weights = LlamaWeights(embedding, tuple(layers), output_norm, output, factors)
    return config, weights

"""The hyper-parameters of a Llama-3-architecture model, read from a GGUF file's metadata.

The keys are llama.cpp's for ``general.architecture = "llama"``, with llama.cpp's defaults.
Required: ``llama.block_count``, ``llama.embedding_length``, ``llama.feed_forward_length``,
``llama.attention.head_count``, ``llama.attention.layer_norm_rms_epsilon`` and
``llama.context_length``. Optional: ``llama.attention.head_count_kv`` (else ``head_count``:
multi-head attention), ``llama.rope.freq_base`` (else 10000), ``llama.vocab_size`` (else the
embedding's rows), ``llama.attention.key_length`` / ``value_length`` (else
``embedding_length / head_count``), ``llama.rope.dimension_count`` (must be the whole head: partial
rotary embeddings are not Llama), ``llama.expert_count`` (0 or absent: a dense model; mixture of
experts is refused) and RoPE scaling: ``llama.rope.scaling.type`` is "linear" when absent, or
"none"; the linear factor is ``llama.rope.scaling.factor``, else the older
``llama.rope.scale_linear``, else 1 (Llama-3's own scaling comes as the ``rope_freqs.weight``
tensor). A missing required key, a key of the wrong type and an unsupported value are refused with
a ValueError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader, GGUFValueType

ARCH = "llama"
#: llama.cpp's RoPE base when a file records none.
DEFAULT_ROPE_THETA = 10000.0

_INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16, GGUFValueType.UINT32,
        GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
    }
)  # fmt: skip
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and hyper-parameters of the decoder (names follow the file's keys)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    #: Rows of the token embedding (and of the output head).
    vocab: int
    #: Positions the model was trained for; also the default length of a generation cache.
    context: int
    rope_theta: float
    rms_eps: float
    #: "linear" RoPE scaling divides every position by this (1.0: none).
    rope_linear_factor: float = 1.0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def _value(reader: GGUFReader, key: str, kinds: frozenset[GGUFValueType], what: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"{key}: missing from the file's metadata (expected {what})")
    if len(field.types) != 1 or field.types[0] not in kinds:
        got = "/".join(t.name for t in field.types) or "nothing"
        raise ValueError(f"{key}: expected {what}, got a {got} value")
    return field.contents()


def _int(reader: GGUFReader, key: str, *, default: int | None = None, minimum: int = 1) -> int:
    if default is not None and key not in reader.fields:
        return default
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    value = int(_value(reader, key, _INT_TYPES, what))
    if value < minimum:
        raise ValueError(f"{key}: expected {what}, got {value}")
    return value


def _float(reader: GGUFReader, key: str, *, default: float | None = None) -> float:
    if default is not None and key not in reader.fields:
        return default
    value = float(_value(reader, key, _FLOAT_TYPES, "a positive float"))
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{key}: expected a positive finite float, got {value}")
    return value


def architecture(reader: GGUFReader) -> str:
    """``general.architecture``, which must be "llama"."""
    arch = _value(reader, "general.architecture", frozenset({GGUFValueType.STRING}), 'the string "llama"')
    if arch != ARCH:
        raise ValueError(f'general.architecture: expected "llama", got {arch!r} (only Llama files are read)')
    return str(arch)


def config_from_gguf(reader: GGUFReader, *, embedding_rows: int | None = None) -> LlamaConfig:
    """The config of a Llama GGUF file; ``embedding_rows`` stands in for a missing ``llama.vocab_size``."""
    architecture(reader)
    # llama.cpp writes expert_count = 0 into dense files.
    if _int(reader, f"{ARCH}.expert_count", default=0, minimum=0) > 0:
        raise ValueError(f"{ARCH}.expert_count: mixture-of-experts files are not supported")
    hidden = _int(reader, f"{ARCH}.embedding_length")
    heads = _int(reader, f"{ARCH}.attention.head_count")
    kv_heads = _int(reader, f"{ARCH}.attention.head_count_kv", default=heads)
    if heads % kv_heads:
        raise ValueError(
            f"{ARCH}.attention.head_count_kv: {kv_heads} does not divide {ARCH}.attention.head_count={heads} (GQA)"
        )
    key_length = f"{ARCH}.attention.key_length"
    if key_length in reader.fields:
        head_dim = _int(reader, key_length)
    elif hidden % heads:
        raise ValueError(f"{ARCH}.attention.head_count: {heads} does not divide {ARCH}.embedding_length={hidden}")
    else:
        head_dim = hidden // heads
    value_length = _int(reader, f"{ARCH}.attention.value_length", default=head_dim)
    if value_length != head_dim:
        raise ValueError(f"{ARCH}.attention.value_length: {value_length} differs from the key length {head_dim}")
    rope_dims = _int(reader, f"{ARCH}.rope.dimension_count", default=head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{ARCH}.rope.dimension_count: {rope_dims}, expected the head dim {head_dim} (full rotary)")
    vocab_key = f"{ARCH}.vocab_size"
    vocab = _int(reader, vocab_key) if vocab_key in reader.fields or embedding_rows is None else embedding_rows
    return LlamaConfig(
        layers=_int(reader, f"{ARCH}.block_count"),
        hidden=hidden,
        ffn=_int(reader, f"{ARCH}.feed_forward_length"),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        context=_int(reader, f"{ARCH}.context_length"),
        rope_theta=_float(reader, f"{ARCH}.rope.freq_base", default=DEFAULT_ROPE_THETA),
        rms_eps=_float(reader, f"{ARCH}.attention.layer_norm_rms_epsilon"),
        rope_linear_factor=_rope_linear_factor(reader),
    )


def _rope_linear_factor(reader: GGUFReader) -> float:
    """The divisor of positions, as llama.cpp reads it (``llm_load_hparams``).

    The type defaults to "linear"; its factor is ``rope.scaling.factor``, else the older
    ``rope.scale_linear``, and a missing or zero factor means none. "none" ignores any factor.
    """
    kind_key = f"{ARCH}.rope.scaling.type"
    kind = "linear"
    if kind_key in reader.fields:
        kind = _value(reader, kind_key, frozenset({GGUFValueType.STRING}), 'a string ("none" or "linear")')
    if kind == "none":
        return 1.0
    if kind != "linear":
        raise ValueError(f'{kind_key}: {kind!r} is not supported (expected "none" or "linear")')
    for factor_key in (f"{ARCH}.rope.scaling.factor", f"{ARCH}.rope.scale_linear"):
        if factor_key in reader.fields:
            factor = float(_value(reader, factor_key, _FLOAT_TYPES, "a float"))
            if factor == 0.0:
                return 1.0
            if not 0.0 < factor < float("inf"):
                raise ValueError(f"{factor_key}: expected a positive finite float (or 0: none), got {factor}")
            return factor
    return 1.0

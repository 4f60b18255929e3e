"""A Q4_K weight repacked once into the layout the GEMM kernels read."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from . import format as q4k_format


class Q4KWeight:
    """A ``[N, K]`` linear weight in GGUF Q4_K, kept in a kernel-friendly device layout.

    The 144-byte super-blocks are split once into four tensors (``S = K / 256``):

    ================ ================ ==========================================================
    tensor           dtype, shape     contents
    ================ ================ ==========================================================
    ``qs``           uint8 [N, K/2]   the 4-bit quants in natural order: byte ``i`` holds weight
                                      ``2i`` in its low nibble and ``2i + 1`` in its high nibble
    ``scales``       uint8 [N, K/32]  the 6-bit sub-block scales ``sc``
    ``mins``         uint8 [N, K/32]  the 6-bit sub-block mins ``m``
    ``super_scales`` fp16 [N, S, 2]   ``(d, dmin)`` of each super-block
    ================ ================ ==========================================================

    Weight ``k`` of row ``n`` is ``(d * sc) * q - dmin * m`` with the fields of its sub-block
    ``k // 32`` and super-block ``k // 256``. This is 4.625 bits per weight (the file's 4.5 plus
    the unpacked 6-bit codes), and it loses nothing: both products are exact in float32, so the
    kernels start from exactly gguf's float32 weights, :meth:`dequantize` reproduces them bit for
    bit, and :meth:`to_blocks` gives back the original bytes.

    Instances are immutable; :meth:`to` returns a new one.
    """

    __slots__ = ("mins", "qs", "scales", "shape", "super_scales")

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    super_scales: torch.Tensor
    shape: tuple[int, int]

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, super_scales: torch.Tensor) -> None:
        for name, part in (("qs", qs), ("scales", scales), ("mins", mins), ("super_scales", super_scales)):
            _check_part_kind(name, part)
        n, half_k = qs.shape
        k = half_k * 2
        expected = {
            "qs": (qs, torch.uint8, (n, k // 2)),
            "scales": (scales, torch.uint8, (n, k // 32)),
            "mins": (mins, torch.uint8, (n, k // 32)),
            "super_scales": (super_scales, torch.float16, (n, k // q4k_format.QK_K, 2)),
        }
        if k % q4k_format.QK_K != 0 or k == 0:
            raise ValueError(f"qs: K={k} must be a positive multiple of {q4k_format.QK_K}")
        for name, (tensor, dtype, shape) in expected.items():
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name}: expected {dtype} of shape {shape}, got {tensor.dtype} of shape {tuple(tensor.shape)}"
                )
            if tensor.device != qs.device:
                raise ValueError(f"{name}: on {tensor.device}, but qs is on {qs.device}")
        for name, codes in (("scales", scales), ("mins", mins)):
            _check_six_bits(name, codes)
        values = {"qs": qs, "scales": scales, "mins": mins, "super_scales": super_scales, "shape": (n, k)}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.contiguous()
                # The kernels read the codes as 16- and 32-bit words: a view that starts at an odd
                # byte of its storage gets a fresh (aligned) copy, once, here.
                if value.data_ptr() % 16:
                    value = value.clone()
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Q4KWeight is immutable; cannot set {name!r}")

    def __repr__(self) -> str:
        n, k = self.shape
        return f"Q4KWeight(shape=({n}, {k}), device={self.device})"

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_parts(
        cls, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, super_scales: torch.Tensor
    ) -> Q4KWeight:
        """The weight whose :meth:`tensors` these are, taken as they are: no checks, no copies.

        For the op's body, which rebuilds the weight a checked call split into its tensors; under
        ``torch.compile`` they are fake tensors, which have no data for the constructor to align.
        """
        weight = object.__new__(cls)
        for name, value in (("qs", qs), ("scales", scales), ("mins", mins), ("super_scales", super_scales)):
            object.__setattr__(weight, name, value)
        object.__setattr__(weight, "shape", (qs.shape[0], qs.shape[1] * 2))
        return weight

    @classmethod
    def from_blocks(cls, raw: torch.Tensor | np.ndarray, shape: tuple[int, int]) -> Q4KWeight:
        """Repack raw GGUF Q4_K rows (uint8 ``[N, K/256*144]``) of a weight of ``shape`` (N, K)."""
        if isinstance(raw, np.ndarray):
            if raw.dtype != np.uint8:
                raise TypeError(f"raw: expected uint8 Q4_K blocks, got numpy {raw.dtype}")
            # Memory-mapped GGUF data is read-only; torch wants a writable array to wrap.
            raw = torch.from_numpy(np.array(raw) if not raw.flags.writeable else np.ascontiguousarray(raw))
        if not isinstance(shape, tuple | list) or len(shape) != 2:
            raise TypeError(f"shape: expected (N, K), got {shape!r}")
        if any(isinstance(v, bool) or not isinstance(v, int | np.integer) for v in shape):
            raise TypeError(f"shape: expected two ints (N, K), got {shape!r}")
        n, k = (int(v) for v in shape)
        if n < 0:
            raise ValueError(f"shape: N={n} must not be negative")
        if k % q4k_format.QK_K != 0 or k <= 0:
            raise ValueError(f"shape: K={k} must be a positive multiple of {q4k_format.QK_K} for Q4_K")
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
            got = raw.dtype if isinstance(raw, torch.Tensor) else type(raw).__name__
            raise TypeError(f"raw: expected uint8 Q4_K blocks, got {got}")
        expected = (n, k // q4k_format.QK_K * q4k_format.BLOCK_BYTES)
        if tuple(raw.shape) != expected:
            raise ValueError(f"raw: a Q4_K weight of shape {(n, k)} needs uint8 {expected}, got {tuple(raw.shape)}")
        d, dmin, sc, m, q = q4k_format.split_blocks(raw)
        qs = q[:, 0::2] | (q[:, 1::2] << 4)
        return cls(qs, sc, m, torch.stack([d, dmin], dim=-1))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q4KWeight:
        """Quantize a float ``[N, K]`` weight (K a multiple of 256) to Q4_K on its device."""
        raw = q4k_format.quantize_q4_k(weight)
        return cls.from_blocks(raw, tuple(weight.shape))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], tensor_name: str) -> Q4KWeight:
        """Read tensor ``tensor_name`` of a GGUF file; it must be stored as Q4_K."""
        try:
            import gguf
        except ImportError as exc:
            raise ImportError(
                "Q4KWeight.from_gguf reads GGUF files with the gguf package: pip install 'tritune[gguf]'"
            ) from exc

        reader = gguf.GGUFReader(path)
        found = [t for t in reader.tensors if t.name == tensor_name]
        if not found:
            names = [t.name for t in reader.tensors]
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise KeyError(f"tensor_name: no tensor {tensor_name!r} in {os.fspath(path)} (it has: {shown})")
        tensor = found[0]
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_K:
            raise ValueError(f"tensor_name: {tensor_name!r} is stored as {tensor.tensor_type.name}, not Q4_K")
        dims = [int(v) for v in tensor.shape]
        if len(dims) != 2:
            raise ValueError(f"tensor_name: {tensor_name!r} has {len(dims)} dimensions; a linear weight needs 2")
        # GGUF lists dimensions innermost first: (K, N).
        k, n = dims
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n, -1)
        return cls.from_blocks(raw, (n, k))

    # ---- views ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins, self.super_scales))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qs, scales, mins, super_scales)``, the arguments of the ``tritune::q4k_linear`` op."""
        return self.qs, self.scales, self.mins, self.super_scales

    def to(self, device: torch.device | str) -> Q4KWeight:
        return Q4KWeight(*(t.to(device) for t in self.tensors()))

    def _fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.stack([self.qs & 0x0F, self.qs >> 4], dim=-1).reshape(self.shape)
        return self.super_scales[..., 0], self.super_scales[..., 1], self.scales, self.mins, q

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]``: exactly the values ``gguf.quants.dequantize`` gives for the file."""
        return q4k_format.decode(*self._fields())

    def to_blocks(self) -> torch.Tensor:
        """The raw GGUF Q4_K rows again (uint8 ``[N, K/256*144]``), byte for byte."""
        return q4k_format.pack_blocks(*self._fields())


#: Each part's dtype, rank and layout, as the constructor's errors name them.
_PARTS = {
    "qs": (torch.uint8, "[N, K/2]"),
    "scales": (torch.uint8, "[N, K/32]"),
    "mins": (torch.uint8, "[N, K/32]"),
    "super_scales": (torch.float16, "[N, K/256, 2]"),
}


def _check_part_kind(name: str, part: object) -> None:
    """Refuse a part that is not a tensor of the part's rank, before its shape is unpacked."""
    dtype, layout = _PARTS[name]
    dims = layout.count(",") + 1
    wanted = f"{name}: expected a {dims}-D torch.Tensor of {str(dtype).removeprefix('torch.')} {layout}"
    if isinstance(part, np.ndarray):
        raise TypeError(f"{wanted}, got a numpy.ndarray; convert it with torch.from_numpy({name})")
    if not isinstance(part, torch.Tensor):
        raise TypeError(f"{wanted}, got {type(part).__name__}")
    if part.dim() != dims:
        raise ValueError(f"{wanted}, got a {part.dim()}-D tensor of shape {tuple(part.shape)}")


def _check_six_bits(name: str, codes: torch.Tensor) -> None:
    """Refuse 6-bit codes of 64 or more: :meth:`Q4KWeight.to_blocks` keeps only their low six bits,
    so the weight would no longer be the one its blocks describe."""
    if codes.numel() == 0 or codes.device.type == "meta":
        return
    largest = int(codes.max())
    if largest >= 64:
        raise ValueError(f"{name}: expected 6-bit codes (values below 64), got a value of {largest}")

"""``validate_seq_info``: a host-side check of a step's ``seq_info`` table, for debugging.

``varlen_attention`` reads ``seq_info`` on the device only (checking it there would synchronise
every step), and clamps entries out of range instead of reporting them. This check copies the
table to the host and says what is wrong with it, naming the row.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["validate_seq_info"]


def validate_seq_info(seq_info: torch.Tensor, *, T: int, rows: int, cols: int, ring: bool = False) -> None:
    """Check a ``seq_info`` table on the host (for debugging: it synchronises), raising ValueError.

    Checks the dtype and shape, negative entries, query ranges outside ``[0, T)`` or overlapping,
    columns outside ``[0, cols)``, ``q_len > kv_end``, and ``kv_end > rows`` for a flat store (a
    ring holds any length, but one step's new tokens must fit in it: ``q_len <= rows``). Segments
    with ``q_len == 0`` are unused and only checked for negative entries. ``T``, ``rows`` and
    ``cols`` must be ints (else a TypeError), with ``T >= 0`` and ``rows, cols >= 1``.
    """
    for name, value, least in (("T", T, 0), ("rows", rows, 1), ("cols", cols, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{name}: expected at least {least}, got {value}")
    if not isinstance(ring, bool):
        raise TypeError(f"ring: expected a bool, got {type(ring).__name__}")
    if not isinstance(seq_info, torch.Tensor):
        raise ValueError(f"seq_info: expected a torch.Tensor, got {type(seq_info).__name__}")
    if seq_info.dtype != torch.int32:
        raise ValueError(f"seq_info: expected dtype torch.int32, got {seq_info.dtype}")
    if seq_info.dim() != 2 or seq_info.shape[1] != 4 or seq_info.shape[0] < 1:
        raise ValueError(f"seq_info: expected shape [S, 4] with S >= 1, got {tuple(seq_info.shape)}")
    table = seq_info.detach().cpu().tolist()
    names = ("q_start", "q_len", "col", "kv_end")
    used: list[tuple[int, int, int]] = []
    for s, entry in enumerate(table):
        for name, value in zip(names, entry, strict=True):
            if value < 0:
                raise ValueError(f"seq_info[{s}]: {name} is negative ({value})")
        q_start, q_len, col, kv_end = entry
        if q_len == 0:
            continue
        if q_start + q_len > T:
            raise ValueError(f"seq_info[{s}]: query rows [{q_start}, {q_start + q_len}) leave q's {T} rows")
        if col >= cols:
            raise ValueError(f"seq_info[{s}]: column {col} is outside the store's {cols} columns")
        if q_len > kv_end:
            raise ValueError(f"seq_info[{s}]: q_len {q_len} exceeds kv_end {kv_end} (the new tokens are the last ones)")
        if not ring and kv_end > rows:
            raise ValueError(f"seq_info[{s}]: kv_end {kv_end} is beyond the flat store's {rows} rows")
        if ring and q_len > rows:
            raise ValueError(f"seq_info[{s}]: q_len {q_len} new tokens overwrite each other in a ring of {rows} rows")
        used.append((q_start, q_start + q_len, s))
    used.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(used):
        if start < end:
            raise ValueError(f"seq_info[{first}] and seq_info[{second}]: query ranges overlap")

"""GGUF Q4_K blocks: decoding to float32 and quantizing from float, in vectorised PyTorch.

A Q4_K super-block holds 256 weights in 144 bytes:

====== ======= =================================================================
bytes  type    meaning
====== ======= =================================================================
0-1    fp16    ``d``, the scale of the eight sub-block scales
2-3    fp16    ``dmin``, the scale of the eight sub-block mins
4-15   12 B    eight 6-bit scales ``sc`` and eight 6-bit mins ``m`` (see below)
16-143 128 B   256 4-bit quants ``q``
====== ======= =================================================================

Sub-block ``j`` (weights ``32j .. 32j+31``) decodes as ``w = (d * sc[j]) * q - dmin * m[j]``.

The 12 scale bytes ``s``: for ``j < 4``, ``sc[j]`` and ``m[j]`` are the low six bits of ``s[j]`` and
``s[j + 4]``; for ``j >= 4``, the low four bits of ``sc[j]`` and ``m[j]`` are the low and high
nibble of ``s[j + 4]``, and their top two bits are the top two bits of ``s[j - 4]`` and ``s[j]``.

The 128 quant bytes come in four groups of 32: byte ``32g + l`` holds weight ``64g + l`` in its
low nibble and weight ``64g + 32 + l`` in its high nibble (sub-blocks ``2g`` and ``2g + 1``).

Decoding is exact and matches ``gguf.quants.dequantize`` bit for bit: ``d * sc`` and
``dmin * m`` are exact in float32 (11-bit by 6-bit significands), so is ``(d * sc) * q``, and the
final subtraction is the only rounding step, in either evaluation order.
"""

from __future__ import annotations

import torch

QK_K = 256
SUB_BLOCK = 32
BLOCK_BYTES = 144
SCALE_BYTES = 12
QUANT_BYTES = 128


def check_blocks(raw: torch.Tensor, name: str = "raw") -> int:
    """Validate raw Q4_K rows (uint8 ``[N, K/256*144]``) and return K."""
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of uint8, got {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raise TypeError(f"{name}: expected dtype torch.uint8, got {raw.dtype}")
    if raw.dim() != 2 or raw.shape[1] % BLOCK_BYTES != 0 or raw.shape[1] == 0:
        raise ValueError(
            f"{name}: expected shape [N, K/256*144] (a positive multiple of {BLOCK_BYTES} bytes per row), "
            f"got {tuple(raw.shape)}"
        )
    return raw.shape[1] // BLOCK_BYTES * QK_K


def split_blocks(
    raw: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack raw rows into ``d, dmin`` (fp16 ``[N, K/256]``), ``sc, m`` (uint8 ``[N, K/32]``), ``q``.

    ``q`` is uint8 ``[N, K]`` in natural weight order (values 0..15).
    """
    check_blocks(raw)
    # Sizes spelled out rather than -1: an empty weight (N = 0) leaves -1 undetermined.
    n, n_super = raw.shape[0], raw.shape[1] // BLOCK_BYTES
    blocks = raw.reshape(n, n_super, BLOCK_BYTES)  # [N, S, 144]
    halves = blocks[..., :4].contiguous().view(torch.float16)  # [N, S, 2]
    d, dmin = halves[..., 0], halves[..., 1]
    packed = blocks[..., 4 : 4 + SCALE_BYTES].to(torch.int32)
    lead, mid, tail = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lead & 0x3F, (tail & 0x0F) | ((lead >> 6) << 4)], dim=-1)
    m = torch.cat([mid & 0x3F, (tail >> 4) | ((mid >> 6) << 4)], dim=-1)
    qbytes = blocks[..., 4 + SCALE_BYTES :].reshape(n, n_super, 4, 1, 32)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).reshape(1, 1, 1, 2, 1)
    q = ((qbytes >> shifts) & 0x0F).reshape(n, n_super * QK_K)
    return (
        d,
        dmin,
        sc.to(torch.uint8).reshape(n, n_super * 8),
        m.to(torch.uint8).reshape(n, n_super * 8),
        q,
    )


def decode(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Float32 weights from split fields (shapes as :func:`split_blocks` returns them)."""
    n, k = q.shape
    scale = (d.float().repeat_interleave(QK_K // SUB_BLOCK, dim=1) * sc.float()).unsqueeze(-1)
    offset = (dmin.float().repeat_interleave(QK_K // SUB_BLOCK, dim=1) * m.float()).unsqueeze(-1)
    # Two rounding-free products, then one rounding subtraction: gguf's exact arithmetic.
    w = scale * q.reshape(n, k // SUB_BLOCK, SUB_BLOCK).float() - offset
    return w.reshape(n, k)


def dequantize_q4k_blocks(raw: torch.Tensor) -> torch.Tensor:
    """Decode raw Q4_K rows (uint8 ``[N, K/256*144]``) to float32 ``[N, K]``, bitwise as gguf does."""
    return decode(*split_blocks(raw))


def pack_blocks(
    d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """The inverse of :func:`split_blocks`: fields back to raw uint8 rows ``[N, K/256*144]``."""
    n = q.shape[0]
    n_super = q.shape[1] // QK_K
    sc = sc.to(torch.int32).reshape(n, n_super, 8)
    m = m.to(torch.int32).reshape(n, n_super, 8)
    lead = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    mid = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    tail = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    scale_bytes = torch.cat([lead, mid, tail], dim=-1).to(torch.uint8)  # [N, S, 12]
    halves = torch.stack([d.to(torch.float16), dmin.to(torch.float16)], dim=-1).contiguous()
    head = halves.view(torch.uint8).reshape(n, n_super, 4)
    qv = q.to(torch.uint8).reshape(n, n_super, 4, 2, 32)
    qbytes = (qv[:, :, :, 0] | (qv[:, :, :, 1] << 4)).reshape(n, n_super, QUANT_BYTES)
    return torch.cat([head, scale_bytes, qbytes], dim=-1).reshape(n, n_super * BLOCK_BYTES)


def _fit_sub_blocks(x: torch.Tensor, nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (rows of ``x``, 32 wide) a scale >= 0 and an offset >= 0 with ``x ~ s*L - o``."""
    nmax = 15.0
    weights = x.square().mean(dim=-1, keepdim=True).sqrt() + x.abs()
    lo = x.amin(dim=-1, keepdim=True).clamp(max=0.0)
    hi = x.amax(dim=-1, keepdim=True)
    span = (hi - lo).clamp(min=torch.finfo(torch.float32).tiny)
    sw = weights.sum(dim=-1, keepdim=True)
    sx = (weights * x).sum(dim=-1, keepdim=True)
    best_scale = span / nmax
    best_lo = lo
    levels = torch.round((x - lo) / best_scale).clamp(0, nmax)
    best_err = (weights * (best_scale * levels + lo - x).square()).sum(dim=-1, keepdim=True)
    for step in range(nstep + 1):
        iscale = (nmax - 1.0 + 0.1 * step) / span
        levels = torch.round(iscale * (x - lo)).clamp(0, nmax)
        sl = (weights * levels).sum(dim=-1, keepdim=True)
        sll = (weights * levels.square()).sum(dim=-1, keepdim=True)
        slx = (weights * levels * x).sum(dim=-1, keepdim=True)
        det = sw * sll - sl * sl
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        scale = (sw * slx - sl * sx) / safe
        offset = (sll * sx - sl * slx) / safe
        # A positive offset would need a negative min; refit the scale alone through zero.
        refit = offset > 0
        scale = torch.where(refit, slx / sll.clamp(min=torch.finfo(torch.float32).tiny), scale)
        offset = torch.where(refit, torch.zeros_like(offset), offset)
        err = (weights * (scale * levels + offset - x).square()).sum(dim=-1, keepdim=True)
        better = ok & (err < best_err) & (scale >= 0)
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_lo = torch.where(better, offset, best_lo)
    return best_scale.squeeze(-1), (-best_lo).squeeze(-1)


def _levels(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x + offset) / safe).clamp(0, 15)
    return torch.where(scale > 0, q, torch.zeros_like(q))


def _quantize_chunk(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 8, SUB_BLOCK)
    scale, offset = _fit_sub_blocks(x)  # [N, S, 8] each
    d = (scale.amax(dim=-1) / 63.0).to(torch.float16)
    dmin = (offset.amax(dim=-1) / 63.0).to(torch.float16)
    d32, dmin32 = d.float().unsqueeze(-1), dmin.float().unsqueeze(-1)
    sc = torch.round(scale / torch.where(d32 > 0, d32, torch.ones_like(d32))).clamp(0, 63)
    m = torch.round(offset / torch.where(dmin32 > 0, dmin32, torch.ones_like(dmin32))).clamp(0, 63)
    sc = torch.where(d32 > 0, sc, torch.zeros_like(sc))
    m = torch.where(dmin32 > 0, m, torch.zeros_like(m))
    # The 6-bit rounding moved each sub-block's grid: try the neighbouring codes and keep the best.
    best_err = None
    best = (sc, m)
    for dsc in (-1, 0, 1):
        for dm in (-1, 0, 1):
            sc_try = (sc + dsc).clamp(0, 63)
            m_try = (m + dm).clamp(0, 63)
            s_try, o_try = d32 * sc_try, dmin32 * m_try
            q = _levels(x, s_try.unsqueeze(-1), o_try.unsqueeze(-1))
            err = (s_try.unsqueeze(-1) * q - o_try.unsqueeze(-1) - x).square().sum(dim=-1)
            if best_err is None:
                best_err = err
                best = (sc_try, m_try)
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better, sc_try, best[0]), torch.where(better, m_try, best[1]))
    sc, m = best
    q = _levels(x, (d32 * sc).unsqueeze(-1), (dmin32 * m).unsqueeze(-1))
    return pack_blocks(d, dmin, sc.reshape(n, -1), m.reshape(n, -1), q.reshape(n, k))


def quantize_q4_k(weight: torch.Tensor, *, rows_per_chunk: int = 1024) -> torch.Tensor:
    """Quantize ``weight`` (float ``[N, K]``, K a multiple of 256) to raw Q4_K rows, ggml layout.

    The method follows the idea of ggml's ``make_qkx`` search, in our own vectorised form. For
    every 32-weight sub-block, weighted by ``rms(sub-block) + |x|`` so that large weights count
    more, it tries a range of grid spacings around ``(max - min) / 15``: each spacing rounds the
    weights to levels 0..15, and a weighted least-squares fit of ``x ~ scale * level - offset``
    (offset refit to zero where it would turn negative) gives a scale, an offset and an error; the
    best fit is kept. The sub-block scales and offsets of a super-block are then coded as 6-bit
    multiples of fp16 ``d = max(scale) / 63`` and ``dmin = max(offset) / 63``; each sub-block
    tries the neighbouring 6-bit codes and keeps the one with the smallest error once its levels
    are re-rounded on the coded grid. On Gaussian data the relative RMS error is about 7%.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [N, K] tensor, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % QK_K != 0 or k == 0:
        raise ValueError(f"weight: K={k} must be a positive multiple of {QK_K} for Q4_K")
    if not weight.is_floating_point():
        raise TypeError(f"weight: expected a floating-point tensor, got {weight.dtype}")
    w = weight.detach().float()
    if n == 0:
        return torch.empty(0, k // QK_K * BLOCK_BYTES, dtype=torch.uint8, device=weight.device)
    # A meta weight (shapes only: the sm_90 build checks) has no values to check.
    checked = w.device.type != "meta"
    nonfinite = int((~torch.isfinite(w)).sum()) if checked else 0
    if nonfinite:
        raise ValueError(
            f"weight: {nonfinite} of its {w.numel()} values are not finite (NaN or inf); Q4_K codes finite weights only"
        )
    raw = torch.cat([_quantize_chunk(w[i : i + rows_per_chunk]) for i in range(0, n, rows_per_chunk)], dim=0)
    if checked:
        _check_super_scales(raw, w)
    return raw


def _check_super_scales(raw: torch.Tensor, w: torch.Tensor) -> None:
    """Refuse a weight whose super-block scales overflowed fp16: every weight of such a block would
    decode to NaN or inf. ``dmin`` is a 63rd of the largest sub-block offset (about the most
    negative weight) and ``d`` a 63rd of the largest sub-block step (a 15th of its span)."""
    halves = raw.reshape(raw.shape[0], -1, BLOCK_BYTES)[..., :4].contiguous().view(torch.float16)
    if bool(torch.isfinite(halves).all()):
        return
    largest, limit = float(w.abs().amax()), torch.finfo(torch.float16).max
    raise ValueError(
        f"weight: its largest magnitude {largest:.4g} needs super-block scales (d, dmin) past fp16's "
        f"largest value {limit:g}: Q4_K codes negative weights down to about -63 * {limit:g} = "
        f"{-63 * limit:.3g} and sub-block spans up to about 15 times that"
    )

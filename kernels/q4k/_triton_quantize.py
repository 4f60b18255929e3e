"""The fp8 paths' pre-pass: each row of x as e4m3 with one scale, and its exact 32-wide sums.

The centred fp8 kernel reads the row sums (its centre term is computed against the exact
activations); the folded kernel needs only the e4m3 rows and their scales (``ROW_SUMS=False``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import _quantize_row


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr,
    xq_ptr,
    row_scale_ptr,
    rowsum_ptr,
    K,
    stride_xm,
    stride_xk,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    ROW_SUMS: tl.constexpr,
):
    """One row per program: e4m3 row with scale ``amax / 448``, and exact 32-wide row sums."""
    pid_m = tl.program_id(0).to(tl.int64)
    _quantize_row(
        x_ptr + pid_m * stride_xm, xq_ptr + pid_m * K, row_scale_ptr + pid_m, rowsum_ptr + pid_m * (K // 32),
        stride_xk, BLOCK_K, K_TILES, ROUND_IN_FP32, ROW_SUMS,
    )  # fmt: skip

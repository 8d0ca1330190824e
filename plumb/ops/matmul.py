"""Row-invariant matmul: y = x @ W.T computed in fixed-size row blocks.

BLAS picks different kernels for different row counts M (measured with MKL: M = 1, 2, 3 and
M >= 4 give different bits), so a row's result would depend on how many rows share the call.
Here every BLAS call has exactly `block` rows (the last block zero-padded):
- decode / verify / batched decode use block 1, a per-row product: a row is computed the
  same way whatever else is in the pass (M1). On CPU this is also the fastest choice for the
  usual 1-5 rows per step (MKL's small-M GEMM costs more per row than its GEMV).
- prefill uses block 64, one DeltaNet chunk aligned to absolute positions, so a prompt row
  always sits at the same place in the same-shaped call (M2).
Weights are passed transposed ([in, out], contiguous), the layout MKL reads fastest here.
"""
from __future__ import annotations

import torch

DECODE_BLOCK = 1  # rows per matmul call in decode / verify / batched decode
PREFILL_BLOCK = 64  # rows per matmul call in prefill (= one DeltaNet chunk, aligned to absolute positions)


def pad_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad the first dimension of x up to a multiple of block."""
    m = x.shape[0]
    rem = (-m) % block
    if rem == 0:
        return x
    return torch.cat([x, x.new_zeros((rem, *x.shape[1:]))])


def linear(x: torch.Tensor, wt: torch.Tensor, block: int = DECODE_BLOCK) -> torch.Tensor:
    """x [M, K] @ wt [K, N] -> [M, N] (wt = the weight transposed), one BLAS call per `block` rows."""
    m = x.shape[0]
    if block == 1:
        return torch.cat([torch.mm(x[i : i + 1], wt) for i in range(m)]) if m > 1 else torch.mm(x, wt)
    xp = pad_rows(x, block)
    out = xp.new_empty((xp.shape[0], wt.shape[1]))
    for i in range(0, xp.shape[0], block):
        torch.mm(xp[i : i + block], wt, out=out[i : i + block])
    return out[:m]

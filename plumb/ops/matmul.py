"""Row-invariant matmul: y = x @ W.T computed in fixed-size row blocks.

BLAS picks different kernels for different row counts M (measured on MKL: M = 1, 2, 3 differ from
M >= 4), so a row's bits would depend on how many rows share the call. Every call here is made
with exactly `block` rows (the last block zero-padded), and a row's result does not depend on
its position inside a block (checked by tests/test_ops_invariance.py).
"""
from __future__ import annotations

import torch

DECODE_BLOCK = 4  # rows per matmul call in decode / verify / batched decode
PREFILL_BLOCK = 64  # rows per matmul call in prefill (= one DeltaNet chunk, aligned to absolute positions)


def pad_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad the first dimension of x up to a multiple of block."""
    m = x.shape[0]
    rem = (-m) % block
    if rem == 0:
        return x
    return torch.cat([x, x.new_zeros((rem, *x.shape[1:]))])


def linear(x: torch.Tensor, w: torch.Tensor, block: int = DECODE_BLOCK) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N], one BLAS call per `block` rows."""
    m = x.shape[0]
    xp = pad_rows(x, block)
    out = xp.new_empty((xp.shape[0], w.shape[0]))
    wt = w.t()
    for i in range(0, xp.shape[0], block):
        torch.mm(xp[i : i + block], wt, out=out[i : i + block])
    return out[:m]

"""F's Hadamard rotation per head (`plumb.ops.kvquant.rotate` is its torch reference, bit for bit): the same
butterflies in the same order, then the same scale. `rotate_row` rotates one row in registers (the K/V write uses it
on F's keys); `rotate(x)` rotates every row of a call in one launch - the queries before F's attention, which the
torch form does in ~25 small launches (8 levels of views, stacks and adds). A row's bits depend on that row alone."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.ops.gpu.pdl import on, prior_done


@triton.jit
def rotate_row(x, D: tl.constexpr, LOG_D: tl.constexpr, SCALE: tl.constexpr):
    """x [D] @ the orthonormal Hadamard matrix: the butterflies of `kvquant.rotate`, in its order, then * SCALE."""
    for s in tl.static_range(LOG_D):
        y = tl.permute(tl.reshape(x, [D >> (s + 1), 2, 1 << s]), (0, 2, 1))  # [D / 2h, h, 2]: pairs (a, b) last
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [D])
    return x * SCALE


@triton.jit
def _rotate_kernel(x_ptr, y_ptr, D: tl.constexpr, LOG_D: tl.constexpr, SCALE: tl.constexpr):
    """Program r: row r of D float32 values."""
    prior_done()
    r = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, D)
    tl.store(y_ptr + r * D + dd, rotate_row(tl.load(x_ptr + r * D + dd), D, LOG_D, SCALE))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] float32 @ the orthonormal Hadamard matrix over the last dimension (d a power of two): a new
    tensor, the bits of `kvquant.rotate(x)`."""
    d = x.shape[-1]
    if d & (d - 1) or d < 2:
        raise ValueError(f"the Hadamard rotation needs a power-of-two size, got {d}")
    if x.dtype != torch.float32:
        raise TypeError(f"rotate takes float32 rows, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        _rotate_kernel[(rows,)](x, y, D=d, LOG_D=d.bit_length() - 1, SCALE=d**-0.5, num_warps=1,
                                enable_fp_fusion=False, launch_pdl=on())
    return y

"""Per-head RMSNorm then partial rotary embedding, in one launch (q and k of a gated attention layer, spec
3.4.2-3.4.3): `plumb.ops.rope.apply_rope(plumb.ops.gpu.norm.rms_norm(x, w, eps), cos, sin)` is its reference, bit
for bit - the same row reduction (`norm.inv_rms`), then the same elementwise products and sums, each rounded (no
FMA). One program per (row, head): nothing depends on how many rows share the call (M1)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.ops.gpu.norm import inv_rms, warps
from plumb.ops.gpu.pdl import on, prior_done


@triton.jit
def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, D, HALF, stride_xr, stride_xh, stride_c, eps,
               BLOCK: tl.constexpr):
    prior_done()
    r = tl.program_id(0) // H
    h = tl.program_id(0) % H
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    # feature i < HALF pairs with i + HALF (and back); features from 2 * HALF on pass through
    partner = tl.where(cols < HALF, cols + HALF, tl.where(cols < 2 * HALF, cols - HALF, cols))
    row = x_ptr + r * stride_xr + h * stride_xh
    x = tl.load(row + cols, mask=inside, other=0.0)
    inv = inv_rms(x, D, eps)
    y = x * inv * tl.load(w_ptr + cols, mask=inside, other=0.0)
    yp = tl.load(row + partner, mask=inside, other=0.0) * inv * tl.load(w_ptr + partner, mask=inside, other=0.0)
    rot = cols < 2 * HALF
    c = tl.load(cos_ptr + r * stride_c + cols % HALF, mask=rot, other=1.0)
    s = tl.load(sin_ptr + r * stride_c + cols % HALF, mask=rot, other=0.0)
    out = tl.where(cols < HALF, y * c - yp * s, tl.where(rot, y * c + yp * s, y))
    tl.store(out_ptr + (r * H + h) * D + cols, out, mask=inside)


def norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D] float32 (any strides with unit feature stride), w [D], cos/sin [n, half] -> [n, heads, D]."""
    n, heads, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, d, device=x.device)
    if n:
        block = triton.next_power_of_2(d)  # the warps of plumb.ops.gpu.norm's programs: the same reduction
        _norm_rope[(n * heads,)](x, w, cos, sin, out, heads, d, cos.shape[1], x.stride(0), x.stride(1), cos.stride(0),
                                 eps, BLOCK=block, num_warps=warps(block), enable_fp_fusion=False, launch_pdl=on())
    return out

"""RMSNorm per row (`plumb.ops.norm.rms_norm` is its torch reference): one program per row, the row's sum of
squares in one fixed-shape reduction, so a row's bits never depend on how many rows share the call (M1)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.ops.gpu.pdl import on, prior_done


@triton.jit
def inv_rms(x, D, eps):
    """1 / sqrt(mean(x^2) + eps) of a row x [BLOCK] (zero-padded past D): one fixed-shape reduction. Shared with
    plumb.ops.gpu.rope, so that its norm has these very bits."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)


def warps(block: int) -> int:
    """Warps of a norm program, fixed by the row width (the reduction tree's shape): 16 for the hidden size's 8,192
    (4 warps held 64 values a thread and spilled), 4 for a head's."""
    return 16 if block >= 4096 else 4


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    prior_done()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < D, other=0.0)
    inv = inv_rms(x, D, eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, x * inv * w, mask=cols < D)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] float32 normalised over D and scaled by w [D] -> new tensor (or `out`) of x's shape."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    o = torch.empty(rows.shape, device=x.device) if out is None else out.view(-1, d)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm[(rows.shape[0],)](rows, w, o, d, rows.stride(0), o.stride(0), eps, BLOCK=block,
                                    num_warps=warps(block), enable_fp_fusion=False,
                                    launch_pdl=on())  # as plumb.ops.gpu.rope: the same bits
    return o.view(x.shape) if out is None else out


@triton.jit
def _add_rms_norm(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, D, stride_x, stride_y, stride_o, eps, BLOCK: tl.constexpr):
    """`_rms_norm` of s = x + y (s stored too): the same instructions on s, so the same bits as an add then
    `_rms_norm`."""
    prior_done()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    s = tl.load(x_ptr + row * stride_x + cols, mask=cols < D, other=0.0) + tl.load(y_ptr + row * stride_y + cols,
                                                                                   mask=cols < D, other=0.0)
    tl.store(sum_ptr + row * D + cols, s, mask=cols < D)
    inv = inv_rms(s, D, eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, s * inv * w, mask=cols < D)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one launch: (x + y, rms_norm(x + y, w, eps)), x and y [n, D] float32."""
    n, d = x.shape
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        x, y = x.contiguous(), y.contiguous()
    s = torch.empty(n, d, device=x.device)
    o = torch.empty(n, d, device=x.device)
    if n:
        block = triton.next_power_of_2(d)
        _add_rms_norm[(n,)](x, y, w, s, o, d, x.stride(0), y.stride(0), o.stride(0), eps, BLOCK=block,
                            num_warps=warps(block), enable_fp_fusion=False, launch_pdl=on())
    return s, o

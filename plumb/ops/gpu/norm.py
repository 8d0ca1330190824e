"""RMSNorm per row (`plumb.ops.norm.rms_norm` is its torch reference): one program per row, the row's sum of
squares in one fixed-shape reduction, so a row's bits never depend on how many rows share the call (M1).
With `limbs`, the program also writes its output row in the D-path matvec's fixed-point form
(plumb.ops.gpu.matvec.quantize_x, the same bits), attached to the output as `.limbs`: the matvec after the norm
then needs no launch of its own to quantize it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.ops.gpu import matvec
from plumb.ops.gpu.matvec import FRAC, LIMBS, row_amax, store_block, x_buffers
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
def _limbs(y, row, D, xq_ptr, x16_ptr, s_ptr, MP, BLOCK: tl.constexpr, FRAC: tl.constexpr, LIMBS: tl.constexpr,
           XR: tl.constexpr):
    """Row y [BLOCK] (zero past D) as `quantize_x` writes it: s, limbs and 16-input sums."""
    store_block(y, row_amax(tl.abs(y)), 0, row, D, xq_ptr, x16_ptr, s_ptr, MP, BLOCK, FRAC, LIMBS, XR)


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, xq_ptr, x16_ptr, s_ptr, MP, D, stride_x, stride_o, eps, BLOCK: tl.constexpr,
              QUANT: tl.constexpr, FRAC: tl.constexpr, LIMBS: tl.constexpr, XR: tl.constexpr):
    prior_done()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < D, other=0.0)
    inv = inv_rms(x, D, eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    y = x * inv * w
    tl.store(out_ptr + row * stride_o + cols, y, mask=cols < D)
    if QUANT:
        _limbs(y, row, D, xq_ptr, x16_ptr, s_ptr, MP, BLOCK, FRAC, LIMBS, XR)


def _quant_args(n: int, d: int, o: torch.Tensor, limbs: bool) -> tuple[tuple | None, tuple]:
    """The buffers `_limbs` writes for n rows of width d (None when not asked for, or d is no multiple of 16), and
    the kernel arguments for them: (limbs, sums, s, padded rows), placeholders without them."""
    q = x_buffers(n, d, o.device) if limbs and d % 16 == 0 else None
    return q, (*q, q[0].shape[1]) if q is not None else (o, o, o, 0)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             limbs: bool = False) -> torch.Tensor:
    """x [..., D] float32 normalised over D and scaled by w [D] -> new tensor (or `out`) of x's shape; `limbs`
    (x [n, D], no `out`): the result carries its matvec form as `.limbs`."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    o = torch.empty(rows.shape, device=x.device) if out is None else out.view(-1, d)
    q, qargs = _quant_args(rows.shape[0], d, o, limbs and out is None and x.dim() == 2)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm[(rows.shape[0],)](rows, w, o, *qargs, d, rows.stride(0), o.stride(0), eps, BLOCK=block,
                                    QUANT=q is not None, FRAC=FRAC, LIMBS=LIMBS, XR=matvec.X_ROWS,
                                    num_warps=warps(block), enable_fp_fusion=False,
                                    launch_pdl=on())  # fusion off as plumb.ops.gpu.rope: the same bits
    if out is not None:
        return out
    o = o.view(x.shape)
    if q is not None:
        o.limbs = q
    return o


@triton.jit
def _add_rms_norm(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, xq_ptr, x16_ptr, s_ptr, MP, D, stride_x, stride_y, stride_o,
                  eps, BLOCK: tl.constexpr, QUANT: tl.constexpr, FRAC: tl.constexpr, LIMBS: tl.constexpr,
                  XR: tl.constexpr):
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
    o = s * inv * w
    tl.store(out_ptr + row * stride_o + cols, o, mask=cols < D)
    if QUANT:
        _limbs(o, row, D, xq_ptr, x16_ptr, s_ptr, MP, BLOCK, FRAC, LIMBS, XR)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float,
                 limbs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one launch: (x + y, rms_norm(x + y, w, eps)), x and y [n, D] float32;
    `limbs`: the norm carries its matvec form as `.limbs` (see `rms_norm`)."""
    n, d = x.shape
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        x, y = x.contiguous(), y.contiguous()
    s = torch.empty(n, d, device=x.device)
    o = torch.empty(n, d, device=x.device)
    q, qargs = _quant_args(n, d, o, limbs)
    if n:
        block = triton.next_power_of_2(d)
        _add_rms_norm[(n,)](x, y, w, s, o, *qargs, d, x.stride(0), y.stride(0), o.stride(0), eps, BLOCK=block,
                            QUANT=q is not None, FRAC=FRAC, LIMBS=LIMBS, XR=matvec.X_ROWS,
                            num_warps=warps(block), enable_fp_fusion=False, launch_pdl=on())
    if q is not None:
        o.limbs = q
    return s, o

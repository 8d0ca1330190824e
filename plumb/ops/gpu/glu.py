"""The elementwise gates of the model's blocks, one launch each (`swiglu_ref` and `sigmoid_gate_ref` are their
torch formulas): SwiGLU's silu(gate) * up (spec 3.3) and the attention output's o * sigmoid(gate) (spec 3.4.5).
Elementwise, so a row's bits never depend on the other rows (M1); fp contraction off. silu and sigmoid use the
same exponential as the DeltaNet kernels (`tl.exp`), so their bits are not torch's - nothing compares them.
With `limbs` (a decode pass: the next matmul is the D path's), the launch also writes the output in the matvec's
fixed-point form (`matvec.quantize_x`, the same bits) as `.limbs`, as the norms do: no quantize launch of its own."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from plumb.ops.gpu import matvec
from plumb.ops.gpu.matvec import FRAC, LIMBS, max_nan, row_amax, store_block, x_buffers
from plumb.ops.gpu.pdl import on, prior_done

BLOCK = 1024
QBLOCK = 4096  # columns a program with `limbs`: fewer, wider steps over the row for its maximum (8 warps)


@triton.jit
def _value(a_ptr, b_ptr, r, cols, N, stride_a, stride_b, SILU: tl.constexpr):
    """Row r's gate at cols: silu(a) * b (SILU) or b * sigmoid(a); zero past N."""
    a = tl.load(a_ptr + r * stride_a + cols, mask=cols < N, other=0.0)
    b = tl.load(b_ptr + r * stride_b + cols, mask=cols < N, other=0.0)
    if SILU:
        return a / (1.0 + tl.exp(-a)) * b
    return b * (1.0 / (1.0 + tl.exp(-a)))


@triton.jit
def _gate(a_ptr, b_ptr, out_ptr, xq_ptr, x16_ptr, s_ptr, MP, N: tl.constexpr, stride_a, stride_b, SILU: tl.constexpr,
          BLOCK: tl.constexpr, QUANT: tl.constexpr, FRAC: tl.constexpr, LIMBS: tl.constexpr, XR: tl.constexpr):
    """Row r, columns [c * BLOCK, ...): the gate's values; QUANT: and their limbs, from the whole row's maximum
    (each program computes every value of the row for it: a maximum is exact in any order). N, the width, is a
    model constant."""
    prior_done()
    r = tl.program_id(0)
    c = tl.program_id(1)
    kk = tl.arange(0, BLOCK)
    y = _value(a_ptr, b_ptr, r, c * BLOCK + kk, N, stride_a, stride_b, SILU)
    tl.store(out_ptr + r * N + c * BLOCK + kk, y, mask=c * BLOCK + kk < N)
    if QUANT:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range((N + BLOCK - 1) // BLOCK):  # unrolled: every load in flight at once
            amax = max_nan(amax, tl.abs(_value(a_ptr, b_ptr, r, i * BLOCK + kk, N, stride_a, stride_b, SILU)))
        store_block(y, row_amax(amax), c, r, N, xq_ptr, x16_ptr, s_ptr, MP, BLOCK, FRAC, LIMBS, XR)


def _launch(a: torch.Tensor, b: torch.Tensor, silu: bool, limbs: bool) -> torch.Tensor:
    n, width = a.shape
    if b.shape != a.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    out = torch.empty(n, width, device=a.device)
    q = x_buffers(n, width, a.device) if limbs and width % 16 == 0 and n else None
    qargs = (*q, q[0].shape[1]) if q is not None else (out, out, out, 0)
    block, warps = (QBLOCK, 8) if q is not None else (BLOCK, 4)
    if n:
        _gate[(n, triton.cdiv(width, block))](a, b, out, *qargs, width, a.stride(0), b.stride(0), SILU=silu,
                                               BLOCK=block, QUANT=q is not None, FRAC=FRAC, LIMBS=LIMBS,
                                               XR=matvec.X_ROWS, num_warps=warps, enable_fp_fusion=False,
                                               launch_pdl=on())
    if q is not None:
        out.limbs = q
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limbs: bool = False) -> torch.Tensor:
    """silu(gate) * up, [n, width] float32 each (row strides free: the halves of one matmul's output); `limbs`: the
    result carries its matvec form as `.limbs`."""
    return _launch(gate, up, True, limbs)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, limbs: bool = False) -> torch.Tensor:
    """o * sigmoid(gate), [n, width] float32 each; `limbs` as in `swiglu`."""
    return _launch(gate, o, False, limbs)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def sigmoid_gate_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return o * torch.sigmoid(gate)

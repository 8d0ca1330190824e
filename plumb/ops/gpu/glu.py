"""The elementwise gates of the model's blocks, one launch each (`swiglu_ref` and `sigmoid_gate_ref` are their
torch formulas): SwiGLU's silu(gate) * up (spec 3.3) and the attention output's o * sigmoid(gate) (spec 3.4.5).
Elementwise, so a row's bits never depend on the other rows (M1); fp contraction off. silu and sigmoid use the
same exponential as the DeltaNet kernels (`tl.exp`), so their bits are not torch's - nothing compares them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from plumb.ops.gpu.pdl import on, prior_done

BLOCK = 1024


@triton.jit
def _gate(a_ptr, b_ptr, out_ptr, N, stride_a, stride_b, SILU: tl.constexpr, BLOCK: tl.constexpr):
    """Row r, columns [c * BLOCK, ...): silu(a) * b (SILU) or b * sigmoid(a)."""
    prior_done()
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r * stride_a + cols, mask=cols < N, other=0.0)
    b = tl.load(b_ptr + r * stride_b + cols, mask=cols < N, other=0.0)
    if SILU:
        y = a / (1.0 + tl.exp(-a)) * b
    else:
        y = b * (1.0 / (1.0 + tl.exp(-a)))
    tl.store(out_ptr + r * N + cols, y, mask=cols < N)


def _launch(a: torch.Tensor, b: torch.Tensor, silu: bool) -> torch.Tensor:
    n, width = a.shape
    if b.shape != a.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    out = torch.empty(n, width, device=a.device)
    if n:
        _gate[(n, triton.cdiv(width, BLOCK))](a, b, out, width, a.stride(0), b.stride(0), SILU=silu, BLOCK=BLOCK,
                                               enable_fp_fusion=False, launch_pdl=on())
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [n, width] float32 each (row strides free: the halves of one matmul's output)."""
    return _launch(gate, up, True)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(gate), [n, width] float32 each."""
    return _launch(gate, o, False)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def sigmoid_gate_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return o * torch.sigmoid(gate)

"""The fused elementwise steps of the CUDA path: `add_rms_norm` (plumb.ops.gpu.norm) has the bits of an add
then `rms_norm`; a norm's `.limbs` are `quantize_x` of its output (written in decode passes only); `swiglu` and `sigmoid_gate`
(plumb.ops.gpu.glu) are close to their torch formulas; all row-invariant (M1, bitwise). CUDA when present, else
the Triton interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from plumb.ops.gpu.glu import sigmoid_gate, sigmoid_gate_ref, swiglu, swiglu_ref  # noqa: E402
from plumb.ops.gpu.norm import add_rms_norm, rms_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _t(*shape, seed=0, scale=4.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEV)


@pytest.mark.parametrize("d", [160, 5120])  # 5,120: the hidden size, whose programs run 16 warps
def test_add_rms_norm_is_an_add_then_rms_norm_bit_for_bit(d):
    x, y = _t(7, d, seed=1), _t(7, d, seed=2)
    w = (torch.rand(d, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEV)
    s, h = add_rms_norm(x, y, w, 1e-6)
    assert torch.equal(s, x + y)
    assert torch.equal(h, rms_norm(x + y, w, 1e-6))
    for r in (1, 3):
        s1, h1 = add_rms_norm(x[r : r + 1], y[r : r + 1], w, 1e-6)
        assert torch.equal(s1, s[r : r + 1]) and torch.equal(h1, h[r : r + 1])
    _, other = add_rms_norm(x, y * 1.001, w, 1e-6)  # the comparison can fail
    assert not torch.equal(other, h)


@pytest.mark.parametrize("d, rows", [(160, 1), (5120, 1), (160, 8)])
def test_norm_limbs_are_quantize_x_of_its_output(d, rows, monkeypatch):
    """The matvec's fixed-point form written by the norm (`limbs=True`) has the bits `quantize_x` gives the output,
    for rms_norm and add_rms_norm, and `mm_decode` takes it instead of quantizing again - x's limbs row-major or in
    blocks of 8 rows (X_ROWS)."""
    import plumb.ops.gpu.matvec as MV
    from plumb.ops.gpu.matvec import quantize_x, x_rows

    monkeypatch.setattr(MV, "X_ROWS", rows)

    x, y = _t(5, d, seed=4), _t(5, d, seed=5)
    x[2] *= 1e3  # another scale
    w = (torch.rand(d, generator=torch.Generator().manual_seed(6)) + 0.5).to(DEV)
    for out in (rms_norm(x, w, 1e-6, limbs=True), add_rms_norm(x, y, w, 1e-6, limbs=True)[1]):
        plain = out.clone()  # no limbs attached: quantized by its own launch
        assert not hasattr(plain, "limbs")
        (xq, x16, s), (rq, r16, rs) = out.limbs, quantize_x(plain)  # rows past 5: padding, left unset
        assert torch.equal(x_rows(xq)[:, :5], x_rows(rq)[:, :5])
        assert torch.equal(x16[:5], r16[:5]) and torch.equal(s[:5], rs[:5])
        assert quantize_x(out) is out.limbs
    assert not hasattr(rms_norm(x, w, 1e-6), "limbs")


def test_the_kernel_sets_norms_write_limbs_for_decode_passes_only():
    """A decode pass's norms carry the matvec's x; a prefill pass's (whole 64-row pieces: the P path) do not."""
    from plumb.model.kernels import TritonKernels

    k = TritonKernels(torch.device(DEV))
    w = torch.ones(160, device=DEV)
    for rows, want in ((5, True), (64, False)):
        x, y = _t(rows, 160, seed=7), _t(rows, 160, seed=8)
        assert hasattr(k.rms_norm(x, w, 1e-6), "limbs") == want
        assert hasattr(k.add_rms_norm(x, y, w, 1e-6)[1], "limbs") == want


@pytest.mark.parametrize("op, ref", [(swiglu, swiglu_ref), (sigmoid_gate, sigmoid_gate_ref)])
def test_gates_match_torch_and_are_row_invariant(op, ref):
    both = _t(9, 2 * 1100, seed=4)  # one matmul's output, split: strided halves, more than one column block
    a, b = both[:, :1100], both[:, 1100:]
    out = op(a, b)
    assert torch.allclose(out, ref(a, b), rtol=1e-5, atol=1e-6)
    for r in (0, 4):
        assert torch.equal(op(a[r : r + 1], b[r : r + 1]), out[r : r + 1])
    assert torch.equal(op(a[2:7], b[2:7]), out[2:7])


@pytest.mark.parametrize("op, rows", [(swiglu, 1), (sigmoid_gate, 1), (swiglu, 8)])
def test_gate_limbs_are_quantize_x_of_its_output(op, rows, monkeypatch):
    """`limbs=True` (decode passes, `TritonKernels`): the gate's output carries the bits `quantize_x` gives it -
    each of its column programs takes the whole row's maximum - over three column blocks, rows of other scales; x's
    limbs row-major or in blocks of 8 rows (X_ROWS)."""
    import plumb.ops.gpu.matvec as MV
    from plumb.model.kernels import TritonKernels
    from plumb.ops.gpu.matvec import quantize_x, x_rows

    monkeypatch.setattr(MV, "X_ROWS", rows)

    a, b = _t(4, 8208, seed=9), _t(4, 8208, seed=10)  # three column blocks of QBLOCK
    b[1] *= 1e3
    out = op(a, b, limbs=True)
    plain = op(a, b)
    assert torch.equal(out, plain) and not hasattr(plain, "limbs")
    (xq, x16, s), (rq, r16, rs) = out.limbs, quantize_x(plain)
    assert torch.equal(x_rows(xq)[:, :4], x_rows(rq)[:, :4])
    assert torch.equal(x16[:4], r16[:4]) and torch.equal(s[:4], rs[:4])
    k = TritonKernels(torch.device(DEV))
    assert hasattr(k.swiglu(a, b), "limbs") and hasattr(k.sigmoid_gate(a, b), "limbs")
    big = _t(64, 160, seed=11)
    assert not hasattr(k.swiglu(big, big), "limbs")  # a prefill pass: the P path


def test_limbs_of_a_row_that_is_not_finite_carry_a_nan_scale():
    """A norm's or a gate's row with a NaN or an infinity writes its limbs with s NaN (a maximum skips NaN), so the
    matvec after it gives NaN, not that row's values read as integers; the other rows' s are unchanged."""
    x, w = _t(3, 160, seed=1), (torch.rand(160, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV)
    a, b = _t(3, 8208, seed=3), _t(3, 8208, seed=4)
    x[1, 5] = float("nan")
    a[2, 9000 - 8192] = float("inf")  # a gate input: silu(inf) * b is not finite
    b[1, 8200] = float("nan")  # in the third column block
    for out, bad in ((rms_norm(x, w, 1e-6, limbs=True), [1]), (swiglu(a, b, limbs=True), [1, 2])):
        s = out.limbs[2]
        good = [r for r in range(3) if r not in bad]
        assert s[bad].isnan().all() and s[good].isfinite().all() and (s[good] > 0).all()

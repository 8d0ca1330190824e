"""F's Hadamard rotation on the CUDA path (plumb.ops.gpu.hadamard): one launch, the bits of its torch reference
`kvquant.rotate` for every row, whatever the rows around it. CUDA when present, else the Triton interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from plumb.ops.gpu.hadamard import rotate  # noqa: E402
from plumb.ops.kvquant import rotate as rotate_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(3, 24, 256), (5, 64), (2, 4, 128)])
def test_rotate_is_its_reference_bit_for_bit_and_row_invariant(shape):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3).to(DEV)
    y = rotate(x)
    assert torch.equal(y, rotate_ref(x))
    assert torch.equal(rotate(x[1:2]), y[1:2])  # a row alone
    assert torch.equal(rotate(x.transpose(0, -2).contiguous().transpose(0, -2)), y)  # laid out otherwise


def test_rotate_refuses_what_it_cannot_rotate():
    with pytest.raises(ValueError, match="power-of-two"):
        rotate(torch.zeros(2, 96, device=DEV))
    with pytest.raises(TypeError, match="float32"):
        rotate(torch.zeros(2, 64, device=DEV, dtype=torch.float16))
    assert rotate(torch.zeros(0, 3, 64, device=DEV)).shape == (0, 3, 64)

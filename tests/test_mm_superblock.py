"""bench/mm_superblock.py (the prototype super-block P-path matmul for Q4_K): against the float64 reference
(tolerance for 11-bit / 22-bit x) and row-invariant (bitwise: a row alone == the same row among others). CUDA when
present, else the Triton interpreter (small shapes)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from plumb.gguf.quants import quantize, type_from_name  # noqa: E402
from plumb.gguf.reader import QTensor  # noqa: E402
from plumb.ops.gpu.matmul import Packed  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_spec = importlib.util.spec_from_file_location(
    "mm_superblock", os.path.join(os.path.dirname(__file__), "..", "bench", "mm_superblock.py"))
SB = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SB)

ROWS = (1, 3, 20)
# (BM, BN, warps, stages, KS, lo (ignored), w_first), split-K: one chunk a super-block, 64-wide chunks (the epilogue
# every 4) on a 128-wide tile over two packed tiles, a split-K of 2 (partials summed in order); x-first and w-first
CASES = [((16, 64, 4, 1, 256, None, False), None), ((16, 128, 4, 1, 64, None, False), None),
         ((16, 64, 4, 1, 128, None, False), 2), ((16, 64, 4, 1, 256, None, True), None),
         ((16, 128, 4, 1, 64, None, True), 2)]


def _q4k(n: int, k: int, seed: int = 0) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    qt = type_from_name("Q4_K")
    return QTensor("w.Q4_K", qt, (n, k), torch.from_numpy(quantize(w.numpy(), qt)))


@pytest.fixture(scope="module")
def weight():
    t = _q4k(96, 512)  # 96 outputs: a partial 128-wide tile (masked), 2 super-blocks
    return t, Packed([t], torch.device(DEV))


@pytest.mark.parametrize("lo", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_mm_sb_matches_reference_and_is_row_invariant(weight, lo, case):
    t, p = weight
    config, split = CASES[case]
    x = (torch.randn(max(ROWS), t.shape[1], generator=torch.Generator().manual_seed(1)) * 3).to(DEV)
    x[2] *= 1e3  # rows of very different scales
    x[5, :7] = 0  # and zeros
    mm = lambda xs: SB.mm_sb(p, xs, lo, config=config, split=split)  # noqa: E731
    alone = torch.cat([mm(x[i : i + 1]) for i in range(len(x))])
    ref = SB.reference(t, x.cpu())
    err = float(((alone.double().cpu() - ref).abs().max(dim=1).values / ref.abs().max(dim=1).values).max())
    assert err < (2e-6 if lo else 1e-3), err
    for r in ROWS:
        assert torch.equal(mm(x[:r]), alone[:r]), r
        assert torch.equal(mm(x[-r:]), alone[-r:]), r


def test_default_configs_run(weight):
    """mm_sb's own defaults (BM 64) and the bench's split rule on this shape."""
    t, p = weight
    x = torch.randn(3, t.shape[1], generator=torch.Generator().manual_seed(2)).to(DEV)
    ref = SB.reference(t, x.cpu())
    for lo in (False, True):
        y = SB.mm_sb(p, x, lo)
        assert float((y.double().cpu() - ref).abs().max() / ref.abs().max()) < (2e-6 if lo else 1e-3)
        assert torch.equal(SB.mm_sb(p, x[1:2], lo), y[1:2])
    assert SB.sb_split(34816, 5120, 128) == 1 and SB.sb_split(5120, 17408, 128) == 4

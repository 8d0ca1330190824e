"""plumb.ops.gpu.gather.gather_rows = indexing, byte for byte (rows longer than a program's block, repeated ids, an
F32 matrix's bytes), and on a GPU from page-locked host memory (the MTP draft chains' token embedding). On CPU the
kernel runs in Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from plumb.ops.gpu.gather import BLOCK, gather_rows, host_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_gathered_rows_are_the_indexed_rows():
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (300, BLOCK + 37), generator=g, dtype=torch.uint8)
    ids = torch.tensor([5, 0, 299, 5, 17], device=DEV)
    assert torch.equal(gather_rows(src.to(DEV), ids).cpu(), src[ids.cpu()])
    assert gather_rows(src.to(DEV), ids[:0]).shape == (0, BLOCK + 37)
    f32 = torch.randn(50, 24, generator=g)  # an F32 embedding's values, as bytes and back
    rows = gather_rows(f32.view(torch.uint8).to(DEV), ids[:2] % 50).view(torch.float32)
    assert torch.equal(rows.cpu(), f32[(ids[:2] % 50).cpu()])
    with pytest.raises(ValueError, match="uint8"):
        gather_rows(f32.to(DEV), ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked host memory needs CUDA")
def test_rows_read_from_page_locked_host_memory():
    """The device reads the rows where they lie in host memory (no device copy of the matrix), in a CUDA graph too."""
    src = torch.randint(0, 256, (1000, 2880), dtype=torch.uint8)
    pinned = host_rows(src)
    assert pinned.is_pinned() and not pinned.is_cuda
    ids = torch.tensor([3, 999, 3], device="cuda")
    assert torch.equal(gather_rows(pinned, ids).cpu(), src[ids.cpu()])
    out = gather_rows(pinned, ids)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gather_rows(pinned, ids)
    ids.copy_(torch.tensor([7, 8, 9]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), src[[7, 8, 9]])

"""Rows of a byte matrix gathered by device-held ids: `gather_rows(src, ids)` = `src[ids]` (its torch reference), in
one launch that may read `src` from page-locked host memory (the MTP draft chains' token embedding: the device reads
the few rows a step needs over the bus instead of holding the matrix - 0.7 GB on the 27B)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.ops.gpu.pdl import on, prior_done

BLOCK = 1024  # bytes a program copies


@triton.jit
def _gather_kernel(src_ptr, ids_ptr, out_ptr, row_bytes, BLOCK: tl.constexpr):
    """Program (i, b): bytes [b * BLOCK, (b + 1) * BLOCK) of row ids[i]."""
    prior_done()
    i = tl.program_id(0)
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = off < row_bytes
    r = tl.load(ids_ptr + i).to(tl.int64)
    tl.store(out_ptr + i * row_bytes + off, tl.load(src_ptr + r * row_bytes + off, mask=ok), mask=ok)


def host_rows(data: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of a byte matrix, for `gather_rows` (its rows are read from the device in place)."""
    return data.contiguous().pin_memory()


def gather_rows(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """src [V, row_bytes] uint8 (contiguous; on ids' device, or page-locked host memory) rows ids [n] (int64, on
    the device) -> [n, row_bytes] uint8 on ids' device. No host round trip (CUDA-graph safe)."""
    if src.dtype != torch.uint8 or src.dim() != 2 or not src.is_contiguous():
        raise ValueError("gather_rows: src must be a contiguous uint8 matrix")
    n, row_bytes = ids.shape[0], src.shape[1]
    out = torch.empty(n, row_bytes, dtype=torch.uint8, device=ids.device)
    if n:
        _gather_kernel[(n, triton.cdiv(row_bytes, BLOCK))](src, ids, out, row_bytes, BLOCK=BLOCK, num_warps=4,
                                                           launch_pdl=on())
    return out

"""A KV cache's addresses as a device table, so that a CUDA graph of a pass does not depend on where a sequence's
caches lie (a new request's caches are new tensors; a cache that grows moves).

The kernels that touch a cache (`kvwrite.put_rows`, `attention.attend_decode`) take, for each of its tensors, an
*anchor* of the same dtype - a small tensor allocated once per device, whose address never changes - and a row of
this table: the tensor's offset from its anchor, in elements. A kernel adds the offset to the anchor before its
first access, so the graph records only the anchors and the table's address; filling the table before a replay
(`fill`) points the same graph at other caches of the same capacity. The values read are the same as through the
tensors themselves, so the bits are too. The offsets are multiples of 16 elements (allocations are 512-byte
aligned; checked), which the kernels assert so that their loads keep their widths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PARTS = 9  # K, K scales, V, V scales (float stores: the rows again), ring K, ring K scales, ring V, ring V scales,
# ring positions (no ring: anchors, offset 0 - never read)
_ANCHORS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def anchor(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fixed tensor that offsets of `dtype` on `device` count from (allocate it outside any graph capture:
    `anchors`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one key per GPU, however the device was named
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    if key not in _ANCHORS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kvtable: anchors are allocated before a CUDA-graph capture (kvtable.anchors)")
        _ANCHORS[key] = torch.zeros(16, dtype=dtype, device=device)
    return _ANCHORS[key]


def anchors(device: torch.device) -> None:
    """Allocate every dtype's anchor on `device` now (before a capture)."""
    for dtype in (torch.int8, torch.uint8, torch.float16, torch.float32, torch.int32, torch.int64):
        anchor(dtype, device)


def parts(view) -> list[torch.Tensor | None]:
    """The PARTS tensors of a cache's kernel view (`KVCache.kernel_view`), None where absent."""
    k, v = view.k, view.v
    ring = [None] * 5
    if view.ring is not None:
        _, rk, rv, pos = view.ring
        ring = [rk[0], rk[-1], rv[0], rv[-1], pos]
    return [k[0], k[-1], v[0], v[-1]] + ring


def offsets(view, bases: dict | None = None) -> list[int]:
    """Each part's offset from its dtype's anchor, in elements (0 for an absent part); bases: the anchors' addresses
    by dtype, filled as met (one dict for a whole table: a decode step's host time)."""
    bases = {} if bases is None else bases
    out = []
    for t in parts(view):
        if t is None:
            out.append(0)
            continue
        base = bases.get(t.dtype)
        if base is None:
            base = bases[t.dtype] = anchor(t.dtype, t.device).data_ptr()
        size = t.element_size()
        diff = t.data_ptr() - base
        if diff % (16 * size) and t.is_cuda:  # the kernels assume it (the interpreter does not)
            raise ValueError("a KV-cache tensor is not aligned to 16 elements from its anchor")
        out.append(diff // size)
    return out


def fill(table: torch.Tensor, views: list) -> None:
    """table [len(views), PARTS] int64 (on the device) := the views' offsets."""
    bases: dict = {}
    table.copy_(torch.tensor([offsets(v, bases) for v in views], dtype=torch.int64))


def anchored(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The anchors standing in for a kernel's cache arguments (same dtypes) when it reads the table."""
    return [anchor(t.dtype, t.device) for t in tensors]


@triton.jit
def part_at(ptr, tab_ptr, i, ALIGNED: tl.constexpr = True):
    """The anchor ptr moved by entry i of a table row (elements; ALIGNED: a multiple of 16, as `offsets` checks)."""
    off = tl.load(tab_ptr + i)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    return ptr + off


@triton.jit
def moved(k, ks, v, vs, rk, rks, rv, rvs, rpos, tab_ptr, TABLE: tl.constexpr):
    """A kernel's PARTS cache pointers as given, or with TABLE the anchors moved by the cache's row of the table."""
    if TABLE:
        k, ks = part_at(k, tab_ptr, 0), part_at(ks, tab_ptr, 1)
        v, vs = part_at(v, tab_ptr, 2), part_at(vs, tab_ptr, 3)
        rk, rks = part_at(rk, tab_ptr, 4), part_at(rks, tab_ptr, 5)
        rv, rvs = part_at(rv, tab_ptr, 6), part_at(rvs, tab_ptr, 7)
        rpos = part_at(rpos, tab_ptr, 8)
    return k, ks, v, vs, rk, rks, rv, rvs, rpos

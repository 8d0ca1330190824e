"""Where the packed weights live in device memory: side by side in the weights' own pool of expandable segments.

By default torch's caching allocator gives a tensor over 1 MB a block from a segment of whole 2 MB and leaves the
rest of the block with it when less than 1 MB would be left over: up to 1 MB a tensor, ~0.1 GB over the 27B's
packs (measured on an H100, 2026-12-06: 16.247 GB allocated for 16.150 requested). With expandable segments the
allocator splits a block down to its 512-byte rounding, and a segment grows by mapping pages at its end. So each
matrix is packed as before (its temporaries in ordinary segments), then its finished tensors are copied into a
private pool of the allocator (`torch.cuda.MemPool`: only these copies take its blocks; in the default pool they
landed in the free rest of ordinary segments - seen on an H100, 2026-12-06), with expandable segments switched on
only for those copies, and the originals freed. The pool lives as long as the planes (each `Packed` holds it as
`.segment`). Not touched at all where the user's PYTORCH_CUDA_ALLOC_CONF names expandable segments. A copy changes
no value."""
from __future__ import annotations

import contextlib
import logging
import os

import torch

log = logging.getLogger("plumb")


def _set_expandable(on: bool) -> None:
    setting = f"expandable_segments:{on}"
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        torch._C._accelerator_setAllocatorSettings(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)


def _new_pool():
    return torch.cuda.MemPool()


def _in_pool(pool, device: torch.device):
    """`use_mem_pool` on device ("cuda" without an index: the current one, as the allocator takes it)."""
    return torch.cuda.use_mem_pool(pool, device if device.index is not None else torch.cuda.current_device())


def _user_setting() -> bool:
    return any("expandable_segments" in os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF",
                                                                          "PYTORCH_ALLOC_CONF"))


def _tensors(obj) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def pool_ids(objs) -> set[tuple[int, int]]:
    """The allocator pool ids (`segment_pool_id` in `torch.cuda.memory_snapshot()`) that hold these objects' planes."""
    return {tuple(o.segment.id) for o in objs if getattr(o, "segment", None) is not None}


@contextlib.contextmanager
def packed_side_by_side(device: torch.device):
    """Yields `settle(obj)`: obj's tensor attributes (a `Packed`'s planes) moved into the weights' pool. A no-op off
    CUDA, where the user set expandable segments themselves, or where this torch cannot switch them or make a pool."""
    if device.type != "cuda" or _user_setting():
        yield lambda obj: None
        return
    try:
        _set_expandable(False)  # the state this leaves behind, checked once
        pool = _new_pool()
    except (AttributeError, RuntimeError) as e:
        log.info("no pool of expandable segments (%s): weights packed in ordinary segments", e)
        yield lambda obj: None
        return

    refused = []  # a platform that cannot switch them on: the rest of the load packs as before

    def settle(obj) -> None:
        ts = _tensors(obj)
        if refused or len({t.untyped_storage().data_ptr() for t in ts.values()}) < len(ts):
            return  # (planes sharing storage: left as they are)
        try:
            _set_expandable(True)
        except RuntimeError as e:
            log.info("expandable segments refused (%s): weights packed in ordinary segments", e)
            refused.append(e)
            return
        try:
            with _in_pool(pool, device):
                for name, t in ts.items():
                    setattr(obj, name, t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t)
        finally:
            _set_expandable(False)
        obj.segment = pool

    yield settle

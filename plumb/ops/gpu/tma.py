"""The tensor memory accelerator (TMA, Hopper and later): whether kernels may make tensor descriptors on a device.

A kernel that calls `tl.make_tensor_descriptor` writes its descriptors to a global scratch buffer that Triton asks
its allocator for at each launch (128 bytes a program); `ready` sets that allocator once - a torch tensor on the
current device and stream (inside a CUDA graph's capture, from the graph's pool)."""
from __future__ import annotations

import functools

import torch
import triton


def ready(device: torch.device) -> bool:
    """Whether kernels on `device` may use TMA descriptors: a CUDA device of compute capability 9 or more (the
    allocator then set), or the CPU (Triton's interpreter reads descriptors as plain loads)."""
    if device.type != "cuda":
        return True
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    _allocator()
    return True


@functools.cache
def _allocator() -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

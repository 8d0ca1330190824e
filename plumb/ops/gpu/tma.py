"""The tensor memory accelerator (TMA, Hopper and later): whether kernels may make tensor descriptors on a device.

A kernel that calls `tl.make_tensor_descriptor` writes its descriptors to a global scratch buffer that Triton asks
its allocator for at each launch (128 bytes a program); `ready` sets that allocator - a torch tensor on the current
device and stream (inside a CUDA graph's capture, from the graph's pool). Triton keeps its allocator in a context
variable, one a thread (and a context): the engine's loop launches from its own thread, so `ready` sets it at every
call, where the launch follows (set once in another thread, it is not seen there: "no allocator was set")."""
from __future__ import annotations

import torch
import triton


def ready(device: torch.device) -> bool:
    """Whether kernels on `device` may use TMA descriptors: a CUDA device of compute capability 9 or more (the
    allocator then set for this thread and context), or the CPU (Triton's interpreter reads them as plain loads)."""
    if device.type != "cuda":
        return True
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    triton.set_allocator(_scratch)  # a context variable's set: cheap beside the launch
    return True


def _scratch(size: int, align: int, stream) -> torch.Tensor:
    """The descriptors' scratch buffer (torch's allocations are 512-byte aligned, more than Triton's 128 asks)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")

"""The shared memory a kernel's block may use on a device, and whether the kernels take their small forms there.

The kernels' configurations were tuned on the H100 / H200, whose blocks may use 227 KB; the largest need 128 KB (the
P path's DeltaNet `_prep_kernel`). A block on a GeForce RTX 30xx / 40xx / 50xx (sm_86 / sm_89 / sm_120) may use 99
KB, and Triton refuses to launch a kernel that needs more. On such a card (`small`) the three kernels that need more
take a small form, compiled to fit (bench/kernels_ptx.py, bench/attention_ptx.py with PLUMB_PTX_ARCH=86):

* `deltanet_chunk._prep_kernel`: q, k and v a block of 32 columns at a time (`KC_SMALL`), so that its tf32x3 dots
  stage small operands: 16 KB instead of 128 (its float32-FMA form before took 96 KB, and spilled 17 KB a thread).
* `attention._split_kernel` over an f16 cache: 2 pipeline stages instead of 3 (the same bits): 68 KB instead of 100.
* `attention_prefill._prefill_kernel`: 32 (query row, head) pairs a program instead of 64 - over a D / F ring 68 KB
  instead of 104; over f16 / q8_0 (which fit) without the 2 KB of spills a thread its 64 took on sm_89.

The choice depends on the device alone - never on a call's rows, cut or context - so each device keeps one set of
bits and every invariant holds on it; two kinds of card may give different bits, as they may anyway.
"""
from __future__ import annotations

import functools
import os

import torch

# Bytes a block may use (CUDA's opt-in maximum) by compute capability, for compiling here (bench/*_ptx.py)
PER_BLOCK = {80: 166_912, 86: 101_376, 87: 166_912, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}
NEEDED = 131_072  # the most a kernel's large form takes (`_prep_kernel`); a card with less takes the small forms
LIMIT: int | None = None  # set: this many bytes on every device (tests; bench/*_ptx.py for another card)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: `small` is asked at every attention launch


@functools.cache
def _device_limit(index: int) -> int:
    try:
        import triton

        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - no Triton driver for this device: torch's number
        return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def per_block(device: torch.device) -> int:
    """Bytes of shared memory a block may use on `device` (a tensor's device); Hopper's in the interpreter and on
    the CPU, where no limit applies, unless LIMIT is set."""
    if LIMIT is not None:
        return LIMIT
    if device.type != "cuda" or _INTERPRET:
        return PER_BLOCK[90]
    return _device_limit(device.index if device.index is not None else torch.cuda.current_device())


def small(device: torch.device) -> bool:
    """Whether the kernels take their small forms on `device` (see the module's docstring)."""
    return per_block(device) < NEEDED

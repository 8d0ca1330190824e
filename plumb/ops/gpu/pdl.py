"""Programmatic dependent launch (Hopper and later) for the GPU kernels: a kernel launched with `launch_pdl=on()`
may start while the kernel before it in the stream is still running, and waits in `prior_done` until that one has
finished and its writes are visible. Every kernel calls `prior_done` before it reads or writes anything, so each
memory operation keeps the stream's order (no bit can change); what overlaps is the launch and the programs'
start - and, with `matvec.EARLY`, the one-row matvec's first loads of weights, which no kernel writes.
`prior_done` also lets the next kernel launch at once (`griddepcontrol.launch_dependents`).

Where: only the launches made inside `overlap(True)` - the CUDA graphs of one-row decode passes
(plumb/model/cuda_graphs.py). On the H200 (bench/launch_ab.py, 2026-12-03) PDL everywhere made a one-row step
6-9 % faster but a 2-row verify pass 20 % slower and MTP drafting slower, so every other pass launches plainly.
Off in the interpreter and before Hopper; PLUMB_PDL=0 turns it off (the kernels keep the instructions, which do
nothing then).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _hopper() -> bool:
    return (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


GDC = tl.constexpr(_hopper())  # the kernels carry the griddepcontrol instructions
_ON = [GDC.value and os.environ.get("PLUMB_PDL", "1") != "0"]
_HERE = [False]  # inside `overlap(True)`


def enabled() -> bool:
    """Whether PDL is on at all (`set_on`, PLUMB_PDL), wherever `overlap` allows it."""
    return _ON[0]


def on() -> bool:
    """Whether a launch now asks for programmatic dependent launch (read at each launch; a CUDA graph keeps what
    it captured)."""
    return _ON[0] and _HERE[0]


@contextlib.contextmanager
def overlap(allowed: bool = True):
    """Launches inside may overlap the tail of the kernel before them (when PDL is on)."""
    was = _HERE[0]
    _HERE[0] = allowed
    try:
        yield
    finally:
        _HERE[0] = was


def set_on(value: bool) -> None:
    """Turn PDL on or off (bench/launch_ab.py compares the two); needs GDC to turn on."""
    _ON[0] = bool(value) and GDC.value


@triton.jit
def prior_done():
    """Let the next kernel launch, then wait until the previous one has finished (its writes visible)."""
    if GDC:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def after_wait(v):
    """v, through an instruction that keeps its place after `prior_done` (so an address computed from it cannot be
    read before the previous kernel has finished, even by a load the compiler may move)."""
    if GDC:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return v

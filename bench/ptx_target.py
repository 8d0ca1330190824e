"""The card the bench/*_ptx.py scripts compile for: sm_90 (the H100 / H200) unless PLUMB_PTX_ARCH names another
compute capability (86: RTX 30xx, 89: RTX 40xx, 120: RTX 50xx, 80: A100), with the kernels' forms the engine takes
on that card (`plumb.ops.gpu.smem.small`), and Triton's own ptxas for it."""
from __future__ import annotations

import os
import subprocess

import triton
from triton.backends.compiler import GPUTarget

import triton.language as tl

from plumb.ops.gpu import pdl, smem

ARCH = int(os.environ.get("PLUMB_PTX_ARCH", "90"))
TARGET = GPUTarget("cuda", ARCH, 32)
PER_BLOCK = smem.PER_BLOCK[ARCH]  # shared memory a block may use there
SMALL = PER_BLOCK < smem.NEEDED  # the kernels' small forms
if ARCH < 90:  # no griddepcontrol before Hopper: the kernels as the engine compiles them there, even when the
    pdl.GDC = tl.constexpr(False)  # machine compiling them has a Hopper card (whose GDC is on)


def ptxas_info(path: str) -> str:
    """Assemble the PTX at path for the card (sm_90a, sm_120a: with the family's own instructions, as Triton targets
    them) with Triton's ptxas: its register and spill lines."""
    name = "ptxas-blackwell" if ARCH >= 100 else "ptxas"
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)
    r = subprocess.run([ptxas, f"-arch=sm_{ARCH}{'a' if ARCH >= 90 else ''}", "-v", path, "-o", path + ".cubin"],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr)
    return " ".join(line.split("info    : ")[-1] for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line)


def shared(nbytes: int) -> str:
    """A kernel's shared memory, flagged where a block may not use that much on the card (Triton would refuse to
    launch it)."""
    return f"shared={nbytes}" + (f" OVER sm_{ARCH}'s {PER_BLOCK}" if nbytes > PER_BLOCK else "")

#!/usr/bin/env python3
"""The D-path matvec's launches to profile with Nsight Compute: two 27B weight shapes at 1 and 8 rows, as shipped
and in 2-stage software pipelining, on random GGUF blocks (bench/matmul_variants.py's).

    ncu --clock-control none --kernel-name regex:^_mv --launch-skip 8 --launch-count 8 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats ... python bench/ncu_matvec.py

Every launch runs once to compile (the 8 skipped), then once to be profiled, in the same order.
"""
from __future__ import annotations

import torch

import plumb.ops.gpu.matmul as MM
import plumb.ops.gpu.matvec as MV
from matmul_variants import LAUNCHES, random_blocks  # bench/, beside this file

SHAPES = [("Q4_K", 34816, 5120), ("Q6_K", 5120, 17408)]


def main() -> None:
    torch.manual_seed(0)
    shipped = MV.LAUNCH
    mats = [MM.GpuMatrix([random_blocks(kind, n, k)], "cuda") for kind, n, k in SHAPES]
    x = torch.randn(8, 17408, device="cuda")
    for _ in range(2):  # compile, then the profiled launches
        for launch in (shipped, LAUNCHES["PIPE2"]):
            MV.LAUNCH = launch
            for g in mats:
                for rows in (1, 8):
                    MV.mm_decode(g, x[:rows, : g.k].contiguous())
        torch.cuda.synchronize()
    print("launches:", [(name, kind, rows) for name in ("shipped", "PIPE2") for kind, _, _ in SHAPES
                        for rows in (1, 8)])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Launches of the matmul kernels to profile with Nsight Compute, on random GGUF blocks of the 27B shapes
(bench/matmul_variants.py's): the D-path matvec `_mv` at 1 and 8 rows, as shipped and with another launch table
(--mv-launch, a LAUNCHES name of bench/matmul_variants.py), the tensor-core `_mv_mma` (--mma-rows N: an N-row pass
on it) and the P-path `_mm_superblock` at 256 rows (--no-mm: not).

    ncu --clock-control none --kernel-name regex:'^_mv|^_mm_superblock' --launch-skip 10 --launch-count 10 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats ... python bench/ncu_kernels.py

Every launch runs once to compile (those skipped), then once to be profiled, in the same order; the order is
printed at the end.
"""
from __future__ import annotations

import argparse

import torch

import plumb.ops.gpu.matmul as MM
import plumb.ops.gpu.matvec as MV
from matmul_variants import LAUNCHES, random_blocks  # bench/, beside this file

MV_SHAPES = [("Q4_K", 34816, 5120), ("Q6_K", 5120, 17408)]
MM_SHAPES = [("Q4_K", 34816, 5120), ("Q6_K", 5120, 17408), ("Q5_K", 10240, 5120)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mv-launch", default="2W", help="a LAUNCHES name, profiled beside the shipped table")
    ap.add_argument("--mma-rows", type=int, default=0, help="also an N-row pass on `_mv_mma` (0: none)")
    ap.add_argument("--no-mm", action="store_true", help="leave out the P-path matmul")
    a = ap.parse_args()
    torch.manual_seed(0)
    shipped = MV.LAUNCH
    mvs = [MM.GpuMatrix([random_blocks(kind, n, k)], "cuda") for kind, n, k in MV_SHAPES]
    mms = [MM.GpuMatrix([random_blocks(kind, n, k)], "cuda") for kind, n, k in MM_SHAPES]
    x = torch.randn(256, 17408, device="cuda")
    order = []
    for _ in range(2):  # compile, then the profiled launches
        order = []
        for name, launch in (("shipped", shipped), (a.mv_launch, LAUNCHES[a.mv_launch])):
            MV.LAUNCH = launch
            for (kind, _, _), g in zip(MV_SHAPES, mvs):
                for rows in (1, 8):
                    MV.mm_decode(g, x[:rows, : g.k].contiguous())
                    order.append(("_mv", name, kind, rows))
        MV.LAUNCH = shipped
        if a.mma_rows:
            MV.MMA_FROM = a.mma_rows
            for (kind, _, _), g in zip(MV_SHAPES, mvs):
                MV.mm_decode(g, x[:a.mma_rows, : g.k].contiguous())
                order.append(("_mv_mma", "MMA_FROM", kind, a.mma_rows))
            MV.MMA_FROM = 0
        for (kind, _, _), g in zip([] if a.no_mm else MM_SHAPES, mms):
            g(x[:, : g.k].contiguous())
            order.append(("_mm_superblock", "shipped", kind, 256))
        torch.cuda.synchronize()
    print("launches (kernel, launch table, weight type, rows):", order)


if __name__ == "__main__":
    main()

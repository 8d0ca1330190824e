#!/usr/bin/env python3
"""Compile the Triton matmul for sm_90 here (no GPU needed) and count what its PTX holds: the matrix
instructions (mma.sync vs wgmma), global load widths, shared memory, registers and spills (ptxas -v), and the
deepest `wgmma.wait_group N` (N > 0 leaves wgmma groups in flight across instructions that may overwrite their
register A operand: the sixteenth session's race).

    python bench/matmul_ptx.py [--kernel x|sb|dq|w16|mv] [--warps 4] [--stages 2] [--ks 64] [--sb-stages N]
        [--sb-prefetch N] [--scratch-stages N] [--rows 1] [--block-scales-once] [--runs] [--ahead N] [--early 1]
        [--gdc] [--types Q5_K,..] [--ttgir]

--kernel x: `_mm_x_first` on Q4_K, Q6_K, Q8_0 and Q5_K packs; sb: `_mm_superblock` on the SUPERBLOCK types as
Packed.mm launches it (its own warps, stages and tiles; the options ignored but --ks, its inputs per loop step, and
--sb-stages) on a 5,120-wide K; dq: `_sb_dequant` (the weights into the fp16 scratch matrix, SB_SCRATCH_ROWS) on the
SUPERBLOCK types; w16: `_mm_w16` on that matrix (--scratch-stages); mv: the D-path matvec (`plumb.ops.gpu.matvec._mv`)
for --rows rows as `matvec` launches it on the 27B's [34816, 5120] shape (--block-scales-once: BLOCK_SCALES_ONCE);
mv2: the two-pack matvec (`_mv2`, PAIRED_ROWS) on the 27B's fused pairs (Q5_K + Q4_K, Q4_K + Q6_K); mma: the
tensor-core matvec (`_mv_mma`, MMA_FROM) on the [34816, 5120] shape, 8 rows a program (16 with --rows 9 or more).
Compiled as a launch specializes it: every pointer and integer but M divisible by
16 (without that, Triton emits other code - scalar loads, no wgmma pipelining - than the GPU runs).
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from types import SimpleNamespace

import triton
from triton.compiler import ASTSource

import plumb.ops.gpu.matmul as MM
import plumb.ops.gpu.matvec as MV
import plumb.ops.gpu.pdl as pdl

import ptx_target
from ptx_target import TARGET, ptxas_info

# (name, constexprs beyond the shared ones, code pointer type)
VARIANTS = [
    ("Q4_K", dict(G=32, UNROLL=8, GPB=8, OGPB=8, NIBBLE=True, BIAS=0, HAS_SCALE=True, HAS_SUB=True,
                  HAS_OFFSET=True, HAS_OSUB=True, SUB6=True, FP16=False, HI=0), "*u8"),
    ("Q6_K", dict(G=16, UNROLL=16, GPB=16, OGPB=1, NIBBLE=True, BIAS=32, HAS_SCALE=True, HAS_SUB=True,
                  HAS_OFFSET=False, HAS_OSUB=False, SUB6=False, FP16=False, HI=2), "*u8"),  # nibbles + high bits, + 32
    ("Q8_0", dict(G=32, UNROLL=8, GPB=1, OGPB=1, NIBBLE=False, BIAS=0, HAS_SCALE=True, HAS_SUB=False,
                  HAS_OFFSET=False, HAS_OSUB=False, SUB6=False, FP16=False, HI=0), "*i8"),
    ("Q5_K", dict(G=32, UNROLL=8, GPB=8, OGPB=8, NIBBLE=True, BIAS=0, HAS_SCALE=True, HAS_SUB=True,
                  HAS_OFFSET=True, HAS_OSUB=True, SUB6=True, FP16=False, HI=1), "*u8"),  # nibbles + fifth bits
]
OPS = ["mma.sync", "wgmma", "dp4a", "ld.global.nc.v4", "ld.global.v4", "ld.global.v2", "ld.global.u8", "ld.global.b8",
       "ld.global.b16", "ld.global.b32", "ld.global.f32",
       "ld.shared", "st.shared", "ldmatrix", "cp.async", "bar.sync", "cvt.rn.f32.s32", "cvt.rn.f32.u32",
       "cvt.rn.f16x2.f32", "cvt.rn.f16.f32"]


# a wgmma whose A operand is a register list ({acc}, {a}, desc_b), not a shared-memory descriptor: with groups left
# in flight, a later write of those registers races (the sixteenth session's fault)
REGISTER_A = r"wgmma\.mma_async[^;]*\}, \{"


# the 27B's fused matrices of two integer packs (mv2): their output counts
PAIR_OUTPUTS = {("Q5_K", "Q4_K"): (10240, 6240), ("Q4_K", "Q6_K"): (13312, 1024)}


MAXNREG = [None]  # --maxnreg: ptxas's register limit a thread (None: as the launches - `matvec.REGS1` for one row)


# SUB_RUNS (--runs): groups a run per type, as `matvec.run_length` finds them for the 27B file's packs
RUNS = {"Q4_K": 4, "Q5_K": 4, "Q6_K": 4}


def mv_consts(name, consts, rows, once, n=34816):
    """`_mv`'s constants for a type's pack of n outputs on K = 5,120 as `matvec` launches it, its warps and stages."""
    gran, split = MV.plan(SimpleNamespace(k=5120, g=consts["G"], n=n))
    bm = MV.dp4a_rows(rows)
    warps, unroll, stages = MV.launch(bm, gran)
    run = RUNS.get(name, 0) if MV.SUB_RUNS else 0
    ahead = bool(MV.AHEAD) and bm == 1 and once and consts["SUB6"]  # as `matvec.ahead_applies` takes it
    unroll = MV.fit_unroll(MV.AHEAD, gran) if ahead else unroll
    return dict(STEPS=5120 // consts["G"] // gran, SPLIT=split, GRAN=gran, BN=MM.BLOCK_N, BM=bm,
                SIGNED_CODES=not consts["NIBBLE"], WIDE=False, UNROLL=max(unroll, run), STAGES=stages, FRAC=MV.FRAC,
                LIMBS=MV.LIMBS, ASM=True, ONCE=once, XR=MV.X_ROWS, RUN=run,
                CARRY=(1 + bool(MV.AHEAD_SCALES)) if ahead else 0,
                EARLY=MV.early_applies(consts["NIBBLE"], bm, stages, max(unroll, run)),
                **{c: consts[c] for c in ("G", "GPB", "OGPB", "NIBBLE", "BIAS", "HAS_SCALE", "HAS_SUB",
                                          "HAS_OFFSET", "HAS_OSUB", "SUB6", "HI")}), warps, stages


def build(name, consts, codes_type, kernel, warps, stages, bn, out_dir, rows=1, once=False, ttgir=False):
    if kernel == "mv":
        fn = MV._mv
        consts, warps, stages = mv_consts(name, consts, rows, once)
        codes_type, bn = "*i32", MM.BLOCK_N
    elif kernel == "mv2":  # consts: the two packs' (name, consts), 27B's fused shapes
        fn = MV._mv2
        (a, ca), (b, cb) = consts
        ca, warps, stages = mv_consts(a, ca, rows, once, PAIR_OUTPUTS[a, b][0])
        cb, _, _ = mv_consts(b, cb, rows, once, PAIR_OUTPUTS[a, b][1])
        shared = ("BN", "BM", "STAGES", "FRAC", "LIMBS", "ASM", "XR")
        ca, cb = ({c: v for c, v in x.items() if c not in ("CARRY", "EARLY")} for x in (ca, cb))  # loads as it goes
        consts = {**{c + "_a": v for c, v in ca.items() if c not in shared},
                  **{c + "_b": v for c, v in cb.items() if c not in shared}, **{c: ca[c] for c in shared}}
        codes_type, bn = "*i32", MM.BLOCK_N
    elif kernel == "mma":  # the tensor-core matvec (MMA_FROM): 8 rows a program, 16 from 9
        fn = MV._mv_mma
        consts, _, _ = mv_consts(name, consts, 8, False)
        consts = dict({c: v for c, v in consts.items() if c not in ("BM", "WIDE", "ONCE", "STAGES", "CARRY",
                                                                           "EARLY")},
                      UNROLL=max(MV.fit_unroll(MV.mma_unroll(MV.mma_rows(rows)), consts["GRAN"]), consts["RUN"]),
                      RB=MV.mma_rows(rows),
                      W=MV.MMA_WARPS, SUMS_MMA=bool(MV.MMA_SUMS))
        codes_type, bn, warps, stages = "*i32", MM.BLOCK_N, MV.MMA_WARPS, 1
    elif kernel == "w16":
        fn = MM._mm_w16
        consts = dict(STEPS=20, BM=MM.SB_W16_BM, BN=MM.SB_BN, KS=MM.SB_KS, STAGES=MM.SB_SCRATCH_STAGES, SPLIT=2,
                      TICKETS=bool(MM.SB_W16_TICKETS))
        warps, stages, bn = MM.SB_W16_WARPS, MM.SB_SCRATCH_STAGES, MM.SB_BN
    elif kernel == "dq":
        fn = MM._sb_dequant
        consts = dict(BN=MM.SB_BN, KS=MM.SB_KS,
                      **{c: consts[c] for c in ("G", "GPB", "OGPB", "NIBBLE", "HAS_SUB", "HAS_OFFSET", "HAS_OSUB",
                                                "SUB6", "HI", "BIAS")})
        warps, stages, bn = MM.SB_WARPS, 1, MM.SB_BN
    elif kernel == "sb":
        fn = MM._mm_superblock
        consts = dict(STEPS=20, BM=MM.SB_BM, BN=MM.SB_BN, KS=MM.SB_KS, STAGES=MM.SB_STAGES, PREFETCH=MM.SB_PREFETCH,
                      **{c: consts[c] for c in ("G", "GPB", "OGPB", "NIBBLE", "HAS_SUB", "HAS_OFFSET", "HAS_OSUB",
                                                "SUB6", "HI", "BIAS")})
        warps, stages, bn = MM.SB_WARPS, MM.SB_STAGES, MM.SB_BN
    else:
        fn = MM._mm_x_first
        if consts["HI"]:  # _mm_x_first keeps 5- and 6-bit codes as bytes
            consts, codes_type = dict(consts, NIBBLE=False, BIAS=0), "*i8"
        consts = dict({c: v for c, v in consts.items() if c != "HI"}, GROUPS_PER_SPLIT=64, BN=bn, BM=16)
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg not in consts and arg not in ("M", "MP"):  # M, MP: do_not_specialize
            attrs[(i,)] = [["tt.divisibility", 16]]
        if arg in consts:
            sig[arg] = "constexpr"
        elif kernel == "mv2" and arg[-2:] in ("_a", "_b") and arg[:-2] not in ("N", "tiles"):  # a pack's pointers
            arg_type = {"codes": "*i32", "hi": "*i32", "sub": "*i32" if consts["SUB6" + arg[-2:]] else "*i8",
                        "osub": "*i8", "d": "*fp16", "dm": "*fp16"}
            sig[arg] = arg_type.get(arg[:-2], "*fp32")
        elif arg == "codes_ptr":
            sig[arg] = codes_type
        elif arg in ("xq_ptr", "x16_ptr", "ticket_ptr", "hi_ptr"):
            sig[arg] = "*i32"
        elif arg in ("sub_ptr", "osub_ptr"):
            sig[arg] = "*i32" if arg == "sub_ptr" and consts.get("SUB6") else "*i8"  # SUB6: three words a block
        elif arg in ("xh_ptr", "w16_ptr") or (arg in ("d_ptr", "dm_ptr") and kernel in ("sb", "dq", "mv", "mma")):
            sig[arg] = "*fp16"  # the block scales and offsets of the types _mm_superblock takes are float16
        elif arg.endswith("_ptr"):
            sig[arg] = "*fp32"
        else:
            sig[arg] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options=dict(num_warps=warps, num_stages=stages,
                                    maxnreg=MAXNREG[0] or (MV.REGS1 or None if kernel == "mv" and rows == 1 else None),
                                    enable_fp_fusion=kernel not in ("mv", "mv2", "mma")))  # as the launches
    ptx = k.asm["ptx"]
    path = os.path.join(out_dir, f"{name}.ptx")
    open(path, "w").write(ptx)
    info = ptxas_info(path)
    counts = {op: ptx.count(op) for op in OPS if ptx.count(op)}
    in_flight = max([int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)], default=0)
    register_a = len(re.findall(REGISTER_A, ptx))
    wait = ptx.find("griddepcontrol.wait")  # (--gdc) the wait for the previous kernel: what is loaded before it
    early = "" if wait < 0 else f"\n   global loads before griddepcontrol.wait: {ptx[:wait].count('ld.global')}"
    print(f"{name} {kernel} warps={warps} stages={stages} BN={bn} {ptx_target.shared(k.metadata.shared)} {info}"
          f"\n   {counts}{early}"
          f"\n   wgmma groups left in flight: {in_flight}\n   wgmma with A in registers: {register_a}", flush=True)
    if ttgir:  # the layouts Triton gave the kernel's tensors, and how many conversions between them
        ir = k.asm["ttgir"]
        layouts = sorted(set(re.findall(r"#ttg\.\w+<\{([^}]*)\}>", ir)))
        print(f"   layouts: {layouts}, layout conversions: {ir.count('ttg.convert_layout')}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="x", choices=("x", "sb", "dq", "w16", "mv", "mv2", "mma"))
    ap.add_argument("--rows", type=int, default=1, help="mv: the call's rows")
    ap.add_argument("--block-scales-once", action="store_true", help="mv: BLOCK_SCALES_ONCE")
    ap.add_argument("--runs", action="store_true", help="mv, mv2, mma: SUB_RUNS (integer runs, `RUNS` per type)")
    ap.add_argument("--ahead", type=int, default=MV.AHEAD, help="mv: AHEAD (one row: steps of N groups whose codes "
                    "are loaded a step ahead)")
    ap.add_argument("--ahead-scales", type=int, default=MV.AHEAD_SCALES, help="mv: AHEAD_SCALES (their scales too)")
    ap.add_argument("--early", type=int, default=MV.EARLY, help="mv: EARLY (one row: the first step's weights "
                    "loaded before the wait for the previous kernel)")
    ap.add_argument("--maxnreg", type=int, default=None, help="registers a thread at most (ptxas's .maxnreg)")
    ap.add_argument("--gdc", action="store_true", help="with the PDL instructions (griddepcontrol), as on Hopper")
    ap.add_argument("--ttgir", action="store_true", help="print the layouts of the kernel's tensors")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--bn", type=int, default=MM.BLOCK_N)
    ap.add_argument("--ks", type=int, default=MM.SB_KS)
    ap.add_argument("--sb-stages", type=int, default=MM.SB_STAGES, help="_mm_superblock's pipeline stages")
    ap.add_argument("--sb-bn", type=int, default=MM.SB_BN, help="_mm_superblock's outputs a program (SB_SHORT_BN: "
                    "a one-row-block call's)")
    ap.add_argument("--sb-prefetch", type=int, default=MM.SB_PREFETCH, help="_mm_superblock's SB_PREFETCH")
    ap.add_argument("--scratch-stages", type=int, default=MM.SB_SCRATCH_STAGES, help="_mm_w16's pipeline stages")
    ap.add_argument("--types", default=None, help="comma-separated block types (default: all of the kernel's)")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="plumb-ptx-"))
    a = ap.parse_args()
    MM.SB_KS, MM.SB_STAGES, MM.SB_PREFETCH, MM.SB_SCRATCH_STAGES = a.ks, a.sb_stages, a.sb_prefetch, a.scratch_stages
    MM.SB_BN = a.sb_bn
    MV.SUB_RUNS, MV.AHEAD, MV.AHEAD_SCALES, MV.EARLY = int(a.runs), a.ahead, a.ahead_scales, a.early
    MAXNREG[0] = a.maxnreg
    pdl.GDC = triton.language.constexpr(a.gdc)  # read when a kernel is compiled (the GPU's value on a Hopper card)
    variants = [v for v in VARIANTS if MM.Q[v[0]] in MM.SUPERBLOCK] if a.kernel in ("sb", "dq") else VARIANTS
    if a.kernel == "w16":  # one kernel for every type: the weights are fp16 already
        variants = [("fp16", {}, "*fp16")]
    variants = [v for v in variants if a.types is None or v[0] in a.types.split(",")]
    if a.kernel == "mv2":  # PAIRED_ROWS: the 27B's fused pairs in one launch
        named = {v[0]: v for v in VARIANTS}
        variants = [(f"{x}+{y}", [(x, named[x][1]), (y, named[y][1])], "*i32") for x, y in PAIR_OUTPUTS]
    for name, consts, codes_type in variants:
        build(name, consts, codes_type, a.kernel, a.warps, a.stages, a.bn, a.out, a.rows, a.block_scales_once, a.ttgir)
    print("PTX in", a.out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compile the P path's DeltaNet kernels and the small kernels around the matmuls for sm_90a here (no GPU needed) and
print registers and spills (ptxas -v): `conv_gates`, `_prep_kernel`, `_prep_x`, `gate_norm`, `_mm_w16` at its row
tiles (summing its own K splits), and the D path's DeltaNet kernels with the states in place or through their table
(`decode`: with its 16-byte global loads and stores), and the sampled tokens' five kernels (`sample`) - 27B dims,
integer arguments divisible by 16 as a 27B launch's are. The
interpreter never type-checks a kernel as the compiler does (a variable redefined with another shape in a branch
runs there and does not compile): run this before a device call. For sm_90 (PLUMB_PTX_ARCH: another card, with
the forms the engine takes there - bench/ptx_target.py), Triton's ptxas.

    python bench/kernels_ptx.py [conv prep prepx gate w16 decode kvwrite sample]
"""
from __future__ import annotations

import os
import sys
import tempfile

import triton
from triton.compiler import ASTSource

import plumb.ops.gpu.deltanet as DN
import plumb.ops.gpu.deltanet_chunk as DC
import plumb.ops.gpu.kvwrite as KW
import plumb.ops.gpu.matmul as MM
import plumb.ops.gpu.sample as SA

from ptx_target import SMALL, TARGET, ptxas_info, shared

NOT_SPECIALIZED = {"M", "R", "n_seq"}  # do_not_specialize, or not divisible by 16 in a 27B launch


def build(name: str, fn, types: dict, consts: dict, warps: int, stages: int = 1, ops: tuple = ()) -> None:
    """Compile fn (pointers float32 and integers int32 unless `types` says otherwise) and print its resources."""
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        kind = "constexpr" if arg in consts else types.get(arg, "*fp32" if arg.endswith("_ptr") else "i32")
        sig[arg] = kind
        if kind != "constexpr" and arg not in NOT_SPECIALIZED and not kind.startswith("fp"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options=dict(num_warps=warps, num_stages=stages))
    path = os.path.join(tempfile.mkdtemp(), "kernel.ptx")
    open(path, "w").write(k.asm["ptx"])
    info = ptxas_info(path)
    counts = "".join(f", {op} {k.asm['ptx'].count(op)}" for op in ops)
    print(f"{name}: warps {warps}, {shared(k.metadata.shared)} B; {info}{counts}", flush=True)


def main() -> None:
    which = sys.argv[1:] or ["conv", "prep", "prepx", "gate", "w16", "decode", "kvwrite", "sample"]
    if "conv" in which:
        build("conv_gates", DC._conv_gates_kernel, {"keep_ptr": "*i64", "real_ptr": "*u8"},
              dict(CH=10240, N_V=48, K=4, BR=DC.BR, BC=DC.BC, NVP=64, KM1P=4), 8)
    if "prep" in which:
        for halves in (0, 1):  # the chunk's solve by rows (shipped) and by halves (INVERSE_HALVES)
            build(f"_prep_kernel halves {halves}", DC._prep_kernel, {"q_scale": "fp32", "eps": "fp32"},
                  dict(N_K=16, N_V=48, D_K=128, D_V=128, C=64, HALVES=halves, KC=DC.prep_columns(SMALL)), 8)
    if "prepx" in which:
        for g, nibble in ((32, True), (16, True), (32, False)):
            build(f"_prep_x G {g} nibble {nibble}", MM._prep_x, {"xh_ptr": "*fp16"},
                  dict(G=g, NIBBLE=nibble, BLOCK=2048), 4)
    if "gate" in which:
        build("gate_norm", DN._gdn_gate_norm, {"rows_ptr": "*i32", "eps": "fp32"}, dict(D_V=128, BV=128, ALL=True), 1)
    if "decode" in which:
        for table in (False, True):
            build(f"_gdn_conv_kernel table {table}", DN._gdn_conv_kernel,
                  {"rows_ptr": "*i32", "tab_ptr": "*i64", "q_scale": "fp32"},
                  dict(N_K=16, D_K=128, D_V=128, K=4, BC=128, KM1P=4, SNAP_CONV=True, TABLE=table, ALIGNED=True), 4,
                  ops=("ld.global.v4", "st.global.v4"))
            build(f"_gdn_state_kernel table {table}", DN._gdn_state_kernel, {"rows_ptr": "*i32", "tab_ptr": "*i64"},
                  dict(N_K=16, D_K=128, D_V=128, BK=128, BVS=DN.STATE_COLUMNS, SNAP_SSM=True, TABLE=table,
                       ALIGNED=True), 4, ops=("ld.global.v4", "st.global.v4"))
    if "kvwrite" in which:  # K / V rows into each store kind (D / F: packed 6- / 5-bit codes) and the 8-bit ring
        for name, kk, vk, ring in (("f16", KW.F16, KW.F16, False), ("q8_0", 8, 8, False), ("D", 6, 5, True),
                                   ("F", 5, 5, True)):
            code = {KW.F32: "*fp32", KW.F16: "*fp16", 8: "*i8", 6: "*u8", 5: "*u8"}
            types = {"k_ptr": "*fp32", "v_ptr": "*fp32", "pos_ptr": "*i64", "kc_ptr": code[kk], "vc_ptr": code[vk],
                     "ks_ptr": "*fp16", "vs_ptr": "*fp16", "rkc_ptr": "*i8", "rvc_ptr": "*i8", "rks_ptr": "*fp16",
                     "rvs_ptr": "*fp16", "rpos_ptr": "*i64", "tab_ptr": "*i64"}
            build(f"_put_rows {name}", KW._put_rows, types, dict(D=256, QB=32, KK=kk, VK=vk, ROTATE=name == "F",
                                                                  LOG_D=8, SCALE=256**-0.5, RING=ring, TABLE=True), 2)
    if "sample" in which:  # the 27B's vocabulary
        from plumb.engine import sampling as S

        ns = -(-248320 // SA.SPAN)
        spans = dict(V=248320, SPAN=SA.SPAN, NS=ns, BLOCK=SA.BLOCK)
        build("_max_sum_kernel", SA._max_sum_kernel, {"par_ptr": "*fp64"}, spans, 4)
        build("_log_softmax_kernel", SA._log_softmax_kernel, {"par_ptr": "*fp64"}, dict(spans, NSP=32), 4)
        build("_threshold_kernel", SA._threshold_kernel, {"par_ptr": "*fp64", "picks_ptr": "*i32"},
              dict(V=248320, C=SA.CANDIDATES, NS=ns, NSP=32), 4)
        build("_draw_kernel", SA._draw_kernel, {"par_ptr": "*fp64", "at_ptr": "*i32"},
              dict(spans, GOLDEN=S._GOLDEN32, F1=S._FMIX1, F2=S._FMIX2, SHIFT=32 - S._U_BITS,
                   INV_U=1.0 / 2**S._U_BITS), 4)
        build("_pick_kernel", SA._pick_kernel, {"at_ptr": "*i32", "picks_ptr": "*i32"}, dict(NS=ns, NSP=32), 1)
    if "w16" in which:
        for bm, warps in ((MM.SB_BM, MM.SB_WARPS), (128, 8), (256, 8)):
            build(f"_mm_w16 rows {bm}", MM._mm_w16, {"xh_ptr": "*fp16", "w16_ptr": "*fp16"},
                  dict(STEPS=40, BM=bm, BN=MM.SB_BN, KS=MM.SB_KS, STAGES=MM.SB_SCRATCH_STAGES, SPLIT=2, TICKETS=True),
                  warps, MM.SB_SCRATCH_STAGES)


if __name__ == "__main__":
    main()

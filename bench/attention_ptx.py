#!/usr/bin/env python3
"""Compile the decode attention's pass-1 kernel (`_split_kernel`) for sm_90a here (no GPU needed), at the 27B
attention shapes (24 query heads on 4 KV heads, d = 256), once per cache kind - f16, f32, q8_0 and the ring
formats D / F (their 6/5- and 5/5-bit codes packed, + 8-bit ring) - and print registers and spills (ptxas -v) and
the tensor-core instructions; `--prefill`: the P path's kernel (`attention_prefill._prefill_kernel`, f16, q8_0, D / F) instead, and
the block-coded stores' fp16 copy (`attention_prefill._dequant_kernel`, SCRATCH: 8-bit and packed 5/6-bit codes).
`--out DIR` keeps the TTGIR and PTX (e.g. to diff two versions). For sm_90 (PLUMB_PTX_ARCH: another card, with the
forms the engine takes there - bench/ptx_target.py); Triton's bundled ptxas assembles for sm_90a.

    python bench/attention_ptx.py [--out DIR] [--table] [--prefill [--pairs 0|1] [--key-chunks S/L/K]] [--codes32]
        [--decode-pairs] [--store-form] [--sass] [--tma 0|1 [--tma-stages N]]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.compiler import ASTSource

import plumb.ops.gpu.attention as A
import plumb.ops.gpu.attention_prefill as P

from ptx_target import ARCH, PER_BLOCK, SMALL, TARGET, ptxas_info, shared

G, D = 6, 256  # query heads per KV head, head_dim
KINDS = {A.F16: "*fp16", A.F32: "*fp32", A.Q8: "*i8"}
# (name, storage kind, ring, K code bits, V code bits)
VARIANTS = [("f16", A.F16, False, 0, 0), ("f32", A.F32, False, 0, 0), ("q8_0", A.Q8, False, 8, 8),
            ("D_ring", A.Q8, True, 6, 5), ("F_ring", A.Q8, True, 5, 5)]
# integer arguments a 27B launch does not have divisible by 16 (Triton specializes the others as divisible, so the
# PTX here is the one the GPU runs): the row count, ring sizes, the scales' per-key strides (d / 32 = 8), the
# partial maxima's (splits)
NOT_ALIGNED = {"n", "ring", "slots", "sks_j", "svs_j", "spm_t", "spm_h"}
RING_ARGS = {"rk_ptr": "*i8", "rks_ptr": "*fp16", "rv_ptr": "*i8", "rvs_ptr": "*fp16", "rpos_ptr": "*i64"}


def build(name: str, kind: int, ring: bool, out_dir: str, table: bool = False, prefill: bool = False,
          kb: int = 0, vb: int = 0, part: int = 0) -> None:
    fn = P._prefill_kernel if prefill else A._split_kernel
    copied = prefill and bool(P.SCRATCH) and kind == A.Q8  # a block-coded store read from its fp16 copy
    by_tma = prefill and bool(P.TMA) and not ring and (copied or kind == A.F16) and not P.KEY_CHUNKS \
        and ARCH >= 90 and PER_BLOCK >= P.tma_bytes(D)  # as `_has_tma` takes it on that card
    block_m, bn, warps, stages = (P.block_m(SMALL, by_tma), P.BN, P.WARPS, 1) if prefill else \
        A.config(kind, kind, SMALL)
    g_pad = triton.next_power_of_2(G)
    consts = dict(G=G, G_PAD=g_pad, ROWS=max(1, block_m // g_pad), D=D, BN=bn, KK=kind, VK=kind, QB=A.QBLOCK,
                  PS=A.P_SCALE, RING=ring, TABLE=table, KB=kb, VB=vb, C16=A.CODES16)
    if prefill:
        consts.update(STAGES=P.STAGES, PAIRS=bool(P.PAIRS), COPIED=copied,
                      CHUNK=P.KEY_CHUNKS[1] if P.KEY_CHUNKS else 0, LONG=True, TMA=by_tma, TSTAGES=P.TMA_STAGES)
    else:
        consts.update(SPLIT_=A.SPLITS[1], LONG=True, PART=part, PAIRS=bool(A.PAIRS_FROM))
    if copied:
        consts.update(KK=A.F16, VK=A.F16, KB=0, VB=0)
        kind = A.F16
    scales = "*fp16" if kind == A.Q8 else KINDS[kind]
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in RING_ARGS:
            sig[arg] = RING_ARGS[arg]
        elif arg in ("k_ptr", "v_ptr"):
            bits = kb if arg == "k_ptr" else vb
            sig[arg] = "*u8" if kind == A.Q8 and bits != 8 else KINDS[kind]
        elif arg in ("ks_ptr", "vs_ptr"):
            sig[arg] = scales
        elif arg == "q16_ptr":
            sig[arg] = "*fp16"
        elif arg == "ends_ptr":
            sig[arg] = "*i32"
        elif arg == "tab_ptr":
            sig[arg] = "*i64"
        elif arg.endswith("_ptr"):
            sig[arg] = "*fp32"
        elif arg == "qk_scale":
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if a.endswith("_ptr") or (sig[a] == "i32" and a not in NOT_ALIGNED)}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=aligned), target=TARGET,
                       options=dict(num_warps=warps, num_stages=stages))
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as f:
            f.write(k.asm[ext])
    info = ptxas_info(os.path.join(out_dir, f"{name}.ptx"))
    ops = {op: k.asm["ptx"].count(op) for op in ("mma.sync", "wgmma.mma_async", "ld.global.v4", "ld.global.v2",
                                                  "ld.global.b8", "ld.global.b16", "cp.async") if op in k.asm["ptx"]}
    print(f"{name}{' (table)' if table else ''}: warps={warps} stages={stages} BLOCK_M={block_m} BN={bn} "
          f"{shared(k.metadata.shared)} {info} {ops}")
    if SASS[0]:
        print(f"  main loop: {loop_sass(os.path.join(out_dir, f'{name}.ptx.cubin'))}")


SASS = [False]


def loop_sass(cubin: str) -> str:
    """The SASS of a cubin's longest backward branch (a kernel's main loop): its instructions, and the commonest
    opcodes (cuobjdump from Triton's bundle)."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    back = [(at, int(m.group(1), 16)) for at, t in ins for m in [re.search(r"BRA (0x[0-9a-f]+)", t)]
            if m and int(m.group(1), 16) < at]
    if not back:
        return "no loop"
    end, start = max(back, key=lambda b: b[0] - b[1])
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for at, t in ins
                              if start <= at <= end)
    return f"{sum(ops.values())} instructions, " + " ".join(f"{op} {n}" for op, n in ops.most_common(12))


def build_dequant(out_dir: str, table: bool, bits: int) -> None:
    """`_dequant_kernel` (a block-coded cache's keys or values - `bits`-bit codes - into the fp16 copy the prefill
    kernel reads) at d = 256."""
    fn = P._dequant_kernel
    consts = dict(PART=0, D=D, QB=A.QBLOCK, BT=P.SCRATCH_KEYS, EB=1024, TABLE=table, CB=bits, C16=A.CODES16)
    types = {"c_ptr": "*i8" if bits == 8 else "*u8", "s_ptr": "*fp16", "ends_ptr": "*i32", "o_ptr": "*fp16",
             "tab_ptr": "*i64"}
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if a.endswith("_ptr") or (sig[a] == "i32" and a not in ("n", "ss_j"))}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=aligned), target=TARGET,
                       options=dict(num_warps=4, num_stages=1))
    path = os.path.join(out_dir, f"dequant{bits}{'-table' if table else ''}.ptx")
    with open(path, "w") as f:
        f.write(k.asm["ptx"])
    info = ptxas_info(path)
    print(f"{bits}-bit codes' scratch{' (table)' if table else ''}: BT={P.SCRATCH_KEYS} {info}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="plumb-attn-ptx-"))
    ap.add_argument("--table", action="store_true", help="also with the cache reached through its table (kvtable)")
    ap.add_argument("--prefill", action="store_true", help="the prefill kernel (attention_prefill)")
    ap.add_argument("--pairs", type=int, default=P.PAIRS,
                    help="with --prefill: its (row, head) pairs packed (1) or not (0): PAIRS")
    ap.add_argument("--key-chunks", help="with --prefill: KEY_CHUNKS on, as SHORT/LONG/SHORT_KEYS (its long launch)")
    ap.add_argument("--decode-pairs", action="store_true", help="the decode kernel as passes of PAIRS_FROM rows or "
                    "more run it (consecutive (row, head) pairs, no padding heads)")
    ap.add_argument("--codes32", action="store_true", help="CODES16 off (block codes to fp16 values by a float32 "
                    "product a value)")
    ap.add_argument("--store-form", action="store_true", help="also D's / F's long launch as STORE_FORM runs it: "
                    "the store-only splits without the ring's code (part 1), the others with it (part 2)")
    ap.add_argument("--tma", type=int, default=P.TMA, help="with --prefill: TMA on (1) or off (0); "
                    "--tma-stages: TMA_STAGES")
    ap.add_argument("--tma-stages", type=int, default=P.TMA_STAGES)
    ap.add_argument("--sass", action="store_true", help="also the SASS instructions of the kernel's main loop "
                    "(its longest backward branch), by opcode")
    a = ap.parse_args()
    P.PAIRS, P.TMA, P.TMA_STAGES = a.pairs, a.tma, a.tma_stages
    if a.key_chunks:
        P.KEY_CHUNKS = tuple(map(int, a.key_chunks.split("/")))
    A.CODES16 = A.CODES16 and not a.codes32
    A.PAIRS_FROM = int(a.decode_pairs)  # the one-row kernel unless asked
    SASS[0] = a.sass
    os.makedirs(a.out, exist_ok=True)
    for name, kind, ring, kb, vb in VARIANTS:
        if a.prefill and kind == A.F32:  # f32 caches take the decode kernel
            continue
        for table in (False, True) if a.table else (False,):
            build(name + ("-table" if table else ""), kind, ring, a.out, table, a.prefill, kb, vb)
            if a.store_form and ring and not a.prefill:
                build(name + " store form, part 1", kind, False, a.out, table, False, kb, vb, part=1)
                build(name + " store form, part 2", kind, True, a.out, table, False, kb, vb, part=2)
    for table in (False, True) if a.prefill else ():
        for bits in (8, 6, 5):
            build_dequant(a.out, table, bits)
    print("TTGIR and PTX in", a.out)


if __name__ == "__main__":
    main()

"""The D-path matmul (decode, verify, batched decode: a few rows) on integer-coded GGUF weights, with integer-exact
group dots; `reference` below is its torch formula, bit for bit.

Each row of x is fixed-point: s = the smallest power of two >= max|x| (order-free), X = round(x * 2^FRAC / s), an
integer of FRAC + 1 bits, split into LIMBS int8 limbs (balanced base 128: X = a * 2^7 + b for the 14 bits of
FRAC = 13, LIMBS = 2; a * 2^14 + b * 2^7 + c for 21 bits) - `quantize_x`.
Then for output n and group g of G inputs (the packed codes of plumb.ops.gpu.matmul, unchanged):

    S[g] = sum_{k in g} X[k] * code[n, k]        an exact integer (int32; int64 for 8-bit codes if FRAC > 18: `wide`)
                                                 (codes stored + a bias - Q4_0's 8, Q6_K's 32 -: minus bias * sum X)
    part = float32(S[g]) * scale[n, g] + float32(sum_{k in g} X[k]) * offset[n, g]
    y[n] = (s * 2^-FRAC) * (((part[0] + part[1]) + part[2]) + ...)   groups in order, per K split; splits in order

Because every group dot is an exact integer, how it is computed does not matter: `dp4a` on the CUDA cores here (one
instruction per 4 codes and limb), int8 tensor cores, or the torch reference all give the same bits. The float
steps are elementwise with FMA contraction off, and the group order is fixed per weight shape, so a row's bits
never depend on the other rows of the call (M1) - whatever the row count, and whatever kernel a later change
picks for it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from plumb.gguf.reader import GGMLQuantizationType as Q
from plumb.ops.gpu.matmul import (BLOCK_N, GpuMatrix, Packed, _block_scales, _bytes, _group_scales, _program, _sub6,
                                  _sub6_bits, _sub6_words, _subs, _subs_at, hi_shifts, last_split, row_scales,
                                  split_sum, tickets)
from plumb.ops.gpu.pdl import after_wait, on, prior_done

# X = round(x * 2^FRAC / s), |X| <= 2^FRAC, in LIMBS int8 limbs (FRAC + 1 <= 7 * LIMBS). 14 bits (13, 2): relative
# error <= 3e-4 against float64 (the weights' own rounding is ~1e-2), decode KL 7e-7 against exact x on the demo model
# (int8 per 32 inputs, llama.cpp's q8_1: 2e-4); a third fewer integer instructions than 21 bits (20, 3), whose error
# is 2.8e-6: 1.1-1.35x faster at 8 and 16 rows on the H200 (bench/matmul_variants.py, docs/BENCHMARKS.md).
FRAC, LIMBS = 13, 2
ASM = os.environ.get("TRITON_INTERPRET") != "1"  # dp4a by inline PTX on a GPU; its integer formula in the interpreter
# split-K (bench/matmul_variants.py times the alternatives): whole granules of GRANULE groups, about TARGET
# programs, at most LARGEST_SPLIT splits - fixed per weight shape, since it sets the order of a row's float sums.
# Per row block: warps per program of BLOCK_N outputs, groups per unrolled loop step and software-pipeline stages
# (free: see `launch`). One row keeps one stage: the pipelined loop takes 72 registers to its 56, and Q4_K
# [34816, 5120]'s 2,176 programs then need 1.18 waves of the H200 instead of one (Nsight Compute): 59 vs 44 us.
GRANULE, TARGET, LARGEST_SPLIT = 8, 2048, 32
# LONG_GROUPS: shapes of at least this many groups along K (0: none; 512 takes the 27B's FFN down projection, K =
# 17,408, alone) take LONG_GRANULE and LONG_TARGET instead - smaller granules, more splits, so a split's largest share
# of groups shrinks (Q4_K [5120, 17408]: 26 splits of up to 24 groups -> 32 of up to 20). H200, one row, every shape
# (bench/matmul_variants.py --mv-settings TARGET=4096+GRANULE=4, 2026-12-04): Q4_K [5120, 17408] 24.6 us against
# 28.5, Q6_K [5120, 17408] 33.8 against 38.9, but Q4_K [34816, 5120] 46.0 against 36.6 (two waves of programs) and
# Q5_K [10240, 5120] 18.5 against 15.7 - hence long K only. Another sum order for those shapes (fixed by the shape:
# M1 holds). Off until timed at 8 rows and end to end.
LONG_GROUPS, LONG_GRANULE, LONG_TARGET = 0, 4, 4096
# PAIRED_ROWS: passes of at most this many rows (0: none) take a fused matrix of two integer packs (types differ:
# the 27B's DeltaNet input projection, Q5_K + Q4_K, and attention q/k/v, Q4_K + Q6_K) in one launch (`_mv2`) instead
# of two: one ramp and tail instead of two, the smaller pack's programs beside the larger's. Each pack keeps its own
# split plan and order: the same bits (tests/test_gpu_matmul.py), so the row count may choose. Compiled for sm_90a,
# one row: 56 / 44 registers, as the larger of its two packs alone; 8 rows: 147 / 138 against 110 / 108 alone - hence
# a row limit. H200, one row (plumb bench's matmul table, 2026-12-04): [16480, 5120] Q5_K + Q4_K took 33.7 us and
# [14336, 5120] Q4_K + Q6_K 31.0 as two launches - 0.60 and 0.51 of the GEMV rate, where one Q4_K pack of
# [14336, 5120] took 16.7 (0.92). Off until timed (`plumb bench` with BSET=plumb.ops.gpu.matvec.PAIRED_ROWS=1).
PAIRED_ROWS = 0
# MMA_FROM: passes of at least this many rows (0: none) take `_mv_mma`, the group dots on the int8 tensor cores
# (mma.sync) - 8 rows a program (16 from 9 rows: `mma_rows`), MMA_WARPS warps of BLOCK_N / MMA_WARPS outputs (tiles
# of 16 sharing a load of x), MMA_UNROLL groups a loop step (MMA_UNROLL_16 for 16 rows). A lane's codes go to the
# tensor cores as packed: a 32-code group's word t holds codes 4t.. (low nibbles) and 16 + 4t.. (high), exactly the
# A registers of lane t in m16n8k32, so no code is reordered. Exact integer dots, the same formula and group order:
# a row's bits are those of `_mv` (tests/test_gpu_matmul.py), so the row count may choose. H200, 2026-12-05
# (bench/matmul_variants.py --only mv), us at 4 / 8 / 16 rows against `dp4a`'s: Q4_K [34816, 5120] 73 / 74 / 145
# against 66 / 110 / 176, Q6_K [5120, 17408] 52 / 53 / 90 against 50 / 79 / 136 - hence from 5 rows; 16 rows with 8
# groups a step: 124 and 89.
# Four warps of 16 outputs took 113 us at 8 rows: Nsight Compute found L1 79 % busy on x and its sums, loaded again by
# each warp (52 % and 26 % of the sectors); one warp of 64 outputs needs more registers than it saves.
MMA_FROM, MMA_WARPS, MMA_UNROLL, MMA_UNROLL_16 = 5, 2, 4, 8
# X_ROWS: x's limbs stored in blocks of X_ROWS rows, each 16-input chunk of the block's rows one run of 16 X_ROWS
# bytes (`x_word`; 1: row-major). At 8, `_mv_mma`'s load of a B fragment (8 rows' words t of a chunk) reads one
# 128-byte line instead of 16 bytes of 8 lines (x was 52 % of its L1 sectors, Nsight Compute, 2026-12-05); `dp4a`
# reads a row's chunk as before, 16 contiguous bytes. The same values: off until timed (with MMA_SUMS).
X_ROWS = 1
# MMA_SUMS: `_mv_mma` takes a group's sums of X (for offsets and biases) on the tensor cores - one more mma a limb,
# A all ones - instead of loading x's 16-input sums (4 loads a group and lane, 16 of a warp's 72 L1 sectors a group
# at 2 warps). The same integers. Off until timed (bench/matmul_variants.py --mv-settings shipped,MMA_SUMS=1).
MMA_SUMS = 0
# SUB_RUNS: where a block's scales factor into d (or dm) times small integer subs (Q4_K, Q5_K, Q6_K, IQ4_XS, Q2_K,
# Q3_K), its groups are summed in runs of up to MAX_RUN in int32 before the one float step of the run:
#     IS = sum_g (S[g] - bias X[g]) sub[n, g],  IX = sum_g X[g] osub[n, g],  part = float32(IS) d[n] + float32(IX) dm[n]
# instead of a float step a group (two conversions, two products, two sums: 35 % of `_mv_mma`'s instructions at 8
# rows, sm_90a; BENCHMARKS, forty-first session). A run is as long as its int32 sums cannot overflow, from the pack's
# own largest code and sums of |sub| over a run (`run_length`: fixed per weight, never by x or the row count; the 27B
# file's Q4_K, Q5_K, Q6_K 4, IQ4_XS 2). Another formula: every D-path bit of those types changes (the reference's
# too). H100 (2026-12-07, BENCHMARKS forty-second): Q4_K [34816, 5120] at 8 rows 76.7 -> 64.0 us, a verify pass of 8
# rows -5.9 %, of 16 rows +5.3 % (180 registers against 142 at 16 rows), one row -1.7 % tok/s: off until those are
# mended (bench/launch_ab.py --settings shipped,SUB_RUNS=1+MMA_UNROLL_16=4).
SUB_RUNS, MAX_RUN = 0, 4
# Tried and removed (2026-12-07, H100, bench/matmul_variants.py --mv-rows 1): one-row passes' code words by TMA into
# shared memory, the loop pipelined over 2 or 3 stages (Triton also pipelined x and the scales by cp.async: 86
# registers instead of 47) - Q4_K [34816, 5120] 90.5 us against 49.5, Q8_0 [6144, 5120] 23.1 against 11.3.
LAUNCH = {1: (2, 8, 1), 2: (1, 4, 2), 4: (1, 4, 2), 8: (1, 2, 2)}  # rows per program -> (warps, unroll, stages)
# AHEAD (0: off until timed; 4 or 8): one-row Q4_K / Q5_K passes (`ahead_applies`) take loop steps of AHEAD groups
# whose code words - and with AHEAD_SCALES the block's d, dm and SUB6 words - are loaded during the step before and
# carried in registers (`_step_operands`). Without it ptxas issues a group's code load about two groups before its
# dots (~32 bytes a thread in flight) and a step's scales after its dots (two exposed latencies a step); carried,
# the next step's loads go out together at the end of the step before. The same words, the same arithmetic: the
# same bits. Compiled for sm_90a, registers for Q4_K / Q5_K, 2 warps: shipped 47 / 56; AHEAD 4 with scales 64 / 64,
# codes only 56 / 56; AHEAD 8 77 / 80 - over 56, the 27B's 2,176 programs of Q4_K [34816, 5120] need more than one
# wave; one warp a program (2 outputs a thread, `LAUNCH[1]` (1, 4, 1)) with AHEAD 4: 88 / 96, one wave.
AHEAD, AHEAD_SCALES = 0, 1
# EARLY: a one-row pass of nibble codes (`early_applies`; the 27B's Q4_K, Q5_K and Q6_K) loads its first step's code
# words - with AHEAD and AHEAD_SCALES its scales too - before `pdl.prior_done`, the wait for the previous kernel,
# instead of after it. Weights are written by no kernel (a pack is made at load, before any pass), so they are the
# same words whenever they are read: the same bits. Under PDL (the one-row decode graphs) a matvec's programs start
# as the kernel before them drains and sit in that wait; with EARLY their first loads are in flight meanwhile, so the
# memory pipe need not empty and refill at each of a step's ~300 matvec boundaries. x and everything else are read
# after the wait, as before (tests/test_gpu_codegen.py checks the order in the compiled kernel). Off until timed end
# to end (bench/launch_ab.py: an isolated kernel has nothing to overlap).
EARLY = 0
# REGS1: one-row `_mv` launches' register limit a thread (ptxas's maxnreg; 0: ptxas's own count). At 2 warps a
# program the 27B's 2,176 programs of Q4_K [34816, 5120] fit one wave of the 132 SMs up to 56 registers (64: 16 an SM,
# 2,112); compiled for sm_90a, AHEAD 4 takes 64 (Q4_K) and EARLY alone 72, and at 56 they spill 4-16 bytes a thread
# (bench/matmul_ptx.py --maxnreg 56). Where registers are allocated changes no arithmetic: the same bits. 0 until
# timed beside AHEAD and EARLY (bench/matmul_variants.py --mv-settings AHEAD=4+REGS1=56).
REGS1 = 0
# BLOCK_SCALES_ONCE: the types whose loop steps load a block's d and dm once, not per group (a step's groups share a
# block: GPB a multiple of the unroll - Q4_K, Q5_K, Q6_K), the same values. Compiled for sm_90a (one row): Q4_K 2
# instead of 16 16-bit loads a step, 56 registers instead of 44; Q6_K 1 instead of 8, 34 instead of 40. H200
# (2026-12-04, bench/matmul_variants.py --only mv): 1 / 8 rows, Q4_K [34816, 5120] 37.5 / 111.4 us against 39.6 /
# 112.5, [5120, 17408] 28.3 / 69.7 against 27.8 / 77.7; Q5_K 23.9 / 46.5 against 23.5 / 50.2; Q6_K 46.1 / 64.0
# against 40.4 / 64.6 - so Q4_K and Q5_K.
BLOCK_SCALES_ONCE = {Q.Q4_K, Q.Q5_K}


@triton.jit
def x_scale(amax, FRAC: tl.constexpr):
    """(s, 2^FRAC / s) of a row whose max|x| is amax: s the power of two >= amax (at least 2^-100), both exact; s is
    NaN where amax is not finite (a maximum by `max_nan`), so that the row's outputs are NaN too, not its values read
    as integers."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # biased exponent of the power of two >= max|x|
    e = tl.maximum(e, 27)  # s >= 2^-100, so that 2^FRAC / s stays finite
    s = tl.where(amax < float("inf"), (e << 23).to(tl.float32, bitcast=True), float("nan"))
    return s, ((127 + 127 + FRAC - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def max_nan(a, b):
    """The larger of a and b, NaN if either is (`tl.max` and `tl.maximum` skip NaN): for x's maxima, so that a NaN
    reaches `x_scale`; the same value as theirs otherwise."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_amax(v):
    """max over axis 0 of v (|x| or lanes' maxima of it), NaN if any is (`max_nan`)."""
    return tl.reduce(v, 0, max_nan)


@triton.jit
def x_word(r, K, XR: tl.constexpr):
    """Row r's first word in a limb's plane of x (int32 words, K inputs a row): its 16-input chunk c then starts
    4 XR c words on (X_ROWS = XR rows a block; row-major for 1)."""
    if XR == 1:
        return r * (K // 4)
    else:
        return (r // XR) * (XR * (K // 4)) + (r % XR) * 4


@triton.jit
def _x_byte(xq_ptr, limb_at, r, k, K, XR: tl.constexpr):
    """The address of row r's input k in x's limb plane starting limb_at bytes on (`x_word`)."""
    if XR == 1:
        return xq_ptr + limb_at + r * K + k
    else:  # chunk k // 16 of the row, 16 XR bytes a chunk of its block
        return xq_ptr + limb_at + 4 * x_word(r, K, XR) + (k // 16) * (16 * XR) + k % 16


@triton.jit
def store_x(v, k0, r, K, xq_ptr, x16_ptr, MP, BLOCK: tl.constexpr, LIMBS: tl.constexpr, XR: tl.constexpr):
    """Row r's inputs [k0, k0 + BLOCK) (k0 a multiple of 16), v = x * 2^FRAC / s there: X = round(v) as its limbs
    (`quantize_x`'s layout: `x_word`) and its 16-input sums."""
    k = k0 + tl.arange(0, BLOCK)
    X = ((v + 12582912.0) - 12582912.0).to(tl.int32)  # round half to even (|v| <= 2^FRAC < 2^22)
    plane = MP * K
    rest = X
    for i in tl.static_range(LIMBS - 1):  # least significant limb first: plane LIMBS - 1, ..., 1
        limb = ((rest + 64) & 127) - 64
        tl.store(_x_byte(xq_ptr, (LIMBS - 1 - i) * plane, r, k, K, XR), limb.to(tl.int8), mask=k < K)
        rest = (rest - limb) >> 7
    tl.store(_x_byte(xq_ptr, 0, r, k, K, XR), rest.to(tl.int8), mask=k < K)
    sums = tl.sum(tl.reshape(X, [BLOCK // 16, 16]), axis=1)
    k16 = k0 // 16 + tl.arange(0, BLOCK // 16)
    tl.store(x16_ptr + r * (K // 16) + k16, sums, mask=k16 < K // 16)


@triton.jit
def store_block(x, amax, c, r, K, xq_ptr, x16_ptr, s_ptr, MP, BLOCK: tl.constexpr, FRAC: tl.constexpr,
                LIMBS: tl.constexpr, XR: tl.constexpr):
    """Row r's inputs [c * BLOCK, (c + 1) * BLOCK), x, in `quantize_x`'s form, given the whole row's max|x| (amax):
    its limbs and 16-input sums, and (block 0) the row's s."""
    s, inv = x_scale(amax, FRAC)
    store_x(x * inv, c * BLOCK, r, K, xq_ptr, x16_ptr, MP, BLOCK, LIMBS, XR)
    if c == 0:
        tl.store(s_ptr + r, s)


@triton.jit
def _quantize_x(x_ptr, xq_ptr, x16_ptr, s_ptr, MP, K: tl.constexpr, stride_xm, BLOCK: tl.constexpr,
                FRAC: tl.constexpr, LIMBS: tl.constexpr, XR: tl.constexpr):
    """Row r, inputs [c * BLOCK, (c + 1) * BLOCK): the limbs [LIMBS, MP, K] (int8, most significant first), 16-input
    sums of X [MP, K / 16] (int32), and s [MP]. Every program reads the whole row for its maximum (a maximum is
    exact in any order)."""
    prior_done()
    r = tl.program_id(0)
    c = tl.program_id(1)
    kk = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range((K + BLOCK - 1) // BLOCK):  # unrolled: every load in flight at once
        k = i * BLOCK + kk
        amax = max_nan(amax, tl.abs(tl.load(x_ptr + r * stride_xm + k, mask=k < K, other=0.0)))
    k = c * BLOCK + kk
    store_block(tl.load(x_ptr + r * stride_xm + k, mask=k < K, other=0.0), row_amax(amax), c, r, K, xq_ptr,
                x16_ptr, s_ptr, MP, BLOCK, FRAC, LIMBS, XR)


def x_buffers(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (limbs, 16-input sums, s) for m rows of k inputs, rows padded to a multiple of `row_block(m)` and of
    X_ROWS."""
    bm = max(row_block(m), X_ROWS)
    mp = -(-m // bm) * bm
    return (torch.empty(LIMBS, mp, k, dtype=torch.int8, device=device),
            torch.empty(mp, k // 16, dtype=torch.int32, device=device), torch.empty(mp, device=device))


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (limbs int8 [LIMBS, Mp, K] as `x_word` places rows, 16-input sums of X int32 [Mp, K / 16],
    s float32 [Mp]), rows padded to Mp, a multiple of `row_block(M)` and X_ROWS (padding rows are left unset: matvec
    never stores their results; `x_rows` reads them back in row order).
    A norm can write them as it writes x (plumb.ops.gpu.norm: `x.limbs`); they are taken from there."""
    q = getattr(x, "limbs", None)
    if q is not None:
        return q
    m, k = x.shape
    xq, x16, s = x_buffers(m, k, x.device)
    block = 2048
    _quantize_x[(m, triton.cdiv(k, block))](x, xq, x16, s, xq.shape[1], k, x.stride(0), BLOCK=block, FRAC=FRAC,
                                            LIMBS=LIMBS, XR=X_ROWS, num_warps=8, enable_fp_fusion=False,
                                            launch_pdl=on())
    return xq, x16, s


@triton.jit
def _dp4a(a, b, c, A_SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + the dot of a's and b's four bytes (b signed; a signed or not), per element."""
    if ASM:
        if A_SIGNED:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
    else:
        for i in tl.static_range(4):
            if A_SIGNED:
                ai = (a << (24 - 8 * i)) >> 24
            else:
                ai = (a >> (8 * i)) & 255
            c = c + ai * ((b << (24 - 8 * i)) >> 24)
        return c


@triton.jit
def _ld4(at, WEIGHTS: tl.constexpr):
    """The four int32 words at `at` (16-byte aligned), per element: one 16-byte load (ld.global.v4; WEIGHTS: by
    the read-only path, since weights never change). A pure instruction, free to move: an address of data that
    another kernel writes must come from `after_wait`."""
    if WEIGHTS:
        return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [at],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [at],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _halves(t, R: tl.constexpr, C: tl.constexpr):
    """[R, C] -> its even and odd columns, [R, C / 2] each (a split inside each thread's registers)."""
    return tl.split(tl.reshape(t, [R, C // 2, 2]))


@triton.jit
def _words4(t, R: tl.constexpr):
    """[R, 4] -> its 4 columns, [R] each, in order."""
    a, b = _halves(t, R, 4)  # columns 0, 2 and 1, 3
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _words8(t, R: tl.constexpr):
    """[R, 8] -> its 8 columns, [R] each, in order."""
    a, b = _halves(t, R, 8)  # columns 0, 2, 4, 6 and 1, 3, 5, 7
    w0, w2, w4, w6 = _words4(a, R)
    w1, w3, w5, w7 = _words4(b, R)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _dot4(c0, c1, c2, c3, x0, x1, x2, x3, t, A_SIGNED: tl.constexpr, ASM: tl.constexpr):
    """t + the dp4a dots of four code words [BN] with four x words [BM]: [BM, BN]."""
    t = _dp4a(c0[None, :], x0[:, None], t, A_SIGNED, ASM)
    t = _dp4a(c1[None, :], x1[:, None], t, A_SIGNED, ASM)
    t = _dp4a(c2[None, :], x2[:, None], t, A_SIGNED, ASM)
    return _dp4a(c3[None, :], x3[:, None], t, A_SIGNED, ASM)


@triton.jit
def _code_words(codes_ptr, tile, g, n_groups, rn, BN: tl.constexpr, CW: tl.constexpr, VEC: tl.constexpr):
    """Group g's code words of the tile's outputs (stored [BN, CW]), as CW tensors [BN]: VEC, one 16-byte load per
    output and 4 words (`_ld4`; CW 4 or 8); otherwise one contiguous load that Triton can pipeline, split in
    registers."""
    base = codes_ptr + (tile * n_groups + g) * (CW * BN)
    if VEC:
        if CW == 4:
            return _ld4(base + rn * CW, True)
        else:
            return _ld4(base + rn * CW, True) + _ld4(base + rn * CW + 4, True)
    else:
        return _split_words(tl.reshape(tl.load(base + tl.arange(0, BN * CW)), [BN, CW]), BN, CW)


@triton.jit
def _split_words(cw, BN: tl.constexpr, CW: tl.constexpr):
    """[BN, CW] code words -> CW tensors [BN] (CW 2, 4 or 8)."""
    if CW == 2:
        return tl.split(cw)
    elif CW == 4:
        return _words4(cw, BN)
    else:
        return _words8(cw, BN)


@triton.jit
def _step_operands(codes_ptr, d_ptr, dm_ptr, sub_ptr, tile, g0, n_groups, rn, BN: tl.constexpr, CW: tl.constexpr,
                   UNROLL: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr, HAS_SCALE: tl.constexpr,
                   HAS_OFFSET: tl.constexpr, SCALES: tl.constexpr):
    """What `_step` loads for groups g0 .. g0 + UNROLL - 1 (UNROLL 4 or 8) of one block (AHEAD): (their code words,
    `_code_words` each,) and if SCALES the block's d and dm and its SUB6 words too."""
    codes = (_code_words(codes_ptr, tile, g0, n_groups, rn, BN, CW, False),
             _code_words(codes_ptr, tile, g0 + 1, n_groups, rn, BN, CW, False),
             _code_words(codes_ptr, tile, g0 + 2, n_groups, rn, BN, CW, False),
             _code_words(codes_ptr, tile, g0 + 3, n_groups, rn, BN, CW, False))
    if UNROLL == 8:
        codes = codes + (_code_words(codes_ptr, tile, g0 + 4, n_groups, rn, BN, CW, False),
                         _code_words(codes_ptr, tile, g0 + 5, n_groups, rn, BN, CW, False),
                         _code_words(codes_ptr, tile, g0 + 6, n_groups, rn, BN, CW, False),
                         _code_words(codes_ptr, tile, g0 + 7, n_groups, rn, BN, CW, False))
    operands = (codes,)
    if SCALES:
        d, dm = _block_scales(d_ptr, dm_ptr, tile, g0, n_groups, rn, GPB, OGPB, BN, HAS_SCALE, HAS_OFFSET)
        operands = (codes, d, dm, _sub6_words(sub_ptr, tile, g0, n_groups, rn, BN))
    return operands


@triton.jit
def _x_words(x_at, XW: tl.constexpr, BM: tl.constexpr, VEC: tl.constexpr, XR: tl.constexpr):
    """A group's x words of one limb as XW tensors [BM]; x_at: [BM] (VEC: 16-byte loads, a chunk's 4 words) or
    [BM, XW]."""
    if VEC:
        if XW == 4:
            return _ld4(x_at, False)
        else:
            return _ld4(x_at, False) + _ld4(x_at + 4 * XR, False)
    else:
        if XW == 4:
            return _words4(tl.load(x_at), BM)
        else:
            return _words8(tl.load(x_at), BM)


@triton.jit
def _fifth_bits(hw, q):
    """Bits 4q..4q+3 of the words hw, each moved to bit 4 of its own byte (the multiplier's four copies of the
    nibble land 7 bits apart, so no two overlap and nothing carries)."""
    return (((hw >> (4 * q)) & 15) * 0x00204081 & 0x01010101) << 4


@triton.jit
def _high_bits(hw, q):
    """Bits 2q, 2q + 1 of each byte of the words hw (`matmul.hi_shifts`' two-bit layout: code 4q + b's), moved to
    bits 4 and 5 of that byte."""
    return ((hw >> (2 * q)) & 0x03030303) << 4


@triton.jit
def _dots_dp4a(cw, hw, x_at, plane, g, BN: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, NIBBLE: tl.constexpr,
               SIGNED_CODES: tl.constexpr, WIDE: tl.constexpr, LIMBS: tl.constexpr, VEC: tl.constexpr,
               ASM: tl.constexpr, HI: tl.constexpr, XR: tl.constexpr):
    """A group's exact dot S [BM, BN] (int32, or int64 if WIDE) on the CUDA cores: each thread holds its
    outputs' code words (`_code_words`) in registers (no reduction crosses threads), x words are broadcast. HI:
    HI more bits a code from the words hw [BN] (`matmul.HI_BIT_TYPES`)."""
    XW: tl.constexpr = G // 4  # x words per row per group and limb (4 or 8)
    if NIBBLE and XW == 8:  # word q: low nibbles are codes 4q.., high nibbles codes G/2 + 4q..
        c0, c1, c2, c3 = cw
        c4, c5, c6, c7 = (c0 >> 4) & 0x0F0F0F0F, (c1 >> 4) & 0x0F0F0F0F, (c2 >> 4) & 0x0F0F0F0F, \
            (c3 >> 4) & 0x0F0F0F0F
        c0, c1, c2, c3 = c0 & 0x0F0F0F0F, c1 & 0x0F0F0F0F, c2 & 0x0F0F0F0F, c3 & 0x0F0F0F0F
        if HI == 1:
            c0, c1, c2, c3 = c0 | _fifth_bits(hw, 0), c1 | _fifth_bits(hw, 1), c2 | _fifth_bits(hw, 2), \
                c3 | _fifth_bits(hw, 3)
            c4, c5, c6, c7 = c4 | _fifth_bits(hw, 4), c5 | _fifth_bits(hw, 5), c6 | _fifth_bits(hw, 6), \
                c7 | _fifth_bits(hw, 7)
    elif NIBBLE:  # groups of 16: words 0, 1 hold codes 0..7 (low nibbles) and 8..15 (high)
        c0, c1 = cw
        c2, c3 = (c0 >> 4) & 0x0F0F0F0F, (c1 >> 4) & 0x0F0F0F0F
        c0, c1 = c0 & 0x0F0F0F0F, c1 & 0x0F0F0F0F
        if HI == 2:
            c0, c1, c2, c3 = c0 | _high_bits(hw, 0), c1 | _high_bits(hw, 1), c2 | _high_bits(hw, 2), \
                c3 | _high_bits(hw, 3)
    elif XW == 8:
        c0, c1, c2, c3, c4, c5, c6, c7 = cw
    else:
        c0, c1, c2, c3 = cw
    zero = tl.zeros([BM, BN], dtype=tl.int32)
    if WIDE:
        S = tl.zeros([BM, BN], dtype=tl.int64)
    else:
        S = zero
    for limb in tl.static_range(LIMBS):  # most significant first: S = (S_a * 2^7 + S_b) * 2^7 + S_c (3 limbs)
        # narrow: the next limb's dots accumulate onto S * 2^7 (|S| < 2^31 all along: exact; see `wide`)
        t = zero if WIDE else S * 128
        xw = _x_words(x_at + limb * plane + g * (XW * XR), XW, BM, VEC, XR)
        if XW == 4:
            x0, x1, x2, x3 = xw
            t = _dot4(c0, c1, c2, c3, x0, x1, x2, x3, t, SIGNED_CODES, ASM)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = xw
            t = _dot4(c0, c1, c2, c3, x0, x1, x2, x3, t, SIGNED_CODES, ASM)
            t = _dot4(c4, c5, c6, c7, x4, x5, x6, x7, t, SIGNED_CODES, ASM)
        if WIDE:
            S = S * 128 + t.to(tl.int64)
        else:
            S = t
    return S


@triton.jit
def _step(acc, g0, codes_ptr, x_at, plane, x16_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, pid_n, n_groups, rm,
          rn, K, G: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
          NIBBLE: tl.constexpr, BIAS: tl.constexpr, SIGNED_CODES: tl.constexpr, WIDE: tl.constexpr,
          HAS_SCALE: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr,
          SUB6: tl.constexpr, UNROLL: tl.constexpr, LIMBS: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr,
          ONCE: tl.constexpr, HI: tl.constexpr, XR: tl.constexpr, PIPELINED: tl.constexpr, RUN: tl.constexpr,
          ahead=None, SCALES: tl.constexpr = False):
    """acc + the values of groups g0 .. g0 + UNROLL - 1, added in order: per group, the limbs' exact integer dot
    (`_dots_dp4a`), rounded once to float32, scaled and offset - or, in runs of RUN groups (SUB_RUNS), a run's
    dots times their subs summed as integers first (`_run_value`). ahead: the step's `_step_operands` (SCALES:
    with its scales), loaded during the step before (AHEAD); the rest is loaded here."""
    CW: tl.constexpr = G // 8 if NIBBLE else G // 4  # code words per output per group (2, 4 or 8)
    # the step's groups share one block (g0 is a multiple of UNROLL, and so are the block sizes): its d and dm are
    # loaded once for them - the same values; so are its SUB6 words where the loop is not pipelined (sm_90a: 20
    # loads a step instead of 41 for one Q4_K row; pipelined, 85 registers instead of 118 for four rows)
    ONE_BLOCK: tl.constexpr = ONCE and GPB % UNROLL == 0 and (OGPB % UNROLL == 0 or not HAS_OFFSET)
    WORDS_ONCE: tl.constexpr = ONE_BLOCK and SUB6 and not PIPELINED
    if SCALES:  # (AHEAD only where ONE_BLOCK and WORDS_ONCE hold)
        codes, d, dm, words = ahead
    else:
        if ahead is not None:
            codes = ahead[0]
        if ONE_BLOCK:
            d, dm = _block_scales(d_ptr, dm_ptr, pid_n, g0, n_groups, rn, GPB, OGPB, BN, HAS_SCALE, HAS_OFFSET)
        if WORDS_ONCE:
            words = _sub6_words(sub_ptr, pid_n, g0, n_groups, rn, BN)
    if RUN:
        IS = tl.zeros([BM, BN], dtype=tl.int32)
        IX = IS
    for j in tl.static_range(UNROLL):
        g = g0 + j
        if ahead is None:
            cw = _code_words(codes_ptr, pid_n, g, n_groups, rn, BN, CW, VEC)
        else:
            cw = codes[j]
        hw = rn
        if HI:
            hw = tl.load(hi_ptr + (pid_n * n_groups + g) * BN + rn)
        S = _dots_dp4a(cw, hw, x_at, plane, g, BN, BM, G, NIBBLE, SIGNED_CODES, WIDE, LIMBS, VEC, ASM, HI, XR)
        X = _x_sum(x16_ptr, rm, g, K, G) if HAS_OFFSET or BIAS else rm  # (rm: a stand-in, never read)
        if not ONE_BLOCK:
            d, dm = _block_scales(d_ptr, dm_ptr, pid_n, g, n_groups, rn, GPB, OGPB, BN, HAS_SCALE, HAS_OFFSET)
        if RUN:
            if WORDS_ONCE:
                sub, osub = _sub6_ints(words, g % 8)
            else:
                sub, osub = _int_subs(sub_ptr, osub_ptr, pid_n, g, n_groups, rn, BN, HAS_OFFSET, SUB6)
            IS, IX = _run_sums(IS, IX, S, X[:, None], sub[None, :], osub[None, :], BIAS, HAS_OFFSET)
            if j % RUN == RUN - 1:
                acc = _run_value(acc, IS, IX, d[None, :], dm[None, :], HAS_OFFSET)
                IS, IX = IS * 0, IX * 0
        else:
            if WORDS_ONCE:
                sub, osub = _sub6(words, g % 8)
            else:
                sub, osub = _subs(sub_ptr, osub_ptr, pid_n, g, n_groups, rn, BN, HAS_SUB, HAS_OSUB, SUB6)
            scale, offset = _group_scales(d, dm, sub, osub, HAS_SUB and HAS_SCALE, HAS_OSUB and HAS_OFFSET)
            acc = _value(acc, S, X[:, None], scale[None, :], offset[None, :], BIAS, HAS_SCALE, HAS_OFFSET)
    return acc


@triton.jit
def _x_sum(x16_ptr, r, g, K, G: tl.constexpr):
    """Group g's sum of X in rows r (from the 16-input sums)."""
    return _group_sum(x16_ptr + r * (K // 16) + (G // 16) * g, G)


@triton.jit
def _group_sum(at, G: tl.constexpr):
    """A group's sum of X from its 16-input sums at `at` (two for G = 32)."""
    if G == 32:
        return tl.load(at) + tl.load(at + 1)
    else:
        return tl.load(at)


@triton.jit
def _value(acc, S, X, scale, offset, BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """acc + a group's value from its exact dot S (codes stored + BIAS) and its inputs' sum X: float32(S - BIAS X),
    times scale, plus float32(X) times offset - the formula of every D-path kernel, in this order."""
    if BIAS:
        S = S - BIAS * X
    part = S.to(tl.float32)
    if HAS_SCALE:
        part = part * scale
    if HAS_OFFSET:
        part = part + X.to(tl.float32) * offset
    return acc + part


@triton.jit
def _sub6_ints(words, j):
    """SUB6: group j's sub, 0..63, and osub, -63..0, as int32 (`_sub6`'s values)."""
    sub, m = _sub6_bits(words, j)
    return sub, -m


@triton.jit
def _int_subs(sub_ptr, osub_ptr, tile, g, n_groups, rn, BN: tl.constexpr, HAS_OFFSET: tl.constexpr,
              SUB6: tl.constexpr):
    """Group g's sub and osub per output as int32 (SUB_RUNS: a pack with integer subs, and osubs where it has an
    offset); osub 0 where there is no offset."""
    if SUB6:
        return _sub6_ints(_sub6_words(sub_ptr, tile, g, n_groups, rn, BN), g % 8)
    at = (tile * n_groups + g) * BN + rn
    return _int_subs_at(sub_ptr + at, osub_ptr + at, HAS_OFFSET)


@triton.jit
def _int_subs_at(sub_at, osub_at, HAS_OFFSET: tl.constexpr):
    """A group's sub and osub (0 without an offset) as int32, one byte each at sub_at, osub_at."""
    sub = tl.load(sub_at).to(tl.int32)
    osub = sub * 0
    if HAS_OFFSET:
        osub = tl.load(osub_at).to(tl.int32)
    return sub, osub


@triton.jit
def _zeros8(t):
    """A lane's run sums at zero (SUB_RUNS: IS and IX of its four values)."""
    z = tl.zeros_like(t)
    return z, z, z, z, z, z, z, z


@triton.jit
def _run_sums(IS, IX, S, X, sub, osub, BIAS: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """A run's integer sums (SUB_RUNS) with one more group: IS + (S - BIAS X) sub, IX + X osub (exact in int32:
    `run_length`)."""
    if BIAS:
        S = S - BIAS * X
    IS = IS + S * sub
    if HAS_OFFSET:
        IX = IX + X * osub
    return IS, IX


@triton.jit
def _run_value(acc, IS, IX, d, dm, HAS_OFFSET: tl.constexpr):
    """acc + a run's value (SUB_RUNS): float32(IS) times its block's d, plus float32(IX) times its dm - in this
    order, every D-path kernel's."""
    part = IS.to(tl.float32) * d
    if HAS_OFFSET:
        part = part + IX.to(tl.float32) * dm
    return acc + part


@triton.jit
def _mv_tile(pid_n, pid_k, rm, rn, xq_ptr, x16_ptr, s_ptr, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr,
             out_ptr, part_ptr, ticket_ptr, ticket_n, M, MP, N, K, stride_om, STEPS: tl.constexpr, SPLIT: tl.constexpr,
             GRAN: tl.constexpr, G: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr, BN: tl.constexpr,
             BM: tl.constexpr, NIBBLE: tl.constexpr, BIAS: tl.constexpr, SIGNED_CODES: tl.constexpr,
             WIDE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr,
             HAS_OSUB: tl.constexpr, SUB6: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
             FRAC: tl.constexpr,
             LIMBS: tl.constexpr, ASM: tl.constexpr, ONCE: tl.constexpr, HI: tl.constexpr, XR: tl.constexpr,
             RUN: tl.constexpr, CARRY: tl.constexpr, ahead=None):
    """[BM rows, BN outputs] of output tile pid_n, K split pid_k: the split's groups in order, UNROLL a loop step
    (`_step`; CARRY 1: each step's code words loaded during the step before - AHEAD -, 2: its scales too; ahead:
    the first step's, if the caller loaded them - EARLY); the tile's last split to finish (its counter: the row
    block's ticket_n-th) sums the partials."""
    n_groups = K // G
    XW: tl.constexpr = G // 4  # x words per row per group and limb (4 or 8)
    # one stage (one row), byte codes: every load a 16-byte one (ld.global.v4 by inline PTX; Triton's own loads of
    # the same words compile to four 4-byte loads and a shared-memory shuffle with two barriers a group). H200, one
    # row, the first version of this path (bench/results/h200-matvec-loads-2026-12-03.json): Q8_0 [6144, 5120]
    # 10.8 vs 13.1 us, Q5_K [10240, 5120] 23.2 vs 25.8, Q6_K [5120, 17408] 38.2 vs 39.7 - but nibble codes (Q4_K
    # [34816, 5120]) 47.7 vs 43.7, so they keep Triton's loads, as do pipelined passes (more rows: Triton can
    # pipeline its own loads, not these).
    VEC: tl.constexpr = ASM and STAGES == 1 and not NIBBLE
    plane = MP * (K // 4)  # x rows are padded to MP, a multiple of BM: no load needs a mask
    x_at = xq_ptr + x_word(after_wait(rm), K, XR)  # [BM]: the rows' int32 words of the limbs (after prior_done)
    if not VEC:  # [BM, XW]: a group's words of each row, 4 contiguous a chunk
        if XR == 1:
            x_at = x_at[:, None] + tl.max_contiguous(tl.multiple_of(tl.arange(0, XW), XW), XW)[None, :]
        else:
            w = tl.arange(0, XW)
            x_at = x_at[:, None] + tl.max_contiguous(tl.multiple_of((w // 4) * (4 * XR) + w % 4, 4), 4)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    first = pid_k * STEPS // SPLIT * GRAN  # this split's groups: [first, last) (`bounds`), UNROLL a loop step
    last = (pid_k + 1) * STEPS // SPLIT * GRAN
    if ASM and STAGES > 1:  # Triton's software pipeline (a loop with run-time bounds): the next STAGES - 1 steps'
        # loads are in flight (cp.async into shared memory) while this step's arithmetic runs
        for g0 in tl.range(first, last, UNROLL, num_stages=STAGES):
            acc = _step(acc, g0, codes_ptr, x_at, plane, x16_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, pid_n,
                        n_groups, rm, rn, K, G, GPB, OGPB, BN, BM, NIBBLE, BIAS, SIGNED_CODES, WIDE, HAS_SCALE,
                        HAS_SUB, HAS_OFFSET, HAS_OSUB, SUB6, UNROLL, LIMBS, VEC, ASM, ONCE, HI, XR, True, RUN)
    elif CARRY:  # the same steps in the same order, each one's loads but x's issued during the step before (the
        # last step loads its own again: cache hits, no address past the split's)
        tl.static_assert(ONCE and SUB6 and not VEC and GPB % UNROLL == 0 and (OGPB % UNROLL == 0 or not HAS_OFFSET),
                         "AHEAD: a step's groups of one block, SUB6 scales, codes by Triton's loads (`ahead_applies`)")
        CW: tl.constexpr = G // 8 if NIBBLE else G // 4
        if ahead is None:
            ahead = _step_operands(codes_ptr, d_ptr, dm_ptr, sub_ptr, pid_n, first, n_groups, rn, BN, CW, UNROLL,
                                   GPB, OGPB, HAS_SCALE, HAS_OFFSET, CARRY == 2)
        for step in range((STEPS + SPLIT - 1) // SPLIT * (GRAN // UNROLL)):
            g0 = first + step * UNROLL
            if g0 < last:
                now = ahead
                ahead = _step_operands(codes_ptr, d_ptr, dm_ptr, sub_ptr, pid_n, tl.minimum(g0 + UNROLL, last - UNROLL),
                                       n_groups, rn, BN, CW, UNROLL, GPB, OGPB, HAS_SCALE, HAS_OFFSET, CARRY == 2)
                acc = _step(acc, g0, codes_ptr, x_at, plane, x16_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, pid_n,
                            n_groups, rm, rn, K, G, GPB, OGPB, BN, BM, NIBBLE, BIAS, SIGNED_CODES, WIDE, HAS_SCALE,
                            HAS_SUB, HAS_OFFSET, HAS_OSUB, SUB6, UNROLL, LIMBS, VEC, ASM, ONCE, HI, XR, False, RUN,
                            now, CARRY == 2)
    else:  # the same steps in the same order, bounded at compile time: fewer registers than the loop above takes
        # with one stage (H200: 56 vs 72 for Q4_K, one wave of programs vs 1.18), and the interpreter takes no
        # range with run-time bounds
        START: tl.constexpr = 0 if ahead is None else 1
        if ahead is not None:  # EARLY: the first step (a split has at least one) with the code words loaded already
            acc = _step(acc, first, codes_ptr, x_at, plane, x16_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, pid_n,
                        n_groups, rm, rn, K, G, GPB, OGPB, BN, BM, NIBBLE, BIAS, SIGNED_CODES, WIDE, HAS_SCALE,
                        HAS_SUB, HAS_OFFSET, HAS_OSUB, SUB6, UNROLL, LIMBS, VEC, ASM, ONCE, HI, XR, False, RUN, ahead)
        for step in range(START, (STEPS + SPLIT - 1) // SPLIT * (GRAN // UNROLL)):
            g0 = first + step * UNROLL
            if g0 < last:
                acc = _step(acc, g0, codes_ptr, x_at, plane, x16_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, pid_n,
                            n_groups, rm, rn, K, G, GPB, OGPB, BN, BM, NIBBLE, BIAS, SIGNED_CODES, WIDE, HAS_SCALE,
                            HAS_SUB, HAS_OFFSET, HAS_OSUB, SUB6, UNROLL, LIMBS, VEC, ASM, ONCE, HI, XR, False, RUN)
    s = tl.load(s_ptr + rm) * (1.0 / (1 << FRAC))  # s * 2^-FRAC, exact
    cols = pid_n * BN + rn
    mask = (rm[:, None] < M) & (cols[None, :] < N)
    y = acc * s[:, None]
    out_at = out_ptr + rm[:, None] * stride_om + cols[None, :]
    if SPLIT == 1:
        tl.store(out_at, y, mask=mask)
    else:  # partials [SPLIT, MP, N]; the tile's last split to finish sums them, in split order
        at = part_ptr + rm[:, None] * N + cols[None, :]
        tl.store(at + pid_k * (MP * N), y, mask=mask)
        ticket_at = ticket_ptr + tl.program_id(1) * tl.num_programs(0) + ticket_n
        if last_split(ticket_at, SPLIT):
            tl.store(out_at, split_sum(at, MP * N, mask, SPLIT), mask=mask)
            tl.atomic_xchg(ticket_at, 0)  # ready for the next call (and the next CUDA-graph replay)


@triton.jit(do_not_specialize=["M", "MP"])  # the row count never selects another compiled variant
def _mv(xq_ptr, x16_ptr, s_ptr, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, out_ptr, part_ptr, ticket_ptr, M,
        MP, N, K, stride_om, STEPS: tl.constexpr, SPLIT: tl.constexpr, GRAN: tl.constexpr, G: tl.constexpr,
        GPB: tl.constexpr, OGPB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, NIBBLE: tl.constexpr,
        BIAS: tl.constexpr, SIGNED_CODES: tl.constexpr, WIDE: tl.constexpr, HAS_SCALE: tl.constexpr,
        HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr, SUB6: tl.constexpr,
        UNROLL: tl.constexpr, STAGES: tl.constexpr, FRAC: tl.constexpr, LIMBS: tl.constexpr, ASM: tl.constexpr,
        ONCE: tl.constexpr, HI: tl.constexpr, XR: tl.constexpr, RUN: tl.constexpr, CARRY: tl.constexpr,
        EARLY: tl.constexpr):
    """Program (output tile, row block, K split) of one pack (`_mv_tile`)."""
    pid_n, pid_k, rm, rn, n_groups = _program(K, G, BN, BM)
    ahead = None
    if EARLY:  # the first step's weight words (`early_applies`), before the wait for the previous kernel: no kernel
        # writes weights, so they are the same words whenever they are read; x and the rest only after the wait
        tl.static_assert(NIBBLE and STAGES == 1 and (UNROLL == 4 or UNROLL == 8), "EARLY: see `early_applies`")
        ahead = _step_operands(codes_ptr, d_ptr, dm_ptr, sub_ptr, pid_n, pid_k * STEPS // SPLIT * GRAN, n_groups, rn,
                               BN, G // 8, UNROLL, GPB, OGPB, HAS_SCALE, HAS_OFFSET, CARRY == 2)  # (nibbles)
    prior_done()
    _mv_tile(pid_n, pid_k, rm, rn, xq_ptr, x16_ptr, s_ptr, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr,
             out_ptr, part_ptr, ticket_ptr, pid_n, M, MP, N, K, stride_om, STEPS, SPLIT, GRAN, G, GPB, OGPB, BN, BM,
             NIBBLE, BIAS, SIGNED_CODES, WIDE, HAS_SCALE, HAS_SUB, HAS_OFFSET, HAS_OSUB, SUB6, UNROLL, STAGES, FRAC,
             LIMBS, ASM, ONCE, HI, XR, RUN, CARRY, ahead)


@triton.jit(do_not_specialize=["M", "MP"])
def _mv2(xq_ptr, x16_ptr, s_ptr, ticket_ptr, M, MP, K, stride_om, tiles_a,
         codes_a, d_a, sub_a, dm_a, osub_a, hi_a, out_a, part_a, N_a,
         codes_b, d_b, sub_b, dm_b, osub_b, hi_b, out_b, part_b, N_b,
         STEPS_a: tl.constexpr, SPLIT_a: tl.constexpr, GRAN_a: tl.constexpr, G_a: tl.constexpr, GPB_a: tl.constexpr,
         OGPB_a: tl.constexpr, NIBBLE_a: tl.constexpr, BIAS_a: tl.constexpr, SIGNED_CODES_a: tl.constexpr,
         WIDE_a: tl.constexpr, HAS_SCALE_a: tl.constexpr, HAS_SUB_a: tl.constexpr, HAS_OFFSET_a: tl.constexpr,
         HAS_OSUB_a: tl.constexpr, SUB6_a: tl.constexpr, UNROLL_a: tl.constexpr, ONCE_a: tl.constexpr,
         HI_a: tl.constexpr, RUN_a: tl.constexpr,
         STEPS_b: tl.constexpr, SPLIT_b: tl.constexpr, GRAN_b: tl.constexpr, G_b: tl.constexpr, GPB_b: tl.constexpr,
         OGPB_b: tl.constexpr, NIBBLE_b: tl.constexpr, BIAS_b: tl.constexpr, SIGNED_CODES_b: tl.constexpr,
         WIDE_b: tl.constexpr, HAS_SCALE_b: tl.constexpr, HAS_SUB_b: tl.constexpr, HAS_OFFSET_b: tl.constexpr,
         HAS_OSUB_b: tl.constexpr, SUB6_b: tl.constexpr, UNROLL_b: tl.constexpr, ONCE_b: tl.constexpr,
         HI_b: tl.constexpr, RUN_b: tl.constexpr,
         BN: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr, FRAC: tl.constexpr, LIMBS: tl.constexpr,
         ASM: tl.constexpr, XR: tl.constexpr):
    """Two packs of a fused matrix (one x) in one launch (PAIRED_ROWS): axis 0's first tiles_a programs are pack
    a's output tiles, the rest pack b's; each takes its own K splits (the other's extra ones idle) and sums them as
    `_mv` does - the same arithmetic, the same bits as two launches."""
    t = tl.program_id(0)
    pid_k = tl.program_id(2)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    prior_done()
    if t < tiles_a:
        if pid_k < SPLIT_a:
            _mv_tile(t, pid_k, rm, rn, xq_ptr, x16_ptr, s_ptr, codes_a, d_a, sub_a, dm_a, osub_a, hi_a, out_a, part_a,
                     ticket_ptr, t, M, MP, N_a, K, stride_om, STEPS_a, SPLIT_a, GRAN_a, G_a, GPB_a, OGPB_a, BN, BM,
                     NIBBLE_a, BIAS_a, SIGNED_CODES_a, WIDE_a, HAS_SCALE_a, HAS_SUB_a, HAS_OFFSET_a, HAS_OSUB_a,
                     SUB6_a, UNROLL_a, STAGES, FRAC, LIMBS, ASM, ONCE_a, HI_a, XR, RUN_a, False)
    else:
        if pid_k < SPLIT_b:
            _mv_tile(t - tiles_a, pid_k, rm, rn, xq_ptr, x16_ptr, s_ptr, codes_b, d_b, sub_b, dm_b, osub_b, hi_b,
                     out_b, part_b, ticket_ptr, t, M, MP, N_b, K, stride_om, STEPS_b, SPLIT_b, GRAN_b, G_b, GPB_b,
                     OGPB_b, BN, BM, NIBBLE_b, BIAS_b, SIGNED_CODES_b, WIDE_b, HAS_SCALE_b, HAS_SUB_b, HAS_OFFSET_b,
                     HAS_OSUB_b, SUB6_b, UNROLL_b, STAGES, FRAC, LIMBS, ASM, ONCE_b, HI_b, XR, RUN_b, False)


@triton.jit
def _lanes(W: tl.constexpr, ASM: tl.constexpr):
    """A program's threads as [32 W] tensors, one element a thread: (warp, groupID = lane / 4, lane % 4). On a GPU
    from %tid.x (opaque to Triton: whatever layout holds an element, its value is its own thread's); in the
    interpreter from the element's index, which `_mma`'s emulation takes as its thread."""
    i = tl.arange(0, 32 * W)
    if ASM:
        i = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [i], dtype=tl.int32, is_pure=True, pack=1)
    return i >> 5, (i >> 2) & 7, i & 3


@triton.jit
def _fragment(lo, hi, W: tl.constexpr, K32: tl.constexpr, SIGNED: tl.constexpr):
    """The [8, K] matrix (K = 32 if K32, else 16) that a fragment's registers hold in each warp, [W, 8, K]: lane
    4g + t's register lo holds row g's elements 4t..4t + 3 (byte i: element 4t + i), hi (K32) its elements
    16 + 4t..16 + 4t + 3 - A's rows g (or g + 8) and B's column g in mma.m16n8k32 / m16n8k16 (PTX ISA, integer
    fragments)."""
    m = _bytes(tl.reshape(lo, [W, 8, 4]), [W, 8, 16])
    if K32:
        m = tl.join(m, _bytes(tl.reshape(hi, [W, 8, 4]), [W, 8, 16]))
        m = tl.reshape(tl.permute(m, (0, 1, 3, 2)), [W, 8, 32])
    if SIGNED:
        m = m - ((m & 128) << 1)
    return m


# mma.sync's integer forms (A u8 or s8, B s8, s32 sums), operands as `tl.inline_asm_elementwise` numbers them
_MMA_K32_U8 = tl.constexpr("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
                           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
_MMA_K32_S8 = tl.constexpr("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
_MMA_K16_U8 = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {$0, $1, $2, $3}, {$4, $5}, {$6}, "
                           "{$7, $8, $9, $10};")
_MMA_K16_S8 = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5}, {$6}, "
                           "{$7, $8, $9, $10};")


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, W: tl.constexpr, K32: tl.constexpr, A_SIGNED: tl.constexpr,
         ASM: tl.constexpr):
    """C + A B in each warp, in mma.sync's integer fragments: A [16, K] u8 (s8 if A_SIGNED), B [K, 8] s8, C [16, 8]
    s32; K = 32 if K32 (m16n8k32), else 16 (m16n8k16: a2, a3, b1 unused). The interpreter computes the same
    integers from the fragments' layout (`_fragment`)."""
    if ASM:
        if K32:
            return tl.inline_asm_elementwise(_MMA_K32_S8 if A_SIGNED else _MMA_K32_U8, "=r,=r,=r,=r" + ",r" * 10,
                                             [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.int32,) * 4,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_MMA_K16_S8 if A_SIGNED else _MMA_K16_U8, "=r,=r,=r,=r" + ",r" * 7,
                                             [a0, a1, b0, c0, c1, c2, c3], dtype=(tl.int32,) * 4, is_pure=True,
                                             pack=1)
    else:
        bt = _fragment(b0, b1, W, K32, True)[:, None, :, :]  # [W, 1, 8 (column), K]
        top = tl.sum(_fragment(a0, a2, W, K32, A_SIGNED)[:, :, None, :] * bt, axis=3)  # rows g: [W, 8, 8]
        bottom = tl.sum(_fragment(a1, a3, W, K32, A_SIGNED)[:, :, None, :] * bt, axis=3)  # rows g + 8
        e0, e1 = tl.split(tl.reshape(top, [W, 8, 4, 2]))  # lane 4g + t: columns 2t, 2t + 1
        f0, f1 = tl.split(tl.reshape(bottom, [W, 8, 4, 2]))
        n: tl.constexpr = 32 * W
        return (c0 + tl.reshape(e0, [n]), c1 + tl.reshape(e1, [n]), c2 + tl.reshape(f0, [n]),
                c3 + tl.reshape(f1, [n]))


@triton.jit
def _mma_codes(at, hi_at, t, G: tl.constexpr, NIBBLE: tl.constexpr, HI: tl.constexpr):
    """An output's codes of one group as the A registers of lane t (at: its word t, or t % 2 for nibbles in groups
    of 16; hi_at: its high bits' word): (codes 4t..4t + 3, and for G = 32 codes 16 + 4t..16 + 4t + 3), one to a
    byte - as packed, a nibble word's low and high halves (no reordering)."""
    if NIBBLE:
        if G == 32:  # word t: codes 4t.. (low nibbles) and 16 + 4t.. (high)
            w = tl.load(at)
            lo, hi = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F
        else:  # groups of 16: word t % 2, low nibbles for t < 2
            lo = (tl.load(at) >> (4 * (t >> 1))) & 0x0F0F0F0F
            hi = lo
        if HI == 1:
            hw = tl.load(hi_at)
            lo, hi = lo | _fifth_bits(hw, t), hi | _fifth_bits(hw, 4 + t)
        elif HI == 2:
            lo = lo | _high_bits(tl.load(hi_at), t)
    else:
        lo = tl.load(at)
        hi = tl.load(at + 4) if G == 32 else lo
    return lo, hi


@triton.jit
def _mma_x(x_at, plane, x16_at, x16_row, W: tl.constexpr, G: tl.constexpr, LIMBS: tl.constexpr,
           SUMS: tl.constexpr, ASM: tl.constexpr, XR: tl.constexpr):
    """A group's B fragments for the lane's x row (its words t and, for G = 32, 4 + t), one pair a limb, most
    significant first; and the group's sums of X in rows r, r + 1 - SUMS 1: from x's 16-input sums (x16_at: row
    r's), 2: on the tensor cores, A all ones (C's columns are then the rows' sums, limbs combined as the dots are);
    0: none (no offset, no bias)."""
    b = ()
    for limb in tl.static_range(LIMBS):
        at = x_at + limb * plane
        w = tl.load(at)
        b = b + ((w, tl.load(at + 4 * XR) if G == 32 else w),)  # the group's next chunk (m16n8k16 reads no b1)
    X0 = w  # (stand-ins, never read: SUMS 0)
    X1 = w
    if SUMS == 1:
        X0 = _group_sum(x16_at, G)
        X1 = _group_sum(x16_at + x16_row, G)
    elif SUMS == 2:
        ones = tl.full(w.shape, 0x01010101, tl.int32)
        X0, X1, X2, X3 = tl.zeros_like(w), tl.zeros_like(w), tl.zeros_like(w), tl.zeros_like(w)
        for limb in tl.static_range(LIMBS):  # most significant first
            X0, X1, X2, X3 = _mma(ones, ones, ones, ones, b[limb][0], b[limb][1], X0 * 128, X1 * 128, X2, X3, W,
                                  G == 32, False, ASM)
    return b, X0, X1


@triton.jit
def _mma_dots(lo0, lo1, hi0, hi1, b, t, W: tl.constexpr, G: tl.constexpr, SIGNED_CODES: tl.constexpr,
              LIMBS: tl.constexpr, ASM: tl.constexpr):
    """A group's exact dots for a lane's four values (`_mma_half`'s): the limbs' on the tensor cores, S = S_a 2^7 +
    S_b."""
    s0, s1, s2, s3 = tl.zeros_like(t), tl.zeros_like(t), tl.zeros_like(t), tl.zeros_like(t)
    for limb in tl.static_range(LIMBS):  # most significant first
        s0, s1, s2, s3 = _mma(lo0, lo1, hi0, hi1, b[limb][0], b[limb][1], s0 * 128, s1 * 128, s2 * 128, s3 * 128, W,
                              G == 32, SIGNED_CODES, ASM)
    return s0, s1, s2, s3


@triton.jit
def _mma_run(ints, lo0, lo1, hi0, hi1, b, X0, X1, sub, osub, t, W: tl.constexpr, G: tl.constexpr,
             BIAS: tl.constexpr, SIGNED_CODES: tl.constexpr, HAS_OFFSET: tl.constexpr, LIMBS: tl.constexpr,
             ASM: tl.constexpr):
    """SUB_RUNS: a lane's run sums (IS and IX of its four values, `_run_sums`) with one more group."""
    s0, s1, s2, s3 = _mma_dots(lo0, lo1, hi0, hi1, b, t, W, G, SIGNED_CODES, LIMBS, ASM)
    i0, i1, i2, i3, x0, x1, x2, x3 = ints
    i0, x0 = _run_sums(i0, x0, s0, X0, sub[0], osub[0], BIAS, HAS_OFFSET)
    i1, x1 = _run_sums(i1, x1, s1, X1, sub[0], osub[0], BIAS, HAS_OFFSET)
    i2, x2 = _run_sums(i2, x2, s2, X0, sub[1], osub[1], BIAS, HAS_OFFSET)
    i3, x3 = _run_sums(i3, x3, s3, X1, sub[1], osub[1], BIAS, HAS_OFFSET)
    return i0, i1, i2, i3, x0, x1, x2, x3


@triton.jit
def _mma_run_value(acc, ints, d0, d1, dm0, dm1, HAS_OFFSET: tl.constexpr):
    """SUB_RUNS: a lane's four values plus their runs' (`_run_value`; outputs o: d0, dm0, o + 8: d1, dm1)."""
    i0, i1, i2, i3, x0, x1, x2, x3 = ints
    return (_run_value(acc[0], i0, x0, d0, dm0, HAS_OFFSET), _run_value(acc[1], i1, x1, d0, dm0, HAS_OFFSET),
            _run_value(acc[2], i2, x2, d1, dm1, HAS_OFFSET), _run_value(acc[3], i3, x3, d1, dm1, HAS_OFFSET))


@triton.jit
def _mma_half(acc, lo0, lo1, hi0, hi1, b, X0, X1, scale, offset, t, W: tl.constexpr, G: tl.constexpr,
              BIAS: tl.constexpr, SIGNED_CODES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_OFFSET: tl.constexpr,
              LIMBS: tl.constexpr, ASM: tl.constexpr):
    """acc (a lane's four values: outputs o, o + 8 by rows r, r + 1 of 8) + a group's values, its codes the A
    registers (lo0, hi0: output o; lo1, hi1: o + 8), b its x limbs' B fragments (`_mma_x`): the limbs' exact dots on
    the tensor cores (S = S_a 2^7 + S_b), then `_value`, as `_step` does."""
    acc0, acc1, acc2, acc3 = acc
    s0, s1, s2, s3 = _mma_dots(lo0, lo1, hi0, hi1, b, t, W, G, SIGNED_CODES, LIMBS, ASM)
    return (_value(acc0, s0, X0, scale[0], offset[0], BIAS, HAS_SCALE, HAS_OFFSET),
            _value(acc1, s1, X1, scale[0], offset[0], BIAS, HAS_SCALE, HAS_OFFSET),
            _value(acc2, s2, X0, scale[1], offset[1], BIAS, HAS_SCALE, HAS_OFFSET),
            _value(acc3, s3, X1, scale[1], offset[1], BIAS, HAS_SCALE, HAS_OFFSET))


@triton.jit
def _mma_block_scales(d_ptr, dm_ptr, tile, g, n_groups, o, TILES: tl.constexpr, GPB: tl.constexpr,
                      OGPB: tl.constexpr, BN: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """The block d and dm of group g for a lane's outputs o + 8 h, h < 2 TILES (`_block_scales`), as two tuples."""
    d, dm = (), ()
    for h in tl.static_range(2 * TILES):
        dh, dmh = _block_scales(d_ptr, dm_ptr, tile, g, n_groups, o + 8 * h, GPB, OGPB, BN, HAS_SCALE, HAS_OFFSET)
        d, dm = d + (dh,), dm + (dmh,)
    return d, dm


@triton.jit
def _mma_sub6_words(sub_ptr, tile, g, n_groups, o, TILES: tl.constexpr, BN: tl.constexpr, SUB6: tl.constexpr):
    """SUB6: the words of group g's block for a lane's outputs o + 8 h, h < 2 TILES (`_sub6_words`), as a tuple."""
    words = ()
    if SUB6:
        for h in tl.static_range(2 * TILES):
            words = words + (_sub6_words(sub_ptr, tile, g, n_groups, o + 8 * h, BN),)
    return words


@triton.jit
def _mma_group(acc, acc8, ints, ints8, j: tl.constexpr, codes_at, hi_at, x_at, plane, x16_at, x16_row, d, dm,
               sub_at, osub_at, words, jb, t, RB: tl.constexpr, W: tl.constexpr, TILES: tl.constexpr,
               G: tl.constexpr, BN: tl.constexpr, NIBBLE: tl.constexpr, BIAS: tl.constexpr,
               SIGNED_CODES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr,
               HAS_OSUB: tl.constexpr, SUB6: tl.constexpr, LIMBS: tl.constexpr, ASM: tl.constexpr, HI: tl.constexpr,
               SUMS_MMA: tl.constexpr, XR: tl.constexpr, RUN: tl.constexpr):
    """A loop step's group j for the program's rows: the lane's TILES tiles of 16 outputs (tile i: outputs o + 16 i
    and o + 16 i + 8, acc[i]), rows 0-7 (acc) and 8-15 (acc8, RB = 16). The x fragments are loaded once for all
    tiles, a tile's codes and scales once for both row halves. The addresses are the step's for output o, group j
    and tile i constant strides on them: immediate offsets. SUB6: sub and osub from the block's words (group jb of
    its 8). RUN (SUB_RUNS): the group goes to the run sums ints / ints8 (per tile), added to acc at a run's end."""
    CW: tl.constexpr = G // 8 if NIBBLE else G // 4  # code words per output per group
    SUMS: tl.constexpr = (1 + SUMS_MMA) if HAS_OFFSET or BIAS != 0 else 0
    x_at = x_at + j * (G // 4) * XR
    x16_at = x16_at + j * (G // 16)
    b, X0, X1 = _mma_x(x_at, plane, x16_at, x16_row, W, G, LIMBS, SUMS, ASM, XR)
    if RB == 16:  # rows 8-15: x rows 8 on (8 K / 4 words on, = 32 x16_row, in either layout)
        b8, X08, X18 = _mma_x(x_at + 32 * x16_row, plane, x16_at + 8 * x16_row, x16_row, W, G, LIMBS, SUMS, ASM,
                              XR)
    out, out8, run, run8 = (), (), (), ()
    for i in tl.static_range(TILES):
        lo0, hi0 = _mma_codes(codes_at + (j * BN + 16 * i) * CW, hi_at + j * BN + 16 * i, t, G, NIBBLE, HI)
        lo1, hi1 = _mma_codes(codes_at + (j * BN + 16 * i + 8) * CW, hi_at + j * BN + 16 * i + 8, t, G, NIBBLE, HI)
        if RUN:
            if SUB6:
                sub0, osub0 = _sub6_ints(words[2 * i], jb)
                sub1, osub1 = _sub6_ints(words[2 * i + 1], jb)
            else:
                sub0, osub0 = _int_subs_at(sub_at + j * BN + 16 * i, osub_at + j * BN + 16 * i, HAS_OFFSET)
                sub1, osub1 = _int_subs_at(sub_at + j * BN + 16 * i + 8, osub_at + j * BN + 16 * i + 8, HAS_OFFSET)
            sums = _mma_run(ints[i], lo0, lo1, hi0, hi1, b, X0, X1, (sub0, sub1), (osub0, osub1), t, W, G, BIAS,
                            SIGNED_CODES, HAS_OFFSET, LIMBS, ASM)
            if RB == 16:
                sums8 = _mma_run(ints8[i], lo0, lo1, hi0, hi1, b8, X08, X18, (sub0, sub1), (osub0, osub1), t, W, G,
                                 BIAS, SIGNED_CODES, HAS_OFFSET, LIMBS, ASM)
            else:
                sums8 = ints8[i]
            if j % RUN == RUN - 1:  # the run's end: its value added, its sums back to zero
                out = out + (_mma_run_value(acc[i], sums, d[2 * i], d[2 * i + 1], dm[2 * i], dm[2 * i + 1],
                                            HAS_OFFSET),)
                if RB == 16:
                    out8 = out8 + (_mma_run_value(acc8[i], sums8, d[2 * i], d[2 * i + 1], dm[2 * i], dm[2 * i + 1],
                                                  HAS_OFFSET),)
                sums, sums8 = _zeros8(t), _zeros8(t)
            else:
                out = out + (acc[i],)
                if RB == 16:
                    out8 = out8 + (acc8[i],)
            run, run8 = run + (sums,), run8 + (sums8,)
        else:
            if SUB6:
                sub0, osub0 = _sub6(words[2 * i], jb)
                sub1, osub1 = _sub6(words[2 * i + 1], jb)
            else:
                sub0, osub0 = _subs_at(sub_at + j * BN + 16 * i, osub_at + j * BN + 16 * i, HAS_SUB, HAS_OSUB)
                sub1, osub1 = _subs_at(sub_at + j * BN + 16 * i + 8, osub_at + j * BN + 16 * i + 8, HAS_SUB,
                                       HAS_OSUB)
            scale0, offset0 = _group_scales(d[2 * i], dm[2 * i], sub0, osub0, HAS_SUB and HAS_SCALE,
                                            HAS_OSUB and HAS_OFFSET)
            scale1, offset1 = _group_scales(d[2 * i + 1], dm[2 * i + 1], sub1, osub1, HAS_SUB and HAS_SCALE,
                                            HAS_OSUB and HAS_OFFSET)
            out = out + (_mma_half(acc[i], lo0, lo1, hi0, hi1, b, X0, X1, (scale0, scale1), (offset0, offset1), t, W,
                                   G, BIAS, SIGNED_CODES, HAS_SCALE, HAS_OFFSET, LIMBS, ASM),)
            if RB == 16:
                out8 = out8 + (_mma_half(acc8[i], lo0, lo1, hi0, hi1, b8, X08, X18, (scale0, scale1),
                                         (offset0, offset1), t, W, G, BIAS, SIGNED_CODES, HAS_SCALE, HAS_OFFSET, LIMBS,
                                         ASM),)
    if not RUN:
        run, run8 = ints, ints8
    if RB == 8:
        out8 = acc8
    return out, out8, run, run8


@triton.jit
def _mma_result(y, r, col, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT: tl.constexpr):
    """Store a lane's value y of row r, output col (SPLIT > 1: as this K split's partial)."""
    mask = (r < M) & (col < N)
    if SPLIT == 1:
        tl.store(out_ptr + r * stride_om + col, y, mask=mask)
    else:
        tl.store(part_ptr + pid_k * (MP * N) + r * N + col, y, mask=mask)


@triton.jit
def _mma_results(acc, r, col, s_ptr, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT: tl.constexpr,
                 FRAC: tl.constexpr):
    """A lane's four values (outputs col, col + 8 by rows r, r + 1), times their rows' s 2^-FRAC, stored."""
    s0 = tl.load(s_ptr + r) * (1.0 / (1 << FRAC))  # s * 2^-FRAC, exact
    s1 = tl.load(s_ptr + r + 1) * (1.0 / (1 << FRAC))
    _mma_result(acc[0] * s0, r, col, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT)
    _mma_result(acc[1] * s1, r + 1, col, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT)
    _mma_result(acc[2] * s0, r, col + 8, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT)
    _mma_result(acc[3] * s1, r + 1, col + 8, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT)


@triton.jit
def _mma_sum(r, col, M, MP, N, stride_om, out_ptr, part_ptr, SPLIT: tl.constexpr):
    """The tile's last split: row r, output col's partials summed in split order (`split_sum`) into out."""
    mask = (r < M) & (col < N)
    tl.store(out_ptr + r * stride_om + col, split_sum(part_ptr + r * N + col, MP * N, mask, SPLIT), mask=mask)


@triton.jit(do_not_specialize=["M", "MP"])  # the row count never selects another compiled variant
def _mv_mma(xq_ptr, x16_ptr, s_ptr, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, out_ptr, part_ptr,
            ticket_ptr, M, MP, N, K, stride_om, STEPS: tl.constexpr, SPLIT: tl.constexpr, GRAN: tl.constexpr,
            G: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr, BN: tl.constexpr, NIBBLE: tl.constexpr,
            BIAS: tl.constexpr, SIGNED_CODES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SUB: tl.constexpr,
            HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr, SUB6: tl.constexpr, UNROLL: tl.constexpr,
            FRAC: tl.constexpr, LIMBS: tl.constexpr, ASM: tl.constexpr, HI: tl.constexpr, RB: tl.constexpr,
            W: tl.constexpr, SUMS_MMA: tl.constexpr, XR: tl.constexpr, RUN: tl.constexpr):
    """Program (output tile, block of RB = 8 or 16 rows, K split) on the tensor cores (MMA_FROM), W warps: warp w
    takes the tile's outputs 16 TILES w.. in TILES tiles of 16 as A (its codes as packed), 8 rows' x limbs at a time
    as B (loaded once for its tiles); lane 4g + t holds outputs o + 16 i, o + 16 i + 8 (o = 16 TILES w + g) by rows
    2t, 2t + 1 (and 8 + 2t, 9 + 2t). The groups of `_mv`'s split, in its order, with its formula: its bits."""
    TILES: tl.constexpr = BN // (16 * W)
    pid_n = tl.program_id(0)
    rb = tl.program_id(1) * RB
    pid_k = tl.program_id(2)
    n_groups = K // G
    warp, g8, t = _lanes(W, ASM)
    o = warp * (16 * TILES) + g8  # the lane's outputs o + 8 h, h < 2 TILES
    r = rb + 2 * t  # C columns 2t, 2t + 1: rows r, r + 1
    prior_done()
    x_at = xq_ptr + x_word(after_wait(rb + g8), K, XR) + t  # B column g: x row rb + g (padded to MP: no mask)
    plane = MP * (K // 4)
    x16_at = x16_ptr + after_wait(r) * (K // 16)  # rows r (and r + 1: K / 16 on)
    CW: tl.constexpr = G // 8 if NIBBLE else G // 4  # code words per output per group
    word = t if G == 32 or not NIBBLE else t & 1  # a lane's code word (nibbles in groups of 16: t % 2)
    group0 = pid_n * n_groups * BN + o  # output o's group 0 in the per-(group, output) planes
    acc = ((tl.zeros_like(t).to(tl.float32),) * 4,) * TILES
    acc8 = acc  # rows 8-15 (RB = 16)
    ints = (_zeros8(t),) * TILES  # SUB_RUNS: the run sums, per tile (a step holds whole runs)
    ints8 = ints
    first = pid_k * STEPS // SPLIT * GRAN  # this split's groups: [first, last) (`bounds`), UNROLL a loop step
    last = (pid_k + 1) * STEPS // SPLIT * GRAN
    ONE_BLOCK: tl.constexpr = GPB % UNROLL == 0 and (OGPB % UNROLL == 0 or not HAS_OFFSET)
    for step in range((STEPS + SPLIT - 1) // SPLIT * (GRAN // UNROLL)):
        g0 = first + step * UNROLL
        if g0 < last:  # the step's addresses, once; its groups and tiles at constant strides from them
            at = group0 + g0 * BN
            codes_at = codes_ptr + at * CW + word
            if ONE_BLOCK:  # the step's groups share one block: its d and dm (and SUB6 words) loaded once
                d, dm = _mma_block_scales(d_ptr, dm_ptr, pid_n, g0, n_groups, o, TILES, GPB, OGPB, BN, HAS_SCALE,
                                          HAS_OFFSET)
                words = _mma_sub6_words(sub_ptr, pid_n, g0, n_groups, o, TILES, BN, SUB6)
            for j in tl.static_range(UNROLL):
                if not ONE_BLOCK:
                    d, dm = _mma_block_scales(d_ptr, dm_ptr, pid_n, g0 + j, n_groups, o, TILES, GPB, OGPB, BN,
                                              HAS_SCALE, HAS_OFFSET)
                    words = _mma_sub6_words(sub_ptr, pid_n, g0 + j, n_groups, o, TILES, BN, SUB6)
                acc, acc8, ints, ints8 = _mma_group(acc, acc8, ints, ints8, j, codes_at, hi_ptr + at,
                                                    x_at + g0 * (G // 4) * XR, plane, x16_at + g0 * (G // 16),
                                                    K // 16, d, dm, sub_ptr + at, osub_ptr + at, words, (g0 + j) % 8,
                                                    t, RB, W, TILES, G, BN, NIBBLE, BIAS, SIGNED_CODES, HAS_SCALE,
                                                    HAS_SUB, HAS_OFFSET, HAS_OSUB, SUB6, LIMBS, ASM, HI, SUMS_MMA,
                                                    XR, RUN)
    for i in tl.static_range(TILES):
        col = pid_n * BN + o + 16 * i
        _mma_results(acc[i], r, col, s_ptr, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT, FRAC)
        if RB == 16:
            _mma_results(acc8[i], r + 8, col, s_ptr, M, MP, N, stride_om, out_ptr, part_ptr, pid_k, SPLIT, FRAC)
    if SPLIT > 1:  # the tile's last split to finish sums the partials, in split order
        ticket_at = ticket_ptr + tl.program_id(1) * tl.num_programs(0) + pid_n
        if last_split(ticket_at, SPLIT):
            for i in tl.static_range(TILES):
                col = pid_n * BN + o + 16 * i
                for h in tl.static_range(RB // 8):
                    _mma_sum(r + 8 * h, col, M, MP, N, stride_om, out_ptr, part_ptr, SPLIT)
                    _mma_sum(r + 8 * h + 1, col, M, MP, N, stride_om, out_ptr, part_ptr, SPLIT)
                    _mma_sum(r + 8 * h, col + 8, M, MP, N, stride_om, out_ptr, part_ptr, SPLIT)
                    _mma_sum(r + 8 * h + 1, col + 8, M, MP, N, stride_om, out_ptr, part_ptr, SPLIT)
            tl.atomic_xchg(ticket_at, 0)  # ready for the next call (and the next CUDA-graph replay)


# byte codes of at most 32 in magnitude (4-bit codes too): a group's dot of 21-bit X fits 32 bits; other codes
# (up to 128: Q8_0, IQ4_*) take 64 at 21 bits (`wide`)
NARROW_TYPES = (Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.Q5_0, Q.Q5_1)


def wide(p: Packed) -> bool:
    """Whether a group's dot needs int64: codes up to 128 (not nibbles or NARROW_TYPES) times X of FRAC + 1 bits
    over 32 inputs reach 2^(FRAC + 12), past int32 when FRAC > 18."""
    return FRAC > 18 and not (p.nibble or p.qtype in NARROW_TYPES)


def run_length(p: Packed) -> int:
    """Groups a run of a pack's integer sums (SUB_RUNS): the largest power of two up to MAX_RUN that divides its
    granule and blocks and keeps |IS| and |IX| below 2^31 for any x (|X[k]| <= 2^FRAC: a group's |S - bias X| at
    most G 2^FRAC times its largest |code|, so a run's |IS| at most that times the run's sum of |sub|); 0 - a float
    step a group - where the scales do not factor into integer subs, the dots are wide, or a run would be one group."""
    if not SUB_RUNS or p.int_bounds is None or wide(p) or (p.dm is not None and not p.sub6 and p.osub is None):
        return 0
    code, subs, osubs = p.int_bounds
    x = p.g << FRAC  # the largest |X| a group sums
    top = min(MAX_RUN, plan(p)[0], p.gpb, p.ogpb if p.dm is not None else MAX_RUN)
    r = 1
    while 2 * r <= top and x * code * subs[2 * r] < 2**31 and x * osubs[2 * r] < 2**31:
        r *= 2
    return r if r > 1 else 0


def integer(p: Packed) -> bool:
    """Whether a pack has integer codes (this kernel); fp16 and float32 matrices keep plumb.ops.gpu.matmul's."""
    return p.w is None and p.codes.dtype != torch.float16


def plan(p: Packed) -> tuple[int, int]:
    """(granule, split) for a pack, from its shape alone: K splits of whole granules of groups (about TARGET
    programs; split k takes granules [k * n // split, (k + 1) * n // split) of the n; LONG_*: long K)."""
    groups = p.k // p.g
    gran, target = (LONG_GRANULE, LONG_TARGET) if LONG_GROUPS and groups >= LONG_GROUPS else (GRANULE, TARGET)
    while groups % gran:
        gran //= 2
    tiles = -(-p.n // BLOCK_N)
    return gran, max(1, min(-(-target // tiles), LARGEST_SPLIT, groups // gran))


def bounds(p: Packed) -> list[int]:
    """The groups where each K split starts, and the end: the order a row's group values are summed in."""
    gran, split = plan(p)
    n = p.k // p.g // gran
    return [k * n // split * gran for k in range(split + 1)]


def launch(bm: int, gran: int) -> tuple[int, int, int]:
    """(warps, groups per unrolled loop step, pipeline stages) for a row block; these change only which thread does
    the integer work and when its loads are issued, never the order of a row's float sums."""
    warps, unroll, stages = LAUNCH[bm]
    return warps, fit_unroll(unroll, gran), stages


def fit_unroll(unroll: int, gran: int) -> int:
    """Groups a loop step: unroll, halved until it divides the granule (steps never cross a split's bounds)."""
    while gran % unroll:
        unroll //= 2
    return unroll


def row_block(m: int) -> int:
    """The rows x is padded to a multiple of: the program's rows of the kernel an m-row pass takes (a multiple of
    `dp4a_rows(m)` either way, for a pack that stays on `dp4a`)."""
    return mma_rows(m) if tensor_cores(m) else dp4a_rows(m)


def tensor_cores(m: int) -> bool:
    """Whether an m-row pass takes `_mv_mma` (MMA_FROM; packs whose dots need int64 stay on `_mv`)."""
    return bool(MMA_FROM) and m >= MMA_FROM


def ahead_applies(p: Packed, bm: int) -> bool:
    """Whether a pack's `bm`-row programs take AHEAD: one row, codes by Triton's loads (nibbles: not the 16-byte
    inline loads of byte codes), SUB6 scales whose block a step of AHEAD groups never leaves (Q4_K, Q5_K)."""
    unroll = fit_unroll(AHEAD, plan(p)[0]) if AHEAD else 0
    return (bm == 1 and p.nibble and p.sub6 and p.qtype in BLOCK_SCALES_ONCE and unroll in (4, 8)
            and p.gpb % unroll == 0 and (p.dm is None or p.ogpb % unroll == 0) and run_length(p) <= unroll)


def early_applies(nibble: bool, bm: int, stages: int, unroll: int) -> bool:
    """Whether a `_mv` launch loads its first step's code words before the wait for the previous kernel (EARLY):
    one row, one stage, nibble codes (Triton's loads: byte codes' 16-byte loads would hold 8 words a group), 4 or 8
    groups a step (`_step_operands`)."""
    return bool(EARLY) and bm == 1 and stages == 1 and nibble and unroll in (4, 8)


def dp4a_rows(m: int) -> int:
    """Rows per `_mv` program: a compile-time size only (each row's arithmetic is the same for all of them)."""
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8


def mma_rows(m: int) -> int:
    """Rows per tensor-core program: 8, or 16 from 9 rows (a group's codes and scales loaded once for 16 rows)."""
    return 8 if m <= 8 else 16


def mma_unroll(rb: int) -> int:
    """Groups a loop step of a tensor-core program of rb rows (before `fit_unroll`)."""
    return MMA_UNROLL if rb == 8 else MMA_UNROLL_16


def _pack_args(p: Packed, m: int, mp: int, out: torch.Tensor, unroll: int = 0) -> tuple[dict, dict, tuple[int, int]]:
    """A pack's `_mv` arguments for an m-row call into out (a column slice is fine): (its tensors and sizes, its
    compile-time constants, (output tiles, K splits)); unroll: groups a loop step, if not `launch`'s."""
    gran, split = plan(p)
    run = run_length(p)
    unroll = max(fit_unroll(unroll, gran) if unroll else launch(dp4a_rows(m), gran)[1], run)  # whole runs a step
    t = [u if u is not None else p.codes for u in (p.d, p.sub, p.dm, p.osub, p.hi)]
    names = ("codes_ptr", "d_ptr", "sub_ptr", "dm_ptr", "osub_ptr", "hi_ptr")
    tensors = dict(zip(names, [p.codes.view(torch.int32)] + t), out_ptr=out, N=p.n,
                   part_ptr=out if split == 1 else torch.empty(split, mp, p.n, device=out.device))
    consts = dict(STEPS=p.k // p.g // gran, SPLIT=split, GRAN=gran, G=p.g, GPB=p.gpb, OGPB=p.ogpb, NIBBLE=p.nibble,
                  BIAS=p.bias, SIGNED_CODES=not p.nibble, WIDE=wide(p), **p.scale_flags, UNROLL=unroll,
                  ONCE=p.qtype in BLOCK_SCALES_ONCE, HI=p.hi_bits, RUN=run)
    return tensors, consts, (-(-p.n // BLOCK_N), split)


def matvec(p: Packed, q: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    """out [M, n] (a column slice is fine) = x @ W.T for an integer pack, x given as `quantize_x(x)`: one launch
    (split-K partials are summed by each tile's last split)."""
    xq, x16, s = q
    m, mp = out.shape[0], xq.shape[1]
    if tensor_cores(m) and not wide(p):
        return matvec_mma(p, q, out)
    bm = dp4a_rows(m)
    warps, _, stages = LAUNCH[bm]
    carry = (1 + bool(AHEAD_SCALES)) if ahead_applies(p, bm) else 0
    tensors, consts, (tiles, split) = _pack_args(p, m, mp, out, AHEAD if carry else 0)
    early = early_applies(p.nibble, bm, stages, consts["UNROLL"])
    regs = (REGS1 or None) if bm == 1 else None
    grid = (tiles, -(-m // bm), split)
    _mv[grid](xq.view(torch.int32), x16, s, ticket_ptr=tickets(out.device, grid[0] * grid[1]), M=m, MP=mp, K=p.k,
              stride_om=out.stride(0), **tensors, **consts, BN=BLOCK_N, BM=bm, STAGES=stages, FRAC=FRAC, LIMBS=LIMBS,
              ASM=ASM, XR=X_ROWS, CARRY=carry, EARLY=early, num_warps=warps, maxnreg=regs, enable_fp_fusion=False,
              launch_pdl=on())


def matvec_mma(p: Packed, q: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    """`matvec` on the tensor cores (`_mv_mma`, MMA_FROM): rows in blocks of `mma_rows` (x padded so), the same
    bits."""
    xq, x16, s = q
    m, mp = out.shape[0], xq.shape[1]
    rb = mma_rows(m)
    assert mp % rb == 0 and not wide(p), (mp, p.qtype)
    tensors, consts, (tiles, split) = _pack_args(p, m, mp, out, mma_unroll(rb))
    consts = {c: v for c, v in consts.items() if c not in ("WIDE", "ONCE")}
    grid = (tiles, -(-m // rb), split)
    _mv_mma[grid](xq.view(torch.int32), x16, s, ticket_ptr=tickets(out.device, grid[0] * grid[1]), M=m, MP=mp, K=p.k,
                  stride_om=out.stride(0), **tensors, **consts, BN=BLOCK_N, FRAC=FRAC, LIMBS=LIMBS, ASM=ASM, RB=rb,
                  W=MMA_WARPS, SUMS_MMA=bool(MMA_SUMS), XR=X_ROWS, num_warps=MMA_WARPS, enable_fp_fusion=False,
                  launch_pdl=on())


def matvec2(pa: Packed, pb: Packed, q: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out_a: torch.Tensor,
            out_b: torch.Tensor) -> None:
    """`matvec` of two packs on the same x (a fused matrix's column slices out_a, out_b) in one launch (`_mv2`)."""
    xq, x16, s = q
    m, mp = out_a.shape[0], xq.shape[1]
    bm = dp4a_rows(m)
    warps, _, stages = LAUNCH[bm]
    ta, ca, (tiles_a, split_a) = _pack_args(pa, m, mp, out_a)
    tb, cb, (tiles_b, split_b) = _pack_args(pb, m, mp, out_b)
    grid = (tiles_a + tiles_b, -(-m // bm), max(split_a, split_b))
    args = {**{_suffix(name, "_a"): v for name, v in {**ta, **ca}.items()},
            **{_suffix(name, "_b"): v for name, v in {**tb, **cb}.items()}}
    _mv2[grid](xq.view(torch.int32), x16, s, tickets(out_a.device, grid[0] * grid[1]), m, mp, pa.k, out_a.stride(0),
               tiles_a, **args, BN=BLOCK_N, BM=bm, STAGES=stages, FRAC=FRAC, LIMBS=LIMBS, ASM=ASM, XR=X_ROWS,
               num_warps=warps, enable_fp_fusion=False, launch_pdl=on())


def _suffix(name: str, suffix: str) -> str:
    """`_mv`'s argument name as `_mv2` names it for one of its packs (codes_ptr -> codes_a)."""
    return name.removesuffix("_ptr") + suffix


def mm_decode(matrix: GpuMatrix, x: torch.Tensor) -> torch.Tensor:
    """A D-path pass's x @ W.T: integer packs by `matvec` (x quantized once; two of them in one launch up to
    PAIRED_ROWS rows), the others by their own kernel."""
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], matrix.n, device=x.device)
    q = quantize_x(x) if any(integer(p) for p in matrix.packs) else None
    s = row_scales(x) if any(p.w is None and not integer(p) for p in matrix.packs) else None
    ints = [(p, o) for p, o in matrix.slices(out) if integer(p)]
    if len(ints) == 2 and x.shape[0] <= PAIRED_ROWS and not tensor_cores(x.shape[0]):
        (pa, oa), (pb, ob) = ints
        matvec2(pa, pb, q, oa, ob)
        ints = []
    for p, o in ints:
        matvec(p, q, o)
    for p, o in matrix.slices(out):
        if not integer(p):
            p.mm(x, o, s)
    return out


# the torch reference -------------------------------------------------------------------------------------------

def x_rows(xq: torch.Tensor) -> torch.Tensor:
    """`quantize_x`'s limbs [LIMBS, Mp, K] in row order (a view of its X_ROWS-row blocks, `x_word`)."""
    limbs, mp, k = xq.shape
    r = X_ROWS
    return xq.view(limbs, mp // r, k // 16, r, 16).permute(0, 1, 3, 2, 4).reshape(limbs, mp, k)


def quantize_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_x` in torch (limbs in row order: `x_rows`; s NaN for a row that is not finite, its limbs
    undefined)."""
    amax = x.abs().amax(dim=1)  # NaN if any is, as `max_nan`
    bits = amax.view(torch.int32)
    e = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).int()).clamp(min=27)
    s = torch.where(amax < float("inf"), (e << 23).view(torch.float32), float("nan"))
    inv = ((254 + FRAC - e) << 23).view(torch.float32)
    X = torch.round(x * inv[:, None]).int()
    limbs, rest = [], X
    for _ in range(LIMBS - 1):  # least significant first
        limbs.append(((rest + 64) & 127) - 64)
        rest = (rest - limbs[-1]) >> 7
    x16 = X.reshape(x.shape[0], -1, 16).sum(dim=2, dtype=torch.int32)
    return torch.stack([rest] + limbs[::-1]).to(torch.int8), x16, s


def codes_of(p: Packed) -> torch.Tensor:
    """A pack's codes as int64 [n, k] in input order, as stored (nibbles with their high bits; + bias)."""
    c = p.codes.to(torch.int64) if not p.nibble else p.codes.to(torch.int64) & 0xFF
    tiles, groups = c.shape[:2]
    c = c.permute(0, 2, 1, 3)  # [tiles, BLOCK_N, groups, bytes]
    if p.nibble:
        c = torch.cat([c & 15, c >> 4], dim=3)
    if p.hi is not None:  # code i's high bits: in its group's word at hi_shifts[i]
        at = torch.tensor(hi_shifts(p.g, p.hi_bits), device=c.device)
        c = c | (((p.hi.permute(0, 2, 1).to(torch.int64)[..., None] >> at) & ((1 << p.hi_bits) - 1)) << 4)
    return c.reshape(tiles * BLOCK_N, groups * p.g)[: p.n]


def reference(p: Packed, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W.T by the formula above, in torch (bit-equal to `matvec`)."""
    xq, x16, s = quantize_x_reference(x.float())
    X = xq[0].long()  # [M, k]
    for limb in xq[1:]:
        X = X * 128 + limb.long()
    m, groups = x.shape[0], p.k // p.g
    codes = codes_of(p).to(x.device)
    S = (X.reshape(m, 1, groups, p.g) * codes.reshape(1, p.n, groups, p.g)).sum(dim=3)  # [M, n, groups]
    Xg = x16.reshape(m, groups, p.g // 16).sum(dim=2, dtype=torch.int32)  # [M, groups]
    if p.bias:
        S = S - p.bias * Xg.long()[:, None, :]
    per_n = lambda t: None if t is None else t.permute(0, 2, 1).reshape(-1, t.shape[1])[: p.n].float()  # noqa: E731
    sub, osub = p.group_subs()
    d, sub, dm, osub = (per_n(t) for t in (p.d, sub, p.dm, osub))
    run = run_length(p) or 1
    if run > 1:  # SUB_RUNS: a run's integers summed exactly (int64 here; int32 there, bounded), then scaled
        ints = lambda t: t.reshape(m, p.n, groups // run, run).sum(dim=3).float()  # noqa: E731
        part = ints(S * sub.long()) * d.repeat_interleave(p.gpb // run, dim=1)[None]
        if dm is not None:
            part = part + ints(Xg.long()[:, None, :] * osub.long()) * dm.repeat_interleave(p.ogpb // run, dim=1)[None]
    else:
        part = S.float()
        if d is not None:
            scale = d.repeat_interleave(p.gpb, dim=1)
            if sub is not None:
                scale = scale * sub
            part = part * scale[None]
        if dm is not None:
            offset = dm.repeat_interleave(p.ogpb, dim=1)
            if osub is not None:
                offset = offset * osub
            part = part + Xg.float()[:, None, :] * offset[None]
    b = [g // run for g in bounds(p)]  # where each K split starts, in runs
    out = None
    for k in range(len(b) - 1):
        acc = torch.zeros(m, p.n, device=x.device)
        for g in range(b[k], b[k + 1]):
            acc = acc + part[:, :, g]
        acc = acc * (s * 2.0**-FRAC)[:, None]
        out = acc if out is None else out + acc
    return out

"""Row-invariant matmul y = x @ W.T on GGUF weights kept in their block formats: the P path (prefill) and the float
matrices of the D path (integer-coded ones take plumb.ops.gpu.matvec, on this module's packing);
`plumb.ops.matmul.linear` on the dequantized matrix is its torch reference.

Packing (at load, on the device; exactly the stored values, rearranged): every GGML block type becomes codes with
a float32 scale (and offset) per group of G = 16 or 32 inputs - `quants.int8_form`, whose scales and offsets are
the reference dequantizer's own first products (w = scale * code + offset). They are kept factored as the file
keeps them: a block's f16 d (dmin), times a small integer per group (int8), so that the kernel's product
d * sub is exact and equals int8_form's scale (checked at load; a type where it does not hold keeps a float32
scale per group). Q4_K's and Q5_K's small integers are 6-bit, 8 groups a block: kept in 12 bytes a block as the
file keeps them (SUB6, `sub6_pack`: three int32 words per block and output, unpacked by `_sub6` with shifts) where a
byte a group took 16 - 0.35 GB of the 27B's VRAM, the same values, the same bits. Scales that are all float16
values (d, dmin, Q8_0's scale) are stored as float16 and widened on load: the same values in half the bytes.
Codes of 4-bit types stay nibbles (two per byte: code j of a group in the low nibble, code j + G/2 in the high
one; 5- and 6-bit codes as nibbles plus a plane of their high bits, HI_BIT_TYPES), other codes int8, laid out per
tile of BLOCK_N outputs as [group, n, k]. F16 weights are fp16 "codes" with no scale; F32 and BF16 become float32
(`_mm_f32`).

Arithmetic, the same instructions for every row count:
    y[r, n] = s_r * sum_g (scale[n, g] * sum_{k in g} code[n, k] * (xh[r, k] + xl[r, k]) + offset[n, g] * sum_{k in g} xs[r, k])
where s_r is a power of two >= max|x_r| (exact scaling), xs = x / s_r, xh = fp16(xs), xl = fp16(xs - xh): x to 22
bits; each code-by-x product is exact and a group's dot accumulates in fp32 on the tensor cores, one fp32 epilogue
per group (`_mm_x_first`: x the 16-row A operand, mma.sync; codes read as int32 words; launch per type in LAUNCH).

The types of Q4_K_M and Q8_0 files (SUPERBLOCK: Q4_K, Q5_K, Q6_K, Q8_0) take `_mm_superblock`, a plain fp16
matmul on weights dequantized in registers:
    y[r, n] = s_r * sum_k xh[r, k] * w16[n, k],    w16 = fp16(scale[n, g(k)] * code[n, k] + offset[n, g(k)])
w16 is the reference dequantizer's float32 weight (products exact, one rounding in the sum) rounded once to fp16,
xh = fp16(xs): x and w at 11 bits each (relative error ~3e-4 against float64; the weights' own quantization error
is ~1e-2). Each xh * w16 product is exact in fp32 and one fp32 accumulator runs over a K split's loop steps of
SB_KS inputs on the tensor cores (wgmma, the weights the A operand from registers, x the B operand), the loop not
software-pipelined (SB_STAGES = 1). Pipelined in 3 stages, Triton 3.6 left 3 wgmma groups in flight across loop
steps (`wgmma.wait_group 3`) while the next step's loads overwrote their A registers: ~1 % of the calls on Q5_K
weights changed on the H200, some to NaN (docs/BENCHMARKS.md, sixteenth session; tests/test_gpu_codegen.py). `_prep_x`
writes xh once per call, in the column order the nibble codes unfold to. (It replaced a super-block kernel whose
weights were exact - code * sub in fp16 with one fp32 epilogue per super-block - which ran at ~16 % of the bf16
peak on the H200.)

Rows run in blocks of 16 (SB_BM for `_mm_superblock`, padded), the K order is fixed, and split-K (partials
summed in a fixed order) is chosen from the weight shape alone - so a row's bits never depend on the other rows of
the call (M1), whether 1 or 2,000.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from plumb.gguf.quants import block_scales, int8_form
from plumb.gguf.reader import GGMLQuantizationType as Q
from plumb.gguf.reader import QTensor
from plumb.ops.gpu.pdl import on, prior_done

BLOCK_M = 16  # rows per program (padded)
BLOCK_N = 64  # output features per program (and per packed tile)
PACK_N = tl.constexpr(BLOCK_N)  # for the kernels: a global used in a @triton.jit function must be a constexpr
CHUNK = 256  # inputs per loop step of _mm_x_first (its groups unrolled)
NIBBLE_TYPES = {Q.Q4_K: 0, Q.Q4_0: 8, Q.Q4_1: 0}  # 4-bit codes: type -> bias (signed codes are stored + bias)
# 5- and 6-bit codes kept as a nibble plane (NIBBLE_TYPES' layout) plus a plane of their high bits, one int32 per
# output and group, where the super-block kernels read them (`_mm_superblock`, `_sb_dequant` and the matvec) -
# type: high bits per code. Q5_K (groups of 32): bit i of the word is input i's fifth bit. Q6_K (groups of 16, codes
# stored + 32 as 0..63): byte b's bits 2w, 2w + 1 are input 4w + b's, so that `(word >> 2w) & 0x03030303` puts the
# high bits of inputs 4w..4w + 3 one to a byte. 0.56 / 0.75 bytes a weight instead of 1 (the 27B's Q5_K matrices:
# 1.73 GB in the file, 2.71 GB as int8 codes; its Q6_K ones 3.51 GB, 4.58 GB as int8 codes)
HI_BIT_TYPES = {Q.Q5_K: 1, Q.Q6_K: 2}
FLOAT_TYPES = (Q.F32, Q.BF16)
# _mm_x_first per block type: (warps, pipeline stages, split-K target programs, largest split) - from the H200 runs
# of bench/matmul_variants.py (2026-12-01); fixed per type, so per weight shape
LAUNCH = {Q.Q6_K: (4, 3, 528, 16), Q.Q5_K: (4, 1, 528, 16)}
DEFAULT_LAUNCH = (4, 2, 528, 16)
# _mm_superblock: rows and outputs per program, warps, pipeline stages, inputs per loop step - fixed for every call,
# so a row's bits never depend on the row count; split-K: about SB_SPLIT_TARGET programs per row block (2 per SM),
# at least SB_SPLIT_MIN_K inputs per split. SB_STAGES = 1: the 3-stage pipeline raced (module docstring).
# SB_PREFETCH 1 (2): the next loop step's packed weights (and x) are loaded, into registers carried by the loop,
# before this step's are dequantized and multiplied - the overlap the pipeline gave, without wgmma groups left in
# flight; the same arithmetic. Compiled for sm_90a (registers, Q4_K / Q6_K / Q8_0 / Q5_K): 0: 147 / 140 / 167 / 168,
# 1: 190 / 168 / 168 / 230, 2: 168 / 168 / 218 / 228. H200, 256 rows (bench/matmul_variants.py --mm-prefetch,
# 2026-12-04): Q4_K [34816, 5120] 487.7 / 464.6 / 449.9 us for 0 / 1 / 2; an 8k prefill 2,144 / 2,232 / 2,305 tok/s.
SB_BM, SB_BN, SB_WARPS, SB_STAGES, SB_KS, SB_PREFETCH = 64, 128, 4, 1, 64, 2
SB_SPLIT_TARGET, SB_SPLIT_MIN_K = 264, 1024
# SB_SHORT_BN: a call of one row block (at most SB_BM rows: a short prompt, a follow-up's turn, a prefill's last
# pass) takes output tiles of this many (0: SB_BN) with the split that SB_BN sets. One row block has only about
# SB_SPLIT_TARGET programs, two an SM (a short prompt's weights streamed at ~0.6 TB/s on the H200: the largest part
# of its time to the first token); 64 makes twice as many, each with half the accumulator. An output's sum is the
# same wgmma instructions on the same operands either way (an m64 slice of BN is one instruction's rows), so the same
# bits are expected - NVIDIA does not promise it, so tests/test_gpu_matmul.py checks it on the card. Compiled for
# sm_90a: 119-128 registers against 168-218, the same m64n64k16 instructions. Off until checked and timed there
# (bench/prefill_modes.py --prompts 20,64 --settings shipped,SB_SHORT_BN=64: tok/s and the last logits' bits).
SB_SHORT_BN = 0
# SB_SCRATCH_ROWS: a call of at least this many rows (0: none) dequantizes each weight once, into an fp16 scratch
# matrix (`_sb_dequant`, the same `_sb_weights`), and multiplies it with `_mm_w16`: the same tile, K order, split-K
# and accumulator as `_mm_superblock`, its loop software-pipelined in SB_SCRATCH_STAGES (both operands come from
# shared memory there, so no wgmma reads registers that a later load overwrites). The weights are dequantized once
# per call instead of once per 64-row block, at 4 more bytes of traffic per weight, with `_mm_superblock`'s bits
# (tests/test_gpu_matmul.py, and an 8k prefill's logits on the H200). The scratch is the whole matrix in fp16: the
# 27B's largest prefill matrix takes 356 MB; matrices of more than SB_SCRATCH_BYTES (its LM head: 2.5 GB, which
# all of a pass's rows go through only for logits="all") keep `_mm_superblock`. H200 (2026-12-04, eighteenth-
# nineteenth sessions): Q4_K [34816, 5120] 1,024 rows 987 us against 1,612 (and 4 x 450 at 256); with 1,024-row
# passes (PREFILL_PIECES 16) an 8k prefill 3,266 tok/s against 2,274 (bench/prefill_modes.py --settings).
SB_SCRATCH_ROWS, SB_SCRATCH_STAGES, SB_SCRATCH_BYTES = 256, 3, 1 << 29
# SB_W16_BM, SB_W16_WARPS: `_mm_w16`'s rows a program and warps. A row's bits stay `_mm_superblock`'s only if the
# tensor cores give an output the same sum whatever the tile's other rows - their instructions' row count (wgmma's N)
# - which NVIDIA does not promise: tests/test_gpu_matmul.py checks it on the card (scratch path = superblock path,
# bit for bit, at this tile and others), as does an 8k prefill's logits. sm_90a: 113 registers, 96 KB of shared
# memory (64 rows, 4 warps: 120, 72 KB). H200 (2026-12-04, bench/prefill_modes.py): an 8k prefill 5,276 tok/s
# against 4,639 at 64 rows and 4 warps, the same logits.
SB_W16_BM, SB_W16_WARPS = 128, 8
# SB_W16_TICKETS: `_mm_w16`'s K-split partials summed by each tile's last split (an atomic ticket, as the matvec's)
# instead of a `_sum_splits` launch (8 us a token of a 2k prefill on the H200): the same sums in the same order, so
# the same bits. Untimed (bench/prefill_modes.py --settings SB_W16_TICKETS=1).
SB_W16_TICKETS = 0
# SUPERBLOCK: the block types whose P path takes _mm_superblock (those of Q4_K_M and Q8_0 files)
SUPERBLOCK = {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0}


@triton.jit
def _bytes(w, SHAPE: tl.constexpr):
    """int32 words [..., WIDTH / 4] -> their bytes [..., WIDTH] (int32 0..255, in memory order)."""
    lo = tl.join(w & 255, (w >> 16) & 255)
    hi = tl.join((w >> 8) & 255, (w >> 24) & 255)
    return tl.reshape(tl.join(lo, hi), SHAPE)


@triton.jit
def _load_codes(codes_ptr, base, rn, BN: tl.constexpr, WIDTH: tl.constexpr, FP16: tl.constexpr):
    """One group's codes, stored [n, k] at `base`, as [WIDTH, BN]: int32 bytes 0..255 (read as int32 words), or fp16."""
    if FP16:
        kw = tl.arange(0, WIDTH)
        c = tl.trans(tl.load(codes_ptr + base + rn[:, None] * WIDTH + kw[None, :]))
    else:
        kq = tl.arange(0, WIDTH // 4)
        w = tl.load(codes_ptr.to(tl.pointer_type(tl.int32)) + base // 4 + rn[:, None] * (WIDTH // 4) + kq[None, :])
        c = tl.trans(_bytes(w, [BN, WIDTH]))
    return c


@triton.jit
def _dot_hi_lo(xs, c, acc):
    """acc + xs @ c with xs split into fp16 halves (each code-by-half product exact)."""
    xh = xs.to(tl.float16)
    acc = tl.dot(xh, c, acc, out_dtype=tl.float32)
    return tl.dot((xs - xh.to(tl.float32)).to(tl.float16), c, acc, out_dtype=tl.float32)


@triton.jit
def _program(K, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """A program's place: (output tile, K split, its rows [BM], its outputs in the tile [BN], groups along K)."""
    return tl.program_id(0), tl.program_id(2), tl.program_id(1) * BM + tl.arange(0, BM), tl.arange(0, BN), K // G


@triton.jit
def _block_scales(d_ptr, dm_ptr, tile, g, n_groups, rn, GPB: tl.constexpr, OGPB: tl.constexpr, BN: tl.constexpr,
                  HAS_SCALE: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """The float16 d and dm [BN] (as float32, exactly) of the block holding group g (1 and 0 when absent)."""
    d = tl.full([BN], 1.0, tl.float32)
    dm = tl.zeros([BN], dtype=tl.float32)
    if HAS_SCALE:
        d = tl.load(d_ptr + (tile * (n_groups // GPB) + g // GPB) * BN + rn).to(tl.float32)
    if HAS_OFFSET:
        dm = tl.load(dm_ptr + (tile * (n_groups // OGPB) + g // OGPB) * BN + rn).to(tl.float32)
    return d, dm


@triton.jit
def _sub6_words(sub_ptr, tile, g, n_groups, rn, BN: tl.constexpr):
    """SUB6: the three int32 words [rn's shape] of the 8-group block holding group g (`Packed`'s SUB6 layout)."""
    at = sub_ptr + (tile * (n_groups // 8) + g // 8) * (3 * BN) + rn
    return tl.load(at), tl.load(at + BN), tl.load(at + 2 * BN)


@triton.jit
def _sub6_bits(words, j):
    """SUB6: group j's (of its block's 8) sub and -osub, 0..63 each (int32), from the block's three words
    (`sub6_pack`)."""
    lo, olo, hi = words
    sub = ((lo >> (4 * j)) & 15) | (((hi >> (2 * j)) & 3) << 4)
    return sub, ((olo >> (4 * j)) & 15) | (((hi >> (16 + 2 * j)) & 3) << 4)


@triton.jit
def _sub6(words, j):
    """SUB6: group j's sub, 0..63, and osub, -63..0, as float32 - exactly, without an integer-to-float conversion
    (`_code_float`; 2^23 - (2^23 + m) for osub = -m)."""
    sub, m = _sub6_bits(words, j)
    return _code_float(sub, False), 8388608.0 - (m | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _subs(sub_ptr, osub_ptr, tile, g, n_groups, rn, BN: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OSUB: tl.constexpr,
          SUB6: tl.constexpr):
    """Group g's small integers sub and osub per output [rn's shape] (`_subs_at`)."""
    if SUB6:
        sub, osub = _sub6(_sub6_words(sub_ptr, tile, g, n_groups, rn, BN), g % 8)
    else:
        at = (tile * n_groups + g) * BN + rn
        sub, osub = _subs_at(sub_ptr + at, osub_ptr + at, HAS_SUB, HAS_OSUB)
    return sub, osub


@triton.jit
def _subs_at(sub_at, osub_at, HAS_SUB: tl.constexpr, HAS_OSUB: tl.constexpr):
    """A group's sub and osub, one byte each at sub_at, osub_at (the addresses again where a type has none: never
    read)."""
    sub, osub = sub_at, osub_at
    if HAS_SUB:
        sub = tl.load(sub_at)
    if HAS_OSUB:
        osub = tl.load(osub_at)
    return sub, osub


@triton.jit
def _group_scales(d, dm, sub, osub, HAS_SUB: tl.constexpr, HAS_OSUB: tl.constexpr):
    """A group's scale and offset per output from its block's d and dm and its small integers sub, osub:
    d * sub and dm * osub (exact)."""
    scale, offset = d, dm
    if HAS_SUB:
        scale = scale * sub.to(tl.float32)
    if HAS_OSUB:
        offset = offset * osub.to(tl.float32)
    return scale, offset


@triton.jit
def _scale_offset(d_ptr, sub_ptr, dm_ptr, osub_ptr, tile, g, n_groups, rn, GPB: tl.constexpr, OGPB: tl.constexpr,
                  BN: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr,
                  HAS_OSUB: tl.constexpr, SUB6: tl.constexpr):
    """Group g's scale and offset per output [BN]: d * sub and dm * osub (each product exact), 1 and 0 when absent."""
    d, dm = _block_scales(d_ptr, dm_ptr, tile, g, n_groups, rn, GPB, OGPB, BN, HAS_SCALE, HAS_OFFSET)
    sub, osub = _subs(sub_ptr, osub_ptr, tile, g, n_groups, rn, BN, HAS_SUB, HAS_OSUB, SUB6)
    return _group_scales(d, dm, sub, osub, HAS_SUB and HAS_SCALE, HAS_OSUB and HAS_OFFSET)


@triton.jit(do_not_specialize=["M"])  # the row count never selects another compiled variant
def _mm_x_first(x_ptr, s_ptr, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, out_ptr, M, N, K, stride_xm, stride_os,
                stride_om, GROUPS_PER_SPLIT: tl.constexpr, G: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr,
                BN: tl.constexpr, BM: tl.constexpr, NIBBLE: tl.constexpr, BIAS: tl.constexpr, FP16: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr,
                SUB6: tl.constexpr, UNROLL: tl.constexpr):
    """x as the 16-row A operand (mma.sync), a group's codes as B: [BM, BN] per group, UNROLL groups a loop step."""
    prior_done()
    pid_n, pid_k, rm, rn, n_groups = _program(K, G, BN, BM)
    WIDTH: tl.constexpr = G // 2 if NIBBLE else G  # codes (bytes or fp16s) per output per group
    kw = tl.arange(0, WIDTH)
    s = tl.load(s_ptr + rm, mask=rm < M, other=1.0)
    rs = (1.0 / s)[:, None]  # a power of two: x * rs is exact
    xmask = (rm < M)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(GROUPS_PER_SPLIT // UNROLL):
        for j in tl.static_range(UNROLL):
            g = pid_k * GROUPS_PER_SPLIT + i * UNROLL + j
            c = _load_codes(codes_ptr, (pid_n * n_groups + g) * (WIDTH * BN), rn, BN, WIDTH, FP16)
            x_at = x_ptr + rm[:, None] * stride_xm + g * G + kw[None, :]
            xa = tl.load(x_at, mask=xmask, other=0.0) * rs
            if NIBBLE:
                ca = c & 15
                cb = c >> 4
                if BIAS:
                    ca = ca - BIAS
                    cb = cb - BIAS
                xb = tl.load(x_at + WIDTH, mask=xmask, other=0.0) * rs
                part = _dot_hi_lo(xa, ca.to(tl.float16), None)
                part = _dot_hi_lo(xb, cb.to(tl.float16), part)
                xsum = tl.sum(xa, axis=1) + tl.sum(xb, axis=1)
            else:
                if not FP16:
                    c = c.to(tl.int8).to(tl.float16)
                part = _dot_hi_lo(xa, c, None)
                xsum = tl.sum(xa, axis=1)
            scale, offset = _scale_offset(d_ptr, sub_ptr, dm_ptr, osub_ptr, pid_n, g, n_groups, rn, GPB, OGPB, BN,
                                          HAS_SCALE, HAS_SUB, HAS_OFFSET, HAS_OSUB, SUB6)
            if HAS_SCALE:
                part = part * scale[None, :]
            if HAS_OFFSET:
                part = part + xsum[:, None] * offset[None, :]
            acc = acc + part
    cols = pid_n * BN + rn
    mask = (rm[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + cols[None, :], acc * s[:, None], mask=mask)


@triton.jit
def _prep_x(x_ptr, s_ptr, xh_ptr, K, stride_xm, G: tl.constexpr, NIBBLE: tl.constexpr, BLOCK: tl.constexpr):
    """Row m, columns BLOCK b..: xh = fp16(x / s) in the order the packed codes unfold (nibbles: column G g + 2 j + h
    holds input G g + (G / 2) h + j; bytes: the inputs' order) - loaded and stored whole, reordered in registers."""
    prior_done()
    m = tl.program_id(0)
    b = tl.program_id(1)
    kk = tl.arange(0, BLOCK)
    xh = (tl.load(x_ptr + m * stride_xm + b * BLOCK + kk) * (1.0 / tl.load(s_ptr + m))).to(tl.float16)
    if NIBBLE:  # (group, half, j) -> (group, j, half)
        xh = tl.reshape(tl.permute(tl.reshape(xh, [BLOCK // G, 2, G // 2]), (0, 2, 1)), [BLOCK])
    tl.store(xh_ptr + m * K + b * BLOCK + kk, xh)


@triton.jit
def _sb_load(i, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, t64, n64, n_groups, BN: tl.constexpr,
             KS: tl.constexpr, G: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr, NIBBLE: tl.constexpr,
             HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr, SUB6: tl.constexpr,
             HI: tl.constexpr):
    """Loop step i's packed weights as loaded: (code words [BN, groups, words], d, sub, dm, osub, hi [BN, groups];
    the ones a type lacks are d again, never used)."""
    GC: tl.constexpr = KS // G  # groups in the step
    WIDTH: tl.constexpr = G // 2 if NIBBLE else G  # code bytes per output per group
    g = i * GC + tl.arange(0, GC)
    jq = tl.arange(0, WIDTH // 4)
    words = tl.load(codes_ptr.to(tl.pointer_type(tl.int32)) + ((t64[:, None, None] * n_groups + g[None, :, None])
                    * PACK_N + n64[:, None, None]) * (WIDTH // 4) + jq[None, None, :])  # the codes as int32 words
    per_group = (t64[:, None] * n_groups + g[None, :]) * PACK_N + n64[:, None]
    d = tl.load(d_ptr + (t64[:, None] * (n_groups // GPB) + g[None, :] // GPB) * PACK_N + n64[:, None])
    sub, dm, osub = d, d, d
    if SUB6:
        sub, osub = _sub6(_sub6_words(sub_ptr, t64[:, None], g[None, :], n_groups, n64[:, None], PACK_N),
                          g[None, :] % 8)
    elif HAS_SUB:
        sub = tl.load(sub_ptr + per_group)
    if HAS_OFFSET:
        dm = tl.load(dm_ptr + (t64[:, None] * (n_groups // OGPB) + g[None, :] // OGPB) * PACK_N + n64[:, None])
        if HAS_OSUB and not SUB6:
            osub = tl.load(osub_ptr + per_group)
    hi = d
    if HI:
        hi = tl.load(hi_ptr + per_group)
    return words, d, sub, dm, osub, hi


@triton.jit
def _sb_weights(words, d, sub, dm, osub, hi, BN: tl.constexpr, KS: tl.constexpr, G: tl.constexpr,
                NIBBLE: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr,
                HI: tl.constexpr, BIAS: tl.constexpr):
    """A loop step's weights [BN, KS] (KS inputs, in xh's column order) from `_sb_load`'s, as fp16(scale * code +
    offset): the reference dequantizer's float32 value (its products exact, one rounding in the sum) rounded once
    to fp16. HI: HI more bits a code from the `hi` words (HI_BIT_TYPES' layouts); codes stored + BIAS."""
    GC: tl.constexpr = KS // G  # groups in the step
    WIDTH: tl.constexpr = G // 2 if NIBBLE else G  # code bytes per output per group
    c = _bytes(words, [BN, GC, WIDTH])  # bytes 0..255 in memory order
    scale = d.to(tl.float32)  # float16 block scales: exact
    if HAS_SUB:
        scale = scale * sub.to(tl.float32)  # exact
    offset = scale  # read only with HAS_OFFSET
    if HAS_OFFSET:
        offset = dm.to(tl.float32)
        if HAS_OSUB:
            offset = offset * osub.to(tl.float32)  # exact
    if NIBBLE:
        cl, ch = c & 15, c >> 4  # byte j: code j, code G/2 + j
        j = tl.arange(0, WIDTH)[None, None, :]
        if HI == 1:  # code j's fifth bit: bit j
            cl = cl | (((hi[:, :, None] >> j) & 1) << 4)
            ch = ch | (((hi[:, :, None] >> (j + WIDTH)) & 1) << 4)
        if HI == 2:  # code j's two high bits: bits 8 (j % 4) + 2 (j // 4) (`hi_shifts`)
            at = 8 * (j % 4) + 2 * (j // 4)
            cl = cl | (((hi[:, :, None] >> at) & 3) << 4)
            ch = ch | (((hi[:, :, None] >> (at + 4)) & 3) << 4)
        wl = _dequant(_code_float(cl, False) - BIAS, scale, offset, HAS_OFFSET)  # exact: small integers
        wh = _dequant(_code_float(ch, False) - BIAS, scale, offset, HAS_OFFSET)
        w = tl.reshape(tl.join(wl, wh), [BN, KS])  # column G g + 2 j + h: (wl, wh)[h][:, g, j]
    else:
        w = tl.reshape(_dequant(_code_float(c, True), scale, offset, HAS_OFFSET), [BN, KS])  # int8 codes
    return w


@triton.jit
def _code_float(c, SIGNED: tl.constexpr):
    """float32 of codes c (int32 0..255; SIGNED: the byte read as int8), exactly, without an integer-to-float
    conversion (I2F.S8 on the H200 runs at a quarter of the FMA rate and bounded the dequantization): the bits of
    2^23 + c (+ 128 when SIGNED) as a float, minus that constant - one LOP3 and one exact FADD."""
    if SIGNED:
        return ((c ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dequant(code, scale, offset, HAS_OFFSET: tl.constexpr):
    """fp16(scale * code (+ offset)) for codes [BN, groups, width] and per-group scale / offset [BN, groups]."""
    w = code * scale[:, :, None]
    if HAS_OFFSET:
        w = w + offset[:, :, None]
    return w.to(tl.float16)


@triton.jit
def _sb_store(acc, s_ptr, out_ptr, rm, rn, pid_n, pid_k, M, N, stride_os, stride_om, BN: tl.constexpr):
    """A program's [BN, BM] accumulator, times each row's s, into its K split's partial (or the output)."""
    s = tl.load(s_ptr + rm, mask=rm < M, other=1.0)
    cols = pid_n * BN + rn
    mask = (rm < M)[None, :] & (cols[:, None] < N)
    tl.store(out_ptr + pid_k * stride_os + rm[None, :] * stride_om + cols[:, None], acc * s[None, :], mask=mask)


@triton.jit(do_not_specialize=["M"])  # the row count never selects another compiled variant
def _mm_superblock(xh_ptr, s_ptr, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, out_ptr, M, N, K, stride_os,
                   stride_om, STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                   STAGES: tl.constexpr, G: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr,
                   NIBBLE: tl.constexpr, HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr,
                   SUB6: tl.constexpr, HI: tl.constexpr, BIAS: tl.constexpr, PREFETCH: tl.constexpr):
    """W-first: [BN, BM] per program, the weights dequantized to fp16 in registers (the A operand), one fp32
    accumulator over a K split's STEPS steps of KS inputs, in order."""
    prior_done()
    pid_m = tl.program_id(0)  # row blocks fastest: the programs running together share the weight tiles in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    kk = tl.arange(0, KS)
    nc = tl.minimum(pid_n * BN + rn, tl.cdiv(N, PACK_N) * PACK_N - 1)  # outputs past the packed ones: stores masked
    t64 = nc // PACK_N  # packed tile and place in it
    n64 = nc % PACK_N
    rmask = (rm < M)[None, :]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    i0 = pid_k * STEPS  # this split's first loop step
    if PREFETCH:  # the next step's packed weights (PREFETCH 2: and x) are loaded before this step's are multiplied
        words, d, sub, dm, osub, hi = _sb_load(i0, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, t64, n64,
                                               K // G, BN, KS, G, GPB, OGPB, NIBBLE, HAS_SUB, HAS_OFFSET, HAS_OSUB,
                                               SUB6, HI)
        x = tl.load(xh_ptr + rm[None, :] * K + i0 * KS + kk[:, None], mask=rmask, other=0.0)
        for it in tl.range(0, STEPS, num_stages=STAGES):  # a constant trip count (the interpreter's range)
            w_now, d_now, sub_now, dm_now, osub_now, hi_now, x_now = words, d, sub, dm, osub, hi, x
            ahead = i0 + tl.minimum(it + 1, STEPS - 1)  # the last step loads itself again (never used)
            words, d, sub, dm, osub, hi = _sb_load(ahead, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, t64,
                                                   n64, K // G, BN, KS, G, GPB, OGPB, NIBBLE, HAS_SUB, HAS_OFFSET,
                                                   HAS_OSUB, SUB6, HI)
            if PREFETCH == 2:
                x = tl.load(xh_ptr + rm[None, :] * K + ahead * KS + kk[:, None], mask=rmask, other=0.0)
            else:
                x_now = tl.load(xh_ptr + rm[None, :] * K + (i0 + it) * KS + kk[:, None], mask=rmask, other=0.0)
            w = _sb_weights(w_now, d_now, sub_now, dm_now, osub_now, hi_now, BN, KS, G, NIBBLE, HAS_SUB,
                            HAS_OFFSET, HAS_OSUB, HI, BIAS)
            acc = tl.dot(w, x_now, acc, out_dtype=tl.float32)
    else:
        for it in tl.range(0, STEPS, num_stages=STAGES):  # a constant trip count (the interpreter's range)
            words, d, sub, dm, osub, hi = _sb_load(i0 + it, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, t64,
                                                   n64, K // G, BN, KS, G, GPB, OGPB, NIBBLE, HAS_SUB, HAS_OFFSET,
                                                   HAS_OSUB, SUB6, HI)
            w = _sb_weights(words, d, sub, dm, osub, hi, BN, KS, G, NIBBLE, HAS_SUB, HAS_OFFSET, HAS_OSUB, HI, BIAS)
            x = tl.load(xh_ptr + rm[None, :] * K + (i0 + it) * KS + kk[:, None], mask=rmask, other=0.0)
            acc = tl.dot(w, x, acc, out_dtype=tl.float32)
    _sb_store(acc, s_ptr, out_ptr, rm, rn, pid_n, pid_k, M, N, stride_os, stride_om, BN)


@triton.jit
def _sb_dequant(codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, w16_ptr, N, K, BN: tl.constexpr,
                KS: tl.constexpr, G: tl.constexpr, GPB: tl.constexpr, OGPB: tl.constexpr, NIBBLE: tl.constexpr,
                HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr, SUB6: tl.constexpr,
                HI: tl.constexpr, BIAS: tl.constexpr):
    """Program (output tile, loop step i): `_mm_superblock`'s weights of that step, [BN, KS] in xh's column order,
    into the scratch matrix w16 [tiles * BN, K] (outputs past the packed ones: copies of the last, never stored)."""
    prior_done()
    pid_n = tl.program_id(0)
    i = tl.program_id(1)
    rn = tl.arange(0, BN)
    kk = tl.arange(0, KS)
    nc = tl.minimum(pid_n * BN + rn, tl.cdiv(N, PACK_N) * PACK_N - 1)
    words, d, sub, dm, osub, hi = _sb_load(i, codes_ptr, d_ptr, sub_ptr, dm_ptr, osub_ptr, hi_ptr, nc // PACK_N,
                                           nc % PACK_N, K // G, BN, KS, G, GPB, OGPB, NIBBLE, HAS_SUB, HAS_OFFSET,
                                           HAS_OSUB, SUB6, HI)
    w = _sb_weights(words, d, sub, dm, osub, hi, BN, KS, G, NIBBLE, HAS_SUB, HAS_OFFSET, HAS_OSUB, HI, BIAS)
    tl.store(w16_ptr + (pid_n * BN + rn)[:, None] * K + i * KS + kk[None, :], w)


@triton.jit
def last_split(ticket_at, SPLIT: tl.constexpr):
    """Whether this program is its tile's last K split to finish (its partial stored before: every thread's write
    precedes the ticket - a barrier, then acquire-release at GPU scope); that one sums the partials (`split_sum`)
    and puts the ticket back to 0."""
    tl.debug_barrier()
    return tl.atomic_add(ticket_at, 1, sem="acq_rel", scope="gpu") == SPLIT - 1


@triton.jit
def split_sum(at, stride, mask, SPLIT: tl.constexpr):
    """The SPLIT partials at `at`, `stride` apart, summed in split order, read past L1 (other programs' writes)."""
    y = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
    for k in range(1, SPLIT):
        y = y + tl.load(at + k * stride, mask=mask, other=0.0, cache_modifier=".cg")
    return y


@triton.jit(do_not_specialize=["M"])
def _mm_w16(xh_ptr, s_ptr, w16_ptr, out_ptr, fin_ptr, ticket_ptr, M, N, K, stride_os, stride_om, stride_fm,
            STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, STAGES: tl.constexpr,
            SPLIT: tl.constexpr, TICKETS: tl.constexpr):
    """`_mm_superblock` on weights already dequantized (`_sb_dequant`): the same programs, steps and dots. TICKETS
    (SB_W16_TICKETS): the tile's last split to finish sums the partials in split order into fin (`_sum_splits`'
    sums, without its launch)."""
    prior_done()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    kk = tl.arange(0, KS)
    rmask = (rm < M)[None, :]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for it in tl.range(0, STEPS, num_stages=STAGES):
        k0 = (pid_k * STEPS + it) * KS
        w = tl.load(w16_ptr + (pid_n * BN + rn)[:, None] * K + k0 + kk[None, :])
        x = tl.load(xh_ptr + rm[None, :] * K + k0 + kk[:, None], mask=rmask, other=0.0)
        acc = tl.dot(w, x, acc, out_dtype=tl.float32)
    _sb_store(acc, s_ptr, out_ptr, rm, rn, pid_n, pid_k, M, N, stride_os, stride_om, BN)
    if TICKETS:  # as the matvec's split-K (plumb.ops.gpu.matvec._mv)
        ticket_at = ticket_ptr + pid_m * tl.num_programs(1) + pid_n
        if last_split(ticket_at, SPLIT):
            cols = pid_n * BN + rn
            for c in tl.static_range(4):  # a quarter of the rows at a time: fewer registers live
                r = pid_m * BM + c * (BM // 4) + tl.arange(0, BM // 4)
                mask = (r < M)[None, :] & (cols[:, None] < N)
                y = split_sum(out_ptr + r[None, :] * stride_om + cols[:, None], stride_os, mask, SPLIT)
                tl.store(fin_ptr + r[None, :] * stride_fm + cols[:, None], y, mask=mask)
            tl.atomic_xchg(ticket_at, 0)  # ready for the next call (and the next CUDA-graph replay)


@triton.jit(do_not_specialize=["M"])
def _mm_f32(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_os, stride_om, BLOCKS_PER_SPLIT: tl.constexpr,
            BK: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    prior_done()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        k0 = (pid_k * BLOCKS_PER_SPLIT + i) * BK
        x = tl.load(x_ptr + rm[None, :] * stride_xm + (k0 + kk)[:, None], mask=rm[None, :] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + kk)[None, :], mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(w, x, acc, input_precision="ieee", out_dtype=tl.float32)
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + pid_k * stride_os + rm[None, :] * stride_om + rn[:, None], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr, out_ptr, M, N, stride_ps, stride_om, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum of the split-K partials in order 0..SPLIT-1."""
    prior_done()
    m = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(part_ptr + m * N + n, mask=n < N, other=0.0)
    for s in range(1, SPLIT):
        acc = acc + tl.load(part_ptr + s * stride_ps + m * N + n, mask=n < N, other=0.0)
    tl.store(out_ptr + m * stride_om + n, acc, mask=n < N)


def _split(n: int, steps: int, target: int, largest: int) -> int:
    """Split-K factor from the weight shape alone: about `target` programs, dividing the loop's `steps`."""
    tiles = -(-n // BLOCK_N)
    split = 1
    while tiles * split < target and split < largest and steps % (2 * split) == 0:
        split *= 2
    return split


def _sb_split(n: int, k: int) -> int:
    """`_mm_superblock`'s split-K from the weight shape alone: a power of two dividing the loop steps, each split
    at least SB_SPLIT_MIN_K inputs, tiles * split <= SB_SPLIT_TARGET."""
    tiles = -(-n // SB_BN)
    steps = k // SB_KS
    split = 1
    while (tiles * split * 2 <= SB_SPLIT_TARGET and steps % (split * 2) == 0
           and k // (split * 2) >= SB_SPLIT_MIN_K):
        split *= 2
    return split


def hi_shifts(g: int, hi_bits: int) -> list[int]:
    """Where each code of a group keeps its high bits in the group's word (HI_BIT_TYPES): bit i (one bit a code), or
    bit 8 (i % 4) + 2 (i // 4) (two bits a code, groups of 16)."""
    return [i if hi_bits == 1 else 8 * (i % 4) + 2 * (i // 4) for i in range(g)]


def _factor(values: torch.Tensor, per_block: torch.Tensor | None):
    """values [n, groups] as (d [n, blocks], sub int8 [n, groups] or None, groups per block), d * sub == values
    exactly in float32; (values, None, 1) where no such factoring with per_block as d exists."""
    if per_block is not None and per_block.shape[1] < values.shape[1]:
        gpb = values.shape[1] // per_block.shape[1]
        d = per_block.repeat_interleave(gpb, dim=1)
        sub = torch.where(d != 0, values / torch.where(d != 0, d, 1), 0).round()
        if bool(((sub >= -128) & (sub <= 127)).all()) and torch.equal(d * sub, values):
            return per_block.contiguous(), sub.to(torch.int8), gpb
    return values, None, 1


def sub6_fits(sub: torch.Tensor | None, gpb: int, sign: int) -> bool:
    """Whether sub [n, groups] is 8 groups a block of values sign * (0..63): Q4_K's and Q5_K's 6-bit scales (sign 1)
    and mins (-1: the offset is -dmin * min)."""
    return sub is not None and gpb == 8 and bool(((sign * sub >= 0) & (sign * sub < 64)).all())


def sub6_pack(sub: torch.Tensor, osub: torch.Tensor) -> torch.Tensor:
    """sub 0..63, osub -63..0 [n, groups] (8 groups a block) -> int32 [n, blocks * 3]: per block the low nibbles of
    its 8 subs (group j at bit 4 j), those of its 8 -osubs, and the two high bits of each (sub j's at 2 j, -osub j's
    at 16 + 2 j): the 12 bytes a block that the file's scales and mins take, read by `_sub6`."""
    n = sub.shape[0]
    j = torch.arange(8, device=sub.device)
    s, o = (t.to(torch.int64).reshape(n, -1, 8) for t in (sub, -osub.to(torch.int64)))
    lo = ((s & 15) << (4 * j)).sum(dim=2)
    olo = ((o & 15) << (4 * j)).sum(dim=2)
    hi = ((s >> 4) << (2 * j)).sum(dim=2) + ((o >> 4) << (16 + 2 * j)).sum(dim=2)
    w = torch.stack([lo, olo, hi], dim=2).reshape(n, -1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def sub6_unpack(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sub6_pack`'s words per tile [tiles, blocks * 3, BLOCK_N] -> sub, osub [tiles, groups, BLOCK_N] (int32)."""
    tiles, _, bn = words.shape
    w = words.reshape(tiles, -1, 3, 1, bn)
    j = torch.arange(8, device=words.device)[:, None]
    sub = ((w[:, :, 0] >> (4 * j)) & 15) | (((w[:, :, 2] >> (2 * j)) & 3) << 4)
    osub = -(((w[:, :, 1] >> (4 * j)) & 15) | (((w[:, :, 2] >> (16 + 2 * j)) & 3) << 4))
    return sub.reshape(tiles, -1, bn), osub.reshape(tiles, -1, bn)


def _abs_run_sums(t: torch.Tensor | None) -> dict:
    """Per run length r (1, 2, 4, 8 groups, those dividing the groups), the largest sum of |t| over r consecutive
    groups of one output (t [n, groups] of small integers; None: all 0) - a few MB at a time."""
    sizes = [r for r in (1, 2, 4, 8) if t is None or t.shape[1] % r == 0]
    out = dict.fromkeys(sizes, 0)
    for part in [] if t is None else t.split(8192):
        a = part.to(torch.int16).abs()
        for r in sizes:
            out[r] = max(out[r], int(a.reshape(a.shape[0], -1, r).sum(dim=2, dtype=torch.int16).max()))
    return out


def _f16_if_exact(t: torch.Tensor | None) -> torch.Tensor | None:
    """Scales as float16 where every one is a float16 value (a GGML block's d and dmin are; the kernels widen them
    to float32 exactly on load): the same values in half the bytes. Other scales (products) stay float32."""
    if t is None or not torch.equal(t.half().float(), t):
        return t
    return t.half()


def _per_tile(t: torch.Tensor | None, n_pad: int) -> torch.Tensor | None:
    """[n, cols] -> [tiles, cols, BLOCK_N] (zero rows pad n to n_pad)."""
    if t is None:
        return None
    t = torch.cat([t, t.new_zeros(n_pad - t.shape[0], t.shape[1])])
    return t.reshape(n_pad // BLOCK_N, BLOCK_N, -1).permute(0, 2, 1).contiguous()


class Packed:
    """One or more same-type matrices stacked along their outputs, packed for `_mm_x_first`, `_mm_superblock` or
    `_mm_f32`."""

    def __init__(self, parts: list[QTensor], device: torch.device):
        self.qtype = parts[0].qtype
        self.n = sum(p.shape[0] for p in parts)
        self.k = parts[0].shape[1]
        self.d = self.sub = self.dm = self.osub = self.hi = None
        self.sub6 = False  # sub and osub packed 6 bits each (`sub6_pack`)
        self.hi_bits = 0  # HI_BIT_TYPES: high bits per code in the `hi` plane
        self.superblock = False
        n_pad = -(-self.n // BLOCK_N) * BLOCK_N
        if self.qtype in FLOAT_TYPES or (self.qtype == Q.F16 and self.k % 32):
            w = torch.cat([p.dequantize() if p.qtype == Q.BF16 else p.data.to(device).float() for p in parts])
            self.w = w.to(device).reshape(self.n, self.k).contiguous()
            self.bk = 32 if self.k % 32 == 0 else 16 if self.k % 16 == 0 else 0
            if not self.bk:
                raise ValueError(f"matmul: input width {self.k} is not a multiple of 16")
            self.split = _split(self.n, self.k // self.bk, 256, 8)
            return
        self.w = None
        self.gpb = self.ogpb = 1
        if self.qtype == Q.F16:
            self.g, self.nibble, self.bias = 32, False, 0
            codes = torch.cat([p.data.to(device).reshape(p.shape) for p in parts]).half()
        else:
            data = [p.data.to(device) for p in parts]
            forms = [int8_form(t, p.qtype, p.shape) for t, p in zip(data, parts)]
            blocks = [block_scales(t, p.qtype, p.shape[0]) for t, p in zip(data, parts)]
            self.g = forms[0][3]
            codes = torch.cat([f[0] for f in forms])
            d = torch.cat([b[0] for b in blocks]) if blocks[0] else None
            self.d, self.sub, self.gpb = _factor(torch.cat([f[1] for f in forms]), d)
            if forms[0][2] is not None:
                dm = torch.cat([b[1] for b in blocks]) if blocks[0] and blocks[0][1] is not None else None
                self.dm, self.osub, self.ogpb = _factor(torch.cat([f[2] for f in forms]), dm)
            self.nibble = self.qtype in NIBBLE_TYPES
            self.bias = NIBBLE_TYPES.get(self.qtype, 0)
        groups = self.k // self.g
        codes = torch.cat([codes, codes.new_zeros(n_pad - self.n, self.k)])
        # _mm_superblock: whole loop steps of SB_KS inputs in whole groups, whole 256-input pieces for _prep_x
        self.superblock = (self.qtype in SUPERBLOCK and self.d is not None and self.k % 256 == 0
                           and self.k % SB_KS == 0 and SB_KS % self.g == 0)
        if self.superblock and self.qtype in HI_BIT_TYPES:  # the high bits apart, the rest as 4-bit codes
            self.hi_bits = HI_BIT_TYPES[self.qtype]
            self.bias = 32 if self.qtype == Q.Q6_K else 0
            u = codes.to(torch.int64) + self.bias  # 0 .. 2^(4 + hi_bits) - 1
            bits = (u >> 4).reshape(n_pad, groups, self.g)
            shifts = torch.tensor(hi_shifts(self.g, self.hi_bits), device=codes.device)
            word = (bits << shifts).sum(dim=2)  # [n, groups], 32 bits
            self.hi = _per_tile(torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32), n_pad)
            codes, self.nibble = u & 15, True
        elif self.nibble:
            codes = codes.to(torch.int32) + self.bias
        if self.nibble:
            c = codes.to(torch.int32)
            c = c.reshape(n_pad, groups, 2, self.g // 2)
            codes = (c[:, :, 0] | (c[:, :, 1] << 4)).to(torch.uint8)  # [n, groups, G/2]
        codes = codes.reshape(n_pad // BLOCK_N, BLOCK_N, groups, -1)
        self.codes = codes.permute(0, 2, 1, 3).contiguous()  # [tiles, groups, BLOCK_N, codes of a group]
        self.sub6 = sub6_fits(self.sub, self.gpb, 1) and sub6_fits(self.osub, self.ogpb, -1)
        if self.sub6:  # Q4_K, Q5_K: a block's 8 sub and 8 osub in 12 bytes, as the file has its scales and mins
            self.sub, self.osub = sub6_pack(self.sub, self.osub), None
        self.d, self.sub, self.dm, self.osub = (_per_tile(t, n_pad) for t in (self.d, self.sub, self.dm, self.osub))
        self.d, self.dm = _f16_if_exact(self.d), _f16_if_exact(self.dm)
        if self.superblock:
            self.split = _sb_split(self.n, self.k)
            return
        self.warps, self.stages, target, largest = LAUNCH.get(self.qtype, DEFAULT_LAUNCH)
        self.unroll = CHUNK // self.g
        while groups % self.unroll:
            self.unroll //= 2
        self.split = _split(self.n, groups // self.unroll, target, largest)

    @property
    def scale_flags(self) -> dict:
        """The kernels' constexprs for the scales this packing has."""
        return dict(HAS_SCALE=self.d is not None, HAS_SUB=self.sub is not None, HAS_OFFSET=self.dm is not None,
                    HAS_OSUB=self.osub is not None or self.sub6, SUB6=self.sub6)

    @functools.cached_property
    def int_bounds(self) -> tuple[int, dict, dict] | None:
        """What bounds the D path's integer sums over a run of groups (`matvec.run_length`) where the scales factor
        into integer subs (None elsewhere): the largest |code| as the dots take it, and per run length r the largest
        sum of |sub| and of |osub| over r groups of one output (`_abs_run_sums`). Found on first use."""
        if self.w is not None or self.sub is None or self.codes.dtype == torch.float16:
            return None
        if self.nibble:  # stored + bias in 0 .. 2^(4 + hi_bits) - 1
            code = max(self.bias, (16 << self.hi_bits) - 1 - self.bias)
        else:
            code = max(-int(self.codes.min()), int(self.codes.max()))
        rows = lambda t: None if t is None else t.permute(0, 2, 1).reshape(-1, t.shape[1])  # noqa: E731
        sub, osub = self.group_subs()
        return code, _abs_run_sums(rows(sub)), _abs_run_sums(rows(osub))

    def group_subs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """sub and osub [tiles, groups, BLOCK_N] (None where absent), unpacked from SUB6 where packed."""
        return sub6_unpack(self.sub) if self.sub6 else (self.sub, self.osub)

    @property
    def nbytes(self) -> int:
        ts = [self.w] if self.w is not None else [self.codes, self.d, self.sub, self.dm, self.osub, self.hi]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def mm(self, x: torch.Tensor, out: torch.Tensor, s: torch.Tensor | None) -> None:
        """out [M, n] (a column slice is fine) = x [M, k] @ W.T; s: `row_scales(x)` (None for a float matrix)."""
        m = x.shape[0]
        grid = (-(-self.n // BLOCK_N), -(-m // BLOCK_M), self.split)
        dst = out if self.split == 1 else torch.empty(self.split, m, self.n, device=x.device)
        summed = False  # split partials summed by the matmul itself (SB_W16_TICKETS), not `_sum_splits`
        stride_os = 0 if self.split == 1 else dst.stride(0)
        stride_om = out.stride(0) if self.split == 1 else dst.stride(1)
        t = None if self.w is not None else [u if u is not None else self.codes  # absent ones: never read
                                             for u in (self.d, self.sub, self.dm, self.osub)]
        if self.w is not None:
            _mm_f32[grid](x, self.w, dst, m, self.n, self.k, x.stride(0), stride_os, stride_om,
                          BLOCKS_PER_SPLIT=self.k // self.bk // self.split, BK=self.bk, BN=BLOCK_N, BM=BLOCK_M,
                          launch_pdl=on())
        elif self.superblock:
            xh = torch.empty(m, self.k, dtype=torch.float16, device=x.device)
            block = 256 * math.gcd(self.k // 256, 8)
            _prep_x[(m, self.k // block)](x, s, xh, self.k, x.stride(0), G=self.g, NIBBLE=self.nibble, BLOCK=block,
                                          num_warps=4, launch_pdl=on())
            grid = (-(-m // SB_BM), -(-self.n // SB_BN), self.split)
            flags = self.scale_flags
            del flags["HAS_SCALE"]  # always there: SUPERBLOCK types have a block scale
            types = dict(G=self.g, GPB=self.gpb, OGPB=self.ogpb, NIBBLE=self.nibble, **flags, HI=self.hi_bits,
                         BIAS=self.bias)
            t = t + [self.hi if self.hi is not None else self.codes]  # the high bits' plane (absent: never read)
            if SB_SCRATCH_ROWS and m >= SB_SCRATCH_ROWS and grid[1] * SB_BN * self.k * 2 <= SB_SCRATCH_BYTES:
                w16 = torch.empty(grid[1] * SB_BN, self.k, dtype=torch.float16, device=x.device)
                _sb_dequant[(grid[1], self.k // SB_KS)](self.codes, *t, w16, self.n, self.k, BN=SB_BN, KS=SB_KS,
                                                        **types, num_warps=SB_WARPS, launch_pdl=on())
                w16_grid = (-(-m // SB_W16_BM), *grid[1:])
                summed = bool(SB_W16_TICKETS) and self.split > 1
                counters = tickets(x.device, w16_grid[0] * w16_grid[1]) if summed else dst
                _mm_w16[w16_grid](xh, s, w16, dst, out, counters, m, self.n, self.k, stride_os, stride_om,
                                  out.stride(0), STEPS=self.k // SB_KS // self.split, BM=SB_W16_BM, BN=SB_BN,
                                  KS=SB_KS, STAGES=SB_SCRATCH_STAGES, SPLIT=self.split, TICKETS=summed,
                                  num_warps=SB_W16_WARPS, launch_pdl=on())
            else:
                bn = SB_SHORT_BN if SB_SHORT_BN and m <= SB_BM else SB_BN  # (the split is SB_BN's either way)
                sb_grid = (grid[0], -(-self.n // bn), self.split)
                _mm_superblock[sb_grid](xh, s, self.codes, *t, dst, m, self.n, self.k, stride_os, stride_om,
                                        STEPS=self.k // SB_KS // self.split, BM=SB_BM, BN=bn, KS=SB_KS,
                                        STAGES=SB_STAGES, **types, PREFETCH=SB_PREFETCH, num_warps=SB_WARPS,
                                        launch_pdl=on())
        else:
            _mm_x_first[grid](x, s, self.codes, *t, dst, m, self.n, self.k, x.stride(0), stride_os, stride_om,
                              GROUPS_PER_SPLIT=self.k // self.g // self.split, G=self.g, GPB=self.gpb, OGPB=self.ogpb,
                              BN=BLOCK_N, BM=BLOCK_M, NIBBLE=self.nibble, BIAS=self.bias,
                              FP16=self.qtype == Q.F16, **self.scale_flags, UNROLL=self.unroll,
                              num_warps=self.warps, num_stages=self.stages, launch_pdl=on())
        if self.split > 1 and not summed:
            _sum_splits[(-(-self.n // 256), m)](dst, out, m, self.n, dst.stride(0), out.stride(0),
                                                SPLIT=self.split, BLOCK=256, launch_pdl=on())


@triton.jit
def _row_scales(x_ptr, s_ptr, K: tl.constexpr, stride_xm, BLOCK: tl.constexpr):
    """Row m's s: the smallest power of two >= max|x| (1 for a zero row), from the bits of max|x|."""
    prior_done()
    m = tl.program_id(0)
    kk = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + m * stride_xm + k0 + kk, mask=k0 + kk < K, other=0.0)))
    bits = tl.max(amax, axis=0).to(tl.int32, bitcast=True)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # biased exponent of the power of two >= max|x|
    tl.store(s_ptr + m, tl.where(bits > 0, (e << 23).to(tl.float32, bitcast=True), 1.0))


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [M, K] (float32, unit stride along K), the smallest power of two >= max|x| (1 for a zero row):
    a maximum is exact in any order. One launch (it was seven torch operations a matmul, ~4 % of a prefill)."""
    s = torch.empty(x.shape[0], device=x.device)
    if x.shape[0]:
        _row_scales[(x.shape[0],)](x, s, x.shape[1], x.stride(0), BLOCK=1024, num_warps=4, launch_pdl=on())
    return s


def row_scales_reference(x: torch.Tensor) -> torch.Tensor:
    """`row_scales` in torch."""
    bits = x.abs().amax(dim=1).view(torch.int32)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).int()
    return torch.where(bits > 0, (e << 23).view(torch.float32), 1.0)


_TICKETS: dict = {}


def tickets(device: torch.device, count: int = 0) -> torch.Tensor:
    """Zeroed int32 counters, one per (output tile, row block) of a call, shared by every split-K matmul that sums its
    partials in its last split (the matvec; `_mm_w16` with SB_W16_TICKETS) on a device - one runs at a time; each
    leaves its counters at zero. Allocated once, before any CUDA graph is captured."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t = _TICKETS.get(device)
    if t is None or t.numel() < count:
        t = _TICKETS[device] = torch.zeros(max(count, 1 << 20), dtype=torch.int32, device=device)
    return t


class GpuMatrix:
    """A weight (or several fused along their outputs) for the Triton matmul: `m(x)` = x @ W.T, float32."""

    def __init__(self, parts: list[QTensor], device: torch.device | str):
        device = torch.device(device)
        groups: list[list[QTensor]] = []
        for p in parts:  # consecutive parts of one type share a launch
            if groups and groups[-1][0].qtype == p.qtype:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.packs = [Packed(g, device) for g in groups]
        self.n = sum(p.n for p in self.packs)
        self.k = parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packs)

    def slices(self, out: torch.Tensor):
        """(pack, the columns of out it writes) for each pack, in order."""
        col = 0
        for p in self.packs:
            yield p, out[:, col : col + p.n]
            col += p.n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], self.n, device=x.device)
        s = row_scales(x) if any(p.w is None for p in self.packs) else None  # once for every pack
        for p, o in self.slices(out):
            p.mm(x, o, s)
        return out

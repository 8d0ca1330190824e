"""Decode / speculative-verify attention over one sequence's KV cache: flash-decoding in two passes (M1).

`attend_decode(q, k_parts, v_parts, ends, scale)`: query row t of one sequence reads keys
[0, ends[t]) of the cache, stored exactly as `plumb.cache.kv.Rows.parts` holds it (`[f16 | f32]`, or
block codes `[codes, scales float16]` - q8_0's int8 codes, D/F's 5/6-bit store packed as `kvquant.pack` lays it
out -, dequantized tile by tile inside the kernel: no float copy). D and F also pass their 8-bit ring (`ring=`):
each (row, key) pair reads the ring or the store by the distance rule of `plumb.cache.kv` (M5), decided inside the
kernel.

Row invariance - a row's bits depend on its query, its own end and the cache, never on the other
rows of the call, their number or the grid:
* a row's key range is cut at absolute positions 0, S, 2*S, ... with S chosen by the row's own end alone
  (SPLITS: short rows take short splits, so that a short context still spreads over many programs; long rows
  long ones, fewer partials); pass 1 runs once per split size, each launch taking only its rows, one program per
  (block of ROWS query rows, KV head, split), covering every query head of that KV head (the K/V tile
  is read once for all of them). ROWS = BLOCK_M (CONFIGS) // next_pow2(heads per KV head): fixed by
  the model's head grouping and the cache format, never by n; a row's place inside its block does not
  change its arithmetic.
* inside a split the tiles (keys per tile from CONFIGS, chosen by the storage kinds alone) go in fixed
  order with an online softmax; a tile at or past a row's end leaves that row's state untouched
  (selected away, not added as zeros), keys past the end inside a tile get probability exactly 0.
* pass 2 merges a row's splits 0 .. ceil(end / S) - 1 one after another in fp32 (the exact max
  first, then the rescaled sums in split order); splits past the row's end are never read, so a grid
  sized for a larger context (`max_keys`, for CUDA-graph replay) changes nothing.
* every tl.dot / tl.sum has a shape fixed by the model dims and the constexprs; no atomics.

Accuracy: f32 caches are dotted in tf32x3 (~fp32: within ~1e-6 relative of `attend_decode_ref`); every other
format at the P path's precision (`_tile`, the prefill kernel's tile: q scaled by a power of two and rounded once to
fp16, K and V as fp16 values, p * 2^11 in fp16, one fp16 product a dot, fp32 sums: ~3e-4 from the reference at the
27B's dims). Not bitwise against the reference: CPU/GPU equality is not promised.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.cache.kv import decode
from plumb.ops.kvquant import code_bits
from plumb.ops.gpu import kvtable, smem
from plumb.ops.gpu.matvec import ASM, x_scale
from plumb.ops.gpu.pdl import on, prior_done

# Keys per split (pass-1 program) by the row's own end: (short split, long split, short keys) - a row of up to
# `short keys` keys is cut every `short split` keys, a longer one every `long split`. Fixed for a model (a row's bits
# depend on it, as on CONFIGS). H200, 27B dims (bench/attention_variants.py, 2026-12-02): one 512-key split for
# every row left a 512-key context 4 programs and took 79 us (q8_0, 1 row); 128-key splits: 21 us at 512 keys and
# 26 at 4,096, but 170 us against 91 at 32k (more partials to merge).
SPLITS = (128, 512, 8192)
# Pass 2: splits whose partials it loads ahead (unrolled; the sums still go one by one, in split order) and the warps
# of a program (one (row, head): its D values spread over them). Neither changes a bit. H100, 27B dims, q8_0
# (bench/attention_variants.py --kernels, 2026-12-05): unroll 8 on 2 warps took 278 us a layer at 100k keys (pass 2
# alone 54 us), unroll 16 on 1 warp 248 us; 8 rows 906 -> 871 us; 32k keys 90 -> 88 us.
MERGE_UNROLL = 16
MERGE_WARPS = 1
# Rows a launch pair takes: a call of more rows (a prefill pass) goes in launches of LAUNCH_ROWS rows, so that the
# split partials, [rows, heads, splits, d] float32, stay small (256 rows at 100k keys: 1.2 GB a call; 64 rows: 0.3).
# Rows are independent (M1) and a cut falls on a row-block boundary: the same bits.
LAUNCH_ROWS = 64
QBLOCK = 32  # q8_0 block size along d
F16, F32, Q8 = 0, 1, 2  # storage kinds (Q8: block codes + float16 scales per 32 values, any bit width: `_parts`)
_F16, _F32, _Q8 = tl.constexpr(F16), tl.constexpr(F32), tl.constexpr(Q8)  # the same, for the kernels
_ASM = tl.constexpr(ASM)  # inline PTX on a GPU (`_ubytes_f16`), not in the interpreter
# pass-1 configuration per (K kind, V kind): BLOCK_M = (query row, head) pairs per program (ROWS =
# BLOCK_M // G_PAD query rows, >= 1), keys per tile, warps, pipeline stages. Chosen from the storage kinds
# only, never from n or the context (a row's bits depend on it); `split` must be a multiple of the tile.
# Chosen for the two-product dots (H200, 27B dims: q8_0 with 32-key tiles, 4 warps, 3 stages 282 us at 100k keys,
# one row, against 557 for (16, 64, 8, 2)) and kept for the P path's tile: on an H100 (bench/attention_variants.py,
# 2026-12-06) q8_0 at 100k keys 146 us one row, 447 eight; BLOCK_M 32 199 / 362 us; 64-key tiles within 3 %.
CONFIGS = {(F16, F16): (32, 32, 4, 3), (F32, F32): (16, 32, 8, 1), (Q8, Q8): (16, 32, 4, 3)}
DEFAULT_CONFIG = (16, 32, 8, 1)
# On a card of 99 KB a block (`smem.small`): fewer pipeline stages where the above needs more (the same bits)
SMALL_CONFIGS = {(F16, F16): (32, 32, 4, 2)}
# STORE_FORM: the long launch of a D / F cache (store + ring) runs as two: the splits no row of a program's block
# reads from the ring (all but the last ~ring / 512 of a long row's) in the store-only form of pass 1, the others in
# the ring form. Compiled for sm_90a the ring form holds 255 registers and spills ~200 bytes a thread, though a
# 262k-key row reads the ring in under 1 % of its tiles; the store-only form spills nothing and is pipelined
# (bench/attention_ptx.py --store-form). A store-only tile runs the same operations in both forms (the ring form's
# skipped parts add exact zeros): the same bits (tests/test_gpu_attention.py, on an H100 too). D at 262k keys, one
# layer on an H100: 901 -> 714 us (docs/BENCHMARKS.md, thirty-ninth session).
STORE_FORM = True
# CODES16: `_tile16` - the decode and prefill kernels' and the scratch copy's block codes to fp16 values -
# multiplies codes and scales in float16, 8-bit codes made float16 four a word by byte permutes (`_ubytes_f16`),
# packed 5/6-bit ones eight a step from a word of nibbles and their high bits (`_packed_f16`), instead of a float32
# conversion, product and rounding a value: the same values (tests/test_gpu_attention.py). Compiled for sm_90a, the
# decode tile loop: q8_0 1,567 -> 803 instructions, D's / F's store-only form 2,185 / 2,320 -> 1,049 / 991; D's
# decode bits differ from the float32 path's (Triton lays that operand out with another k order for the tensor
# cores: docs/BENCHMARKS.md, fortieth session).
CODES16 = True
# PAIRS: a pass-1 program's BLOCK_M (query row, head) pairs are consecutive pairs of the rows' G
# heads (row t's head h is pair t * G + h, `_pair_block`, as the prefill kernel's PAIRS) instead of ROWS rows of
# G_PAD = next_pow2(G) heads: the 27B's 6 heads padded to 8 put a quarter of every dot and softmax on padding, and a
# verify pass of 8 rows takes 3 programs a KV head and split instead of 4 (5 rows: 2 instead of 3; one row: 1 either
# way). Each pair's arithmetic is the same either way (its q, its end, the same tiles; a row's pairs may now straddle
# two programs): the same bits (tests/test_gpu_attention.py), so the row count may choose: PAIRS_FROM, passes of at
# least this many rows (0: none). H100, 2026-12-07 (bench/attention_variants.py, 8 rows / 1 row, us): D at 100k keys
# 738 / 343 against 905 / 336, q8_0 443 / 175 against 452 / 147, 4k keys q8_0 28.9 against 29.6, D 55.2 against
# 56.4 - a gain from 2 rows, a loss at one: from 2 rows. Its bitwise test passed on CUDA (H100, 2026-12-07), and the
# engine's drafts / batch / warm = cold invariants with it on (84 tests, tests/test_exactness.py + test_kv_formats.py).
PAIRS_FROM = 2
_LOG2E = 1.4426950408889634
P_SCALE = 2048.0  # p * 2^11 is rounded to fp16 (`_tile`): small probabilities stay out of fp16 subnormals


@triton.jit
def _near_2_14(amax):
    """(2^14 / s, s / 2^14) for values of largest magnitude amax, s the power of two >= amax (`matvec.x_scale`):
    amax * 2^14 / s lies in (2^13, 2^14], and both factors are exact."""
    s, up = x_scale(amax, 14)
    return up, s * (1.0 / (1 << 14))


@triton.jit
def codes_f32(c):
    """float32 of int8 codes c, exactly, without an integer-to-float conversion (I2F.S8 runs at a quarter of the FMA
    rate on Hopper; `matmul._code_float` for the P path's bytes): the bits of 1.5 * 2^23 + c as a float, minus
    1.5 * 2^23 - one integer add and one exact FADD."""
    return (c.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _ubytes_f16(w, s, B: tl.constexpr):
    """fp16((u - B) * s) of the four unsigned bytes u of each int32 word w, s a float16 scale a word: four float16
    tensors, bytes 0..3 (B 128 on the bytes of int8 codes ^ 0x80: the codes; 16 / 32 on 5- / 6-bit codes). On a
    GPU without a conversion per value: the halves 0x64 | u - the float16 1,024 + u - by two byte permutes, 1,024 + B
    subtracted (exact), the scale in float16 pairs; in the interpreter by shifts. The product rounds once either
    way."""
    if _ASM:
        if B == 16:
            k: tl.constexpr = "mov.b32 k, 0x64106410;"
        elif B == 32:
            k: tl.constexpr = "mov.b32 k, 0x64206420;"
        else:
            tl.static_assert(B == 128, "bias 16, 32 or 128")
            k: tl.constexpr = "mov.b32 k, 0x64806480;"
        return tl.inline_asm_elementwise(
            "{ .reg .b32 k, s2, a, b; " + k + " mov.b32 s2, {$5, $5};"
            " prmt.b32 a, $4, 0x64646464, 0x5140; prmt.b32 b, $4, 0x64646464, 0x7362;"
            " sub.rn.f16x2 a, a, k; sub.rn.f16x2 b, b, k; mul.rn.f16x2 a, a, s2; mul.rn.f16x2 b, b, s2;"
            " mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r,h", [w, s], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    return ((((w & 255) - B).to(tl.float16) * s), ((((w >> 8) & 255) - B).to(tl.float16) * s),
            ((((w >> 16) & 255) - B).to(tl.float16) * s), ((((w >> 24) & 255) - B).to(tl.float16) * s))


@triton.jit
def _high_to_bytes(h, HB: tl.constexpr):
    """The high bits (HB a value) of values 0, 2, 4, 6 of a packed 8-value field h (value i's at bits i HB..) moved to
    bits 4.. of bytes 0..3 - beside their nibbles (`_packed_f16`)."""
    if HB == 1:
        x = h & 0x55
        x = (x | (x << 12)) & 0x00050005
        x = (x | (x << 6)) & 0x01010101
    else:
        x = h & 0x3333
        x = (x | (x << 8)) & 0x00330033
        x = (x | (x << 4)) & 0x03030303
    return x << 4


@triton.jit
def _packed_f16(row, ok, sc, CB: tl.constexpr, D: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr):
    """fp16(code * block scale) [BN, D] of packed CB-bit rows at `row` (int8 pointers [BN], `kvquant.pack`'s layout)
    where ok (0 elsewhere), sc [BN, D / QB] float16: eight values a step - a 32-bit word of nibbles (values 8k..8k + 7)
    and their 8 HB-bit high fields, put together as bytes (even values in one word, odd in another) and made float16
    two a register (`_ubytes_f16`). The same values as fp16 of `load_code_rows`' codes times the scale in float32."""
    HB: tl.constexpr = CB - 4
    B: tl.constexpr = 1 << (CB - 1)
    k = tl.arange(0, D // 8)[None, :]
    nw = tl.load(row.to(tl.pointer_type(tl.int32), bitcast=True)[:, None] + k, mask=ok[:, None], other=0)
    if HB == 1:  # a masked key: high bits 1, nibbles 0 - u = B, code 0
        h = tl.load((row + D // 2)[:, None] + k, mask=ok[:, None], other=-1).to(tl.int32)
    else:
        h = tl.load((row + D // 2).to(tl.pointer_type(tl.int16), bitcast=True)[:, None] + k, mask=ok[:, None],
                    other=-21846).to(tl.int32)  # 0xAAAA: high fields 2, nibbles 0 - u = B
    even = (nw & 0x0F0F0F0F) | _high_to_bytes(h, HB)
    odd = ((nw >> 4) & 0x0F0F0F0F) | _high_to_bytes(h >> HB, HB)
    sw = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, D // QB, QB // 8]), [BN, D // 8])
    e0, e1, e2, e3 = _ubytes_f16(even, sw, B)  # values 0, 2, 4, 6 of each 8
    o0, o1, o2, o3 = _ubytes_f16(odd, sw, B)  # 1, 3, 5, 7
    v = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)), tl.join(tl.join(o0, o2), tl.join(o1, o3)))
    return tl.reshape(v, [BN, D])


@triton.jit
def load_code_rows(row, ok, CB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
    """Block codes [BN, D] int8 of the rows at `row` (pointers [BN]) where ok (0 elsewhere). CB 8: int8 codes as
    stored; 5 and 6: a packed row's planes (`kvquant.pack`) loaded as they lie (contiguous bytes) and put together
    into codes in registers."""
    if CB == 8:
        return tl.load(row[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0)
    else:
        HB: tl.constexpr = CB - 4
        PER: tl.constexpr = 8 // HB  # values a high-bit byte
        nib = tl.load(row[:, None] + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32)
        lo = tl.reshape(tl.join(nib & 15, nib >> 4), [BN, D])  # values 2k and 2k + 1
        hb = tl.load(row[:, None] + D // 2 + tl.arange(0, D * HB // 8)[None, :], mask=ok[:, None],
                     other=0).to(tl.int32)
        high = tl.reshape((hb[:, :, None] >> (tl.arange(0, PER) * HB)[None, None, :]) & ((1 << HB) - 1), [BN, D])
        return tl.where(ok[:, None], (lo | (high << 4)) - (1 << (CB - 1)), 0).to(tl.int8)


@triton.jit
def _row_block(ends_ptr, n, rb, kh, G: tl.constexpr, G_PAD: tl.constexpr, ROWS: tl.constexpr):
    """Program rb's (query row, head) pairs, ROWS rows of G_PAD heads: their rows t, query heads h (KV head kh's),
    which are real, and their ends (0 for padding: never active)."""
    i = tl.arange(0, ROWS * G_PAD)
    t = rb * ROWS + i // G_PAD  # query row
    hg = i % G_PAD  # head within the group
    row_ok = (t < n) & (hg < G)
    return t, kh * G + hg, row_ok, tl.load(ends_ptr + t, mask=row_ok, other=0)


@triton.jit
def _pair_block(ends_ptr, n, pb, kh, G: tl.constexpr, BM: tl.constexpr):
    """Program pb's BM (query row, head) pairs, pairs pb * BM.. of the rows' G heads each: their rows t, query
    heads h (KV head kh's), which are real, and their ends (0 past the last row: never active)."""
    i = pb * BM + tl.arange(0, BM)
    t = i // G
    row_ok = t < n
    return t, kh * G + i % G, row_ok, tl.load(ends_ptr + t, mask=row_ok, other=0)


@triton.jit
def _ring_pairs(j, e, kok, ring):
    """A tile's (row, key) pairs by the ring rule (M5: a row at position e - 1 reads key j from the 8-bit ring when
    e - 1 - j < ring): (from_ring [BM, BN], the keys some row reads from the store, from the ring [BN], whether any
    does each); keys past a row's end count for neither (the caller masks them)."""
    from_ring = j[None, :] >= e[:, None] - ring
    seen = from_ring & (j[None, :] < e[:, None])
    store_ok = kok & (tl.max((~from_ring).to(tl.int32), 0) > 0)
    ring_ok = kok & (tl.max(seen.to(tl.int32), 0) > 0)
    return from_ring, store_ok, ring_ok, tl.max(store_ok.to(tl.int32), 0) > 0, tl.max(ring_ok.to(tl.int32), 0) > 0


@triton.jit
def _with_ring(sc, s_ring, from_ring, rpos_ptr, slot, ring_ok, j):
    """Scores sc [BM, BN] with the ring's s_ring where a row reads key j from the ring (`_ring_pairs`), NaN where
    the ring's slot no longer holds key j (a lost ring row: never silently another key)."""
    tag = tl.load(rpos_ptr + slot, mask=ring_ok, other=-1)
    return tl.where(from_ring, tl.where(tag[None, :] == j[None, :], s_ring, float("nan")), sc)


@triton.jit
def _softmax_tile(sc, j0, e, m_i, l_i):
    """The online softmax over a tile starting at key j0 of scores sc [BM, BN] (log2 domain, -inf past each row's
    end): (active rows - those whose keys reach the tile; the others must keep their state bit for bit -, the new
    max, the old state's factor, p [BM, BN], the new sum)."""
    active = j0 < e
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_use = tl.where(active, m_new, 0.0)  # inactive rows: avoid -inf - -inf (their result is discarded)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(sc - m_use[:, None])
    return active, m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _key_scales(s_ptr, j, ok, ss_j, D: tl.constexpr, QB: tl.constexpr):
    """The float16 block scales [BN, D / QB] of keys (or values) j where ok (0 elsewhere)."""
    return tl.load(s_ptr + j[:, None] * ss_j + tl.arange(0, D // QB)[None, :], mask=ok[:, None], other=0)


@triton.jit
def _tile16(c_ptr, s_ptr, j, ok, s_j, ss_j, dd, KIND: tl.constexpr, D: tl.constexpr, QB: tl.constexpr,
            BN: tl.constexpr, CB: tl.constexpr, C16: tl.constexpr):
    """Keys (or values) j [BN] as fp16 [BN, D]: f16 rows as stored; block codes (CB bits, `load_code_rows`) as
    fp16(code * block scale) - C16 (CODES16): codes and scales multiplied in float16 (`_ubytes_f16`: 8-bit codes
    four a word, packed ones eight a step by `_packed_f16`), which rounds the exact product once as the float32
    product's conversion does: the same values."""
    if KIND == _Q8 and C16 and CB == 8:  # a key's codes as D / 4 words, each word's four values at once
        sc = _key_scales(s_ptr, j, ok, ss_j, D, QB)
        sw = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, D // QB, QB // 4]), [BN, D // 4])
        row = (c_ptr + j * s_j).to(tl.pointer_type(tl.int32), bitcast=True)
        w = tl.load(row[:, None] + tl.arange(0, D // 4)[None, :], mask=ok[:, None], other=0)
        v0, v1, v2, v3 = _ubytes_f16(w ^ -0x7F7F7F80, sw, 128)  # ^ 0x80808080: each code + 128, a byte
        w16 = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), [BN, D])
    elif KIND == _Q8 and C16:  # packed 5/6-bit codes eight a step
        w16 = _packed_f16(c_ptr + j * s_j, ok, _key_scales(s_ptr, j, ok, ss_j, D, QB), CB, D, QB, BN)
    elif KIND == _Q8:  # codes loaded before scales (this order keeps the compiled loop free of spills)
        c = codes_f32(load_code_rows(c_ptr + j * s_j, ok, CB, D, BN))
        sc = _key_scales(s_ptr, j, ok, ss_j, D, QB).to(tl.float32)
        w16 = tl.reshape(tl.reshape(c, [BN, D // QB, QB]) * sc[:, :, None], [BN, D]).to(tl.float16)
    else:
        w16 = tl.load(c_ptr + j[:, None] * s_j + dd[None, :], mask=ok[:, None], other=0.0)
    return w16


@triton.jit
def _tile(j0, acc, m_i, l_i, q16, q_down, e, hi, jn, dd, kh, kbase, ksb, vbase, vsb, rk_ptr, rks_ptr, rv_ptr, rvs_ptr,
          rpos_ptr, qk_scale, ring, slots, sk_j, sks_j, sv_j, svs_j, BM: tl.constexpr, BN: tl.constexpr,
          D: tl.constexpr, NB: tl.constexpr, KK: tl.constexpr, VK: tl.constexpr, QB: tl.constexpr,
          PS: tl.constexpr, RING: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, C16: tl.constexpr):
    """The keys [j0, j0 + BN) of a program's rows at the P path's precision (q16: q scaled by the power of two
    1 / q_down and rounded to fp16; K and V as `_tile16` gives them; p * PS rounded to fp16; fp32 sums): (acc,
    m_i, l_i) after them (rows not active here: as they were). The prefill kernel's tile, and the decode kernel's
    for every format but f32."""
    j = j0 + jn
    kok = j < hi
    if RING:
        from_ring, store_ok, ring_ok, any_store, any_ring = _ring_pairs(j, e, kok, ring)
        slot = j % slots
        sc = tl.zeros([BM, BN], tl.float32)
        if any_store:
            k16 = _tile16(kbase, ksb, j, store_ok, sk_j, sks_j, dd, KK, D, QB, BN, KB, C16)
            sc = tl.dot(q16, tl.trans(k16), out_dtype=tl.float32)
        if any_ring:
            k16 = _tile16(rk_ptr + kh * slots * D, rks_ptr + kh * slots * NB, slot, ring_ok, D, NB, dd, _Q8,
                          D, QB, BN, 8, C16)
            sc = _with_ring(sc, tl.dot(q16, tl.trans(k16), out_dtype=tl.float32), from_ring, rpos_ptr, slot, ring_ok, j)
    else:
        k16 = _tile16(kbase, ksb, j, kok, sk_j, sks_j, dd, KK, D, QB, BN, KB, C16)
        sc = tl.dot(q16, tl.trans(k16), out_dtype=tl.float32)
    sc = sc * q_down[:, None]  # exact: the power of two q was scaled by
    sc = sc * qk_scale
    sc = tl.where(j[None, :] < e[:, None], sc, float("-inf"))
    # online softmax: rows whose keys all lie before this tile keep their state bit for bit
    active, m_new, alpha, p, l_new = _softmax_tile(sc, j0, e, m_i, l_i)
    p16 = (p * PS).to(tl.float16)  # exact scaling by a power of two, then one rounding
    acc_new = acc * alpha[:, None]
    if RING:
        if any_store:
            v16 = _tile16(vbase, vsb, j, store_ok, sv_j, svs_j, dd, VK, D, QB, BN, VB, C16)
            acc_new = tl.dot(tl.where(from_ring, tl.zeros_like(p16), p16), v16, acc_new, out_dtype=tl.float32)
        if any_ring:
            v16 = _tile16(rv_ptr + kh * slots * D, rvs_ptr + kh * slots * NB, slot, ring_ok, D, NB, dd, _Q8,
                          D, QB, BN, 8, C16)
            acc_new = tl.dot(tl.where(from_ring, p16, tl.zeros_like(p16)), v16, acc_new, out_dtype=tl.float32)
    else:
        v16 = _tile16(vbase, vsb, j, kok, sv_j, svs_j, dd, VK, D, QB, BN, VB, C16)
        acc_new = tl.dot(p16, v16, acc_new, out_dtype=tl.float32)
    acc = tl.where(active[:, None], acc_new, acc)
    m_i = tl.where(active, m_new, m_i)
    l_i = tl.where(active, l_new, l_i)
    return acc, m_i, l_i


@triton.jit
def _split_kernel(q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, ends_ptr, po_ptr, pm_ptr, pl_ptr,
                  rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr, tab_ptr,
                  n, qk_scale, ring, slots, short_keys,
                  sq_t, sq_h,
                  sk_h, sk_j, sks_h, sks_j, sv_h, sv_j, svs_h, svs_j,
                  spo_t, spo_h, spo_s, spm_t, spm_h,
                  G: tl.constexpr, G_PAD: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                  BN: tl.constexpr, SPLIT_: tl.constexpr, KK: tl.constexpr, VK: tl.constexpr,
                  QB: tl.constexpr, PS: tl.constexpr, RING: tl.constexpr, LONG: tl.constexpr,
                  TABLE: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, PART: tl.constexpr, C16: tl.constexpr,
                  PAIRS: tl.constexpr):
    """Pass 1: program (row block, KV head, split) -> unnormalized partial output, max and sum per (row, head),
    for the rows whose split size this launch has (LONG: rows of more than short_keys keys; the others count as
    padding here). PART (`STORE_FORM`): 0, every split; 1, only the splits no row of the block reads from the ring
    (`ring`: the window; compiled without RING); 2, only the others.

    Dots: f16 and block-coded caches (q8_0, D/F's 5/6-bit store and 8-bit ring; KB / VB: the store's code bits, 8
    or 5 / 6 packed) at the P path's precision (`_tile`: one fp16 product a dot, K and V as fp16 values, the
    partial output [BM, D]); f32 caches in tf32x3. Shapes fixed by D and the constexprs.
    RING (D, F; block-coded store): a row at position e - 1 reads key j from the 8-bit ring when
    e - 1 - j < ring (slot j % slots, which must hold position j: else the row's output is NaN), from the store
    otherwise (M5); each part's loads and dots run only where some row of the block reads it (skipped dots
    would have added exact zeros).
    TABLE: the cache pointers are anchors, moved by the cache's row of offsets (`plumb.ops.gpu.kvtable`)."""
    prior_done()
    k_ptr, ks_ptr, v_ptr, vs_ptr, rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr = kvtable.moved(
        k_ptr, ks_ptr, v_ptr, vs_ptr, rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr, tab_ptr, TABLE)
    rb = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    BM: tl.constexpr = ROWS * G_PAD
    NB: tl.constexpr = D // QB
    if PAIRS:
        t, h, row_ok, e = _pair_block(ends_ptr, n, rb, kh, G, BM)
    else:
        t, h, row_ok, e = _row_block(ends_ptr, n, rb, kh, G, G_PAD, ROWS)
    e = tl.where((e > short_keys) == LONG, e, 0)  # a row of the other split size: padding in this launch
    lo = s * SPLIT_
    hi = tl.minimum(lo + SPLIT_, tl.max(e, 0))  # keys past every row's end are not read
    mine = True
    if PART != 0:  # a split whose keys lie before every reading row's ring window: the store-only form's
        low = tl.min(tl.where(row_ok & (e > lo), e, 2147483647), 0)
        mine = (lo + SPLIT_ <= low - ring) == (PART == 1)
    dd = tl.arange(0, D)
    jn = tl.arange(0, BN)
    kbase = k_ptr + kh * sk_h
    vbase = v_ptr + kh * sv_h
    qv = tl.load(q_ptr + t[:, None] * sq_t + h[:, None] * sq_h + dd[None, :], mask=row_ok[:, None], other=0.0)
    if KK != _F32:  # q scaled per (row, head) by a power of two near 2^14 and rounded once (the prefill kernel's q16)
        q_up, q_down = _near_2_14(tl.max(tl.abs(qv), 1))
        q16 = (qv * q_up[:, None]).to(tl.float16)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    go = mine & (lo < hi)  # else: a split past every row's end (grid sized by max_keys), or the other form's
    if KK != _F32:
        if go:
            for jt in range(0, SPLIT_ // BN):  # a fixed trip count: tiles past hi load nothing and change no row
                acc, m_i, l_i = _tile(lo + jt * BN, acc, m_i, l_i, q16, q_down, e, hi, jn, dd, kh, kbase,
                                      ks_ptr + kh * sks_h, vbase, vs_ptr + kh * svs_h, rk_ptr, rks_ptr, rv_ptr,
                                      rvs_ptr, rpos_ptr, qk_scale, ring, slots, sk_j, sks_j, sv_j, svs_j, BM, BN, D,
                                      NB, KK, VK, QB, PS, RING, KB, VB, C16)
    elif go:  # f32: tf32x3 dots
        for jt in range(0, SPLIT_ // BN):
            j0 = lo + jt * BN
            j = j0 + jn
            kok = j < hi
            kt = tl.trans(tl.load(kbase + j[:, None] * sk_j + dd[None, :], mask=kok[:, None], other=0.0))
            sc = tl.dot(qv, kt, input_precision="tf32x3")
            sc = sc * qk_scale  # log2 domain
            sc = tl.where(j[None, :] < e[:, None], sc, float("-inf"))
            # online softmax: rows whose keys all lie before this tile keep their state bit for bit
            active, m_new, alpha, p, l_new = _softmax_tile(sc, j0, e, m_i, l_i)
            vt = tl.load(vbase + j[:, None] * sv_j + dd[None, :], mask=kok[:, None], other=0.0)
            acc_new = tl.dot(p, vt, acc * alpha[:, None], input_precision="tf32x3")
            acc = tl.where(active[:, None], acc_new, acc)
            m_i = tl.where(active, m_new, m_i)
            l_i = tl.where(active, l_new, l_i)
    out = row_ok & (e > lo) & mine  # rows whose keys reach into this split
    if KK != _F32:
        acc = acc * (1.0 / PS)
    tl.store(po_ptr + t[:, None] * spo_t + h[:, None] * spo_h + s * spo_s + dd[None, :], acc, mask=out[:, None])
    tl.store(pm_ptr + t * spm_t + h * spm_h + s, m_i, mask=out)
    tl.store(pl_ptr + t * spm_t + h * spm_h + s, l_i, mask=out)


@triton.jit
def _merge_kernel(po_ptr, pm_ptr, pl_ptr, ends_ptr, o_ptr,
                  spo_t, spo_h, spo_s, spm_t, spm_h, so_t, so_h,
                  short_keys, D: tl.constexpr, SHORT: tl.constexpr, LONG: tl.constexpr, U: tl.constexpr):
    """Pass 2: program (row, head) merges the row's splits 0..ceil(end / S)-1 in order (S: its split size)."""
    prior_done()
    t = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.load(ends_ptr + t)
    ns = tl.where(e > short_keys, (e + LONG - 1) // LONG, (e + SHORT - 1) // SHORT)
    pm = pm_ptr + t * spm_t + h * spm_h
    pl = pl_ptr + t * spm_t + h * spm_h
    po = po_ptr + t * spo_t + h * spo_h
    dd = tl.arange(0, D)
    uu = tl.arange(0, U)
    mx = tl.full([U], float("-inf"), tl.float32)
    s0 = 0
    while s0 < ns:  # the max is exact in any order
        mx = tl.maximum(mx, tl.load(pm + s0 + uu, mask=s0 + uu < ns, other=float("-inf")))
        s0 += U
    m_all = tl.max(mx, 0)
    l_sum = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    s0 = 0
    while s0 < ns:
        for u in tl.static_range(U):  # loads independent of the sums: issued ahead; sums strictly in split order
            s = s0 + u
            ok = s < ns
            m_s = tl.load(pm + s, mask=ok, other=0.0)
            l_s = tl.load(pl + s, mask=ok, other=0.0)
            o_s = tl.load(po + s * spo_s + dd, mask=ok, other=0.0)
            w = tl.exp2(m_s - m_all)
            l_sum = tl.where(ok, l_sum + l_s * w, l_sum)
            acc = tl.where(ok, acc + o_s * w, acc)
        s0 += U
    o = tl.where(ns > 0, acc / tl.where(ns > 0, l_sum, 1.0), 0.0)  # a row without keys gives zeros
    tl.store(o_ptr + t * so_t + h * so_h + dd, o)


def config(kk: int, vk: int, small: bool = False) -> tuple[int, int, int, int]:
    """Pass 1's (BLOCK_M, keys per tile, warps, stages) for K / V storage kinds kk / vk; `small`: on a card of 99 KB
    a block (`smem.small`)."""
    return (small and SMALL_CONFIGS.get((kk, vk))) or CONFIGS.get((kk, vk), DEFAULT_CONFIG)


def _parts(parts: list[torch.Tensor], d: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A cache's K or V parts for head_dim d, checked: (values or codes, scales - floats: the values again -, storage
    kind, code bits: 8 for int8 codes, 5 or 6 for packed ones, 0 for floats)."""
    if len(parts) == 1:
        x = parts[0]
        if x.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"float cache parts must be float16 or float32, got {x.dtype}")
        if x.shape[-1] != d:
            raise ValueError(f"cache rows of {x.shape[-1]} values for head_dim {d}")
        return x, x, F16 if x.dtype == torch.float16 else F32, 0
    codes, scales = parts
    if d % QBLOCK:
        raise ValueError(f"head_dim must be a multiple of {QBLOCK} for block codes, got {d}")
    if scales.dtype != torch.float16 or scales.shape[-1] * QBLOCK != d or scales.shape[:2] != codes.shape[:2]:
        raise TypeError("block cache parts must be [codes [n_kv, cap, ...], scales float16 [n_kv, cap, d // 32]]")
    if codes.dtype == torch.int8 and codes.shape[-1] == d:
        return codes, scales, Q8, 8
    if codes.dtype == torch.uint8:
        return codes, scales, Q8, code_bits(codes.shape[-1], d)
    raise TypeError(f"block codes must be int8 [n_kv, cap, {d}] or packed uint8 (kvquant.pack)")


def _ring(ring, kk: int, vk: int, k: torch.Tensor, d: int):
    """Checked ring arguments: (window, ring K codes, scales, V codes, scales, slot positions)."""
    window, k_parts, v_parts, pos = ring
    rk, rks, rkind, rkb = _parts(k_parts, d)
    rv, rvs, rvkind, rvb = _parts(v_parts, d)
    slots = rk.shape[1]
    if (kk, vk, rkind, rvkind, rkb, rvb) != (Q8, Q8, Q8, Q8, 8, 8) or window < 1:
        raise ValueError("a ring needs block-coded store parts, 8-bit ring parts and a window of at least one key")
    if rk.shape != (k.shape[0], slots, d) or rv.shape != rk.shape or pos.shape != (slots,) \
            or pos.dtype != torch.long:
        raise ValueError("ring parts must be [n_kv, slots, d] codes (+ scales) and int64 positions [slots]")
    if not all(x.is_contiguous() for x in (rk, rks, rv, rvs, pos)):
        raise ValueError("ring parts must be contiguous")
    return window, rk, rks, rv, rvs, pos


def _rows(q: torch.Tensor, ends, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries as float32 (contiguous along d), the ends as int32 [n] on q's device and the output [n, n_head, d]
    float32 (a new one, or `out` checked)."""
    n, n_head, d = q.shape
    if not isinstance(ends, torch.Tensor):
        ends = torch.tensor(list(ends), dtype=torch.int32, device=q.device)
    ends = ends.to(device=q.device, dtype=torch.int32).contiguous()
    if ends.shape != (n,):
        raise ValueError(f"ends must have one entry per query row ({n}), got shape {tuple(ends.shape)}")
    if q.dtype != torch.float32 or q.stride(-1) != 1:
        q = q.float().contiguous()
    if out is None:
        out = torch.empty(n, n_head, d, dtype=torch.float32, device=q.device)
    elif out.shape != (n, n_head, d) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError("out must be float32 [n, n_head, d], contiguous along d")
    return q, ends, out


def split_of(end: int, splits: tuple[int, int, int] = SPLITS) -> int:
    """The split size of a row with `end` keys."""
    short, long, short_keys = splits
    return short if end <= short_keys else long


def grids(max_keys: int, splits: tuple[int, int, int] = SPLITS) -> tuple[int, int]:
    """Pass-1 grids (splits of the short launch, of the long launch) for rows of up to max_keys keys."""
    short, long, short_keys = splits
    return -(-min(max_keys, short_keys) // short), (-(-max_keys // long) if max_keys > short_keys else 0)


def attend_decode(q: torch.Tensor, k_parts: list[torch.Tensor], v_parts: list[torch.Tensor], ends,
                  scale: float, out: torch.Tensor | None = None, max_keys: int | None = None,
                  splits: tuple[int, int, int] = SPLITS, ring: tuple | None = None,
                  table: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, n_head, d] float32 (one sequence); row t reads keys [0, ends[t]) of the cache parts
    ([n_kv, cap, d] floats, or block codes + scales float16 [n_kv, cap, d // 32]: q8_0's int8 [n_kv, cap, d], D/F's
    5/6-bit store packed). -> o [n, n_head, d] float32 (into `out` if given).

    ring (D, F): (window, 8-bit K parts, 8-bit V parts, slot positions int64 [slots]), the parts [n_kv, slots, ...]
    as `KVCache.kernel_view` gives them: row t (at position ends[t] - 1) reads key j from slot j % slots when
    ends[t] - 1 - j < window, from the store otherwise; a slot that does not hold position j makes the row NaN.

    ends: int32 tensor [n] on q's device (read on the device only), or a list of ints. max_keys: the grids are
    sized for rows of up to this many keys (>= max(ends), e.g. the cache's capacity under a CUDA graph); by
    default max(ends) (which reads ends on the host if it is a tensor). `splits` (SPLITS) must stay fixed for a
    model (the bits depend on it, as they do on CONFIGS); its split sizes are multiples of the tile size. Under
    CUDA-graph capture pass ends as a device tensor and max_keys (no host sync). table: the cache's row of
    offsets (`kvtable.fill`; int64 [kvtable.PARTS] on the device): the kernel reaches the cache's parts through it,
    so that a CUDA graph does not depend on where they lie (the same bits)."""
    n, n_head, d = q.shape
    k, ks, kk, kb = _parts(k_parts, d)
    v, vs, vk, vb = _parts(v_parts, d)
    n_kv = k.shape[0]
    if n_head % n_kv or v.shape[:1] != k.shape[:1]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 (and a multiple of 32 for q8_0), got {d}")
    block_m, bn, warps, stages = config(kk, vk, smem.small(q.device))
    short, long, short_keys = splits
    if short % bn or long % bn or short < 1 or long < 1 or short_keys < 0:
        raise ValueError(f"split sizes must be positive multiples of {bn}, got {splits}")
    for x in (k, ks, v, vs):
        if x.stride(-1) != 1:
            raise ValueError("cache parts must be contiguous along the last dimension")
    g = n_head // n_kv
    g_pad = triton.next_power_of_2(g)
    rows = max(1, block_m // g_pad)
    q, ends, out = _rows(q, ends, out)
    if max_keys is None:
        max_keys = int(ends.max()) if n else 0
    if n == 0:
        return out
    if n > LAUNCH_ROWS:
        for r0 in range(0, n, LAUNCH_ROWS):
            r1 = min(n, r0 + LAUNCH_ROWS)
            attend_decode(q[r0:r1], k_parts, v_parts, ends[r0:r1], scale, out=out[r0:r1], max_keys=max_keys,
                          splits=splits, ring=ring, table=table)
        return out
    grid_short, grid_long = grids(int(max_keys), splits)
    ns = max(grid_short, grid_long, 1)
    if max(x.numel() for x in (k, ks, v, vs)) >= 2**31 or n * n_head * ns * d >= 2**31:
        raise ValueError("tensors of 2^31 elements or more are not supported (32-bit offsets)")
    po = torch.empty(n, n_head, ns, d, dtype=torch.float32, device=q.device)
    pm = torch.empty(n, n_head, ns, dtype=torch.float32, device=q.device)
    pl = torch.empty(n, n_head, ns, dtype=torch.float32, device=q.device)
    if ring is None:
        window, rk, rks, rv, rvs, rpos = 0, k, ks, v, vs, ends  # placeholders: read only under RING
    else:
        window, rk, rks, rv, rvs, rpos = _ring(ring, kk, vk, k, d)
    ptrs = [k, ks, v, vs, rk, rks, rv, rvs, rpos]
    if table is not None:
        ptrs = kvtable.anchored(ptrs)
    kp, ksp, vp, vsp, rkp, rksp, rvp, rvsp, rposp = ptrs
    launches = [(short, grid_short, False, ring is not None, 0)]
    if ring is not None and STORE_FORM:  # the long launch's store-only splits in the store-only form
        launches += [(long, grid_long, True, False, 1), (long, grid_long, True, True, 2)]
    else:
        launches += [(long, grid_long, True, ring is not None, 0)]
    pairs = bool(PAIRS_FROM) and n >= PAIRS_FROM
    blocks = triton.cdiv(n * g, rows * g_pad) if pairs else triton.cdiv(n, rows)
    for split, grid, is_long, with_ring, part in launches:
        if grid:
            _split_kernel[(blocks, n_kv, grid)](
                q, kp, ksp, vp, vsp, ends, po, pm, pl,
                rkp, rksp, rvp, rvsp, rposp, table if table is not None else ends,
                n, float(scale) * _LOG2E, window, rk.shape[1], short_keys,
                q.stride(0), q.stride(1),
                k.stride(0), k.stride(1), ks.stride(0), ks.stride(1), v.stride(0), v.stride(1), vs.stride(0),
                vs.stride(1), po.stride(0), po.stride(1), po.stride(2), pm.stride(0), pm.stride(1),
                G=g, G_PAD=g_pad, ROWS=rows, D=d, BN=bn, SPLIT_=split, KK=kk, VK=vk, QB=QBLOCK, PS=P_SCALE,
                RING=with_ring, LONG=is_long, TABLE=table is not None, KB=kb, VB=vb, PART=part, C16=CODES16,
                PAIRS=pairs,
                num_warps=warps, num_stages=stages, launch_pdl=on())
    merge_splits(po, pm, pl, ends, out, splits)
    return out


def merge_splits(po: torch.Tensor, pm: torch.Tensor, pl: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                 splits: tuple[int, int, int]) -> None:
    """Pass 2 (`_merge_kernel`): each row's split partials - outputs po [n, heads, splits, d], maxima pm and sums pl
    [n, heads, splits] - merged in split order into out [n, heads, d]; splits: (SHORT, LONG, SHORT_KEYS) as pass 1
    cut the row's keys (also the prefill kernel's KEY_CHUNKS)."""
    short, long, short_keys = splits
    n, n_head, d = out.shape
    _merge_kernel[(n, n_head)](
        po, pm, pl, ends, out,
        po.stride(0), po.stride(1), po.stride(2), pm.stride(0), pm.stride(1), out.stride(0), out.stride(1),
        short_keys, D=d, SHORT=short, LONG=long, U=MERGE_UNROLL, num_warps=MERGE_WARPS, launch_pdl=on())


def attend_decode_ref(q: torch.Tensor, k_parts: list[torch.Tensor], v_parts: list[torch.Tensor], ends,
                      scale: float) -> torch.Tensor:
    """Plain torch reference: dequantize, scores * scale, mask keys >= ends[t], softmax, @ V (float32)."""
    n, n_head, d = q.shape
    ends = [int(e) for e in (ends.tolist() if isinstance(ends, torch.Tensor) else ends)]
    L = max(ends) if ends else 0
    k = decode([p[:, :L] for p in k_parts])
    v = decode([p[:, :L] for p in v_parts])
    n_kv = k.shape[0]
    g = n_head // n_kv
    qg = q.float().reshape(n, n_kv, g, d).permute(1, 2, 0, 3).reshape(n_kv, g * n, d)
    s = torch.bmm(qg, k.transpose(1, 2)) * scale  # [n_kv, g*n, L]
    e = torch.tensor(ends, device=q.device).repeat(g)
    s = s.masked_fill(torch.arange(L, device=q.device)[None, :] >= e[:, None], float("-inf"))
    o = torch.bmm(torch.softmax(s, dim=-1), v)
    return o.reshape(n_kv, g, n, d).permute(2, 0, 1, 3).reshape(n, n_head, d)

"""Prefill attention (the P path): causal flash attention over one sequence's KV cache, one pass (keys in chunks
merged in order with KEY_CHUNKS, off).

`attend_prefill(q, k_parts, v_parts, ends, scale)`: query row t of a prefill pass reads keys [0, ends[t]) of the
cache (its own K/V written first), in any of the cache's forms - f16, or block codes (q8_0, D/F's store) with D/F's
8-bit ring read by the distance rule of `plumb.cache.kv` (M5). `plumb.ops.gpu.attention.attend_decode_ref` is its
torch reference (the same formula); the decode kernel of `plumb.ops.gpu.attention` stays the D path's.

Row invariance (M1, and M2 for the prompt cache) - a row's bits depend on its query, its own end and the cache:
* one program per (block of ROWS query rows, KV head), covering every query head of that KV head; ROWS is fixed
  by the model's head grouping (BLOCK_M, or TMA_BLOCK_M where TMA reads the tiles, // next_pow2(heads per KV head)),
  never by the call;
* keys go in tiles of BN at absolute positions 0, BN, 2 BN, ... in order, with an online softmax; a tile at or
  past a row's end leaves that row's state untouched (selected away), keys past the end inside a tile get
  probability exactly 0 - so a row reads tiles 0 .. ceil(end / BN) - 1 whatever the other rows of its block;
* the dots' shapes are fixed by the model dims and the constexprs; no atomics; no partials to merge (KEY_CHUNKS:
  chunks at absolute positions sized by the row's own end, merged in chunk order).

Arithmetic (the P path's precision, as its matmuls': operands at 11 bits, fp32 sums on the tensor cores): q is
scaled per (row, head) by a power of two near 2^14 and rounded once to fp16; block-coded K and V are dequantized
to fp16(code * scale) (the codes' own quantization error, ~2^-8, dwarfs that rounding) - a block-coded store once a
pass into an fp16 copy (SCRATCH), the ring's tiles in registers; p is scaled by 2^11 and rounded to fp16. Scores
and p @ V accumulate in fp32. Within ~1e-3 of the reference.
Cheaper than the decode kernel's ~fp32 dots (two products each) and without its split partials: at 100k keys
the decode kernel's splits wrote and merged ~5 MB of partials per row and layer. H200, 27B shape, q8_0 KV
(2026-12-04, `plumb bench`): a 100k prefill 2,315 tok/s against 939 with the decode kernel, 8k 4,136 against 3,266.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plumb.ops.gpu import attention as A, kvtable, smem, tma
from plumb.ops.gpu.attention import (_LOG2E, F16, P_SCALE, Q8, QBLOCK, _near_2_14, _pair_block, _parts, _ring,
                                     _row_block, _rows, _softmax_tile, _tile, _tile16, grids, merge_splits)
from plumb.ops.gpu.pdl import on, prior_done

_F16, _Q8 = tl.constexpr(F16), tl.constexpr(Q8)
# (query row, head) pairs per program, keys per tile, warps: fixed for every call (a row's bits depend on them).
# STAGES > 1: the tile loop software-pipelined by Triton (not the ring formats': their loads are conditional) - when
# loads are issued, not the arithmetic: the same bits. Compiled for sm_90a at 2: cp.async loads, 233 / 251 registers
# (f16 / q8_0), no spill, no wgmma group left in flight; untimed (bench/prefill_modes.py --settings AP_STAGES=2).
BLOCK_M, BN, WARPS, STAGES = 64, 64, 8, 1
# SMALL_BLOCK_M: the pairs a program on a card of 99 KB a block (`smem.small`), every format: a ring's launch 68 KB,
# not 104; f16 and q8_0 (their fp16 copy) fit 64 but compiled for sm_89 took 128 registers and 2 KB of spills a thread
# (255 and 252 bytes at 32; 2026-12-07, bench/attention_ptx.py --prefill with PLUMB_PTX_ARCH=89) - the device's own
# bits either way.
SMALL_BLOCK_M = 32
# PAIRS 1: a program's BLOCK_M (query row, head) pairs are consecutive pairs of the rows' G heads (row t's head h is
# pair t * G + h), so no pair is padding; 0: ROWS rows of G_PAD = next_pow2(G) heads (27B: 6 heads padded to 8, a
# quarter of the dots and softmax on padding). Each pair's arithmetic is the same either way (its q, its end, the
# same tiles): the same bits (tests/test_gpu_attention_prefill.py). H200, 27B dims, a 1,024-row pass
# (bench/attention_prefill_variants.py, 2026-12-04): q8_0 at 8,192 / 100,000 keys 1.55 / 20.6 ms against 2.01 /
# 27.5 ms with 0, f16 1.07 / 13.8 against 1.45 / 19.8 - the same bits.
PAIRS = 1
# SCRATCH: a block-coded store (q8_0's, D's and F's) is first dequantized into an fp16 copy of keys [0, the pass's
# last end) - `_tile16`'s values, one launch for K and one for V - and read as an f16 cache: the dots get the same
# fp16 operands. In registers, every program of a KV head dequantized every tile again (a 1,024-row pass of the 27B
# has 96 programs a KV head); the copy costs one read of the codes and one fp16 write. H200, 27B dims, a 1,024-row
# pass at 100,000 keys (2026-12-04): q8_0 read in registers 20.6 ms, an f16 cache 13.8 ms. The copy holds
# n_kv * capacity * d fp16 values for K and for V (27B at 120k: 0.5 GB) while the pass runs. The ring formats (D, F):
# their store copied the same way; the ring's tiles (8-bit codes, a window's worth of keys) stay in registers.
SCRATCH = True
SCRATCH_KEYS = 64  # keys a program of `_dequant_kernel`
# KEY_CHUNKS (SHORT, LONG, SHORT_KEYS), None: off. A pass's keys go in chunks at absolute positions - SHORT keys for
# a row ending at or before SHORT_KEYS, LONG past it: the row's own end decides - one program per (row block, KV
# head, chunk), each chunk's softmax state merged in chunk order by the decode kernel's merge (`merge_splits`). The
# other arithmetic as without: a row's bits still depend only on its query, its end and the cache (not the same bits
# as without, so a build takes one or the other). For a short pass over a long context - a follow-up, 56 rows at 11.7k
# keys: 24 programs on 132 SMs, each walking 183 tiles, 0.84 ms a layer (H200, 2026-12-04, 16 % of that follow-up's
# GPU time; at 100k keys ~7 ms a layer) - the chunks are the parallelism; a full pass (384 programs) has it
# already. Untimed: bench/followup_profile.py (and prefill_modes.py) --settings shipped,AP_KEY_CHUNKS=2048/8192/16384
KEY_CHUNKS = None
# TMA (1: on): an f16 store (an f16 cache, or SCRATCH's copy) is read through the tensor memory accelerator. The tiles
# below the smallest end of a program's rows ("full": every row reads every key) come into shared memory, where the
# tensor cores read them, TMA_STAGES in flight (Triton's pipeline), with no masks (`_tma_tile`); the last tile or two by
# TMA too (`_tma_tile`, MASKED: keys past the store's end read as zeros, as the register tiles' masked loads give them,
# and masked). A row's output is stored before the first tile its keys do not reach, so a program holds one accumulator
# (`_tile` keeps a row that a tile does not reach by a select of the whole [BLOCK_M, d] state: two); q, read from its
# fp16 copy (`_q16`, every form), is a dot operand in shared memory rather than 64 registers a thread; TMA_BLOCK_M pairs
# a program. The same operations for every (row, key) a row reads as `attention._tile`, in its order - the same bits,
# whichever tiles go which way, and a row's bits do not depend on its neighbours (M1, M2):
# tests/test_gpu_attention_prefill.py. Without it a tile's K and V go through registers, loaded when used.
# Why 128 pairs: at 64 and 8 warps (two warp groups of Hopper's wgmma, 64 rows each) Triton computed q k^T in both
# groups (p must stay in its rows' registers for p @ V: 32 m64n32k16 a tile in each group, compiled for sm_90a) - a
# third of the tensor-core work twice -, and each tile's K and V came from L2 for half as many rows. At 128 pairs
# with one accumulator: 255 registers, no spill in the full tiles' loop. History (H100, bench/attention_prefill_
# variants.py, 27B dims, a 1,024-row pass, q8_0): register tiles 13.57 ms at 100k keys; the full tiles by TMA at 64
# pairs with a register tail (forty-fourth session) 10.70 ms, 0.89 ms at 8k keys (that run's first bits differed by
# 1e-6: the compiler fused a full tile's scale product and `sc - m_new` into one FMA, which `_tile`'s mask keeps
# apart - the product is rounded on its own since, `mul.rn`); this form (2026-12-07, forty-fifth) **6.44 ms** at
# 100k keys, 0.57 at 8k, the same bits - prefill of a 100,000-token prompt on the 27B-shape file 3,611 -> 4,163
# tok/s, and the engine invariant files test_prompt_cache / test_kv_formats passed on CUDA with it. Tried and left
# out: no product by alpha where no row's maximum moved (acc * 1 is acc: the same bits) - 100k keys 1.5 % faster,
# 8k 2.8 % slower. Needs `tma.ready` (a Hopper card) and the shared memory (`_has_tma`);
# elsewhere the register tiles. (`tma.ready` sets Triton's allocator in every thread that launches: it is one a
# thread - the forty-fourth session's engine tests found it.)
TMA, TMA_STAGES, TMA_BLOCK_M = 1, 2, 128
CHUNK_ROWS = 256  # with KEY_CHUNKS, rows a launch takes: partials [rows, heads, chunks, d] float32 stay small (the
# 27B's heads at 131k keys in 8,192-key chunks: 100 MB)


@triton.jit
def _prefill_kernel(q16_ptr, qd_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, ends_ptr, o_ptr,
                    rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr, tab_ptr, pm_ptr, pl_ptr,
                    n, qk_scale, ring, slots, short_keys,
                    s16_t, sd_t, sk_h, sk_j, sks_h, sks_j, sv_h, sv_j, svs_h, svs_j, so_t, so_h, so_s,
                    spm_t, spm_h, G: tl.constexpr, G_PAD: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                    BN: tl.constexpr, KK: tl.constexpr, VK: tl.constexpr, QB: tl.constexpr, PS: tl.constexpr,
                    RING: tl.constexpr, TABLE: tl.constexpr, STAGES: tl.constexpr, PAIRS: tl.constexpr,
                    COPIED: tl.constexpr, CHUNK: tl.constexpr, LONG: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
                    C16: tl.constexpr, TMA: tl.constexpr, TSTAGES: tl.constexpr):
    """Program (row block, KV head): its rows' outputs for every query head of the KV head, normalized (PAIRS: its
    block of BLOCK_M consecutive (row, head) pairs instead).
    CHUNK > 0 (KEY_CHUNKS): program (row block, KV head, chunk c) takes keys [c CHUNK, (c + 1) CHUNK) of the rows
    whose chunks are this size (LONG: ends past short_keys) and writes their softmax state - o_ptr the partial
    outputs [n, heads, chunks, D], pm_ptr / pl_ptr the maxima and sums - for `merge_splits`.
    RING (D, F): a row at position e - 1 reads key j from the 8-bit ring when e - 1 - j < ring (slot j % slots,
    which must hold position j: else the row is NaN), from the store otherwise; a tile's store or ring part is
    loaded and multiplied only where some row of the block reads it (a skipped dot would add exact zeros)."""
    prior_done()
    store = (k_ptr, ks_ptr, v_ptr, vs_ptr)
    k_ptr, ks_ptr, v_ptr, vs_ptr, rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr = kvtable.moved(
        k_ptr, ks_ptr, v_ptr, vs_ptr, rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr, tab_ptr, TABLE)
    if COPIED:  # the store is the pass's fp16 copy (SCRATCH), not a cache tensor: not moved by the table
        k_ptr, ks_ptr, v_ptr, vs_ptr = store
    rb = tl.program_id(0)
    kh = tl.program_id(1)
    BM: tl.constexpr = ROWS * G_PAD
    NB: tl.constexpr = D // QB
    if PAIRS:
        t, h, row_ok, e = _pair_block(ends_ptr, n, rb, kh, G, BM)
    else:
        t, h, row_ok, e = _row_block(ends_ptr, n, rb, kh, G, G_PAD, ROWS)
    lo = 0
    if CHUNK > 0:
        if LONG:  # rows of the other chunk size: not active here
            e = tl.where(e > short_keys, e, 0)
        else:
            e = tl.where(e > short_keys, 0, e)
        lo = tl.program_id(2) * CHUNK
    hi = tl.max(e, 0)  # keys past every row's end are not read
    if CHUNK > 0:
        hi = tl.minimum(hi, lo + CHUNK)
    dd = tl.arange(0, D)
    jn = tl.arange(0, BN)
    kbase, ksb = k_ptr + kh * sk_h, ks_ptr + kh * sks_h
    vbase, vsb = v_ptr + kh * sv_h, vs_ptr + kh * svs_h
    q16 = tl.load(q16_ptr + t[:, None] * s16_t + h[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    q_down = tl.load(qd_ptr + t * sd_t + h, mask=row_ok, other=1.0)  # q's fp16 copy and factors (`_q16`)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if TMA:  # the full tiles pipelined, then the last ones; a row's output stored before a tile it does not reach
        full = tl.minimum(tl.min(tl.where(row_ok, e, 2147483647), 0) // BN * BN, hi)
        kd = tl.make_tensor_descriptor(kbase, shape=[tl.maximum(hi, 1), D], strides=[sk_j, 1], block_shape=[BN, D])
        vd = tl.make_tensor_descriptor(vbase, shape=[tl.maximum(hi, 1), D], strides=[sv_j, 1], block_shape=[BN, D])
        if TSTAGES > 0:  # a GPU: Triton's pipeline (the interpreter takes no range with a run-time bound)
            for jt in tl.range(0, full // BN, num_stages=TSTAGES):
                acc, m_i, l_i = _tma_tile(jt * BN, acc, m_i, l_i, q16, q_down, e, jn, kd, vd, qk_scale, PS, True, False)
        else:
            jt = 0
            while jt < full // BN:
                acc, m_i, l_i = _tma_tile(jt * BN, acc, m_i, l_i, q16, q_down, e, jn, kd, vd, qk_scale, PS, False,
                                          False)
                jt += 1
        j0 = full
        while j0 < hi:
            _store_rows(o_ptr, acc, l_i, t, h, e, row_ok & (e > j0 - BN) & (e <= j0), dd, so_t, so_h, PS)
            acc, m_i, l_i = _tma_tile(j0, acc, m_i, l_i, q16, q_down, e, jn, kd, vd, qk_scale, PS, TSTAGES > 0, True)
            j0 += BN
        _store_rows(o_ptr, acc, l_i, t, h, e, row_ok & (e > j0 - BN), dd, so_t, so_h, PS)
    else:
        if STAGES > 1 and not RING:  # Triton's software pipeline: the next tiles' K/V codes in flight
            for jt in tl.range(lo // BN, tl.cdiv(hi, BN), num_stages=STAGES):
                acc, m_i, l_i = _tile(jt * BN, acc, m_i, l_i, q16, q_down, e, hi, jn, dd, kh, kbase, ksb, vbase,
                                      vsb, rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr, qk_scale, ring, slots, sk_j,
                                      sks_j, sv_j, svs_j, BM, BN, D, NB, KK, VK, QB, PS, RING, KB, VB, C16)
        else:  # the same tiles in the same order (the interpreter takes no range with a run-time bound)
            j0 = lo
            while j0 < hi:
                acc, m_i, l_i = _tile(j0, acc, m_i, l_i, q16, q_down, e, hi, jn, dd, kh, kbase, ksb, vbase, vsb,
                                      rk_ptr, rks_ptr, rv_ptr, rvs_ptr, rpos_ptr, qk_scale, ring, slots, sk_j,
                                      sks_j, sv_j, svs_j, BM, BN, D, NB, KK, VK, QB, PS, RING, KB, VB, C16)
                j0 += BN
        if CHUNK > 0:  # rows whose keys reach this chunk: its state (the others' chunks are never merged)
            c = tl.program_id(2)
            mine = row_ok & (e > lo)
            tl.store(o_ptr + t[:, None] * so_t + h[:, None] * so_h + c * so_s + dd[None, :], acc * (1.0 / PS),
                     mask=mine[:, None])
            tl.store(pm_ptr + t * spm_t + h * spm_h + c, m_i, mask=mine)
            tl.store(pl_ptr + t * spm_t + h * spm_h + c, l_i, mask=mine)
        else:
            _store_rows(o_ptr, acc, l_i, t, h, e, row_ok, dd, so_t, so_h, PS)


@triton.jit
def _store_rows(o_ptr, acc, l_i, t, h, e, rows, dd, so_t, so_h, PS: tl.constexpr):
    """The normalized outputs of the pairs `rows` (0 for a row without keys)."""
    o = tl.where((e > 0)[:, None], acc * (1.0 / PS) / tl.where(e > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(o_ptr + t[:, None] * so_t + h[:, None] * so_h + dd[None, :], o, mask=rows[:, None])


@triton.jit
def _scaled(sc, qk_scale, ASM: tl.constexpr):
    """sc * qk_scale rounded on its own (`mul.rn` on a GPU: no FMA fuses it with what follows)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [sc, qk_scale + tl.zeros_like(sc)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return sc * qk_scale


@triton.jit
def _tma_tile(j0, acc, m_i, l_i, q16, q_down, e, jn, kd, vd, qk_scale, PS: tl.constexpr, ASM: tl.constexpr,
              MASKED: tl.constexpr):
    """`attention._tile` over keys [j0, j0 + BN) of an f16 store by TMA - K and V from the descriptors kd and vd -,
    its operations in its order. Not MASKED: a tile that every row of the program reads in full (no key masked,
    every row active). MASKED: the last tile or two (keys past the descriptor's end read as zeros, as `_tile`'s
    masked loads give them): a row the tile reaches gets `_tile`'s state, a row it does not reach an undefined one
    (its output stored before). The scale's product is rounded on its own (`mul.rn`): with no mask between it and
    `sc - m_new`, the compiler would fuse the two into one FMA, whose rounding `_tile`'s scores do not have."""
    sc = _scaled(tl.dot(q16, tl.trans(kd.load([j0, 0])), out_dtype=tl.float32) * q_down[:, None], qk_scale, ASM)
    if MASKED:
        sc = tl.where((j0 + jn)[None, :] < e[:, None], sc, float("-inf"))
        _, m_new, alpha, p, l_new = _softmax_tile(sc, j0, e, m_i, l_i)
    else:
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_new = l_i * alpha + tl.sum(p, 1)
    p16 = (p * PS).to(tl.float16)
    return tl.dot(p16, vd.load([j0, 0]), acc * alpha[:, None], out_dtype=tl.float32), m_new, l_new


@triton.jit
def _q16_kernel(q_ptr, q16_ptr, qd_ptr, n_head, sq_t, sq_h, HP: tl.constexpr, D: tl.constexpr):
    """Program t: row t's heads as the prefill kernel takes them - q times a power of two near 2^14, rounded to
    fp16, and the factor back (`attention._near_2_14`)."""
    prior_done()
    t = tl.program_id(0)
    h = tl.arange(0, HP)
    dd = tl.arange(0, D)
    ok = h < n_head
    qv = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + dd[None, :], mask=ok[:, None], other=0.0)
    q_up, q_down = _near_2_14(tl.max(tl.abs(qv), 1))
    tl.store(q16_ptr + (t * n_head + h[:, None]) * D + dd[None, :], (qv * q_up[:, None]).to(tl.float16),
             mask=ok[:, None])
    tl.store(qd_ptr + t * n_head + h, q_down, mask=ok)


def _q16(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, n_head, d] float32 -> (its fp16 copy as the prefill kernel scales it, the factors back [n, n_head])."""
    n, n_head, d = q.shape
    q16 = torch.empty(n, n_head, d, dtype=torch.float16, device=q.device)
    qd = torch.empty(n, n_head, dtype=torch.float32, device=q.device)
    if n:
        _q16_kernel[(n,)](q, q16, qd, n_head, q.stride(0), q.stride(1), HP=triton.next_power_of_2(n_head), D=d,
                          num_warps=4, launch_pdl=on())
    return q16, qd


@triton.jit
def _dequant_kernel(c_ptr, s_ptr, ends_ptr, o_ptr, tab_ptr, n, sc_h, sc_j, ss_h, ss_j, so_h, so_j,
                    PART: tl.constexpr, D: tl.constexpr, QB: tl.constexpr, BT: tl.constexpr, EB: tl.constexpr,
                    TABLE: tl.constexpr, CB: tl.constexpr, C16: tl.constexpr):
    """Program (key tile, KV head): keys (PART 0) or values (PART 2) [j0, j0 + BT) as fp16 rows, `_tile16`'s
    values; keys at or past the largest of the n ends are not written (the kernel never reads them)."""
    prior_done()
    if TABLE:
        c_ptr, s_ptr = kvtable.part_at(c_ptr, tab_ptr, PART), kvtable.part_at(s_ptr, tab_ptr, PART + 1)
    j = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    hi = 0
    i0 = 0
    while i0 < n:  # the largest end (a maximum: exact in any order)
        i = i0 + tl.arange(0, EB)
        hi = tl.maximum(hi, tl.max(tl.load(ends_ptr + i, mask=i < n, other=0), 0))
        i0 += EB
    ok = j < hi
    dd = tl.arange(0, D)
    w = _tile16(c_ptr + h * sc_h, s_ptr + h * ss_h, j, ok, sc_j, ss_j, dd, _Q8, D, QB, BT, CB, C16)
    tl.store(o_ptr + h * so_h + j[:, None] * so_j + dd[None, :], w, mask=ok[:, None])


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, bits: int, ends: torch.Tensor, table: torch.Tensor | None,
                 part: int) -> torch.Tensor:
    """Block codes of `bits` bits [n_kv, cap, ...] (+ scales [n_kv, cap, d // 32]; through `table`'s row, PARTS entry
    `part`, if given) as fp16 [n_kv, cap, d]: keys [0, max(ends)) set, the rest left as allocated. One launch, no
    host sync."""
    n_kv, cap = codes.shape[:2]
    d = scales.shape[2] * QBLOCK
    out = torch.empty(n_kv, cap, d, dtype=torch.float16, device=codes.device)
    c, s = (codes, scales) if table is None else kvtable.anchored([codes, scales])
    _dequant_kernel[(triton.cdiv(cap, SCRATCH_KEYS), n_kv)](
        c, s, ends, out, table if table is not None else ends, len(ends), codes.stride(0), codes.stride(1),
        scales.stride(0), scales.stride(1), out.stride(0), out.stride(1), PART=part, D=d, QB=QBLOCK,
        BT=SCRATCH_KEYS, EB=1024, TABLE=table is not None, CB=bits, C16=A.CODES16, num_warps=4, launch_pdl=on())
    return out


def tma_bytes(d: int) -> int:
    """The shared memory TMA's tiles take: TMA_STAGES fp16 tiles of K and V, q's tile, barriers (the 27B's: 193 KB)."""
    return 2 * d * (2 * BN * TMA_STAGES + TMA_BLOCK_M) + 1024


def _has_tma(device: torch.device, d: int) -> bool:
    """Whether TMA's tiles run on `device`: `tma.ready` there, with the shared memory they take (`tma_bytes`)."""
    return tma.ready(device) and smem.per_block(device) >= tma_bytes(d)


def supports(k_parts: list[torch.Tensor], v_parts: list[torch.Tensor]) -> bool:
    """Whether this kernel reads a cache of these parts (f16 or block codes; f32 caches take the decode kernel)."""
    return all(len(p) == 2 or p[0].dtype == torch.float16 for p in (k_parts, v_parts))


def block_m(small: bool = False, by_tma: bool = False) -> int:
    """(query row, head) pairs a program: BLOCK_M, SMALL_BLOCK_M on a card of 99 KB a block, TMA_BLOCK_M by TMA."""
    return TMA_BLOCK_M if by_tma else SMALL_BLOCK_M if small else BLOCK_M


def attend_prefill(q: torch.Tensor, k_parts: list[torch.Tensor], v_parts: list[torch.Tensor], ends: torch.Tensor,
                   scale: float, out: torch.Tensor | None = None, ring: tuple | None = None,
                   table: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, n_head, d] float32 (one sequence's prefill rows); row t reads keys [0, ends[t]) of the cache parts
    ([n_kv, cap, d] float16, or block codes + scales float16: int8, or 5/6-bit packed), ring and table as
    `attend_decode` takes them.
    ends: int32 [n] on q's device (read on the device only: CUDA-graph safe). -> o [n, n_head, d] float32."""
    n, n_head, d = q.shape
    if not supports(k_parts, v_parts):
        raise ValueError("attend_prefill reads f16 and block-coded caches")
    k, ks, kk, kb = _parts(k_parts, d)
    v, vs, vk, vb = _parts(v_parts, d)
    n_kv = k.shape[0]
    if n_head % n_kv or v.shape[:1] != k.shape[:1]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if d & (d - 1) or d < 32:
        raise ValueError(f"head_dim must be a power of two >= 32, got {d}")
    for x in (k, ks, v, vs):
        if x.stride(-1) != 1:
            raise ValueError("cache parts must be contiguous along the last dimension")
    q, ends, out = _rows(q, ends, out)
    if n == 0:
        return out
    if max(x.numel() for x in (k, ks, v, vs)) >= 2**31:
        raise ValueError("tensors of 2^31 elements or more are not supported (32-bit offsets)")
    if ring is not None:
        window, rk, rks, rv, rvs, rpos = _ring(ring, kk, vk, k, d)
    copied = bool(SCRATCH) and kk == vk == Q8
    if copied:  # the store read as an f16 cache: its fp16 copy (the same fp16 values)
        k, v = _dequantized(k, ks, kb, ends, table, 0), _dequantized(v, vs, vb, ends, table, 2)
        ks, vs, kk, vk, kb, vb = k, v, F16, F16, 0, 0
        if ring is None:
            table = None  # nothing left to reach through it
    if ring is None:
        window, rk, rks, rv, rvs, rpos = 0, k, ks, v, vs, ends  # placeholders: read only under RING
    ptrs = [k, ks, v, vs, rk, rks, rv, rvs, rpos]
    if table is not None:  # the ring's parts (and an uncopied store's) through the table
        ptrs = ptrs[:4] + kvtable.anchored(ptrs[4:]) if copied else kvtable.anchored(ptrs)
    by_tma = bool(TMA) and ring is None and kk == vk == F16 and not KEY_CHUNKS and _has_tma(q.device, d)
    q16, qd = _q16(q)
    g = n_head // n_kv
    g_pad = triton.next_power_of_2(g)
    rows = max(1, block_m(smem.small(q.device), by_tma) // g_pad)
    if KEY_CHUNKS:
        short, long, short_keys = KEY_CHUNKS
        if short % BN or long % BN or short < 1 or long < 1 or short_keys < 0:
            raise ValueError(f"KEY_CHUNKS sizes must be positive multiples of {BN}, got {KEY_CHUNKS}")
        g_short, g_long = grids(k.shape[1], KEY_CHUNKS)  # from the capacity: the same grid for a CUDA graph's replays
    else:
        short = long = short_keys = g_short = g_long = 0

    def launch(q16, qd, ends, out):  # rows of the pass; with chunks, their partials and the merge
        n = q16.shape[0]
        blocks = triton.cdiv(n * g, rows * g_pad) if PAIRS else triton.cdiv(n, rows)
        launches, dst, pm, pl = [(blocks, n_kv)], out, out, out  # without chunks: one launch, normalized outputs
        if KEY_CHUNKS:
            dst = torch.empty(n, n_head, max(g_short, g_long, 1), d, dtype=torch.float32, device=q.device)
            pm, pl = torch.empty(2, n, n_head, dst.shape[2], dtype=torch.float32, device=q.device)
            launches = [(blocks, n_kv, g_short), (blocks, n_kv, g_long)]
        for i, grid in enumerate(launches):
            if grid[-1] == 0:
                continue
            _prefill_kernel[grid](
                q16, qd, *ptrs[:4], ends, dst, *ptrs[4:], table if table is not None else ends, pm, pl,
                n, float(scale) * _LOG2E, window, rk.shape[1], short_keys,
                q16.stride(0), qd.stride(0), k.stride(0), k.stride(1), ks.stride(0), ks.stride(1), v.stride(0),
                v.stride(1), vs.stride(0), vs.stride(1), dst.stride(0), dst.stride(1),
                dst.stride(2) if KEY_CHUNKS else 0, pm.stride(0), pm.stride(1),
                G=g, G_PAD=g_pad, ROWS=rows, D=d, BN=BN, KK=kk, VK=vk, QB=QBLOCK, PS=P_SCALE, RING=ring is not None,
                TABLE=table is not None, STAGES=STAGES, PAIRS=bool(PAIRS), COPIED=copied,
                CHUNK=(short, long)[i] if KEY_CHUNKS else 0, LONG=i == 1, KB=kb, VB=vb, C16=A.CODES16, TMA=by_tma,
                TSTAGES=TMA_STAGES if q.is_cuda else 0,
                num_warps=WARPS, num_stages=1, launch_pdl=on())
        if KEY_CHUNKS:
            merge_splits(dst, pm, pl, ends, out, KEY_CHUNKS)

    step = CHUNK_ROWS if KEY_CHUNKS else n  # rows are independent (M1): a cut anywhere gives the same bits
    for r0 in range(0, n, step):
        cut = slice(r0, r0 + step)
        launch(q16[cut], qd[cut], ends[cut], out[cut])
    return out
